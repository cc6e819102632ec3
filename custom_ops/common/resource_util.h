// Creating and looking up the ref-counted resources behind the GBA handles.
#ifndef TF_GBA_CUSTOM_OPS_COMMON_RESOURCE_UTIL_H_
#define TF_GBA_CUSTOM_OPS_COMMON_RESOURCE_UTIL_H_

#include <functional>
#include <string>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_gba {

using ::tensorflow::Status;

// Finds the resource named by the op's container/shared_name attributes, creating it with
// `create` if absent, and outputs its handle. Re-running the op (e.g. the same handle created
// again by a retried function) finds the existing resource instead of replacing it.
template <typename R>
void CreateResourceAndOutputHandle(::tensorflow::OpKernelContext* ctx, const std::string& container,
                                   const std::string& shared_name,
                                   const std::function<Status(R**)>& create) {
  ::tensorflow::ResourceMgr* rm = ctx->resource_manager();
  const std::string& c = container.empty() ? rm->default_container() : container;
  OP_REQUIRES(ctx, !shared_name.empty(),
              ::tensorflow::errors::InvalidArgument(
                  "A GBA resource needs a non-empty shared_name, unique per buffer."));
  R* resource = nullptr;
  OP_REQUIRES_OK(ctx, rm->LookupOrCreate<R>(c, shared_name, &resource, create));
  resource->Unref();
  ::tensorflow::Tensor* out;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({}), &out));
  out->scalar<::tensorflow::ResourceHandle>()() =
      ::tensorflow::MakeResourceHandle<R>(ctx, c, shared_name);
}

inline Status ReadScalarInt64(::tensorflow::OpKernelContext* ctx, int index, const char* what,
                              int64_t* value) {
  const ::tensorflow::Tensor& t = ctx->input(index);
  if (!::tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
    return ::tensorflow::errors::InvalidArgument(what, " must be a scalar, got shape ",
                                                 t.shape().DebugString(), ".");
  }
  *value = t.scalar<int64_t>()();
  return ::tensorflow::OkStatus();
}

}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_COMMON_RESOURCE_UTIL_H_
