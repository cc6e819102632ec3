// Straggler injection: real delays inside a worker's step, as a shared cluster would cause them.
//
// The same graph runs on every worker; each kernel finds its own worker index in its device name
// (/job:worker/replica:0/task:<i>) and applies what the profile says for that worker. A slowdown
// s stretches the step's own measured compute time by s (a slow machine computes slowly; the
// RPC and scheduling time around a step are not its compute), so "3x slower" stays 3x on any
// machine; transient slowdowns are drawn from a hash of (seed, worker, step): reproducible.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "custom_ops/common/kernel_util.h"
#include "custom_ops/common/worker_index.h"

namespace tf_gba {

namespace {

std::atomic<int64_t> g_steps{0};
std::atomic<int64_t> g_busy_ns{0};
std::atomic<int64_t> g_delay_ns{0};
std::atomic<int64_t> g_first_unix_ns{0};
std::atomic<int64_t> g_first_mono_ns{0};

int64_t UnixNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// SplitMix64: a well-mixed hash, so (seed, worker, step) gives independent uniform draws.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

double Uniform(uint64_t seed, int64_t worker, int64_t step) {
  const uint64_t h = Mix(Mix(Mix(seed) ^ static_cast<uint64_t>(worker)) ^
                         static_cast<uint64_t>(step));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  return out;
}

}  // namespace

class StepBeginOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const int64_t now = MonoNs();
    int64_t expected = 0;
    if (g_first_mono_ns.compare_exchange_strong(expected, now)) g_first_unix_ns = UnixNs();
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
    OP_REQUIRES_OK(ctx, Parse(profile));
  }

  void Compute(OpKernelContext* ctx) override {
    const int64_t start = ctx->input(0).scalar<int64_t>()();
    const int64_t now = MonoNs();
    const int64_t busy = std::max<int64_t>(0, now - start);
    const int64_t step = g_steps.fetch_add(1);
    const double elapsed_s = (start - g_first_mono_ns.load()) * 1e-9;
    const double factor = Factor(step, elapsed_s);
    // compute:<ms> pads the step to the compute time of a machine of its own, then the slowdown
    // stretches that: delay = (floor - busy) + (factor - 1) * floor.
    const int64_t base = std::max(busy, compute_floor_ns_);
    const int64_t delay =
        (base - busy) + static_cast<int64_t>((factor - 1.0) * static_cast<double>(base));
    if (delay > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(delay));
    g_busy_ns += busy;
    g_delay_ns += std::max<int64_t>(0, delay);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<float>()() = static_cast<float>(std::max<int64_t>(0, delay) * 1e-9);
  }

 private:
  struct Part {
    enum Kind { kPersistent, kTransient, kTrace } kind;
    double factor = 1.0, p = 0.0, window_s = 1.0;
    std::vector<double> trace;  // this worker's factors per window
  };

  ::tensorflow::Status Parse(const std::string& profile) {
    if (profile.empty() || profile == "none") return ::tensorflow::OkStatus();
    for (const std::string& spec : Split(profile, '+')) {
      std::vector<std::string> f = Split(spec, ';');
      Part part;
      if (f[0] == "persistent" && f.size() == 2) {
        part.kind = Part::kPersistent;
        for (const std::string& kv : Split(f[1], ',')) {
          std::vector<std::string> a = Split(kv, '=');
          if (a.size() != 2) return errors::InvalidArgument("Bad persistent straggler '", kv, "'");
          if (std::atoll(a[0].c_str()) == worker_) part.factor = std::atof(a[1].c_str());
        }
      } else if (f[0] == "transient" && f.size() == 3) {
        part.kind = Part::kTransient;
        part.p = std::atof(f[1].c_str());
        part.factor = std::atof(f[2].c_str());
      } else if (f[0] == "compute" && f.size() == 2) {
        const double ms = std::atof(f[1].c_str());
        if (!(ms > 0)) return errors::InvalidArgument("Compute floor must be > 0 ms.");
        compute_floor_ns_ = std::max(compute_floor_ns_, static_cast<int64_t>(ms * 1e6));
        continue;  // not a slowdown factor
      } else if (f[0] == "trace" && f.size() == 3) {
        part.kind = Part::kTrace;
        part.window_s = std::atof(f[1].c_str());
        for (const std::string& kv : Split(f[2], ',')) {
          std::vector<std::string> a = Split(kv, '=');
          if (a.size() != 2) return errors::InvalidArgument("Bad straggler trace '", kv, "'");
          if (std::atoll(a[0].c_str()) != worker_) continue;
          for (const std::string& x : Split(a[1], ':')) part.trace.push_back(std::atof(x.c_str()));
        }
        if (part.window_s <= 0) return errors::InvalidArgument("Trace window must be > 0.");
      } else {
        return errors::InvalidArgument(
            "Unknown straggler profile '", spec,
            "'; expected persistent;<task>=<factor>,..., transient;<p>;<factor>, "
            "trace;<window_s>;<task>=<f0>:<f1>... or compute;<ms>");
      }
      if (part.factor < 1.0) return errors::InvalidArgument("Slowdown factors must be >= 1.");
      for (double x : part.trace) {
        if (x < 1.0) return errors::InvalidArgument("Slowdown factors must be >= 1.");
      }
      parts_.push_back(part);
    }
    return ::tensorflow::OkStatus();
  }

  double Factor(int64_t step, double elapsed_s) const {
    double factor = 1.0;
    for (size_t i = 0; i < parts_.size(); ++i) {
      const Part& part = parts_[i];
      switch (part.kind) {
        case Part::kPersistent:
          factor *= part.factor;
          break;
        case Part::kTransient:
          if (Uniform(seed_ + i, worker_, step) < part.p) factor *= part.factor;
          break;
        case Part::kTrace:
          if (!part.trace.empty()) {
            const size_t w = static_cast<size_t>(std::max(0.0, elapsed_s) / part.window_s);
            factor *= part.trace[std::min(w, part.trace.size() - 1)];
          }
          break;
      }
    }
    return factor;
  }

  int64_t seed_;
  int64_t worker_;
  int64_t compute_floor_ns_ = 0;  // compute:<ms>, 0 when absent
  std::vector<Part> parts_;
};

class WorkerStepStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({4}), &out));
    auto v = out->vec<int64_t>();
    v(0) = g_steps.load();
    v(1) = g_busy_ns.load();
    v(2) = g_delay_ns.load();
    v(3) = g_first_unix_ns.load();
  }
};

REGISTER_KERNEL_BUILDER(Name("GBA>StepBegin").Device(::tensorflow::DEVICE_CPU), StepBeginOp);
REGISTER_KERNEL_BUILDER(Name("GBA>StepEnd").Device(::tensorflow::DEVICE_CPU), StepEndOp);
REGISTER_KERNEL_BUILDER(Name("GBA>WorkerStepStats").Device(::tensorflow::DEVICE_CPU),
                        WorkerStepStatsOp);

}  // namespace tf_gba
