// Creating and looking up the ref-counted resources behind the GBA handles.
#ifndef TF_GBA_CUSTOM_OPS_COMMON_RESOURCE_UTIL_H_
#define TF_GBA_CUSTOM_OPS_COMMON_RESOURCE_UTIL_H_

#include <functional>
#include <string>

#include "custom_ops/common/kernel_util.h"

namespace tf_gba {

// The container/shared_name attributes every resource-creating op has.
struct ResourceName {
  std::string container, shared_name;

  Status FromAttrs(::tensorflow::OpKernelConstruction* ctx) {
    TF_RETURN_IF_ERROR(ctx->GetAttr("container", &container));
    return ctx->GetAttr("shared_name", &shared_name);
  }
};

// Finds the resource named by the op's container/shared_name attributes, creating it with
// `create` if absent, and outputs its handle. Re-running the op (e.g. the same handle created
// again by a retried function) finds the existing resource instead of replacing it.
template <typename R>
void CreateResourceAndOutputHandle(::tensorflow::OpKernelContext* ctx, const ResourceName& name,
                                   const std::function<Status(R**)>& create) {
  ::tensorflow::ResourceMgr* rm = ctx->resource_manager();
  const std::string& c = name.container.empty() ? rm->default_container() : name.container;
  OP_REQUIRES(ctx, !name.shared_name.empty(),
              ::tensorflow::errors::InvalidArgument(
                  "A GBA resource needs a non-empty shared_name, unique per buffer."));
  R* resource = nullptr;
  OP_REQUIRES_OK(ctx, rm->LookupOrCreate<R>(c, name.shared_name, &resource, create));
  resource->Unref();
  ::tensorflow::Tensor* out;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({}), &out));
  out->scalar<::tensorflow::ResourceHandle>()() =
      ::tensorflow::MakeResourceHandle<R>(ctx, c, name.shared_name);
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

// Looks up the resource behind the scalar handle of input `index`; `what` names it in the error.
template <typename R>
Status LookupScalarHandle(::tensorflow::OpKernelContext* ctx, int index, const char* what,
                          ::tensorflow::core::RefCountPtr<R>* resource) {
  const ::tensorflow::Tensor& t = ctx->input(index);
  if (!::tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
    return ::tensorflow::errors::InvalidArgument(
        "The ", what, " handle must be a scalar, got shape ", t.shape().DebugString(), ".");
  }
  return ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, index), resource);
}

// Reads the scalar worker index of input `index` and checks it is in [0, num_workers).
inline Status ReadWorkerIndex(::tensorflow::OpKernelContext* ctx, int index, int64_t num_workers,
                              int64_t* worker) {
  TF_RETURN_IF_ERROR(ReadScalarInt64(ctx, index, "worker", worker));
  if (*worker < 0 || *worker >= num_workers) {
    return ::tensorflow::errors::InvalidArgument("worker must be in [0, num_workers=", num_workers,
                                                 "), got ", *worker, ".");
  }
  return ::tensorflow::OkStatus();
}

}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_COMMON_RESOURCE_UTIL_H_
