// Shape functions shared by the op registrations (custom_ops/<area>/cc/ops/*.cc) of the resources
// that coordinate workers: every input is a scalar (the resource handle, int64 or bool
// arguments), and every output is a scalar or a per-worker vector of unknown length.
#ifndef TF_GBA_CUSTOM_OPS_COMMON_SHAPE_UTIL_H_
#define TF_GBA_CUSTOM_OPS_COMMON_SHAPE_UTIL_H_

#include "tensorflow/core/framework/shape_inference.h"

namespace tf_gba {

// Checks that every input is a scalar.
inline ::tensorflow::Status AllInputsScalar(::tensorflow::shape_inference::InferenceContext* c) {
  ::tensorflow::shape_inference::ShapeHandle unused;
  for (int i = 0; i < c->num_inputs(); ++i) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  }
  return ::tensorflow::OkStatus();
}

// Scalar inputs; output i is a per-worker vector when bit i of kVectorOutputs is set, else a
// scalar. ScalarInputsOutputs<0>: every input and output a scalar (a Create op's handle, a
// wait's results, an op with no output).
template <unsigned kVectorOutputs>
::tensorflow::Status ScalarInputsOutputs(::tensorflow::shape_inference::InferenceContext* c) {
  TF_RETURN_IF_ERROR(AllInputsScalar(c));
  for (int i = 0; i < c->num_outputs(); ++i) {
    c->set_output(i, (kVectorOutputs >> i) & 1u ? c->Vector(c->UnknownDim()) : c->Scalar());
  }
  return ::tensorflow::OkStatus();
}

}  // namespace tf_gba

// The attributes of a resource created on parameter server 0 for num_workers workers and found
// by shared_name: `REGISTER_OP(name).Output("handle: resource").TF_GBA_WORKER_RESOURCE_ATTRS`.
#define TF_GBA_WORKER_RESOURCE_ATTRS \
  Attr("num_workers: int")           \
      .Attr("container: string = ''") \
      .Attr("shared_name: string = ''") \
      .SetIsStateful()                \
      .SetShapeFn(::tf_gba::ScalarInputsOutputs<0>)

#endif  // TF_GBA_CUSTOM_OPS_COMMON_SHAPE_UTIL_H_
