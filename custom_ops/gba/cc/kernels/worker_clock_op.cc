// Worker clock of the bounded-staleness baseline (Hop-BS): one per job, on parameter server 0.
//
// The clock counts the steps each worker has completed. Before a step, a worker waits while it
// is more than `bound` steps ahead of the slowest worker: completed[w] - min_j completed[j] must
// be <= bound for it to proceed. The wait is an AsyncOpKernel: a blocked wait parks its `done`
// callback and context in the clock and returns its thread to the executor. With one blocked
// wait per fast worker on the parameter server, a synchronous wait would take one inter-op thread
// each, and the ops that would let them go (the slow worker's tick, its pushes, its reads) could
// then find no thread to run on. The wait is finished later by whichever thread makes its
// condition true (a tick, a reset), by the clock's timer thread when its timeout passes, by the
// step's cancellation, or by the clock's destruction.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "custom_ops/common/async_waiters.h"
#include "custom_ops/common/kernel_util.h"
#include "custom_ops/common/resource_util.h"
#include "custom_ops/common/worker_index.h"
#include "tensorflow/core/framework/cancellation.h"

namespace tf_gba {

namespace {

constexpr int64_t kNoDeadline = std::numeric_limits<int64_t>::max();

// A blocked wait: what the clock's rule reads besides what every parked wait holds.
struct Waiter : ParkedWait {
  int64_t worker = 0;
  int64_t bound = 0;
  int64_t start_ns = 0;
  int64_t deadline_ns = kNoDeadline;
};

// The outputs of a wait that returns: (waited_ns, timed_out).
struct WaitResult {
  int64_t waited_ns = 0;
  bool timed_out = false;

  Status Write(OpKernelContext* ctx) const {
    Tensor *waited, *timed_out_out;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({}), &waited));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({}), &timed_out_out));
    waited->scalar<int64_t>()() = waited_ns;
    timed_out_out->scalar<bool>()() = timed_out;
    return ::tensorflow::OkStatus();
  }
};

using Release = WaitRelease<Waiter, WaitResult>;

// The clock's state and its waiters. Shared (not owned by the resource alone) because the timer
// thread and the cancellation callbacks hold it too: the resource may be destroyed on the very
// thread that is running one of them.
class ClockState : public std::enable_shared_from_this<ClockState> {
 public:
  explicit ClockState(int64_t num_workers)
      : num_workers_(num_workers),
        completed_(num_workers, 0),
        blocked_ns_(num_workers, 0),
        waits_(num_workers, 0),
        timeouts_(num_workers, 0),
        waiting_(num_workers, 0) {}

  int64_t num_workers() const { return num_workers_; }

  void Wait(Waiter w) TF_LOCKS_EXCLUDED(mu_) {
    std::vector<Release> out;
    {
      ::tensorflow::mutex_lock lock(mu_);
      if (shutdown_) {
        out.push_back(Fail(std::move(w), errors::Cancelled(kDestroyed), true));
      } else if (Allowed(w.worker, w.bound)) {
        out.push_back(Proceed(std::move(w), MonoNs()));
      } else {
        const uint64_t id = next_id_++;
        std::shared_ptr<ClockState> self = shared_from_this();
        if (RegisterCancellation(&w, [self, id]() { self->Cancel(id); })) {
          Park(id, std::move(w));
        } else {
          out.push_back(Fail(std::move(w), errors::Cancelled(kCancelled), true));
        }
      }
    }
    FinishReleases(&out);
  }

  void Tick(int64_t worker) TF_LOCKS_EXCLUDED(mu_) {
    std::vector<Release> out;
    {
      ::tensorflow::mutex_lock lock(mu_);
      ++completed_[worker];
      ReleaseAllowed(&out);
    }
    FinishReleases(&out);
  }

  void Reset() TF_LOCKS_EXCLUDED(mu_) {
    std::vector<Release> out;
    {
      ::tensorflow::mutex_lock lock(mu_);
      std::fill(completed_.begin(), completed_.end(), 0);
      std::fill(blocked_ns_.begin(), blocked_ns_.end(), 0);
      std::fill(waits_.begin(), waits_.end(), 0);
      std::fill(timeouts_.begin(), timeouts_.end(), 0);
      max_lead_ = 0;
      ReleaseAllowed(&out);  // all workers are level: every wait may go (bounds are >= 0)
    }
    FinishReleases(&out);
  }

  void Stats(std::vector<int64_t>* completed, std::vector<int64_t>* blocked_ns,
             std::vector<int64_t>* waits, std::vector<int64_t>* timeouts, int64_t* max_lead,
             std::vector<int64_t>* waiting) TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    *completed = completed_;
    *blocked_ns = blocked_ns_;
    *waits = waits_;
    *timeouts = timeouts_;
    *max_lead = max_lead_;
    *waiting = waiting_;
  }

  // Called when the resource is destroyed: fails every blocked wait and stops the timer thread.
  void Shutdown() TF_LOCKS_EXCLUDED(mu_) {
    std::vector<Release> out;
    std::thread timer;
    {
      ::tensorflow::mutex_lock lock(mu_);
      shutdown_ = true;
      FailAllParked(&waiters_, errors::Cancelled(kDestroyed), &out);
      deadlines_.clear();
      std::fill(waiting_.begin(), waiting_.end(), 0);
      timer = std::move(timer_);
    }
    timer_cv_.notify_all();
    FinishReleases(&out);
    if (timer.joinable()) {
      // The last reference may be dropped by an op that the timer thread's `done` ran inline:
      // it cannot join itself. It holds the state and exits on its own, having seen shutdown_.
      if (timer.get_id() == std::this_thread::get_id()) {
        timer.detach();
      } else {
        timer.join();
      }
    }
  }

 private:
  static constexpr const char* kDestroyed =
      "The worker clock was destroyed while this wait was blocked.";
  static constexpr const char* kCancelled = "Worker clock wait cancelled.";

  // completed[worker] - min_j completed[j] <= bound.
  bool Allowed(int64_t worker, int64_t bound) const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Lead(worker) <= bound;
  }
  int64_t Lead(int64_t worker) const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return completed_[worker] - *std::min_element(completed_.begin(), completed_.end());
  }

  // The bookkeeping of a wait that returns with its condition true.
  Release Proceed(Waiter w, int64_t now) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Release r;
    r.result.waited_ns = std::max<int64_t>(0, now - w.start_ns);
    blocked_ns_[w.worker] += r.result.waited_ns;
    ++waits_[w.worker];
    max_lead_ = std::max(max_lead_, Lead(w.worker));
    r.waiter = std::move(w);
    return r;
  }

  // The bookkeeping of a wait that gives up after its timeout.
  Release TimeOut(Waiter w, int64_t now) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Release r;
    r.result.waited_ns = std::max<int64_t>(0, now - w.start_ns);
    r.result.timed_out = true;
    blocked_ns_[w.worker] += r.result.waited_ns;
    ++waits_[w.worker];
    ++timeouts_[w.worker];
    r.waiter = std::move(w);
    return r;
  }

  // A wait that fails (cancelled, clock destroyed): it counts in no statistic.
  static Release Fail(Waiter w, Status status, bool skip_deregister) {
    return FailedRelease<Release>(std::move(w), std::move(status), skip_deregister);
  }

  void Park(uint64_t id, Waiter w) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t deadline = w.deadline_ns;
    ++waiting_[w.worker];
    waiters_.emplace(id, std::move(w));
    if (deadline == kNoDeadline) return;
    const bool earliest = deadlines_.empty() || deadline < deadlines_.begin()->first;
    deadlines_.emplace(deadline, id);
    if (!timer_.joinable()) {
      std::shared_ptr<ClockState> self = shared_from_this();
      timer_ = std::thread([self]() { self->TimerLoop(); });
    } else if (earliest) {
      timer_cv_.notify_one();
    }
  }

  // Takes a blocked wait out of the clock.
  Waiter Take(std::map<uint64_t, Waiter>::iterator it) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint64_t id = it->first;
    Waiter w = std::move(it->second);
    waiters_.erase(it);
    --waiting_[w.worker];
    if (w.deadline_ns != kNoDeadline) deadlines_.erase({w.deadline_ns, id});
    return w;
  }

  // Releases every waiter whose condition holds now.
  void ReleaseAllowed(std::vector<Release>* out) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t now = MonoNs();
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      auto next = std::next(it);
      if (Allowed(it->second.worker, it->second.bound)) {
        out->push_back(Proceed(Take(it), now));
      }
      it = next;
    }
  }

  // The step of a blocked wait was cancelled.
  void Cancel(uint64_t id) TF_LOCKS_EXCLUDED(mu_) {
    std::vector<Release> out;
    {
      ::tensorflow::mutex_lock lock(mu_);
      auto it = waiters_.find(id);
      if (it == waiters_.end()) return;  // already released
      out.push_back(Fail(Take(it), errors::Cancelled(kCancelled), true));
    }
    FinishReleases(&out);
  }

  // Releases waits whose timeout has passed; sleeps until the earliest deadline otherwise. The
  // released waits are finished outside the lock (their `done` may come back to the clock).
  void TimerLoop() TF_LOCKS_EXCLUDED(mu_) {
    std::vector<Release> out;
    for (;;) {
      {
        ::tensorflow::mutex_lock lock(mu_);
        while (!shutdown_ && out.empty()) {
          if (deadlines_.empty()) {
            timer_cv_.wait(lock);
            continue;
          }
          const int64_t now = MonoNs();
          const int64_t first = deadlines_.begin()->first;
          if (first > now) {
            timer_cv_.wait_for(lock, std::chrono::nanoseconds(first - now));
            continue;
          }
          while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
            out.push_back(TimeOut(Take(waiters_.find(deadlines_.begin()->second)), now));
          }
        }
        if (out.empty()) return;  // shut down
      }
      FinishReleases(&out);
    }
  }

  const int64_t num_workers_;
  ::tensorflow::mutex mu_;
  ::tensorflow::condition_variable timer_cv_;
  std::vector<int64_t> completed_ TF_GUARDED_BY(mu_);
  std::vector<int64_t> blocked_ns_ TF_GUARDED_BY(mu_);
  std::vector<int64_t> waits_ TF_GUARDED_BY(mu_);
  std::vector<int64_t> timeouts_ TF_GUARDED_BY(mu_);
  std::vector<int64_t> waiting_ TF_GUARDED_BY(mu_);
  int64_t max_lead_ TF_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ TF_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, Waiter> waiters_ TF_GUARDED_BY(mu_);
  std::set<std::pair<int64_t, uint64_t>> deadlines_ TF_GUARDED_BY(mu_);  // (deadline_ns, id)
  std::thread timer_ TF_GUARDED_BY(mu_);  // started by the first wait with a timeout
  bool shutdown_ TF_GUARDED_BY(mu_) = false;
};

}  // namespace

class WorkerClock : public ::tensorflow::ResourceBase {
 public:
  explicit WorkerClock(int64_t num_workers)
      : state_(std::make_shared<ClockState>(num_workers)) {}
  // Destroying the resource (DestroyResourceOp, or its container being cleared) fails the waits
  // still blocked with Cancelled instead of leaving their steps hanging.
  ~WorkerClock() override { state_->Shutdown(); }

  std::string DebugString() const override {
    return ::tensorflow::strings::StrCat("GBA WorkerClock(num_workers=", state_->num_workers(),
                                         ")");
  }

  ClockState* state() { return state_.get(); }

 private:
  std::shared_ptr<ClockState> state_;
};

class WorkerClockCreateOp : public OpKernel {
 public:
  explicit WorkerClockCreateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_workers", &num_workers_));
    OP_REQUIRES_OK(ctx, name_.FromAttrs(ctx));
    OP_REQUIRES(ctx, num_workers_ >= 1,
                errors::InvalidArgument("num_workers must be >= 1, got ", num_workers_, "."));
  }
  void Compute(OpKernelContext* ctx) override {
    CreateResourceAndOutputHandle<WorkerClock>(ctx, name_,
                                               [this](WorkerClock** out) {
                                                 *out = new WorkerClock(num_workers_);
                                                 return ::tensorflow::OkStatus();
                                               });
  }

 private:
  int64_t num_workers_;
  ResourceName name_;
};

class WorkerClockWaitOp : public AsyncOpKernel {
 public:
  using AsyncOpKernel::AsyncOpKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const int64_t start = MonoNs();
    ::tensorflow::core::RefCountPtr<WorkerClock> clock;
    OP_REQUIRES_OK_ASYNC(ctx, LookupScalarHandle(ctx, 0, "worker clock", &clock), done);
    ClockState* state = clock->state();
    int64_t worker, bound, timeout_ms;
    OP_REQUIRES_OK_ASYNC(ctx, ReadWorkerIndex(ctx, 1, state->num_workers(), &worker), done);
    OP_REQUIRES_OK_ASYNC(ctx, ReadScalarInt64(ctx, 2, "bound", &bound), done);
    OP_REQUIRES_OK_ASYNC(ctx, ReadScalarInt64(ctx, 3, "timeout_ms", &timeout_ms), done);
    OP_REQUIRES_ASYNC(ctx, bound >= 0,
                      errors::InvalidArgument("bound must be >= 0, got ", bound, "."), done);
    OP_REQUIRES_ASYNC(ctx, timeout_ms >= 0,
                      errors::InvalidArgument("timeout_ms must be >= 0 (0: no time limit), got ",
                                              timeout_ms, "."),
                      done);
    Waiter w;
    w.ctx = ctx;
    w.done = std::move(done);
    w.worker = worker;
    w.bound = bound;
    w.start_ns = start;
    constexpr int64_t kNsPerMs = 1000000;
    if (timeout_ms > 0 && timeout_ms < (kNoDeadline - start) / kNsPerMs) {
      w.deadline_ns = start + timeout_ms * kNsPerMs;
    }
    w.cm = ctx->cancellation_manager();
    // The wait may be finished, and ctx freed, before this returns: ctx is not touched after it.
    state->Wait(std::move(w));
  }
};

class WorkerClockTickOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<WorkerClock> clock;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "worker clock", &clock));
    int64_t worker;
    OP_REQUIRES_OK(ctx, ReadWorkerIndex(ctx, 1, clock->state()->num_workers(), &worker));
    clock->state()->Tick(worker);
  }
};

class WorkerClockStatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<WorkerClock> clock;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "worker clock", &clock));
    std::vector<int64_t> vectors[4], waiting;
    int64_t max_lead;
    clock->state()->Stats(&vectors[0], &vectors[1], &vectors[2], &vectors[3], &max_lead,
                          &waiting);
    for (int i = 0; i < 4; ++i) {
      Tensor* out;
      const int64_t n = static_cast<int64_t>(vectors[i].size());
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, TensorShape({n}), &out));
      std::copy(vectors[i].begin(), vectors[i].end(), out->vec<int64_t>().data());
    }
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({}), &out));
    out->scalar<int64_t>()() = max_lead;
  }
};

class WorkerClockWaitingOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<WorkerClock> clock;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "worker clock", &clock));
    std::vector<int64_t> unused[4], waiting;
    int64_t max_lead;
    clock->state()->Stats(&unused[0], &unused[1], &unused[2], &unused[3], &max_lead, &waiting);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(waiting.size())}), &out));
    std::copy(waiting.begin(), waiting.end(), out->vec<int64_t>().data());
  }
};

class WorkerClockResetOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<WorkerClock> clock;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "worker clock", &clock));
    clock->state()->Reset();
  }
};

class WorkerIndexOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = WorkerIndex(ctx->device()->name());
  }
};

REGISTER_KERNEL_BUILDER(Name("GBA>WorkerClockCreate").Device(::tensorflow::DEVICE_CPU),
                        WorkerClockCreateOp);
REGISTER_KERNEL_BUILDER(Name("GBA>WorkerClockWait").Device(::tensorflow::DEVICE_CPU),
                        WorkerClockWaitOp);
REGISTER_KERNEL_BUILDER(Name("GBA>WorkerClockTick").Device(::tensorflow::DEVICE_CPU),
                        WorkerClockTickOp);
REGISTER_KERNEL_BUILDER(Name("GBA>WorkerClockStats").Device(::tensorflow::DEVICE_CPU),
                        WorkerClockStatsOp);
REGISTER_KERNEL_BUILDER(Name("GBA>WorkerClockWaiting").Device(::tensorflow::DEVICE_CPU),
                        WorkerClockWaitingOp);
REGISTER_KERNEL_BUILDER(Name("GBA>WorkerClockReset").Device(::tensorflow::DEVICE_CPU),
                        WorkerClockResetOp);
REGISTER_KERNEL_BUILDER(Name("GBA>WorkerIndex").Device(::tensorflow::DEVICE_CPU), WorkerIndexOp);

}  // namespace tf_gba
