// The straggler slowdowns a profile gives, without sleeping: for the cluster simulator
// (tf_gba.simulate), which must slow its simulated workers exactly as GBA>StepEnd slows real ones.
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "custom_ops/common/kernel_util.h"
#include "custom_ops/gba/cc/kernels/straggler_profile.h"

namespace tf_gba {

class StragglerFactorsOp : public OpKernel {
 public:
  explicit StragglerFactorsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("profile", &profile_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed_));
    StragglerProfile check;  // a bad profile fails at construction, once
    OP_REQUIRES_OK(ctx, check.Parse(profile_, 0));
    floor_ns_ = check.compute_floor_ns();
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& workers = ctx->input(0);
    const Tensor& steps = ctx->input(1);
    const Tensor& elapsed = ctx->input(2);
    OP_REQUIRES(ctx, workers.dims() == 1 && steps.shape() == workers.shape() &&
                         elapsed.shape() == workers.shape(),
                errors::InvalidArgument("workers, steps and elapsed_seconds must be vectors of "
                                        "one length, got ", workers.shape().DebugString(), ", ",
                                        steps.shape().DebugString(), ", ",
                                        elapsed.shape().DebugString(), "."));
    auto w = workers.vec<int64_t>();
    auto s = steps.vec<int64_t>();
    auto e = elapsed.vec<double>();
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, workers.shape(), &out));
    Tensor* floor;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &floor));
    floor->scalar<double>()() = floor_ns_ * 1e-9;
    auto f = out->vec<double>();
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = 0; i < w.size(); ++i) {
      OP_REQUIRES(ctx, w(i) >= 0 && s(i) >= 0,
                  errors::InvalidArgument("workers and steps must be >= 0, got worker ", w(i),
                                          " step ", s(i), "."));
      auto it = by_worker_.find(w(i));
      if (it == by_worker_.end()) {
        it = by_worker_.emplace(w(i), StragglerProfile()).first;
        OP_REQUIRES_OK(ctx, it->second.Parse(profile_, w(i)));
      }
      f(i) = it->second.Factor(seed_, s(i), e(i));
    }
  }

 private:
  std::string profile_;
  int64_t seed_;
  int64_t floor_ns_ = 0;
  // One parsed profile per worker (persistent and trace parts differ between workers), kept
  // across calls: the simulator asks for the same workers at every step.
  std::mutex mu_;
  std::unordered_map<int64_t, StragglerProfile> by_worker_;
};

REGISTER_KERNEL_BUILDER(Name("GBA>StragglerFactors").Device(::tensorflow::DEVICE_CPU),
                        StragglerFactorsOp);

}  // namespace tf_gba
