// A straggler profile as one worker sees it: its compute floor and its slowdown factor at each
// step. Shared by the op that injects the slowdowns into real steps (straggler_op.cc) and the op
// that hands the same factors to the cluster simulator (straggler_factors_op.cc), so a simulated
// worker is slowed exactly as a real one with the same profile, seed and step would be.
#ifndef TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_STRAGGLER_PROFILE_H_
#define TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_STRAGGLER_PROFILE_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"

namespace tf_gba {

namespace straggler_internal {

// SplitMix64: a well-mixed hash, so (seed, worker, step) gives independent uniform draws.
inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline double Uniform(uint64_t seed, int64_t worker, int64_t step) {
  const uint64_t h = Mix(Mix(Mix(seed) ^ static_cast<uint64_t>(worker)) ^
                         static_cast<uint64_t>(step));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
}

inline std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  return out;
}

}  // namespace straggler_internal

class StragglerProfile {
 public:
  // Parses the canonical profile (tf_gba.distribute.stragglers.parse) for worker `worker`.
  ::tensorflow::Status Parse(const std::string& profile, int64_t worker) {
    namespace errors = ::tensorflow::errors;
    using straggler_internal::Split;
    worker_ = worker;
    parts_.clear();
    compute_floor_ns_ = 0;
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

  // The slowdown of this worker's `step`-th step (0-based), which started `elapsed_s` seconds
  // after its first step.
  double Factor(int64_t seed, int64_t step, double elapsed_s) const {
    double factor = 1.0;
    for (size_t i = 0; i < parts_.size(); ++i) {
      const Part& part = parts_[i];
      switch (part.kind) {
        case Part::kPersistent:
          factor *= part.factor;
          break;
        case Part::kTransient:
          if (straggler_internal::Uniform(seed + i, worker_, step) < part.p) factor *= part.factor;
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

  int64_t compute_floor_ns() const { return compute_floor_ns_; }

 private:
  struct Part {
    enum Kind { kPersistent, kTransient, kTrace } kind;
    double factor = 1.0, p = 0.0, window_s = 1.0;
    std::vector<double> trace;  // this worker's factors per window
  };

  int64_t worker_ = 0;
  int64_t compute_floor_ns_ = 0;  // compute:<ms>, 0 when absent
  std::vector<Part> parts_;
};

}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_STRAGGLER_PROFILE_H_
