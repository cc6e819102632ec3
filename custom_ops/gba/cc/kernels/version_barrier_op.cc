// Per-version barrier of the backup-workers baseline (Hop-BW): one per job, on parameter server 0.
//
// Hop-BW aggregates, for each version k, the first N - b3 gradients computed on version k, and a
// worker computes at most one gradient per version: after pushing for version k it waits for
// version k + 1. The barrier holds the version every variable has reached: version k becomes
// k + 1 when all the step's gradient buffers have completed (aggregated and applied) global step
// k, as reported by the workers whose pushes completed them, so a worker let through reads
// parameters that are all of the new version. The wait is an AsyncOpKernel for the reason the
// worker clock's is (worker_clock_op.cc): blocked waits must not hold the parameter server's
// threads, which the reports that release them need.
#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "custom_ops/common/async_waiters.h"
#include "custom_ops/common/kernel_util.h"
#include "custom_ops/common/resource_util.h"

namespace tf_gba {

namespace {

// A blocked wait: the worker whose last pushed version it waits to see passed.
struct BarrierWaiter : ParkedWait {
  int64_t worker = 0;
  int64_t start_ns = 0;
};

// The outputs of a wait that returns: (version, skip, waited_ns).
struct BarrierResult {
  int64_t version = 0;
  bool skip = false;
  int64_t waited_ns = 0;

  Status Write(OpKernelContext* ctx) const {
    Tensor *version_out, *skip_out, *waited;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({}), &version_out));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({}), &skip_out));
    TF_RETURN_IF_ERROR(ctx->allocate_output(2, TensorShape({}), &waited));
    version_out->scalar<int64_t>()() = version;
    skip_out->scalar<bool>()() = skip;
    waited->scalar<int64_t>()() = waited_ns;
    return ::tensorflow::OkStatus();
  }
};

using BarrierRelease = WaitRelease<BarrierWaiter, BarrierResult>;

// Shared with the cancellation callbacks, which may outlive the resource.
class BarrierState : public std::enable_shared_from_this<BarrierState> {
 public:
  BarrierState(int64_t num_workers, int64_t version)
      : num_workers_(num_workers),
        version_(version),
        last_pushed_(num_workers, -1),
        gradients_(num_workers, 0),
        duplicates_(num_workers, 0),
        released_(num_workers, 0),
        blocked_ns_(num_workers, 0),
        waiting_(num_workers, 0) {}

  int64_t num_workers() const { return num_workers_; }

  void Wait(BarrierWaiter w) TF_LOCKS_EXCLUDED(mu_) {
    std::vector<BarrierRelease> out;
    {
      ::tensorflow::mutex_lock lock(mu_);
      if (shutdown_) {
        out.push_back(Fail(std::move(w), errors::Cancelled(kDestroyed), true));
      } else if (version_ > last_pushed_[w.worker]) {
        out.push_back(Proceed(std::move(w), false, MonoNs()));
      } else {
        const uint64_t id = next_id_++;
        std::shared_ptr<BarrierState> self = shared_from_this();
        if (RegisterCancellation(&w, [self, id]() { self->Cancel(id); })) {
          ++waiting_[w.worker];
          waiters_.emplace(id, std::move(w));
        } else {
          out.push_back(Fail(std::move(w), errors::Cancelled(kCancelled), true));
        }
      }
    }
    FinishReleases(&out);
  }

  int64_t Report(int64_t worker, int64_t version, bool pushed, int64_t completed,
                 int64_t num_buffers) TF_LOCKS_EXCLUDED(mu_) {
    std::vector<BarrierRelease> out;
    int64_t now_version;
    {
      ::tensorflow::mutex_lock lock(mu_);
      if (pushed) {
        ++gradients_[worker];
        if (version <= last_pushed_[worker]) ++duplicates_[worker];
        last_pushed_[worker] = std::max(last_pushed_[worker], version);
      }
      if (completed > 0 && version == version_) {
        completions_ += completed;
        if (completions_ >= num_buffers) {
          ++version_;
          completions_ = 0;
          const int64_t now = MonoNs();
          for (auto it = waiters_.begin(); it != waiters_.end();) {
            auto next = std::next(it);
            if (version_ > last_pushed_[it->second.worker]) {
              out.push_back(Proceed(Take(it), false, now));
            }
            it = next;
          }
        }
      }
      now_version = version_;
    }
    FinishReleases(&out);
    return now_version;
  }

  void ReleaseAll() TF_LOCKS_EXCLUDED(mu_) {
    std::vector<BarrierRelease> out;
    {
      ::tensorflow::mutex_lock lock(mu_);
      const int64_t now = MonoNs();
      while (!waiters_.empty()) {
        BarrierWaiter w = Take(waiters_.begin());
        ++released_[w.worker];
        out.push_back(Proceed(std::move(w), true, now));
      }
    }
    FinishReleases(&out);
  }

  void Stats(int64_t* version, std::vector<int64_t> vectors[5]) TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    *version = version_;
    vectors[0] = gradients_;
    vectors[1] = duplicates_;
    vectors[2] = released_;
    vectors[3] = blocked_ns_;
    vectors[4] = waiting_;
  }

  void Shutdown() TF_LOCKS_EXCLUDED(mu_) {
    std::vector<BarrierRelease> out;
    {
      ::tensorflow::mutex_lock lock(mu_);
      shutdown_ = true;
      FailAllParked(&waiters_, errors::Cancelled(kDestroyed), &out);
      std::fill(waiting_.begin(), waiting_.end(), 0);
    }
    FinishReleases(&out);
  }

 private:
  static constexpr const char* kDestroyed =
      "The version barrier was destroyed while this wait was blocked.";
  static constexpr const char* kCancelled = "Version barrier wait cancelled.";

  // The bookkeeping of a wait that returns: let through, or let go by ReleaseAll (`skip`).
  BarrierRelease Proceed(BarrierWaiter w, bool skip, int64_t now)
      TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    BarrierRelease r;
    r.result.version = version_;
    r.result.skip = skip;
    r.result.waited_ns = std::max<int64_t>(0, now - w.start_ns);
    blocked_ns_[w.worker] += r.result.waited_ns;
    r.waiter = std::move(w);
    return r;
  }

  // A wait that fails (cancelled, barrier destroyed): it counts in no statistic.
  static BarrierRelease Fail(BarrierWaiter w, Status status, bool skip_deregister) {
    return FailedRelease<BarrierRelease>(std::move(w), std::move(status), skip_deregister);
  }

  // Takes a blocked wait out of the barrier.
  BarrierWaiter Take(std::map<uint64_t, BarrierWaiter>::iterator it)
      TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    BarrierWaiter w = std::move(it->second);
    waiters_.erase(it);
    --waiting_[w.worker];
    return w;
  }

  void Cancel(uint64_t id) TF_LOCKS_EXCLUDED(mu_) {
    std::vector<BarrierRelease> out;
    {
      ::tensorflow::mutex_lock lock(mu_);
      auto it = waiters_.find(id);
      if (it == waiters_.end()) return;
      out.push_back(Fail(Take(it), errors::Cancelled(kCancelled), true));
    }
    FinishReleases(&out);
  }

  const int64_t num_workers_;
  ::tensorflow::mutex mu_;
  int64_t version_ TF_GUARDED_BY(mu_);
  int64_t completions_ TF_GUARDED_BY(mu_) = 0;  // buffers that completed the current version
  // Per worker.
  std::vector<int64_t> last_pushed_ TF_GUARDED_BY(mu_);
  std::vector<int64_t> gradients_ TF_GUARDED_BY(mu_);
  std::vector<int64_t> duplicates_ TF_GUARDED_BY(mu_);
  std::vector<int64_t> released_ TF_GUARDED_BY(mu_);
  std::vector<int64_t> blocked_ns_ TF_GUARDED_BY(mu_);
  std::vector<int64_t> waiting_ TF_GUARDED_BY(mu_);
  uint64_t next_id_ TF_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, BarrierWaiter> waiters_ TF_GUARDED_BY(mu_);
  bool shutdown_ TF_GUARDED_BY(mu_) = false;
};

}  // namespace

class VersionBarrier : public ::tensorflow::ResourceBase {
 public:
  VersionBarrier(int64_t num_workers, int64_t version)
      : state_(std::make_shared<BarrierState>(num_workers, version)) {}
  // Destroying the resource fails the waits still blocked instead of leaving their steps hanging.
  ~VersionBarrier() override { state_->Shutdown(); }
  std::string DebugString() const override {
    return ::tensorflow::strings::StrCat("GBA VersionBarrier(num_workers=",
                                         state_->num_workers(), ")");
  }
  BarrierState* state() { return state_.get(); }

 private:
  std::shared_ptr<BarrierState> state_;
};

class VersionBarrierCreateOp : public OpKernel {
 public:
  explicit VersionBarrierCreateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_workers", &num_workers_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initial_version", &initial_version_));
    OP_REQUIRES_OK(ctx, name_.FromAttrs(ctx));
    OP_REQUIRES(ctx, num_workers_ >= 1,
                errors::InvalidArgument("num_workers must be >= 1, got ", num_workers_, "."));
    OP_REQUIRES(ctx, initial_version_ >= 0,
                errors::InvalidArgument("initial_version must be >= 0, got ", initial_version_,
                                        "."));
  }
  void Compute(OpKernelContext* ctx) override {
    CreateResourceAndOutputHandle<VersionBarrier>(
        ctx, name_, [this](VersionBarrier** out) {
          *out = new VersionBarrier(num_workers_, initial_version_);
          return ::tensorflow::OkStatus();
        });
  }

 private:
  int64_t num_workers_, initial_version_;
  ResourceName name_;
};

class VersionBarrierWaitOp : public AsyncOpKernel {
 public:
  using AsyncOpKernel::AsyncOpKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const int64_t start = MonoNs();
    ::tensorflow::core::RefCountPtr<VersionBarrier> barrier;
    OP_REQUIRES_OK_ASYNC(ctx, LookupScalarHandle(ctx, 0, "version barrier", &barrier), done);
    BarrierState* state = barrier->state();
    int64_t worker;
    OP_REQUIRES_OK_ASYNC(ctx, ReadWorkerIndex(ctx, 1, state->num_workers(), &worker), done);
    BarrierWaiter w;
    w.ctx = ctx;
    w.done = std::move(done);
    w.worker = worker;
    w.start_ns = start;
    w.cm = ctx->cancellation_manager();
    // The wait may be finished, and ctx freed, before this returns.
    state->Wait(std::move(w));
  }
};

class VersionBarrierReportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<VersionBarrier> barrier;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "version barrier", &barrier));
    int64_t worker, version, completed, num_buffers;
    OP_REQUIRES_OK(ctx, ReadWorkerIndex(ctx, 1, barrier->state()->num_workers(), &worker));
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 2, "version", &version));
    const Tensor& pushed = ctx->input(3);
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(pushed.shape()),
                errors::InvalidArgument("pushed must be a scalar, got shape ",
                                        pushed.shape().DebugString(), "."));
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 4, "completed", &completed));
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 5, "num_buffers", &num_buffers));
    OP_REQUIRES(ctx, version >= 0,
                errors::InvalidArgument("version must be >= 0, got ", version, "."));
    OP_REQUIRES(ctx, num_buffers >= 1 && completed >= 0 && completed <= num_buffers,
                errors::InvalidArgument("need 0 <= completed <= num_buffers and num_buffers >= 1, "
                                        "got completed=", completed, ", num_buffers=",
                                        num_buffers, "."));
    const int64_t now = barrier->state()->Report(worker, version, pushed.scalar<bool>()(),
                                                 completed, num_buffers);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = now;
  }
};

class VersionBarrierReleaseOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<VersionBarrier> barrier;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "version barrier", &barrier));
    barrier->state()->ReleaseAll();
  }
};

class VersionBarrierStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<VersionBarrier> barrier;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "version barrier", &barrier));
    int64_t version;
    std::vector<int64_t> vectors[5];
    barrier->state()->Stats(&version, vectors);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = version;
    for (int i = 0; i < 5; ++i) {
      const int64_t n = static_cast<int64_t>(vectors[i].size());
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i + 1, TensorShape({n}), &out));
      std::copy(vectors[i].begin(), vectors[i].end(), out->vec<int64_t>().data());
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("GBA>VersionBarrierCreate").Device(::tensorflow::DEVICE_CPU),
                        VersionBarrierCreateOp);
REGISTER_KERNEL_BUILDER(Name("GBA>VersionBarrierWait").Device(::tensorflow::DEVICE_CPU),
                        VersionBarrierWaitOp);
REGISTER_KERNEL_BUILDER(Name("GBA>VersionBarrierReport").Device(::tensorflow::DEVICE_CPU),
                        VersionBarrierReportOp);
REGISTER_KERNEL_BUILDER(Name("GBA>VersionBarrierRelease").Device(::tensorflow::DEVICE_CPU),
                        VersionBarrierReleaseOp);
REGISTER_KERNEL_BUILDER(Name("GBA>VersionBarrierStats").Device(::tensorflow::DEVICE_CPU),
                        VersionBarrierStatsOp);

}  // namespace tf_gba
