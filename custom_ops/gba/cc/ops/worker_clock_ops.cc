// Op registrations of the worker clock behind the bounded-staleness (Hop-BS) baseline: a
// resource on parameter server 0 counting the steps each worker has finished, and a wait that
// holds a worker back while it is more than `bound` steps ahead of the slowest one.
// Kernels live in ../kernels/worker_clock_op.cc; Python wrappers in tf_gba/ops/worker_clock.py.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "custom_ops/common/shape_util.h"

namespace tf_gba {

REGISTER_OP("GBA>WorkerClockCreate")
    .Output("handle: resource")
    .TF_GBA_WORKER_RESOURCE_ATTRS
    .Doc(R"doc(
Creates (or finds, by shared_name) a worker clock: for each of num_workers workers, the number of
steps it has completed. Its state is transient (not checkpointed).
)doc");

REGISTER_OP("GBA>WorkerClockWait")
    .Input("handle: resource")
    .Input("worker: int64")
    .Input("bound: int64")
    .Input("timeout_ms: int64")
    .Output("waited_ns: int64")
    .Output("timed_out: bool")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0>)
    .Doc(R"doc(
Returns once completed[worker] - min_j completed[j] <= bound (at once if that already holds).
The kernel is asynchronous: a blocked wait holds no thread. After timeout_ms milliseconds it
returns anyway with timed_out=true, so that workers whose slowest peer has run out of work do not
block forever; timeout_ms = 0 waits without a time limit (until the condition holds, the clock is
reset or destroyed, or the step is cancelled). waited_ns is the time spent in the wait.
)doc");

REGISTER_OP("GBA>WorkerClockTick")
    .Input("handle: resource")
    .Input("worker: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0>)
    .Doc("Records one more completed step of `worker` and releases every wait that may now go.");

REGISTER_OP("GBA>WorkerClockStats")
    .Input("handle: resource")
    .Output("completed: int64")
    .Output("blocked_ns: int64")
    .Output("waits: int64")
    .Output("timeouts: int64")
    .Output("max_lead: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0b1111u>)
    .Doc(R"doc(
Per worker: steps completed, total time spent in waits (ns), waits that returned (including
timeouts) and waits that timed out. max_lead is the largest completed[w] - min_j completed[j]
seen when a wait of w returned without timing out: never more than the bound of that wait.
)doc");

REGISTER_OP("GBA>WorkerClockWaiting")
    .Input("handle: resource")
    .Output("waiting: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0b1u>)
    .Doc("Per worker, the number of waits blocked right now.");

REGISTER_OP("GBA>WorkerClockReset")
    .Input("handle: resource")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0>)
    .Doc(R"doc(
Zeroes every counter and statistic. All workers are then level, so every blocked wait returns
(timed_out=false): the way to release workers still waiting when training ends.
)doc");

REGISTER_OP("GBA>WorkerIndex")
    .Output("index: int64")
    // Stateful: the value depends on where the op is placed, so it must never be constant-folded
    // (on the client, where it would always be 0).
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0>)
    .Doc(R"doc(
The task index i of the worker this op runs on, read from its device name
/job:worker/replica:0/task:<i>; 0 on a device that is not a worker's (e.g. a single process).
)doc");

}  // namespace tf_gba
