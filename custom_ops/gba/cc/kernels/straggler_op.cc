// Straggler injection: real delays inside a worker's step, as a shared cluster would cause them.
//
// The same graph runs on every worker; each kernel finds its own worker index in its device name
// (/job:worker/replica:0/task:<i>) and applies what the profile says for that worker. A slowdown
// s stretches the step's own measured compute time by s (a slow machine computes slowly; the
// RPC and scheduling time around a step are not its compute), so "3x slower" stays 3x on any
// machine; transient slowdowns are drawn from a hash of (seed, worker, step): reproducible.
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "custom_ops/common/kernel_util.h"
#include "custom_ops/common/worker_index.h"
#include "custom_ops/gba/cc/kernels/straggler_profile.h"

namespace tf_gba {

namespace {

std::atomic<int64_t> g_steps{0};
std::atomic<int64_t> g_busy_ns{0};
std::atomic<int64_t> g_delay_ns{0};
// The longest timed step (own time plus delay): steps of a worker run one after another, so the
// time inside the steps that end in a window is at most the window plus this.
std::atomic<int64_t> g_max_step_ns{0};
std::atomic<int64_t> g_first_unix_ns{0};
std::atomic<int64_t> g_first_mono_ns{0};
// The worker's position in its straggler sequence is g_steps + g_step_offset, and in a trace
// profile's time g_elapsed_offset_ns + (now - first step): a resumed run sets the offsets
// (GBA>SetStepPosition) so that each worker's draws and trace go on where the checkpoint was.
std::atomic<int64_t> g_step_offset{0};
std::atomic<int64_t> g_elapsed_offset_ns{0};

// Nanoseconds of profile time elapsed at `now` (the trace's clock).
int64_t ElapsedNs(int64_t now) {
  const int64_t first = g_first_mono_ns.load();
  return g_elapsed_offset_ns.load() + (first == 0 ? 0 : now - first);
}

int64_t UnixNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void RaiseMax(std::atomic<int64_t>* max, int64_t value) {
  int64_t seen = max->load();
  while (value > seen && !max->compare_exchange_weak(seen, value)) {
  }
}

// First step of this process: starts the clock a trace profile and the straggler position read
// (also without a profile, so that a checkpoint's position is the same with or without one).
void MarkFirstStep(int64_t now) {
  if (g_first_mono_ns.load() != 0) return;
  int64_t expected = 0;
  if (g_first_mono_ns.compare_exchange_strong(expected, now)) g_first_unix_ns = UnixNs();
}

}  // namespace

class StepBeginOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const int64_t now = MonoNs();
    MarkFirstStep(now);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = now;
  }
};

class StepEndOp : public OpKernel {
 public:
  explicit StepEndOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string profile;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("profile", &profile));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed_));
    worker_ = WorkerIndex(ctx->device()->name());
    OP_REQUIRES_OK(ctx, profile_.Parse(profile, worker_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int64_t start = ctx->input(0).scalar<int64_t>()();
    const int64_t now = MonoNs();
    const int64_t busy = std::max<int64_t>(0, now - start);
    const int64_t step = g_steps.fetch_add(1) + g_step_offset.load();
    const double elapsed_s = ElapsedNs(start) * 1e-9;
    const double factor = profile_.Factor(seed_, step, elapsed_s);
    // compute:<ms> pads the step to the compute time of a machine of its own, then the slowdown
    // stretches that: delay = (floor - busy) + (factor - 1) * floor.
    const int64_t base = std::max(busy, profile_.compute_floor_ns());
    const int64_t delay = std::max<int64_t>(
        0, (base - busy) + static_cast<int64_t>((factor - 1.0) * static_cast<double>(base)));
    if (delay > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(delay));
    g_busy_ns += busy;
    g_delay_ns += delay;
    RaiseMax(&g_max_step_ns, busy + delay);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<float>()() = static_cast<float>(delay * 1e-9);
  }

 private:
  int64_t seed_;
  int64_t worker_;
  StragglerProfile profile_;
};

class StepCountOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    MarkFirstStep(MonoNs());
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = g_steps.fetch_add(1) + 1;
  }
};

class WorkerStepStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({7}), &out));
    auto v = out->vec<int64_t>();
    v(0) = g_steps.load();
    v(1) = g_busy_ns.load();
    v(2) = g_delay_ns.load();
    v(3) = g_first_unix_ns.load();
    v(4) = g_steps.load() + g_step_offset.load();
    v(5) = ElapsedNs(MonoNs());
    v(6) = g_max_step_ns.load();
  }
};

class SetStepPositionOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const int64_t step = ctx->input(0).scalar<int64_t>()();
    const int64_t elapsed_ns = ctx->input(1).scalar<int64_t>()();
    OP_REQUIRES(ctx, step >= 0 && elapsed_ns >= 0,
                ::tensorflow::errors::InvalidArgument(
                    "GBA>SetStepPosition: step and elapsed_ns must be >= 0, got ", step, " and ",
                    elapsed_ns));
    // Offsets against this process's own count and clock: the next step is `step`, and the
    // profile's clock reads `elapsed_ns` now.
    g_step_offset = step - g_steps.load();
    const int64_t first = g_first_mono_ns.load();
    g_elapsed_offset_ns = elapsed_ns - (first == 0 ? 0 : MonoNs() - first);
  }
};

REGISTER_KERNEL_BUILDER(Name("GBA>StepBegin").Device(::tensorflow::DEVICE_CPU), StepBeginOp);
REGISTER_KERNEL_BUILDER(Name("GBA>StepEnd").Device(::tensorflow::DEVICE_CPU), StepEndOp);
REGISTER_KERNEL_BUILDER(Name("GBA>StepCount").Device(::tensorflow::DEVICE_CPU), StepCountOp);
REGISTER_KERNEL_BUILDER(Name("GBA>SetStepPosition").Device(::tensorflow::DEVICE_CPU),
                        SetStepPositionOp);
REGISTER_KERNEL_BUILDER(Name("GBA>WorkerStepStats").Device(::tensorflow::DEVICE_CPU),
                        WorkerStepStatsOp);

}  // namespace tf_gba
