// Op registrations of AdaptiveRevision (SPEC section 2; McMahan & Streeter 2014, Algorithm 1).
// Kernels live in ../kernels; Python wrappers in tf_gba/ops/adaptive_revision_ops.py.
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_gba {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace {

template <typename... Args>
absl::Status InvalidArgument(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}

// The shape of the variable behind a resource input, or unknown when the handle carries none.
ShapeHandle VariableShape(InferenceContext* c, int input) {
  auto* handle_data = c->input_handle_shapes_and_types(input);
  if (handle_data != nullptr && !handle_data->empty() &&
      (*handle_data)[0].dtype != ::tensorflow::DT_INVALID) {
    return (*handle_data)[0].shape;
  }
  return c->UnknownShape();
}

// The merged shape of x, gbar, z and z' (they must agree), and alpha a scalar. The messages use
// the words of the kernels' OP_REQUIRES so an error reads the same in eager and in tf.function.
absl::Status CommonShapes(InferenceContext* c, ShapeHandle* var) {
  static constexpr const char* kNames[] = {"var", "gbar", "z", "zprime"};
  *var = VariableShape(c, 0);
  for (int i = 1; i < 4; ++i) {
    ShapeHandle other = VariableShape(c, i);
    absl::Status s = c->Merge(*var, other, var);
    if (!s.ok()) {
      return InvalidArgument(
          "AdaptiveRevision: `", kNames[i], "` must have the shape of var ", c->DebugString(*var),
          " but has shape ", c->DebugString(other),
          ". Create the slots from the variable (AdaptiveRevision.build).");
    }
  }
  ShapeHandle unused;
  if (!c->WithRank(c->input(4), 0, &unused).ok()) {
    return InvalidArgument(
        "AdaptiveRevision: alpha must be a scalar, got shape ", c->DebugString(c->input(4)), ".");
  }
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("GBA>ResourceApplyAdaptiveRevision")
    .Input("var: resource")
    .Input("gbar: resource")
    .Input("z: resource")
    .Input("zprime: resource")
    .Input("alpha: T")
    .Input("grad: T")
    .Input("gbar_old: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("use_max: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle var;
      TF_RETURN_IF_ERROR(CommonShapes(c, &var));
      ShapeHandle merged;
      if (!c->Merge(var, c->input(5), &merged).ok()) {
        return InvalidArgument(
            "AdaptiveRevision: grad must have the shape of var ", c->DebugString(var), ", got ",
            c->DebugString(c->input(5)), ".");
      }
      if (!c->Merge(var, c->input(6), &merged).ok()) {
        return InvalidArgument(
            "AdaptiveRevision: gbar_old must have the shape of var ", c->DebugString(var),
            ", got ", c->DebugString(c->input(6)),
            ". gbar_old is the snapshot of the gbar slot read with the parameters.");
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Applies one AdaptiveRevision update to every coordinate of a dense variable, atomically.

Per coordinate, with g = grad and gbar_old the value of gbar read together with the parameters
that produced g:
  g_bck = gbar - gbar_old; eta_old = alpha / sqrt(z'); z += g^2 + 2 g g_bck;
  z' = use_max ? max(z, z') : z; eta = alpha / sqrt(z');
  x -= eta g; x += (eta_old - eta) g_bck; gbar += g.
With gbar_old == gbar this is AdaGrad with accumulator z. The four variables are updated in place
under their exclusive locks. half and bfloat16 are computed in float.

var: the parameters x.
gbar: the sum of all gradients applied so far (initially 0).
z: the accumulator of Algorithm 1 (initially G0 > 0).
zprime: z', the accumulator the learning rate uses (initially G0); must stay positive.
alpha: learning-rate scale, a scalar.
grad: the gradient g, shape of var.
gbar_old: the gbar snapshot read with the parameters, shape of var.
use_max: true: AdaptiveRevision (non-increasing learning rates, z' = max(z, z')); false: the
  paper's AdaptiveRevision* (z' follows z).
)doc");

REGISTER_OP("GBA>ResourceSparseApplyAdaptiveRevision")
    .Input("var: resource")
    .Input("gbar: resource")
    .Input("z: resource")
    .Input("zprime: resource")
    .Input("alpha: T")
    .Input("grad_rows: T")
    .Input("indices: Tindices")
    .Input("gbar_old_rows: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tindices: {int32, int64}")
    .Attr("use_max: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle var;
      TF_RETURN_IF_ERROR(CommonShapes(c, &var));
      ShapeHandle indices, grad = c->input(5), unused;
      if (!c->WithRank(c->input(6), 1, &indices).ok()) {
        return InvalidArgument(
            "AdaptiveRevision: indices must be a vector, got shape ",
            c->DebugString(c->input(6)), ".");
      }
      if (!c->WithRankAtLeast(var, 1, &unused).ok()) {
        return InvalidArgument(
            "AdaptiveRevision: a sparse update needs a variable of rank >= 1 (its rows are "
            "indexed), got a scalar.");
      }
      DimensionHandle n;
      if (!c->WithRankAtLeast(grad, 1, &unused).ok() ||
          !c->Merge(c->Dim(indices, 0), c->Dim(grad, 0), &n).ok()) {
        return InvalidArgument(
            "AdaptiveRevision: grad must have one row per index: expected first dimension ",
            c->DebugString(c->Dim(indices, 0)), ", got grad shape ", c->DebugString(grad), ".");
      }
      ShapeHandle var_row, grad_row;
      TF_RETURN_IF_ERROR(c->Subshape(var, 1, &var_row));
      TF_RETURN_IF_ERROR(c->Subshape(grad, 1, &grad_row));
      if (!c->Merge(var_row, grad_row, &unused).ok()) {
        return InvalidArgument(
            "AdaptiveRevision: grad rows must have the shape of a var row ",
            c->DebugString(var_row), " (var shape ", c->DebugString(var), "), got grad shape ",
            c->DebugString(grad), ".");
      }
      if (!c->Merge(grad, c->input(7), &unused).ok()) {
        return InvalidArgument(
            "AdaptiveRevision: gbar_old must have the shape of grad ", c->DebugString(grad),
            ", got ", c->DebugString(c->input(7)),
            ". gbar_old holds the gbar rows read (at the same indices) with the parameters.");
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Applies one AdaptiveRevision update to the rows `indices` of a variable, atomically.

Only the given rows are read and written. Each row is updated as in
GBA>ResourceApplyAdaptiveRevision, with gbar_old_rows[i] the gbar row indices[i] read together
with the parameters. Duplicate indices are summed first (like the IndexedSlices gradient of a
gather): one update per distinct row, with the summed gradient; their gbar_old rows must be
identical (gathered from one snapshot), otherwise the op fails without updating anything. An
empty `indices` is a no-op. The variables switch to copy-on-read mode, as with TF's sparse
training ops.

var: the parameters x, rank >= 1.
gbar: the sum of all gradients applied so far (initially 0).
z: the accumulator of Algorithm 1 (initially G0 > 0).
zprime: z', the accumulator the learning rate uses (initially G0); must stay positive.
alpha: learning-rate scale, a scalar.
grad_rows: gradient rows, shape [N] + var.shape[1:].
indices: the N row indices, in [0, var.shape[0]).
gbar_old_rows: the gbar rows read with the parameters, shape of grad_rows.
use_max: true: AdaptiveRevision; false: AdaptiveRevision* (z' follows z).
)doc");

}  // namespace tf_gba
