// The parked-wait machinery of the blocking AsyncOpKernels (the worker clock, the version
// barrier). A blocked wait parks its context and `done` callback in its resource's state and
// returns its thread to the executor; whichever thread later makes the wait's condition true (or
// cancels it, or destroys the resource) takes it out under the state's lock and finishes it after
// the lock is released, because `done` may run further ops inline that come back to the state.
// What decides when a wait goes, and what it counts, stays with each op.
#ifndef TF_GBA_CUSTOM_OPS_COMMON_ASYNC_WAITERS_H_
#define TF_GBA_CUSTOM_OPS_COMMON_ASYNC_WAITERS_H_

#include <utility>
#include <vector>

#include "custom_ops/common/kernel_util.h"
#include "tensorflow/core/framework/cancellation.h"

namespace tf_gba {

// What every parked wait needs to be finished later from another thread. Each op's waiter derives
// from it and adds the fields its own rule reads.
struct ParkedWait {
  OpKernelContext* ctx = nullptr;
  AsyncOpKernel::DoneCallback done;
  ::tensorflow::CancellationManager* cm = nullptr;
  ::tensorflow::CancellationToken token = ::tensorflow::CancellationManager::kInvalidToken;
};

// A wait taken out of its state under the lock, to be finished outside it. `Result` holds what a
// successful wait outputs and writes it with `Status Write(OpKernelContext*) const`, which
// allocates every output before setting any.
template <typename Waiter, typename Result>
struct WaitRelease {
  Waiter waiter;
  Status status;  // OK: the op succeeds with `result`; else it fails with this
  Result result;
  // No cancellation callback to deregister: none was registered, or it is the one releasing the
  // wait (deregistering from inside it would wait for itself).
  bool skip_deregister = false;
};

// A release that fails the wait (cancelled, resource destroyed).
template <typename Release, typename Waiter>
Release FailedRelease(Waiter w, Status status, bool skip_deregister) {
  Release r;
  r.status = std::move(status);
  r.skip_deregister = skip_deregister;
  r.waiter = std::move(w);
  return r;
}

// Takes every parked wait out of `waiters` (a map from id to waiter), failed with `status`: the
// resource is being destroyed. Called under the state's lock; its cancellation callbacks are
// deregistered when the releases are finished.
template <typename Release, typename Waiters>
void FailAllParked(Waiters* waiters, const Status& status, std::vector<Release>* out) {
  for (auto& entry : *waiters) {
    out->push_back(FailedRelease<Release>(std::move(entry.second), status, false));
  }
  waiters->clear();
}

// Finishes the waits taken out under the lock: writes their outputs or status and calls `done`.
// Must be called with no lock held.
template <typename Release>
void FinishReleases(std::vector<Release>* releases) {
  for (Release& r : *releases) {
    ParkedWait& w = r.waiter;
    if (w.cm != nullptr && w.token != ::tensorflow::CancellationManager::kInvalidToken &&
        !r.skip_deregister) {
      // Non-blocking: if the step is being cancelled right now, the callback finds the wait gone.
      w.cm->TryDeregisterCallback(w.token);
    }
    OpKernelContext* ctx = w.ctx;
    if (r.status.ok()) {
      Status s = r.result.Write(ctx);
      if (!s.ok()) ctx->SetStatus(s);
    } else {
      ctx->SetStatus(r.status);
    }
    AsyncOpKernel::DoneCallback done = std::move(w.done);
    done();  // ctx may be gone after this
  }
  releases->clear();
}

// Registers `on_cancel` (which takes the wait out by its id) with the wait's cancellation manager,
// if it has one. Called under the state's lock before parking, so a cancellation cannot slip in
// between the state's check and the parking: its callback waits for the lock and then finds the
// wait. The manager runs callbacks without holding its own lock, so this order cannot deadlock.
// Returns false when the step is already cancelled: the wait must then fail instead of parking.
template <typename OnCancel>
bool RegisterCancellation(ParkedWait* w, OnCancel on_cancel) {
  if (w->cm == nullptr) return true;
  w->token = w->cm->get_cancellation_token();
  return w->cm->RegisterCallback(w->token, std::move(on_cancel));
}

}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_COMMON_ASYNC_WAITERS_H_
