// Op registrations of the expandable hash embedding table (SPEC section 6) and of the sparse
// buffer's push for hash rows. Kernels live in ../kernels/hash_table_op.cc and
// ../kernels/sparse_buffer_op.cc; Python wrappers in tf_gba/ops/hash_table_ops.py.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_gba {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace {

// The table's width, from the handle's creating op's attribute when the graph knows it: rows are
// [len(keys), unknown] otherwise (the kernel checks the real width).
Status RowsOfKeys(InferenceContext* c, int keys_input, int output) {
  ShapeHandle keys;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(keys_input), 1, &keys));
  c->set_output(output, c->Matrix(c->Dim(keys, 0), c->UnknownDim()));
  return ::tensorflow::OkStatus();
}

}  // namespace

REGISTER_OP("GBA>HashTableCreate")
    .Output("handle: resource")
    .Attr("dim: int")
    .Attr("seed: int = 0")
    .Attr("initializer: {'uniform', 'normal', 'zeros'} = 'uniform'")
    .Attr("init_a: float = -0.05")
    .Attr("init_b: float = 0.05")
    .Attr("min_frequency: int = 0")
    .Attr("ttl_steps: int = 0")
    .Attr("max_rows: int = 0")
    .Attr("filter_cells: int = 0")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Creates (or finds, by shared_name) one shard of an expandable hash embedding table: int64 key ->
row (embedding [dim], the optimizer's slots, last_step tag, frequency, last_seen). A key's first
embedding depends on (seed, key) only: uniform in [init_a, init_b), or normal with mean init_a and
stddev init_b, from splitmix64's counter-based stream of the key.
Admission and eviction (0: off): a key gets a row at its min_frequency-th training lookup (zero
rows and filtered gradients before); HashTableEvict removes rows not seen for more than ttl_steps
global steps, then the least frequent (ties: oldest last_seen, smallest key) beyond max_rows.
filter_cells > 0 (with min_frequency > 1): admission counts in a counting Bloom filter of that many
one-byte cells instead of exact per-key counts.
)doc");

REGISTER_OP("GBA>HashTableLookup")
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("global_step: int64")
    .Output("values: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      return RowsOfKeys(c, 1, 0);
    })
    .Doc("Training lookup: find-or-insert each key, frequency += 1, last_seen = global_step (< 0: "
         "the table's own, one past the iteration of its latest apply).");

REGISTER_OP("GBA>HashTableFind")
    .Input("handle: resource")
    .Input("keys: int64")
    .Output("values: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return RowsOfKeys(c, 1, 0); })
    .Doc("Evaluation lookup: a missing key gets its initial row; nothing is inserted.");

REGISTER_OP("GBA>HashTableApply")
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("gradients: float")
    .Input("learning_rate: float")
    .Input("beta_1: float")
    .Input("beta_2: float")
    .Input("epsilon: float")
    .Input("iteration: int64")
    .Attr("optimizer: {'sgd', 'adagrad', 'adam'}")
    .Attr("initial_accumulator: float = 0.1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle keys, grads;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &keys));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &grads));
      DimensionHandle unused;
      return c->Merge(c->Dim(keys, 0), c->Dim(grads, 0), &unused);
    })
    .Doc(R"doc(
The table's optimizer on rows `keys` (duplicates summed first; a missing key is inserted first).
For sgd, w -= lr g; for adagrad, a += g^2, w -= lr g / sqrt(a + epsilon); for adam (LazyAdam),
m += (g - m)(1 - beta_1), v += (g^2 - v)(1 - beta_2), w -= alpha m / (sqrt(v) + epsilon) with
alpha = lr sqrt(1 - beta_2^t) / (1 - beta_1^t), t = iteration + 1. Only the given rows change.
Rows hold the slots of the last optimizer applied (or imported); another one re-lays every row
out once, its slots starting from zero (Adagrad: initial_accumulator).
)doc");

REGISTER_OP("GBA>HashTableSize")
    .Input("handle: resource")
    .Output("size: int64")
    .Output("allocated_bytes: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      return ::tensorflow::OkStatus();
    })
    .Doc("Rows in the table, and the bytes it holds (rows, tags, counters and the key index).");

REGISTER_OP("GBA>HashTableExport")
    .Input("handle: resource")
    .Output("keys: int64")
    .Output("values: float")
    .Output("slots: float")
    .Output("tags: int64")
    .Output("frequency: int64")
    .Output("last_seen: int64")
    .Output("pending_keys: int64")
    .Output("pending_counts: int64")
    .Output("pending_last_seen: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle n = c->UnknownDim();
      c->set_output(0, c->Vector(n));
      c->set_output(1, c->Matrix(n, c->UnknownDim()));
      c->set_output(2, c->MakeShape({n, c->UnknownDim(), c->UnknownDim()}));
      for (int i = 3; i < 6; ++i) c->set_output(i, c->Vector(n));
      DimensionHandle np = c->UnknownDim();
      for (int i = 6; i < 9; ++i) c->set_output(i, c->Vector(np));
      return ::tensorflow::OkStatus();
    })
    .Doc("Every row: keys [n], values [n, dim], slots [n, num_slots, dim], tags, frequency, "
         "last_seen [n]; and admission's keys without a row, their counts and last-seen steps.");

REGISTER_OP("GBA>HashTableImport")
    .Input("handle: resource")
    .Input("keys: int64")
    .Input("values: float")
    .Input("slots: float")
    .Input("tags: int64")
    .Input("frequency: int64")
    .Input("last_seen: int64")
    .Input("pending_keys: int64")
    .Input("pending_counts: int64")
    .Input("pending_last_seen: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(7), 1, &unused));
      return c->WithRank(c->input(3), 3, &unused);
    })
    .Doc("Replaces the table's content with the given rows and pending counts (a checkpoint "
         "restore).");

REGISTER_OP("GBA>HashTableExportDelta")
    .Input("handle: resource")
    .Input("since: int64")
    .Output("keys: int64")
    .Output("values: float")
    .Output("slots: float")
    .Output("tags: int64")
    .Output("frequency: int64")
    .Output("last_seen: int64")
    .Output("pending_keys: int64")
    .Output("pending_counts: int64")
    .Output("pending_last_seen: int64")
    .Output("deleted_keys: int64")
    .Output("sequence: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      DimensionHandle n = c->UnknownDim(), np = c->UnknownDim();
      c->set_output(0, c->Vector(n));
      c->set_output(1, c->Matrix(n, c->UnknownDim()));
      c->set_output(2, c->MakeShape({n, c->UnknownDim(), c->UnknownDim()}));
      for (int i = 3; i < 6; ++i) c->set_output(i, c->Vector(n));
      for (int i = 6; i < 9; ++i) c->set_output(i, c->Vector(np));
      c->set_output(9, c->Vector(c->UnknownDim()));
      c->set_output(10, c->Scalar());
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
The rows changed after the table's write number `since` (every row and no removed key with
since < 0), all pending counts, the keys removed after `since` (kept once HashTableTrackChanges
was called) and the table's current write number, the `since` of the next delta. It changes
nothing, so an export that is never written loses nothing.
)doc");

REGISTER_OP("GBA>HashTableImportDelta")
    .Input("handle: resource")
    .Input("replace: bool")
    .Input("keys: int64")
    .Input("values: float")
    .Input("slots: float")
    .Input("tags: int64")
    .Input("frequency: int64")
    .Input("last_seen: int64")
    .Input("pending_keys: int64")
    .Input("pending_counts: int64")
    .Input("pending_last_seen: int64")
    .Input("deleted_keys: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 2, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(8), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(11), 1, &unused));
      return c->WithRank(c->input(4), 3, &unused);
    })
    .Doc(R"doc(
replace = true: HashTableImport (deleted_keys must be empty). Otherwise applies a delta on top of
the content: inserts or overwrites the given rows, removes deleted_keys, replaces the pending
counts.
)doc");

REGISTER_OP("GBA>HashTableTrackChanges")
    .Input("handle: resource")
    .Input("prune_through: int64")
    .Output("sequence: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      c->set_output(0, c->Scalar());
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
Keeps the keys the table removes from now on (for HashTableExportDelta), forgets those removed at
or before write number prune_through (a full checkpoint of that number is written) and outputs
the current write number.
)doc");

REGISTER_OP("GBA>HashTableExportFilter")
    .Input("handle: resource")
    .Output("cells: uint8")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return ::tensorflow::OkStatus();
    })
    .Doc("The cells of the table's admission filter ([filter_cells]; empty without one).");

REGISTER_OP("GBA>HashTableImportFilter")
    .Input("handle: resource")
    .Input("cells: uint8")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      return c->WithRank(c->input(1), 1, &unused);
    })
    .Doc("Replaces the cells of the table's admission filter (a checkpoint restore).");

REGISTER_OP("GBA>HashTableEvict")
    .Input("handle: resource")
    .Input("global_step: int64")
    .Output("keys: int64")
    .Output("values: float")
    .Output("frequency: int64")
    .Attr("with_rows: bool = true")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      DimensionHandle n = c->UnknownDim();
      c->set_output(0, c->Vector(n));
      c->set_output(1, c->Matrix(n, c->UnknownDim()));
      c->set_output(2, c->Vector(n));
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
Eviction at global_step (< 0: the table's own): removes the rows with
global_step - last_seen > ttl_steps (and forgets pending counts last seen that long ago), then,
while more than max_rows remain, the lowest frequency, ties to the oldest last_seen, then to the
smallest key. Outputs the removed rows' keys, values and frequencies (empty with
with_rows = false: the periodic and pre-checkpoint evictions, which need none of them).
)doc");

REGISTER_OP("GBA>HashTableCounters")
    .Input("handle: resource")
    .Output("counters: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(5));
      return ::tensorflow::OkStatus();
    })
    .Doc("[rows, pending, admitted, filtered, evicted] of the shard since it was created.");

REGISTER_OP("GBA>HashKeyShard")
    .Input("keys: int64")
    .Input("num_shards: int64")
    .Output("shard: int32")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return ::tensorflow::OkStatus();
    })
    .Doc("mix64(key) mod num_shards, mix64 being splitmix64's finaliser.");

REGISTER_OP("GBA>HashBufferPush")
    .Input("handle: resource")
    .Input("token: int64")
    .Input("ticket: int64")
    .Input("keys: int64")
    .Input("values: T")
    .Input("table: resource")
    .Output("ready: bool")
    .Output("aggregate_keys: int64")
    .Output("aggregate_values: T")
    .Output("global_step: int64")
    .Attr("T: {float}")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused, keys, values;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &keys));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 2, &values));
      DimensionHandle n;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(keys, 0), c->Dim(values, 0), &n));
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, c->Matrix(c->UnknownDim(), c->Dim(values, 1)));
      c->set_output(3, c->Scalar());
      return ::tensorflow::OkStatus();
    })
    .Doc(R"doc(
GBA>SparseBufferPush for a buffer created with keyed=true: rows are named by hash-table keys, and
each key's staleness max(0, last_step[key] + 1 - token) reads the tag kept in the table's row
(-1 for a key without a row). The aggregation writes last_step[key] = k into the table.
)doc");

}  // namespace tf_gba
