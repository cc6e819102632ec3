// Op registrations of the per-version barrier behind the backup-workers baseline (Hop-BW): a
// resource on parameter server 0 holding the model version (the global step every variable has
// reached) and, per worker, the version it last pushed a gradient for; a wait that holds a worker
// until the version moves past that one, so that it computes at most one gradient per version.
// Kernels live in ../kernels/version_barrier_op.cc; Python wrappers in tf_gba/ops/version_barrier.py.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "custom_ops/common/shape_util.h"

namespace tf_gba {

REGISTER_OP("GBA>VersionBarrierCreate")
    .Output("handle: resource")
    .Attr("initial_version: int = 0")
    .TF_GBA_WORKER_RESOURCE_ATTRS
    .Doc(R"doc(
Creates (or finds, by shared_name) a version barrier for num_workers workers, at model version
initial_version, with no worker having pushed yet. Its state is transient (not checkpointed).
)doc");

REGISTER_OP("GBA>VersionBarrierWait")
    .Input("handle: resource")
    .Input("worker: int64")
    .Output("version: int64")
    .Output("skip: bool")
    .Output("waited_ns: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0>)
    .Doc(R"doc(
Returns once the model version is greater than the last version `worker` pushed a gradient for
(at once if it already is, or if the worker has not pushed yet), with that version and
skip=false. The kernel is asynchronous: a blocked wait holds no thread. A wait released by
VersionBarrierRelease returns skip=true: the step must push nothing.
)doc");

REGISTER_OP("GBA>VersionBarrierReport")
    .Input("handle: resource")
    .Input("worker: int64")
    .Input("version: int64")
    .Input("pushed: bool")
    .Input("completed: int64")
    .Input("num_buffers: int64")
    .Output("current_version: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0>)
    .Doc(R"doc(
Called after a step's pushes (and the updates they completed) are done. pushed: whether the step
pushed a gradient computed on `version`; completed: how many of the step's num_buffers gradient
buffers it completed (aggregated and applied). When the buffers completed for the current version
reach num_buffers, every variable holds version + 1: the version moves on and the waits it allows
return. Returns the version after the report.
)doc");

REGISTER_OP("GBA>VersionBarrierRelease")
    .Input("handle: resource")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0>)
    .Doc(R"doc(
Lets every wait blocked right now return with skip=true (the end of training, when the workers
that would move the version on have no steps left).
)doc");

REGISTER_OP("GBA>VersionBarrierStats")
    .Input("handle: resource")
    .Output("version: int64")
    .Output("gradients: int64")
    .Output("duplicates: int64")
    .Output("released: int64")
    .Output("blocked_ns: int64")
    .Output("waiting: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarInputsOutputs<0b111110u>)
    .Doc(R"doc(
The current version and, per worker: gradients reported pushed, of those the ones for a version
the worker had already pushed for (0 unless the barrier was bypassed), waits released with
skip=true, total time spent blocked (ns), and waits blocked right now.
)doc");

}  // namespace tf_gba
