// State and rules shared by the dense and the sparse GBA gradient buffers: the global step, the
// number of entries in the current global batch, the staleness decay, push de-duplication and the
// statistics read from Python (BufferCore, guarded by the owning buffer's mutex), and the create and
// stats kernels every buffer type shares.
#ifndef TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_BUFFER_CORE_H_
#define TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_BUFFER_CORE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_set>
#include <vector>

#include "custom_ops/common/accumulate.h"
#include "custom_ops/common/resource_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"

namespace tf_gba {

using ::tensorflow::Status;

// Staleness decay f(s) of SPEC section 1 (Eq. 1) and its exponential variant.
struct DecayRule {
  enum Kind { kThreshold, kExponential };
  Kind kind = kThreshold;
  int64_t iota = 3;     // staleness threshold
  double alpha = 0.5;   // base of the exponential decay

  double Weight(int64_t staleness) const {
    if (staleness <= iota) return 1.0;
    if (kind == kThreshold) return 0.0;
    return std::pow(alpha, static_cast<double>(staleness - iota));
  }
};

// How an aggregate is normalised (SPEC: divide by M, "also when some f = 0").
enum class Normalize { kNumAggregate, kKept };

struct BufferConfig {
  int64_t num_aggregate = 1;          // M
  DecayRule decay;
  Normalize normalize = Normalize::kNumAggregate;
  // Whether a gradient whose weight is 0 (too stale, or non-finite and dropped) still fills one of
  // the M places of the global batch. GBA: yes (the token was spent). Backup workers: no.
  bool count_dropped = true;
  // Embedding buffers: judge each id by its own row's staleness (GBA), or every id of a push by
  // the push's dense staleness step - token (Hop-BW: a gradient from an older version is ignored
  // whole, as a backup worker's would be). Dense buffers always use the dense staleness.
  bool per_id_staleness = true;
  // Embedding buffers: divide a row's weighted sum by M, absent entries counting as zero rows
  // (false: what an all-reduce Sync applies, the default), or by c(id), the number of entries
  // that contained the id (true: the paper's rule, a PS Sync averaging sparse gradients per id).
  bool sparse_per_id_divisor = false;
  bool error_on_nonfinite = false;    // else: drop the push (weight 0) and count it
  int64_t histogram_bins = 16;
  int64_t dedupe_window = 1 << 16;    // how many recent tickets are remembered
};

// Reads the attributes every buffer-creating op has. Shared by the dense and sparse create ops.
inline Status ParseBufferConfig(::tensorflow::OpKernelConstruction* ctx, BufferConfig* config) {
  std::string decay, normalize, nonfinite;
  float alpha;
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_aggregate", &config->num_aggregate));
  TF_RETURN_IF_ERROR(ctx->GetAttr("staleness_threshold", &config->decay.iota));
  TF_RETURN_IF_ERROR(ctx->GetAttr("decay", &decay));
  TF_RETURN_IF_ERROR(ctx->GetAttr("decay_alpha", &alpha));
  TF_RETURN_IF_ERROR(ctx->GetAttr("normalize", &normalize));
  TF_RETURN_IF_ERROR(ctx->GetAttr("count_dropped", &config->count_dropped));
  TF_RETURN_IF_ERROR(ctx->GetAttr("per_id_staleness", &config->per_id_staleness));
  TF_RETURN_IF_ERROR(ctx->GetAttr("nonfinite", &nonfinite));
  TF_RETURN_IF_ERROR(ctx->GetAttr("histogram_bins", &config->histogram_bins));
  TF_RETURN_IF_ERROR(ctx->GetAttr("dedupe_window", &config->dedupe_window));
  if (config->num_aggregate < 1) {
    return ::tensorflow::errors::InvalidArgument(
        "num_aggregate (M, the number of gradients per global batch) must be >= 1, got ",
        config->num_aggregate, ". Use M = global_batch_size / local_batch_size.");
  }
  if (config->decay.iota < 0) {
    return ::tensorflow::errors::InvalidArgument(
        "staleness_threshold must be >= 0, got ", config->decay.iota, ".");
  }
  // decay, normalize and nonfinite are enum-like attributes: TensorFlow has checked their values.
  config->decay.kind = decay == "exponential" ? DecayRule::kExponential : DecayRule::kThreshold;
  if (!(alpha > 0.0f && alpha <= 1.0f)) {
    return ::tensorflow::errors::InvalidArgument(
        "decay_alpha must be in (0, 1], got ", alpha, ".");
  }
  config->decay.alpha = alpha;
  config->normalize = normalize == "kept" ? Normalize::kKept : Normalize::kNumAggregate;
  config->error_on_nonfinite = nonfinite == "error";
  if (config->histogram_bins < 1) {
    return ::tensorflow::errors::InvalidArgument("histogram_bins must be >= 1.");
  }
  if (config->dedupe_window < 0) {
    return ::tensorflow::errors::InvalidArgument("dedupe_window must be >= 0.");
  }
  return ::tensorflow::OkStatus();
}

struct BufferStats {
  int64_t pushes = 0;          // accepted pushes (not counting duplicates)
  int64_t aggregations = 0;
  int64_t dropped = 0;         // dense: gradients with weight 0; sparse: (push, id) pairs
  int64_t duplicates = 0;      // pushes ignored because their ticket was seen before
  int64_t nonfinite = 0;       // pushes that held NaN or Inf
  int64_t staleness_sum = 0;   // over accepted pushes (dense) or (push, id) pairs (sparse)
  int64_t staleness_max = 0;
  std::vector<int64_t> histogram;
};

class BufferCore {
 public:
  explicit BufferCore(const BufferConfig& config, int64_t initial_step)
      : config_(config), step_(initial_step) {
    stats_.histogram.assign(config.histogram_bins, 0);
  }

  const BufferConfig& config() const { return config_; }
  int64_t step() const { return step_; }
  int64_t entries() const { return entries_; }
  BufferStats& stats() { return stats_; }
  const BufferStats& stats() const { return stats_; }

  // Returns false (and counts it) when `ticket` was pushed before. Tickets < 0 are never deduped.
  bool AcceptTicket(int64_t ticket) {
    if (ticket < 0 || config_.dedupe_window == 0) return true;
    if (seen_.count(ticket)) {
      ++stats_.duplicates;
      return false;
    }
    seen_.insert(ticket);
    order_.push_back(ticket);
    while (static_cast<int64_t>(order_.size()) > config_.dedupe_window) {
      seen_.erase(order_.front());
      order_.pop_front();
    }
    return true;
  }

  void RecordStaleness(int64_t staleness) {
    const int64_t s = std::max<int64_t>(0, staleness);
    stats_.staleness_sum += s;
    stats_.staleness_max = std::max(stats_.staleness_max, s);
    ++stats_.histogram[std::min<int64_t>(s, config_.histogram_bins - 1)];
  }

  // Counts one entry towards the global batch; returns true when it completes the batch.
  bool AddEntry(bool counts) {
    ++stats_.pushes;
    if (counts) ++entries_;
    return entries_ >= config_.num_aggregate;
  }

  void FinishAggregation() {
    entries_ = 0;
    ++step_;
    ++stats_.aggregations;
  }

  // Restoring a checkpoint: pending entries belong to gradients whose tokens are gone.
  void Reset(int64_t step) {
    step_ = step;
    entries_ = 0;
    seen_.clear();
    order_.clear();
  }

 private:
  const BufferConfig config_;
  int64_t step_ = 0;
  int64_t entries_ = 0;
  BufferStats stats_;
  std::unordered_set<int64_t> seen_;
  std::deque<int64_t> order_;
};

// Outputs of the Dense/SparseBufferStats ops; the caller holds the buffer's mutex.
inline void WriteBufferStats(::tensorflow::OpKernelContext* ctx, const BufferCore& core) {
  ::tensorflow::Tensor *step, *entries, *counters, *hist;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({}), &step));
  OP_REQUIRES_OK(ctx, ctx->allocate_output(1, ::tensorflow::TensorShape({}), &entries));
  OP_REQUIRES_OK(ctx, ctx->allocate_output(2, ::tensorflow::TensorShape({7}), &counters));
  const BufferStats& s = core.stats();
  OP_REQUIRES_OK(ctx, ctx->allocate_output(
                          3, ::tensorflow::TensorShape({static_cast<int64_t>(s.histogram.size())}), &hist));
  step->scalar<int64_t>()() = core.step();
  entries->scalar<int64_t>()() = core.entries();
  auto c = counters->vec<int64_t>();
  c(0) = s.pushes;
  c(1) = s.aggregations;
  c(2) = s.dropped;
  c(3) = s.duplicates;
  c(4) = s.nonfinite;
  c(5) = s.staleness_sum;
  c(6) = s.staleness_max;
  auto h = hist->vec<int64_t>();
  for (size_t i = 0; i < s.histogram.size(); ++i) h(i) = s.histogram[i];
}

// The (token, ticket) scalars every push op takes as its inputs 1 and 2.
inline Status ReadTokenAndTicket(::tensorflow::OpKernelContext* ctx, int64_t* token,
                                 int64_t* ticket) {
  TF_RETURN_IF_ERROR(ReadScalarInt64(ctx, 1, "token", token));
  TF_RETURN_IF_ERROR(ReadScalarInt64(ctx, 2, "ticket", ticket));
  if (*token < 0) {
    return ::tensorflow::errors::InvalidArgument(
        "token must be >= 0 (tokens come from the GBA token generator), got ", *token, ".");
  }
  return ::tensorflow::OkStatus();
}

// The create op of a buffer type: the attributes every buffer has (BufferConfig, initial_step,
// container/shared_name) plus the buffer's own, read by `Buffer::Params::FromAttrs` (which may
// also set the buffer-specific fields of the config). The buffer is built as
// `new Buffer(params, config, initial_step)`.
template <typename Buffer>
class BufferCreateOp : public ::tensorflow::OpKernel {
 public:
  explicit BufferCreateOp(::tensorflow::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseBufferConfig(ctx, &config_));
    OP_REQUIRES_OK(ctx, Buffer::Params::FromAttrs(ctx, &config_, &params_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initial_step", &initial_step_));
    OP_REQUIRES_OK(ctx, name_.FromAttrs(ctx));
  }
  void Compute(::tensorflow::OpKernelContext* ctx) override {
    CreateResourceAndOutputHandle<Buffer>(ctx, name_, [this](Buffer** out) {
      *out = new Buffer(params_, config_, initial_step_);
      return ::tensorflow::OkStatus();
    });
  }

 private:
  BufferConfig config_;
  typename Buffer::Params params_;
  int64_t initial_step_;
  ResourceName name_;
};

// The stats op of a buffer type: (global_step, entries, counters, histogram), read under the
// buffer's lock by `Buffer::WriteStats`.
template <typename Buffer>
class BufferStatsOp : public ::tensorflow::OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(::tensorflow::OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<Buffer> buf;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &buf));
    buf->WriteStats(ctx);
  }
};

// Registers the create and stats kernels of a buffer type, `Kind` being Dense or Sparse, on the
// CPU and, in CUDA builds, on the GPU: there they only touch the host-side bookkeeping (every
// stats output in host memory), so that a buffer created under tf.device("/GPU:0") lives in that
// device's resource manager, next to its pushes.
#define TF_GBA_REGISTER_BUFFER_CREATE_AND_STATS_CPU(Kind, Buffer)                            \
  REGISTER_KERNEL_BUILDER(Name("GBA>" #Kind "BufferCreate").Device(::tensorflow::DEVICE_CPU), \
                          BufferCreateOp<Buffer>);                                           \
  REGISTER_KERNEL_BUILDER(Name("GBA>" #Kind "BufferStats").Device(::tensorflow::DEVICE_CPU),  \
                          BufferStatsOp<Buffer>)
#if GOOGLE_CUDA
#define TF_GBA_REGISTER_BUFFER_CREATE_AND_STATS(Kind, Buffer)                                \
  TF_GBA_REGISTER_BUFFER_CREATE_AND_STATS_CPU(Kind, Buffer);                                 \
  REGISTER_KERNEL_BUILDER(Name("GBA>" #Kind "BufferCreate").Device(::tensorflow::DEVICE_GPU), \
                          BufferCreateOp<Buffer>);                                           \
  REGISTER_KERNEL_BUILDER(Name("GBA>" #Kind "BufferStats")                                   \
                              .Device(::tensorflow::DEVICE_GPU)                              \
                              .HostMemory("global_step")                                     \
                              .HostMemory("entries")                                         \
                              .HostMemory("counters")                                        \
                              .HostMemory("histogram"),                                      \
                          BufferStatsOp<Buffer>)
#else
#define TF_GBA_REGISTER_BUFFER_CREATE_AND_STATS(Kind, Buffer) \
  TF_GBA_REGISTER_BUFFER_CREATE_AND_STATS_CPU(Kind, Buffer)
#endif  // GOOGLE_CUDA

}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_BUFFER_CORE_H_
