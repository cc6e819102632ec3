// Dense GBA gradient buffer (SPEC section 1, "Gradient buffer and staleness decay").
//
// The buffer keeps a running weighted sum instead of M gradient copies: its global step k cannot
// change before it holds M entries, so the decay f(token, k) is already exact at push time and
// memory stays at one variable's size.
#define EIGEN_USE_THREADS

#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "custom_ops/gba/cc/kernels/buffer_core.h"
#include "custom_ops/gba/cc/kernels/dense_buffer_functor.h"
#include "custom_ops/common/resource_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_gba {

using ::tensorflow::DataType;
using ::tensorflow::DataTypeString;
using ::tensorflow::DataTypeToEnum;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::PartialTensorShape;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;
using CPUDevice = Eigen::ThreadPoolDevice;
using GPUDevice = Eigen::GpuDevice;

class DenseGradientBuffer : public ::tensorflow::ResourceBase {
 public:
  DenseGradientBuffer(DataType dtype, const TensorShape& shape, const BufferConfig& config,
                      int64_t initial_step)
      : dtype_(dtype), shape_(shape), core_(config, initial_step) {}

  std::string DebugString() const override {
    return ::tensorflow::strings::StrCat("GBA DenseGradientBuffer(", DataTypeString(dtype_),
                                         shape_.DebugString(), ")");
  }

  DataType dtype() const { return dtype_; }
  const TensorShape& shape() const { return shape_; }

  std::mutex mu;
  BufferCore core_;
  Tensor sum;              // accumulator dtype; meaningful only while sum_valid
  bool sum_valid = false;  // false: the next kept gradient assigns instead of adding (no memset)
  // The last aggregate handed out. Once its consumers let go of it (reference count one), the
  // next global batch accumulates into it: no fresh allocation, and no page faults, per batch.
  Tensor spare;
  int64_t kept = 0;        // entries with a non-zero weight in the current global batch

 private:
  const DataType dtype_;
  const TensorShape shape_;
};

// True when every value is finite: |x| <= max is false for NaN and Inf. An AND of compares
// (no floating-point reduction order to respect) lets the loop vectorise.
template <typename T>
bool BlockFinite(const T* g, int64_t n) {
  using Acc = typename AccumulatorType<T>::type;
  const Acc limit = std::numeric_limits<Acc>::max();
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= std::abs(static_cast<Acc>(g[i])) <= limit;
  return ok;
}

template <typename T>
bool AllFiniteParallel(const CPUDevice& d, const T* g, int64_t n) {
  std::atomic<bool> ok(true);
  const int64_t blocks = NumCpuBlocks(n);
  d.parallelFor(blocks, Eigen::TensorOpCost(kCpuBlock * sizeof(T), 0, kCpuBlock),
                [&](Eigen::Index b0, Eigen::Index b1) {
                  for (Eigen::Index b = b0; b < b1 && ok.load(std::memory_order_relaxed); ++b) {
                    const int64_t start = b * kCpuBlock;
                    if (!BlockFinite(g + start, std::min(kCpuBlock, n - start))) ok = false;
                  }
                });
  return ok;
}

// s += f * g (or s = f * g when `assign`), in one pass over memory: each block of g is checked
// for NaN/Inf while it is in cache, then accumulated. Returns false if g is not finite; then the
// blocks already added are subtracted back (restoring s up to rounding; a dropped push is rare)
// and, when assigning, s is left undefined for the caller to discard.
template <typename T, typename Acc>
bool CheckedAccumulate(const CPUDevice& d, const T* g, Acc* s, int64_t n, Acc f, bool assign) {
  std::atomic<bool> ok(true);
  std::mutex done_mu;
  std::vector<std::pair<int64_t, int64_t>> done;  // block ranges applied, for the undo
  const int64_t blocks = NumCpuBlocks(n);
  d.parallelFor(blocks, Eigen::TensorOpCost(kCpuBlock * (sizeof(T) + 2 * sizeof(Acc)),
                                            kCpuBlock * sizeof(Acc), 2 * kCpuBlock),
                [&](Eigen::Index b0, Eigen::Index b1) {
                  Eigen::Index b = b0;
                  for (; b < b1 && ok.load(std::memory_order_relaxed); ++b) {
                    const int64_t start = b * kCpuBlock, len = std::min(kCpuBlock, n - start);
                    const T* gb = g + start;
                    Acc* sb = s + start;
                    if (!BlockFinite(gb, len)) {
                      ok = false;
                      break;
                    }
                    if (assign) {
                      for (int64_t i = 0; i < len; ++i) sb[i] = f * static_cast<Acc>(gb[i]);
                    } else {
                      for (int64_t i = 0; i < len; ++i) sb[i] += f * static_cast<Acc>(gb[i]);
                    }
                  }
                  std::lock_guard<std::mutex> lock(done_mu);
                  done.emplace_back(b0, b);
                });
  if (ok) return true;
  if (!assign) {
    for (const auto& r : done) {
      for (int64_t b = r.first; b < r.second; ++b) {
        const int64_t start = b * kCpuBlock, len = std::min(kCpuBlock, n - start);
        for (int64_t i = 0; i < len; ++i) s[start + i] -= f * static_cast<Acc>(g[start + i]);
      }
    }
  }
  return false;
}

namespace functor {

// CPU: the cache-blocked, parallel passes above.
template <typename T>
struct DenseAllFinite<CPUDevice, T> {
  bool operator()(const CPUDevice& d, const T* g, int64_t n) const {
    return AllFiniteParallel(d, g, n);
  }
};

template <typename T, typename Acc>
struct DenseAccumulate<CPUDevice, T, Acc> {
  bool operator()(const CPUDevice& d, const T* g, Acc* s, int64_t n, Acc f, bool assign) const {
    return CheckedAccumulate(d, g, s, n, f, assign);
  }
};

template <typename T, typename Acc>
struct DenseScale<CPUDevice, T, Acc> {
  void operator()(const CPUDevice& d, const Acc* s, T* out, int64_t n, Acc scale) const {
    typename ::tensorflow::TTypes<Acc>::ConstFlat src(s, n);
    typename ::tensorflow::TTypes<T>::Flat dst(out, n);
    Assign(d, src * scale, dst, std::is_same<T, Acc>());
  }

 private:
  template <typename Expr>
  static void Assign(const CPUDevice& d, const Expr& e, typename ::tensorflow::TTypes<T>::Flat dst,
                     std::true_type /*T is Acc*/) {
    dst.device(d) = e;  // in place when out == s
  }
  template <typename Expr>
  static void Assign(const CPUDevice& d, const Expr& e, typename ::tensorflow::TTypes<T>::Flat dst,
                     std::false_type) {
    dst.device(d) = e.template cast<T>();
  }
};

template <typename T>
struct DenseFillZero<CPUDevice, T> {
  void operator()(const CPUDevice& d, T* out, int64_t n) const {
    typename ::tensorflow::TTypes<T>::Flat dst(out, n);
    dst.device(d) = dst.constant(T(0));
  }
};

}  // namespace functor

class DenseBufferCreateOp : public OpKernel {
 public:
  explicit DenseBufferCreateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseBufferConfig(ctx, &config_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
    PartialTensorShape shape;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shape", &shape));
    OP_REQUIRES(ctx, shape.IsFullyDefined(),
                errors::InvalidArgument("A dense GBA buffer needs a fully defined shape, got ",
                                        shape.DebugString(), "."));
    OP_REQUIRES(ctx, shape.AsTensorShape(&shape_),
                errors::InvalidArgument("Invalid buffer shape ", shape.DebugString()));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initial_step", &initial_step_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("container", &container_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared_name", &shared_name_));
  }
  void Compute(OpKernelContext* ctx) override {
    CreateResourceAndOutputHandle<DenseGradientBuffer>(
        ctx, container_, shared_name_, [this](DenseGradientBuffer** out) {
          *out = new DenseGradientBuffer(dtype_, shape_, config_, initial_step_);
          return ::tensorflow::OkStatus();
        });
  }

 private:
  BufferConfig config_;
  DataType dtype_;
  TensorShape shape_;
  int64_t initial_step_;
  std::string container_, shared_name_;
};

template <typename Device, typename T>
class DenseBufferPushOp : public OpKernel {
  using Acc = typename AccumulatorType<T>::type;

 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<DenseGradientBuffer> buf;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &buf));
    int64_t token, ticket;
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 1, "token", &token));
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 2, "ticket", &ticket));
    OP_REQUIRES(ctx, token >= 0,
                errors::InvalidArgument("token must be >= 0 (tokens come from the GBA token "
                                        "generator), got ", token, "."));
    const Tensor& grad = ctx->input(3);
    OP_REQUIRES(ctx, DataTypeToEnum<T>::value == buf->dtype(),
                errors::InvalidArgument("Gradient dtype ", DataTypeString(DataTypeToEnum<T>::value),
                                        " does not match the buffer's dtype ",
                                        DataTypeString(buf->dtype()),
                                        "; cast the gradient to the variable's dtype."));
    OP_REQUIRES(ctx, grad.shape() == buf->shape(),
                errors::InvalidArgument("Gradient shape ", grad.shape().DebugString(),
                                        " does not match the buffer's shape ",
                                        buf->shape().DebugString(),
                                        " (the buffer was created for another variable?)."));
    const Device& d = ctx->eigen_device<Device>();
    auto g = grad.flat<T>();

    const bool error_on_nonfinite = buf->core_.config().error_on_nonfinite;
    if (error_on_nonfinite) {
      // Checked before anything changes, so the push can be refused as a whole.
      OP_REQUIRES(ctx, (functor::DenseAllFinite<Device, T>()(d, g.data(), g.size())),
                  errors::InvalidArgument("Gradient pushed to ", buf->DebugString(),
                                          " contains NaN or Inf (token ", token,
                                          "). Lower the learning rate or clip gradients, or "
                                          "create the buffer with nonfinite='drop' to skip such "
                                          "pushes."));
    }

    bool ready = false;
    bool out_valid = false;
    int64_t step_out, divisor = 1;
    Tensor out_sum;
    {
      std::lock_guard<std::mutex> lock(buf->mu);
      BufferCore& core = buf->core_;
      if (core.AcceptTicket(ticket)) {  // a ticket seen before: the same push delivered again
        const int64_t staleness = core.step() - token;
        core.RecordStaleness(staleness);
        double f = core.config().decay.Weight(staleness);
        bool finite = true;
        if (f == 0.0) {
          // Too stale: dropped whatever it holds. Look for NaN/Inf only to count it.
          finite = functor::DenseAllFinite<Device, T>()(d, g.data(), g.size());
        } else {
          if (!buf->sum_valid) {
            if (buf->spare.IsInitialized() && buf->spare.RefCountIsOne()) {
              buf->sum = buf->spare;
            } else {
              OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<Acc>::value, buf->shape(),
                                                     &buf->sum));
            }
            buf->spare = Tensor();
          }
          finite = functor::DenseAccumulate<Device, T, Acc>()(
              d, g.data(), buf->sum.flat<Acc>().data(), g.size(), static_cast<Acc>(f),
              /*assign=*/!buf->sum_valid);
          if (finite) {
            buf->sum_valid = true;
            ++buf->kept;
          } else {
            f = 0.0;
          }
        }
        if (!finite) ++core.stats().nonfinite;
        if (f == 0.0) ++core.stats().dropped;
        if (core.AddEntry(f != 0.0 || core.config().count_dropped)) {
          ready = true;
          out_valid = buf->sum_valid;
          out_sum = buf->sum;  // shares the buffer; the next batch allocates a fresh one
          buf->sum = Tensor();
          buf->sum_valid = false;
          divisor = core.config().normalize == Normalize::kNumAggregate
                        ? core.config().num_aggregate
                        : std::max<int64_t>(1, buf->kept);
          buf->kept = 0;
          core.FinishAggregation();
        }
      }
      step_out = core.step();
    }

    Tensor* ready_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &ready_t));
    ready_t->scalar<bool>()() = ready;
    Tensor* step_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &step_t));
    step_t->scalar<int64_t>()() = step_out;
    if (!ready) {
      ctx->set_output(1, grad);  // passthrough: costs nothing, never applied
      return;
    }
    const Acc scale = static_cast<Acc>(1.0 / static_cast<double>(divisor));
    if (!out_valid) {  // every gradient of this batch was dropped
      Tensor* out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, buf->shape(), &out));
      functor::DenseFillZero<Device, T>()(d, out->flat<T>().data(), out->NumElements());
    } else if (std::is_same<T, Acc>::value) {
      Acc* s = out_sum.flat<Acc>().data();
      functor::DenseScale<Device, Acc, Acc>()(d, s, s, out_sum.NumElements(), scale);
      ctx->set_output(1, out_sum);
      std::lock_guard<std::mutex> lock(buf->mu);
      if (!buf->sum_valid) buf->spare = out_sum;
    } else {
      Tensor* out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, buf->shape(), &out));
      functor::DenseScale<Device, T, Acc>()(d, out_sum.flat<Acc>().data(), out->flat<T>().data(),
                                            out->NumElements(), scale);
    }
  }
};

class DenseBufferStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<DenseGradientBuffer> buf;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &buf));
    std::lock_guard<std::mutex> lock(buf->mu);
    WriteBufferStats(ctx, buf->core_);
  }
};

class DenseBufferSetStepOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<DenseGradientBuffer> buf;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &buf));
    int64_t step;
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 1, "global_step", &step));
    OP_REQUIRES(ctx, step >= 0,
                errors::InvalidArgument("global_step must be >= 0, got ", step, "."));
    std::lock_guard<std::mutex> lock(buf->mu);
    buf->core_.Reset(step);
    buf->sum = Tensor();
    buf->sum_valid = false;
    buf->kept = 0;
  }
};

REGISTER_KERNEL_BUILDER(Name("GBA>DenseBufferCreate").Device(::tensorflow::DEVICE_CPU),
                        DenseBufferCreateOp);
REGISTER_KERNEL_BUILDER(Name("GBA>DenseBufferStats").Device(::tensorflow::DEVICE_CPU),
                        DenseBufferStatsOp);
REGISTER_KERNEL_BUILDER(Name("GBA>DenseBufferSetStep").Device(::tensorflow::DEVICE_CPU),
                        DenseBufferSetStepOp);

#define REGISTER_PUSH(T)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("GBA>DenseBufferPush").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      DenseBufferPushOp<CPUDevice, T>);
TF_CALL_half(REGISTER_PUSH);
TF_CALL_bfloat16(REGISTER_PUSH);
TF_CALL_float(REGISTER_PUSH);
TF_CALL_double(REGISTER_PUSH);
#undef REGISTER_PUSH

#if GOOGLE_CUDA
// GPU: the buffer's running sum lives in GPU memory and the arithmetic runs there
// (dense_buffer_op_gpu.cu.cc); the bookkeeping (step, entries, tickets, statistics) stays on the
// host, so every scalar input and output is in host memory. Create/Stats/SetStep only touch that
// bookkeeping; they have GPU registrations so that a buffer created under tf.device("/GPU:0")
// lives in that device's resource manager, next to its pushes.
REGISTER_KERNEL_BUILDER(Name("GBA>DenseBufferCreate").Device(::tensorflow::DEVICE_GPU),
                        DenseBufferCreateOp);
REGISTER_KERNEL_BUILDER(Name("GBA>DenseBufferStats")
                            .Device(::tensorflow::DEVICE_GPU)
                            .HostMemory("global_step")
                            .HostMemory("entries")
                            .HostMemory("counters")
                            .HostMemory("histogram"),
                        DenseBufferStatsOp);
REGISTER_KERNEL_BUILDER(
    Name("GBA>DenseBufferSetStep").Device(::tensorflow::DEVICE_GPU).HostMemory("global_step"),
    DenseBufferSetStepOp);

#define REGISTER_GPU_PUSH(T)                                     \
  REGISTER_KERNEL_BUILDER(Name("GBA>DenseBufferPush")            \
                              .Device(::tensorflow::DEVICE_GPU)  \
                              .TypeConstraint<T>("T")            \
                              .HostMemory("token")               \
                              .HostMemory("ticket")              \
                              .HostMemory("ready")               \
                              .HostMemory("global_step"),        \
                          DenseBufferPushOp<GPUDevice, T>);
TF_CALL_half(REGISTER_GPU_PUSH);
TF_CALL_bfloat16(REGISTER_GPU_PUSH);
TF_CALL_float(REGISTER_GPU_PUSH);
TF_CALL_double(REGISTER_GPU_PUSH);
#undef REGISTER_GPU_PUSH
#endif  // GOOGLE_CUDA

}  // namespace tf_gba
