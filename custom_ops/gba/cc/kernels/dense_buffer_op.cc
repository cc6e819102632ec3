// Dense GBA gradient buffer (SPEC section 1, "Gradient buffer and staleness decay").
//
// The buffer keeps a running weighted sum instead of M gradient copies: its global step k cannot
// change before it holds M entries, so the decay f(token, k) is already exact at push time and
// memory stays at one variable's size.
#define EIGEN_USE_THREADS

#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "custom_ops/common/kernel_util.h"
#include "custom_ops/gba/cc/kernels/buffer_core.h"
#include "custom_ops/gba/cc/kernels/dense_buffer_functor.h"
#include "custom_ops/common/resource_util.h"
#include "tensorflow/core/framework/register_types.h"

namespace tf_gba {

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

template <typename T, typename Acc>
void AddScaled(const T* __restrict__ g, Acc* __restrict__ s, int64_t n, Acc f, bool assign) {
  if (assign) {
    for (int64_t i = 0; i < n; ++i) s[i] = f * static_cast<Acc>(g[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) s[i] += f * static_cast<Acc>(g[i]);
  }
}

// s += f * g (or s = f * g when `assign`), in one pass over memory: each L1-sized piece of g is
// checked for NaN/Inf and then accumulated while it is in cache, the blocks in parallel. Returns
// false if g is not finite; then the pieces already added are subtracted back (restoring s up to
// rounding; a dropped push is rare) and, when assigning, s is left undefined for the caller to
// discard. Each block records how far it got (no lock: every block owns its entry).
template <typename T, typename Acc>
bool CheckedAccumulate(const CPUDevice& d, const T* g, Acc* s, int64_t n, Acc f, bool assign) {
  std::atomic<bool> ok(true);
  const int64_t blocks = NumCpuBlocks(n);
  std::vector<int64_t> done(blocks, 0);  // values of each block applied, for the undo
  d.parallelFor(blocks, Eigen::TensorOpCost(kCpuBlock * (sizeof(T) + 2 * sizeof(Acc)),
                                            kCpuBlock * sizeof(Acc), 2 * kCpuBlock),
                [&](Eigen::Index b0, Eigen::Index b1) {
                  for (Eigen::Index b = b0; b < b1; ++b) {
                    const int64_t start = b * kCpuBlock, end = std::min(start + kCpuBlock, n);
                    int64_t i = start;
                    while (i < end && ok.load(std::memory_order_relaxed)) {
                      const int64_t len = std::min(kL1Piece, end - i);
                      if (!BlockFinite(g + i, len)) {
                        ok = false;
                        break;
                      }
                      AddScaled(g + i, s + i, len, f, assign);
                      i += len;
                    }
                    done[b] = i - start;
                  }
                });
  if (ok) return true;
  if (!assign) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t start = b * kCpuBlock;
      for (int64_t i = start; i < start + done[b]; ++i) s[i] -= f * static_cast<Acc>(g[i]);
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

// The buffer of one dense variable. Its state is private and guarded by mu_; a push runs under
// the lock from the ticket check to the hand-out of a completed aggregate, so pushes of one buffer
// are applied one at a time (each is itself parallel over the gradient's blocks).
class DenseGradientBuffer : public ::tensorflow::ResourceBase {
 public:
  // What the create op's own attributes say besides the shared BufferConfig.
  struct Params {
    DataType dtype;
    TensorShape shape;

    static Status FromAttrs(OpKernelConstruction* ctx, BufferConfig*, Params* p) {
      TF_RETURN_IF_ERROR(ctx->GetAttr("dtype", &p->dtype));
      PartialTensorShape shape;
      TF_RETURN_IF_ERROR(ctx->GetAttr("shape", &shape));
      if (!shape.IsFullyDefined() || !shape.AsTensorShape(&p->shape)) {
        return errors::InvalidArgument("A dense GBA buffer needs a fully defined shape, got ",
                                       shape.DebugString(), ".");
      }
      return ::tensorflow::OkStatus();
    }
  };

  // What one push did: whether it completed a global batch, the step after it, and the batch's
  // weighted sum (accumulation type) and divisor when it did.
  struct PushResult {
    bool ready = false;
    int64_t step = 0;
    bool sum_valid = false;  // false: every gradient of the batch was dropped
    Tensor sum;
    int64_t divisor = 1;
  };

  DenseGradientBuffer(const Params& params, const BufferConfig& config, int64_t initial_step)
      : dtype_(params.dtype), shape_(params.shape), core_(config, initial_step) {}

  std::string DebugString() const override {
    return ::tensorflow::strings::StrCat("GBA DenseGradientBuffer(", DataTypeString(dtype_),
                                         shape_.DebugString(), ")");
  }

  DataType dtype() const { return dtype_; }
  const TensorShape& shape() const { return shape_; }
  // Immutable after construction: readable without the lock.
  bool error_on_nonfinite() const { return config_.error_on_nonfinite; }

  // Adds f(staleness) * g to the running sum (SPEC Eq. 1) and, when this push completes the
  // global batch, hands the sum out in `result` and starts the next batch.
  template <typename Device, typename T>
  Status Push(OpKernelContext* ctx, const T* g, int64_t n, int64_t token, int64_t ticket,
              PushResult* result) TF_LOCKS_EXCLUDED(mu_) {
    using Acc = Accumulator<T>;
    const Device& d = ctx->eigen_device<Device>();
    ::tensorflow::mutex_lock lock(mu_);
    if (core_.AcceptTicket(ticket)) {  // a ticket seen before: the same push delivered again
      const int64_t staleness = core_.step() - token;
      core_.RecordStaleness(staleness);
      double f = config_.decay.Weight(staleness);
      bool finite = true;
      if (f == 0.0) {
        // Too stale: dropped whatever it holds. Look for NaN/Inf only to count it.
        finite = functor::DenseAllFinite<Device, T>()(d, g, n);
      } else {
        if (!sum_valid_) TF_RETURN_IF_ERROR(StartSum(ctx, DataTypeToEnum<Acc>::value));
        finite = functor::DenseAccumulate<Device, T, Acc>()(d, g, sum_.flat<Acc>().data(), n,
                                                            static_cast<Acc>(f),
                                                            /*assign=*/!sum_valid_);
        if (finite) {
          sum_valid_ = true;
          ++kept_;
        } else {
          f = 0.0;
        }
      }
      if (!finite) ++core_.stats().nonfinite;
      if (f == 0.0) ++core_.stats().dropped;
      if (core_.AddEntry(f != 0.0 || config_.count_dropped)) {
        result->ready = true;
        result->sum_valid = sum_valid_;
        result->sum = sum_;  // shares the tensor; the next batch starts another (or the spare)
        sum_ = Tensor();
        sum_valid_ = false;
        result->divisor = config_.normalize == Normalize::kNumAggregate
                              ? config_.num_aggregate
                              : std::max<int64_t>(1, kept_);
        kept_ = 0;
        core_.FinishAggregation();
      }
    }
    result->step = core_.step();
    return ::tensorflow::OkStatus();
  }

  // Offers a handed-out aggregate back: once its consumers let go of it (reference count one), a
  // later global batch accumulates into it, without a fresh allocation and its page faults.
  void OfferSpare(const Tensor& aggregate) TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    if (!sum_valid_) spare_ = aggregate;
  }

  // Restoring a checkpoint: the pending sum belongs to gradients whose tokens are gone.
  void Reset(int64_t step) TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    core_.Reset(step);
    sum_ = Tensor();
    sum_valid_ = false;
    kept_ = 0;
  }

  void WriteStats(OpKernelContext* ctx) const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    WriteBufferStats(ctx, core_);
  }

 private:
  // The sum the first kept gradient of a batch is assigned to: the spare when it is free.
  Status StartSum(OpKernelContext* ctx, DataType acc_dtype) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (spare_.IsInitialized() && spare_.RefCountIsOne()) {
      sum_ = spare_;
    } else {
      TF_RETURN_IF_ERROR(ctx->allocate_temp(acc_dtype, shape_, &sum_));
    }
    spare_ = Tensor();
    return ::tensorflow::OkStatus();
  }

  const DataType dtype_;
  const TensorShape shape_;
  mutable ::tensorflow::mutex mu_;
  BufferCore core_ TF_GUARDED_BY(mu_);
  const BufferConfig& config_ = core_.config();  // immutable: no lock needed
  Tensor sum_ TF_GUARDED_BY(mu_);        // accumulation type; meaningful only while sum_valid_
  bool sum_valid_ TF_GUARDED_BY(mu_) = false;  // false: the next kept gradient assigns (no memset)
  Tensor spare_ TF_GUARDED_BY(mu_);      // the last aggregate handed out (see OfferSpare)
  int64_t kept_ TF_GUARDED_BY(mu_) = 0;  // entries with a non-zero weight in the current batch
};

template <typename Device, typename T>
class DenseBufferPushOp : public OpKernel {
  using Acc = Accumulator<T>;

 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<DenseGradientBuffer> buf;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &buf));
    int64_t token, ticket;
    OP_REQUIRES_OK(ctx, ReadTokenAndTicket(ctx, &token, &ticket));
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

    if (buf->error_on_nonfinite()) {
      // Checked before anything changes, so the push can be refused as a whole.
      OP_REQUIRES(ctx, (functor::DenseAllFinite<Device, T>()(d, g.data(), g.size())),
                  errors::InvalidArgument("Gradient pushed to ", buf->DebugString(),
                                          " contains NaN or Inf (token ", token,
                                          "). Lower the learning rate or clip gradients, or "
                                          "create the buffer with nonfinite='drop' to skip such "
                                          "pushes."));
    }

    DenseGradientBuffer::PushResult r;
    OP_REQUIRES_OK(ctx, (buf->Push<Device, T>(ctx, g.data(), g.size(), token, ticket, &r)));

    Tensor* ready_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &ready_t));
    ready_t->scalar<bool>()() = r.ready;
    Tensor* step_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &step_t));
    step_t->scalar<int64_t>()() = r.step;
    if (!r.ready) {
      ctx->set_output(1, grad);  // passthrough: costs nothing, never applied
      return;
    }
    const Acc scale = static_cast<Acc>(1.0 / static_cast<double>(r.divisor));
    if (!r.sum_valid) {  // every gradient of this batch was dropped
      Tensor* out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, buf->shape(), &out));
      functor::DenseFillZero<Device, T>()(d, out->flat<T>().data(), out->NumElements());
    } else if (std::is_same<T, Acc>::value) {
      Acc* s = r.sum.flat<Acc>().data();
      functor::DenseScale<Device, Acc, Acc>()(d, s, s, r.sum.NumElements(), scale);
      ctx->set_output(1, r.sum);
      buf->OfferSpare(r.sum);
    } else {
      Tensor* out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, buf->shape(), &out));
      functor::DenseScale<Device, T, Acc>()(d, r.sum.flat<Acc>().data(), out->flat<T>().data(),
                                            out->NumElements(), scale);
    }
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
    buf->Reset(step);
  }
};

TF_GBA_REGISTER_BUFFER_CREATE_AND_STATS(Dense, DenseGradientBuffer);
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
