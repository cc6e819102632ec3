// CPU kernels of GBA>ResourceApplyAdaptiveRevision and GBA>ResourceSparseApplyAdaptiveRevision.
//
// Algorithm 1 needs each coordinate's Update to be atomic with respect to other Updates (and
// Reads) of that coordinate. Like TF's ResourceApplyAdagrad with use_locking=true, each kernel
// holds the exclusive locks of all four variables (x, gbar, z, z') for the whole update, acquired
// in address order so that concurrent updates cannot deadlock. There is deliberately no
// use_locking=false (Hogwild) mode: a lock-free update could interleave two Updates of one
// coordinate and break the invariant gbar = sum of applied gradients that the revision relies on.
#define EIGEN_USE_THREADS

#include "custom_ops/adaptive_revision/cc/kernels/adaptive_revision_op.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/bounds_check.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace tf_gba {

using CPUDevice = Eigen::ThreadPoolDevice;
using ::tensorflow::DataTypeString;
using ::tensorflow::DataTypeToEnum;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TTypes;

// absl::StrCat-based error constructors (tensorflow::errors::* are deprecated in TF 2.21).
template <typename... Args>
absl::Status InvalidArgument(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status FailedPrecondition(const Args&... args) {
  return absl::FailedPreconditionError(absl::StrCat(args...));
}

namespace functor {
namespace {

// Records the smallest failing index seen by any shard of a parallelFor.
void AtomicMin(std::atomic<int64_t>* target, int64_t value) {
  int64_t current = target->load();
  while (value < current && !target->compare_exchange_weak(current, value)) {
  }
}

constexpr int64_t kNoError = std::numeric_limits<int64_t>::max();

// Per-element costs for parallelFor: 2 square roots and 2 divisions dominate the arithmetic.
template <typename T>
Eigen::TensorOpCost UpdateCost() {
  return Eigen::TensorOpCost(/*bytes_loaded=*/7 * sizeof(T), /*bytes_stored=*/4 * sizeof(T),
                             /*compute_cycles=*/60);
}

template <typename T>
Eigen::TensorOpCost ValidateCost(bool use_max) {
  return use_max ? Eigen::TensorOpCost(sizeof(T), 0, 1)
                 : Eigen::TensorOpCost(5 * sizeof(T), 0, 8);
}

}  // namespace

template <typename T>
struct ApplyAdaptiveRevision<CPUDevice, T> {
  using A = Accumulator<T>;

  AccumulatorError Validate(const CPUDevice& d, typename TTypes<T>::ConstFlat gbar,
                            typename TTypes<T>::ConstFlat z, typename TTypes<T>::ConstFlat zprime,
                            typename TTypes<T>::ConstFlat grad,
                            typename TTypes<T>::ConstFlat gbar_old, bool use_max) {
    std::atomic<int64_t> first_bad(kNoError);
    auto is_bad = [&](int64_t i) {
      const A zp = static_cast<A>(zprime(i));
      // Written as !(> 0) so that NaN accumulators are rejected too.
      if (!(zp > A(0))) return true;
      if (use_max) return false;  // max(z, z') >= z' > 0
      const A next = NextZPrime<A>(static_cast<A>(grad(i)),
                                   static_cast<A>(gbar(i)) - static_cast<A>(gbar_old(i)),
                                   static_cast<A>(z(i)), zp, use_max);
      return !(next > A(0));
    };
    d.parallelFor(zprime.size(), ValidateCost<T>(use_max), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (is_bad(i)) {
          AtomicMin(&first_bad, i);
          return;
        }
      }
    });
    AccumulatorError error;
    const int64_t i = first_bad.load();
    if (i == kNoError) return error;
    error.index = i;
    const A zp = static_cast<A>(zprime(i));
    error.after_update = zp > A(0);
    error.value = error.after_update
                      ? static_cast<double>(NextZPrime<A>(
                            static_cast<A>(grad(i)),
                            static_cast<A>(gbar(i)) - static_cast<A>(gbar_old(i)),
                            static_cast<A>(z(i)), zp, use_max))
                      : static_cast<double>(zp);
    return error;
  }

  void operator()(const CPUDevice& d, typename TTypes<T>::Flat var, typename TTypes<T>::Flat gbar,
                  typename TTypes<T>::Flat z, typename TTypes<T>::Flat zprime,
                  typename TTypes<T>::ConstScalar alpha, typename TTypes<T>::ConstFlat grad,
                  typename TTypes<T>::ConstFlat gbar_old, bool use_max) {
    const A a = static_cast<A>(alpha());
    d.parallelFor(var.size(), UpdateCost<T>(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        A x = static_cast<A>(var(i)), gb = static_cast<A>(gbar(i));
        A zz = static_cast<A>(z(i)), zp = static_cast<A>(zprime(i));
        UpdateCoordinate<A>(a, static_cast<A>(grad(i)), static_cast<A>(gbar_old(i)), use_max, &x,
                            &gb, &zz, &zp);
        var(i) = static_cast<T>(x);
        gbar(i) = static_cast<T>(gb);
        z(i) = static_cast<T>(zz);
        zprime(i) = static_cast<T>(zp);
      }
    });
  }
};

template <typename T, typename Tindex>
struct SparseApplyAdaptiveRevision<CPUDevice, T, Tindex> {
  using A = Accumulator<T>;

  absl::Status operator()(OpKernelContext* ctx, const CPUDevice& d, typename TTypes<T>::Matrix var,
                    typename TTypes<T>::Matrix gbar, typename TTypes<T>::Matrix z,
                    typename TTypes<T>::Matrix zprime, typename TTypes<T>::ConstScalar alpha,
                    typename TTypes<T>::ConstMatrix grad,
                    typename TTypes<Tindex>::ConstVec indices,
                    typename TTypes<T>::ConstMatrix gbar_old, bool use_max) {
    const int64_t n = indices.size();
    const int64_t num_rows = var.dimension(0);
    const int64_t row_size = var.dimension(1);
    if (n == 0) return absl::OkStatus();

    // 1. Every index in range, before anything is touched.
    for (int64_t i = 0; i < n; ++i) {
      const Tindex row = tensorflow::internal::SubtleMustCopy(indices(i));
      if (!tensorflow::FastBoundsCheck(row, num_rows)) {
        return InvalidArgument("indices[", i, "] = ", row, " is not in [0, ", num_rows,
                                       "): the variable has ", num_rows,
                                       " rows. Check the ids fed to the embedding lookup.");
      }
    }

    // 2. Group duplicate indices. A stable sort keeps, within a row, the order of the positions,
    // so the summed gradient is the same for every run (deterministic summation order).
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return indices(a) < indices(b); });
    std::vector<int64_t> group_start;  // offsets into `order`, plus a final sentinel n
    group_start.reserve(n + 1);
    for (int64_t k = 0; k < n; ++k) {
      if (k == 0 || indices(order[k]) != indices(order[k - 1])) group_start.push_back(k);
    }
    const int64_t num_groups = group_start.size();
    group_start.push_back(n);

    // Duplicates are one update with the summed gradient; they must come from a single Read, so
    // their gbar_old rows (gathered from one snapshot) are bit-identical.
    const size_t row_bytes = row_size * sizeof(T);
    for (int64_t gi = 0; gi < num_groups; ++gi) {
      const int64_t first = order[group_start[gi]];
      for (int64_t k = group_start[gi] + 1; k < group_start[gi + 1]; ++k) {
        if (row_bytes > 0 &&
            std::memcmp(&gbar_old(first, 0), &gbar_old(order[k], 0), row_bytes) != 0) {
          return InvalidArgument(
              "indices[", first, "] and indices[", order[k], "] are both ", indices(first),
              " but their gbar_old rows differ. Duplicate indices are summed into one update, "
              "which needs one gbar_old: gather gbar_old for all of them from the same gbar "
              "snapshot, or pass them in separate calls.");
        }
      }
    }

    auto summed_grad = [&](int64_t gi, int64_t j) {
      A g(0);
      for (int64_t k = group_start[gi]; k < group_start[gi + 1]; ++k) {
        g += static_cast<A>(grad(order[k], j));
      }
      return g;
    };

    // 3. Accumulators positive before (and, without use_max, after) the update.
    for (int64_t gi = 0; gi < num_groups; ++gi) {
      const int64_t pos = order[group_start[gi]];
      const int64_t row = indices(pos);
      for (int64_t j = 0; j < row_size; ++j) {
        const A zp = static_cast<A>(zprime(row, j));
        if (!(zp > A(0))) {
          return InvalidArgument(
              "The AdaptiveRevision accumulator z' must be positive, but z'[", row, ", ", j,
              "] = ", static_cast<double>(zp),
              " before this update. Initialise z and z' to G0 > 0 (AdaptiveRevision(g0=...)).");
        }
        if (!use_max) {
          const A next = NextZPrime<A>(
              summed_grad(gi, j), static_cast<A>(gbar(row, j)) - static_cast<A>(gbar_old(pos, j)),
              static_cast<A>(z(row, j)), zp, use_max);
          if (!(next > A(0))) {
            return InvalidArgument(
                "With use_max=false (AdaptiveRevision*), this update would make the accumulator "
                "z[", row, ", ", j, "] = ", static_cast<double>(next),
                " <= 0, so its learning rate alpha / sqrt(z) is undefined (delayed gradients of "
                "opposite signs can decrease z). Use use_max=true, which keeps "
                "z' = max(z, z') >= G0, or a larger g0. Nothing was updated.");
          }
        }
      }
    }

    // 4. Apply, one distinct row per work item, so no two shards write the same row.
    const A a = static_cast<A>(alpha());
    Eigen::TensorOpCost cost = UpdateCost<T>() * static_cast<double>(row_size);
    d.parallelFor(num_groups, cost, [&](int64_t begin, int64_t end) {
      for (int64_t gi = begin; gi < end; ++gi) {
        const int64_t pos = order[group_start[gi]];
        const int64_t row = indices(pos);
        for (int64_t j = 0; j < row_size; ++j) {
          A x = static_cast<A>(var(row, j)), gb = static_cast<A>(gbar(row, j));
          A zz = static_cast<A>(z(row, j)), zp = static_cast<A>(zprime(row, j));
          UpdateCoordinate<A>(a, summed_grad(gi, j), static_cast<A>(gbar_old(pos, j)), use_max,
                              &x, &gb, &zz, &zp);
          var(row, j) = static_cast<T>(x);
          gbar(row, j) = static_cast<T>(gb);
          z(row, j) = static_cast<T>(zz);
          zprime(row, j) = static_cast<T>(zp);
        }
      }
    });
    return absl::OkStatus();
  }
};

}  // namespace functor

namespace {

constexpr const char* kSlotNames[] = {"var", "gbar", "z", "zprime"};

// Checks, before anything is locked or copied, that the four inputs are variables of dtype T:
// TF's locking helpers copy a shared buffer as T, which must not happen on another dtype. A
// variable's dtype is fixed at creation, so reading it without the lock is safe.
template <typename T>
void CheckVariableDtypes(OpKernelContext* ctx) {
  for (int i = 0; i < 4; ++i) {
    tensorflow::core::RefCountPtr<tensorflow::Var> var;
    const absl::Status s =
        tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, i), &var);
    OP_REQUIRES(ctx, s.ok(),
                FailedPrecondition("AdaptiveRevision: the variable `", kSlotNames[i],
                                   "` was not found (", s.message(),
                                   "). Create and initialise it (and the optimizer slots) first."));
    OP_REQUIRES(ctx, var->tensor()->dtype() == DataTypeToEnum<T>::v(),
                InvalidArgument(
                    "AdaptiveRevision: the variable `", kSlotNames[i], "` has dtype ",
                    DataTypeString(var->tensor()->dtype()), " but the op was called with T = ",
                    DataTypeString(DataTypeToEnum<T>::v()),
                    "; x, gbar, z, z', alpha, the gradient and gbar_old must share one dtype."));
  }
}

// Takes the four variables (already locked) as updatable tensors and checks they are initialised
// and of one shape.
template <typename Device, typename T>
void GetVariables(OpKernelContext* ctx, bool sparse, Tensor tensors[4]) {
  for (int i = 0; i < 4; ++i) {
    OP_REQUIRES_OK(ctx, tensorflow::GetInputTensorFromVariable<Device, T>(
                            ctx, i, /*lock_held=*/true, sparse, &tensors[i]));
    OP_REQUIRES(ctx, tensors[i].IsInitialized(),
                FailedPrecondition("AdaptiveRevision: the variable `", kSlotNames[i], "` (",
                                   ctx->op_kernel().requested_input(i),
                                   ") is not initialised."));
  }
  for (int i = 1; i < 4; ++i) {
    OP_REQUIRES(ctx, tensors[i].shape() == tensors[0].shape(),
                InvalidArgument(
                    "AdaptiveRevision: `", kSlotNames[i], "` must have the shape of var ",
                    tensors[0].shape().DebugString(), " but has shape ",
                    tensors[i].shape().DebugString(),
                    ". Create the slots from the variable (AdaptiveRevision.build)."));
  }
}

void CheckAlpha(OpKernelContext* ctx, const Tensor& alpha) {
  OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(alpha.shape()),
              InvalidArgument("AdaptiveRevision: alpha must be a scalar, got shape ",
                              alpha.shape().DebugString(), "."));
}

template <typename Device, typename T>
class ResourceApplyAdaptiveRevisionOp : public OpKernel {
 public:
  explicit ResourceApplyAdaptiveRevisionOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_max", &use_max_));
  }

  void Compute(OpKernelContext* ctx) override {
    CheckVariableDtypes<T>(ctx);
    if (!ctx->status().ok()) return;
    auto locks = tensorflow::MaybeLockVariableInputMutexesInOrder<Device, T>(
        ctx, /*do_lock=*/true, /*sparse=*/false, {0, 1, 2, 3});
    Tensor v[4];
    GetVariables<Device, T>(ctx, /*sparse=*/false, v);
    if (!ctx->status().ok()) return;

    const Tensor& alpha = ctx->input(4);
    const Tensor& grad = ctx->input(5);
    const Tensor& gbar_old = ctx->input(6);
    CheckAlpha(ctx, alpha);
    if (!ctx->status().ok()) return;
    OP_REQUIRES(ctx, grad.shape() == v[0].shape(),
                InvalidArgument("AdaptiveRevision: grad must have the shape of var ",
                                        v[0].shape().DebugString(), ", got ",
                                        grad.shape().DebugString(), "."));
    OP_REQUIRES(ctx, gbar_old.shape() == v[0].shape(),
                InvalidArgument(
                    "AdaptiveRevision: gbar_old must have the shape of var ",
                    v[0].shape().DebugString(), ", got ", gbar_old.shape().DebugString(),
                    ". gbar_old is the snapshot of the gbar slot read with the parameters."));

    const Device& d = ctx->eigen_device<Device>();
    functor::ApplyAdaptiveRevision<Device, T> apply;
    const functor::AccumulatorError error =
        apply.Validate(d, std::as_const(v[1]).flat<T>(), std::as_const(v[2]).flat<T>(),
                       std::as_const(v[3]).flat<T>(), grad.flat<T>(), gbar_old.flat<T>(), use_max_);
    if (error.index >= 0) {
      if (error.after_update) {
        ctx->CtxFailure(InvalidArgument(
            "With use_max=false (AdaptiveRevision*), this update would make the accumulator "
            "z (flat index ", error.index, ") = ", error.value,
            " <= 0, so its learning rate alpha / sqrt(z) is undefined (delayed gradients of "
            "opposite signs can decrease z). Use use_max=true, which keeps z' = max(z, z') >= G0, "
            "or a larger g0. Nothing was updated."));
      } else {
        ctx->CtxFailure(InvalidArgument(
            "The AdaptiveRevision accumulator z' must be positive, but z' (flat index ",
            error.index, ") = ", error.value,
            " before this update. Initialise z and z' to G0 > 0 (AdaptiveRevision(g0=...))."));
      }
      return;
    }
    apply(d, v[0].flat<T>(), v[1].flat<T>(), v[2].flat<T>(), v[3].flat<T>(), alpha.scalar<T>(),
          grad.flat<T>(), gbar_old.flat<T>(), use_max_);
  }

 private:
  bool use_max_;
};

template <typename Device, typename T, typename Tindex>
class ResourceSparseApplyAdaptiveRevisionOp : public OpKernel {
 public:
  explicit ResourceSparseApplyAdaptiveRevisionOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_max", &use_max_));
  }

  void Compute(OpKernelContext* ctx) override {
    CheckVariableDtypes<T>(ctx);
    if (!ctx->status().ok()) return;
    // sparse=true switches the variables to copy-on-read mode (as TF's sparse training ops do):
    // readers then copy, so the rows can be updated in place without copying the whole table.
    auto locks = tensorflow::MaybeLockVariableInputMutexesInOrder<Device, T>(
        ctx, /*do_lock=*/true, /*sparse=*/true, {0, 1, 2, 3});
    Tensor v[4];
    GetVariables<Device, T>(ctx, /*sparse=*/true, v);
    if (!ctx->status().ok()) return;

    const Tensor& alpha = ctx->input(4);
    const Tensor& grad = ctx->input(5);
    const Tensor& indices = ctx->input(6);
    const Tensor& gbar_old = ctx->input(7);
    CheckAlpha(ctx, alpha);
    if (!ctx->status().ok()) return;
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsVectorOrHigher(v[0].shape()),
                InvalidArgument(
                    "AdaptiveRevision: a sparse update needs a variable of rank >= 1 (its rows "
                    "are indexed), got a scalar."));
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsVector(indices.shape()),
                InvalidArgument("AdaptiveRevision: indices must be a vector, got shape ",
                                        indices.shape().DebugString(), "."));
    const int64_t n = indices.dim_size(0);
    OP_REQUIRES(ctx, grad.dims() >= 1 && grad.dim_size(0) == n,
                InvalidArgument(
                    "AdaptiveRevision: grad must have one row per index: expected first "
                    "dimension ", n, ", got grad shape ", grad.shape().DebugString(), "."));
    TensorShape row_shape = v[0].shape();
    row_shape.RemoveDim(0);
    TensorShape grad_row_shape = grad.shape();
    grad_row_shape.RemoveDim(0);
    OP_REQUIRES(ctx, grad_row_shape == row_shape,
                InvalidArgument(
                    "AdaptiveRevision: grad rows must have the shape of a var row ",
                    row_shape.DebugString(), " (var shape ", v[0].shape().DebugString(),
                    "), got grad shape ", grad.shape().DebugString(), "."));
    OP_REQUIRES(ctx, gbar_old.shape() == grad.shape(),
                InvalidArgument(
                    "AdaptiveRevision: gbar_old must have the shape of grad ",
                    grad.shape().DebugString(), ", got ", gbar_old.shape().DebugString(),
                    ". gbar_old holds the gbar rows read (at the same indices) with the "
                    "parameters."));
    if (n == 0) return;
    const int64_t num_rows = v[0].dim_size(0);
    const int64_t row_size = row_shape.num_elements();

    functor::SparseApplyAdaptiveRevision<Device, T, Tindex> apply;
    OP_REQUIRES_OK(ctx, apply(ctx, ctx->eigen_device<Device>(),
                              v[0].shaped<T, 2>({num_rows, row_size}),
                              v[1].shaped<T, 2>({num_rows, row_size}),
                              v[2].shaped<T, 2>({num_rows, row_size}),
                              v[3].shaped<T, 2>({num_rows, row_size}), alpha.scalar<T>(),
                              grad.shaped<T, 2>({n, row_size}), indices.vec<Tindex>(),
                              gbar_old.shaped<T, 2>({n, row_size}), use_max_));
  }

 private:
  bool use_max_;
};

#define TF_GBA_REGISTER_DENSE(T)                                                     \
  REGISTER_KERNEL_BUILDER(Name("GBA>ResourceApplyAdaptiveRevision")                  \
                              .Device(::tensorflow::DEVICE_CPU)                      \
                              .TypeConstraint<T>("T"),                               \
                          ResourceApplyAdaptiveRevisionOp<CPUDevice, T>);

#define TF_GBA_REGISTER_SPARSE(T, Tindex)                                            \
  REGISTER_KERNEL_BUILDER(Name("GBA>ResourceSparseApplyAdaptiveRevision")            \
                              .Device(::tensorflow::DEVICE_CPU)                      \
                              .TypeConstraint<T>("T")                                \
                              .TypeConstraint<Tindex>("Tindices"),                   \
                          ResourceSparseApplyAdaptiveRevisionOp<CPUDevice, T, Tindex>);

#define TF_GBA_REGISTER_CPU(T)        \
  TF_GBA_REGISTER_DENSE(T)            \
  TF_GBA_REGISTER_SPARSE(T, int32_t)  \
  TF_GBA_REGISTER_SPARSE(T, int64_t)

// Every dtype the ops declare: half, bfloat16, float, double.
TF_GBA_REGISTER_CPU(Eigen::half)
TF_GBA_REGISTER_CPU(Eigen::bfloat16)
TF_GBA_REGISTER_CPU(float)
TF_GBA_REGISTER_CPU(double)

#undef TF_GBA_REGISTER_CPU
#undef TF_GBA_REGISTER_SPARSE
#undef TF_GBA_REGISTER_DENSE

}  // namespace
}  // namespace tf_gba
