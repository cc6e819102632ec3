// Dense GBA gradient buffer (SPEC section 1, "Gradient buffer and staleness decay").
//
// The buffer keeps a running weighted sum instead of M gradient copies: its global step k cannot
// change before it holds M entries, so the decay f(token, k) is already exact at push time and
// memory stays at one variable's size.
#define EIGEN_USE_THREADS

#include <mutex>

#include "custom_ops/gba/cc/kernels/buffer_core.h"
#include "custom_ops/gba/cc/kernels/resource_util.h"
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
  int64_t kept = 0;        // entries with a non-zero weight in the current global batch

 private:
  const DataType dtype_;
  const TensorShape shape_;
};

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

template <typename T>
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
    const CPUDevice& d = ctx->eigen_device<CPUDevice>();
    auto g = grad.flat<T>();

    // x * 0 is 0 for finite x and NaN otherwise: one parallel pass finds NaN and Inf.
    bool finite = true;
    if (g.size() > 0) {
      Eigen::Tensor<Acc, 0, Eigen::RowMajor> probe;
      probe.device(d) = (g.template cast<Acc>() * Acc(0)).sum();
      finite = Eigen::numext::isfinite(probe());
    }
    OP_REQUIRES(ctx, finite || !buf->core_.config().error_on_nonfinite,
                errors::InvalidArgument("Gradient pushed to ", buf->DebugString(),
                                        " contains NaN or Inf (token ", token,
                                        "). Lower the learning rate or clip gradients, or create "
                                        "the buffer with nonfinite='drop' to skip such pushes."));

    bool ready = false, duplicate = false;
    bool out_valid = false;
    int64_t step_out, divisor = 1;
    Tensor out_sum;
    {
      std::lock_guard<std::mutex> lock(buf->mu);
      BufferCore& core = buf->core_;
      if (!core.AcceptTicket(ticket)) {
        duplicate = true;
      } else {
        const int64_t staleness = core.step() - token;
        core.RecordStaleness(staleness);
        const double f = finite ? core.config().decay.Weight(staleness) : 0.0;
        if (!finite) ++core.stats().nonfinite;
        if (f == 0.0) {
          ++core.stats().dropped;
        } else {
          if (!buf->sum_valid) {
            OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<Acc>::value, buf->shape(),
                                                   &buf->sum));
          }
          auto s = buf->sum.flat<Acc>();
          if (buf->sum_valid) {
            s.device(d) += g.template cast<Acc>() * static_cast<Acc>(f);
          } else {
            s.device(d) = g.template cast<Acc>() * static_cast<Acc>(f);
          }
          buf->sum_valid = true;
          ++buf->kept;
        }
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
    (void)duplicate;

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
      out->flat<T>().device(d) = out->flat<T>().constant(T(0));
    } else if (std::is_same<T, Acc>::value) {
      auto s = out_sum.flat<Acc>();
      s.device(d) = s * scale;
      ctx->set_output(1, out_sum);
    } else {
      Tensor* out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, buf->shape(), &out));
      out->flat<T>().device(d) = (out_sum.flat<Acc>() * scale).template cast<T>();
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
      DenseBufferPushOp<T>);
TF_CALL_half(REGISTER_PUSH);
TF_CALL_bfloat16(REGISTER_PUSH);
TF_CALL_float(REGISTER_PUSH);
TF_CALL_double(REGISTER_PUSH);
#undef REGISTER_PUSH

}  // namespace tf_gba
