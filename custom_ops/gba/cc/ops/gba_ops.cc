// Op registrations of the GBA core: token generator, dense and sparse gradient buffers.
// Kernels live in ../kernels; Python wrappers in tf_gba/ops/gba_ops.py.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_gba {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace {

Status ScalarResource(InferenceContext* c) {
  c->set_output(0, c->Scalar());
  return ::tensorflow::OkStatus();
}

// Two scalar outputs (token and ticket; count and M).
Status TwoScalars(InferenceContext* c) {
  c->set_output(0, c->Scalar());
  c->set_output(1, c->Scalar());
  return ::tensorflow::OkStatus();
}

// Ops that take (handle, scalar) and output nothing: reset a count, set a step.
Status ScalarSecondInput(InferenceContext* c) {
  ShapeHandle unused;
  return c->WithRank(c->input(1), 0, &unused);
}

// (global_step, entries, counters[7], histogram[bins]) of a dense or sparse buffer.
Status BufferStatsShape(InferenceContext* c) {
  c->set_output(0, c->Scalar());
  c->set_output(1, c->Scalar());
  c->set_output(2, c->Vector(7));
  c->set_output(3, c->Vector(c->UnknownDim()));
  return ::tensorflow::OkStatus();
}

// Attributes of every buffer: M, the decay rule, normalisation, policies and statistics sizes.
// Attributes that are a choice list their values, so TensorFlow rejects any other one.
#define GBA_BUFFER_ATTRS                                  \
  Attr("num_aggregate: int")                                  \
      .Attr("staleness_threshold: int = 3")                   \
      .Attr("decay: {'threshold', 'exponential'} = 'threshold'") \
      .Attr("decay_alpha: float = 0.5")                       \
      .Attr("normalize: {'num_aggregate', 'kept'} = 'num_aggregate'") \
      .Attr("count_dropped: bool = true")                     \
      .Attr("per_id_staleness: bool = true")                  \
      .Attr("nonfinite: {'drop', 'error'} = 'drop'")          \
      .Attr("histogram_bins: int = 16")                   \
      .Attr("dedupe_window: int = 65536")                 \
      .Attr("initial_step: int = 0")                      \
      .Attr("container: string = ''")                     \
      .Attr("shared_name: string = ''")

}  // namespace

// ---------------------------------------------------------------------------------------------
// Token generator: the i-th fetch returns token floor(i / M) and ticket i.
REGISTER_OP("GBA>TokenGeneratorCreate")
    .Output("handle: resource")
    .Attr("num_aggregate: int")
    .Attr("initial_count: int = 0")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(ScalarResource)
    .Doc("Creates (or finds, by shared_name) a token generator handing out floor(i / M).");

REGISTER_OP("GBA>TokenGeneratorFetch")
    .Input("handle: resource")
    .Output("token: int64")
    .Output("ticket: int64")
    .SetIsStateful()
    .SetShapeFn(TwoScalars)
    .Doc("Takes the next token floor(i / M) and its unique ticket i.");

REGISTER_OP("GBA>TokenGeneratorCount")
    .Input("handle: resource")
    .Output("count: int64")
    .Output("num_aggregate: int64")
    .SetIsStateful()
    .SetShapeFn(TwoScalars)
    .Doc("Number of tokens fetched so far, and M.");

REGISTER_OP("GBA>TokenGeneratorReset")
    .Input("handle: resource")
    .Input("count: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarSecondInput)
    .Doc("Sets the fetch count, so the next token is floor(count / M).");

// ---------------------------------------------------------------------------------------------
// Dense gradient buffer: one per dense variable (or shard).
REGISTER_OP("GBA>DenseBufferCreate")
    .Output("handle: resource")
    .Attr("dtype: {half, bfloat16, float, double}")
    .Attr("shape: shape")
    .GBA_BUFFER_ATTRS
    .SetIsStateful()
    .SetShapeFn(ScalarResource)
    .Doc("Creates a dense gradient buffer aggregating M pushes per global step.");

REGISTER_OP("GBA>DenseBufferPush")
    .Input("handle: resource")
    .Input("token: int64")
    .Input("ticket: int64")
    .Input("gradient: T")
    .Output("ready: bool")
    .Output("aggregate: T")
    .Output("global_step: int64")
    .Attr("T: {half, bfloat16, float, double}")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      c->set_output(0, c->Scalar());
      c->set_output(1, c->input(3));
      c->set_output(2, c->Scalar());
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
Stores (token, gradient) and returns at once. The push that completes the M-th entry of the
global batch gets ready=true and aggregate = (1/M) * sum_m f(token_m, k) * gradient_m; every other
push gets ready=false and `aggregate` is its own gradient passed through (do not apply it).
global_step is the buffer's step after this push.
)doc");

REGISTER_OP("GBA>DenseBufferStats")
    .Input("handle: resource")
    .Output("global_step: int64")
    .Output("entries: int64")
    .Output("counters: int64")
    .Output("histogram: int64")
    .SetIsStateful()
    .SetShapeFn(BufferStatsShape)
    .Doc("counters = [pushes, aggregations, dropped, duplicates, nonfinite, staleness_sum, "
         "staleness_max].");

REGISTER_OP("GBA>DenseBufferSetStep")
    .Input("handle: resource")
    .Input("global_step: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarSecondInput)
    .Doc("Sets the global step and discards pending entries (checkpoint restore).");

// ---------------------------------------------------------------------------------------------
// Sparse gradient buffer: one per embedding table (or shard), with per-row staleness tags.
REGISTER_OP("GBA>SparseBufferCreate")
    .Output("handle: resource")
    .Attr("dtype: {half, bfloat16, float, double}")
    .Attr("num_rows: int")
    .Attr("row_shape: shape")
    .Attr("sparse_normalize: {'num_aggregate', 'per_id'} = 'num_aggregate'")
    .Attr("keyed: bool = false")
    .GBA_BUFFER_ATTRS
    .SetIsStateful()
    .SetShapeFn(ScalarResource)
    .Doc("Creates a sparse (embedding-row) gradient buffer with per-ID staleness.");

REGISTER_OP("GBA>SparseBufferPush")
    .Input("handle: resource")
    .Input("token: int64")
    .Input("ticket: int64")
    .Input("indices: Tindices")
    .Input("values: T")
    .Output("ready: bool")
    .Output("aggregate_indices: Tindices")
    .Output("aggregate_values: T")
    .Output("global_step: int64")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tindices: {int32, int64}")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused, indices, values, rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &indices));
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(4), 1, &values));
      DimensionHandle n;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(indices, 0), c->Dim(values, 0), &n));
      TF_RETURN_IF_ERROR(c->Subshape(values, 1, &rows));
      ShapeHandle out_values;
      TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rows, &out_values));
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, out_values);
      c->set_output(3, c->Scalar());
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
Stores (token, ids, rows) with duplicate ids summed, weighting each id by its own staleness
max(0, last_step[id] + 1 - token). The push that completes the M-th entry gets ready=true and the
aggregate rows sum_m w_m(id) row_m[id] / d(id) for the ids with a non-zero weight, in the order
they were first pushed, where d(id) = M (sparse_normalize='num_aggregate': absent entries count as
zero rows, as in an all-reduce) or c(id), the number of entries containing id ('per_id'); then
last_step[id] = k for those ids. Other pushes get ready=false and empty outputs.
)doc");

REGISTER_OP("GBA>SparseBufferStats")
    .Input("handle: resource")
    .Output("global_step: int64")
    .Output("entries: int64")
    .Output("counters: int64")
    .Output("histogram: int64")
    .SetIsStateful()
    .SetShapeFn(BufferStatsShape)
    .Doc("counters = [pushes, aggregations, dropped (push, id) pairs, duplicates, nonfinite, "
         "staleness_sum, staleness_max].");

REGISTER_OP("GBA>SparseBufferExport")
    .Input("handle: resource")
    .Output("global_step: int64")
    .Output("row_tags: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Vector(c->UnknownDim()));
      return ::tensorflow::OkStatus();
    })
    .Doc("The global step and every row's last_step tag (-1: never updated).");

REGISTER_OP("GBA>SparseBufferImport")
    .Input("handle: resource")
    .Input("global_step: int64")
    .Input("row_tags: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      return c->WithRank(c->input(2), 1, &unused);
    })
    .Doc("Restores the global step and row tags; discards pending entries.");

}  // namespace tf_gba

namespace tf_gba {

// ---------------------------------------------------------------------------------------------
// Straggler simulation and per-worker step counters (run on the worker executing the step).
REGISTER_OP("GBA>StepBegin")
    .Output("start_ns: int64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("Marks the start of a training step on this worker; returns a monotonic time in ns.");

REGISTER_OP("GBA>StepEnd")
    .Input("start_ns: int64")
    .Output("delay_seconds: float")
    .Attr("profile: string = 'none'")
    .Attr("seed: int = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Ends a step on this worker: sleeps (factor - 1) x the step's own time, where factor is what the
straggler profile gives this worker (read from the device's task index) at this step, and counts
the step. Profiles: 'none'; 'persistent;<task>=<factor>,...'; 'transient;<p>;<factor>';
'trace;<window seconds>;<task>=<f0>:<f1>:...,...'; several joined by '+', factors multiply.
)doc");

REGISTER_OP("GBA>StepCount")
    .Output("steps: int64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Counts a step on this worker without timing it and returns the count so far: what a step runs
when no straggler profile is set (GBA>StepEnd counts the steps it times and stretches). Like
GBA>StepBegin, the process's first call starts the clock of its straggler position.
)doc");

REGISTER_OP("GBA>WorkerStepStats")
    .Output("stats: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(7));
      return ::tensorflow::OkStatus();
    })
    .Doc("[steps, busy_ns, delay_ns, first_step_unix_ns, straggler step position, straggler "
         "profile elapsed ns, longest timed step's ns (own time plus delay)] of this worker "
         "process.");

REGISTER_OP("GBA>SetStepPosition")
    .Input("step: int64")
    .Input("elapsed_ns: int64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc(R"doc(
Sets this worker process's position in its straggler profile: its next step draws as step `step`
(transient draws hash (seed, worker, step)), and a trace profile's clock reads `elapsed_ns` now.
A resumed run sets what the checkpoint recorded, so each worker's sequence goes on.
)doc");

REGISTER_OP("GBA>StragglerFactors")
    .Input("workers: int64")
    .Input("steps: int64")
    .Input("elapsed_seconds: float64")
    .Output("factors: float64")
    .Output("compute_floor_seconds: float64")
    .Attr("profile: string = 'none'")
    .Attr("seed: int = 0")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->Scalar());
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
The slowdown factor GBA>StepEnd would apply to step steps[i] of worker workers[i], started
elapsed_seconds[i] after that worker's first step, and the profile's compute floor (0 if none).
Sleeps nothing: the cluster simulator's view of the same profile.
)doc");

}  // namespace tf_gba
