// AdaptiveRevision (McMahan & Streeter, NIPS 2014, Algorithm 1): functors shared by the kernels.
//
// One functor per computation, templated on <Device, T>: the CPU specialisations live in
// adaptive_revision_op.cc; a CUDA version would specialise the same functors for GPUDevice in
// adaptive_revision_op_gpu.cu.cc and reuse `UpdateCoordinate` below, which is device-agnostic.
#ifndef TF_GBA_CUSTOM_OPS_ADAPTIVE_REVISION_CC_KERNELS_ADAPTIVE_REVISION_OP_H_
#define TF_GBA_CUSTOM_OPS_ADAPTIVE_REVISION_CC_KERNELS_ADAPTIVE_REVISION_OP_H_

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "custom_ops/common/accumulate.h"
#include "tensorflow/core/framework/numeric_types.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_types.h"
#include "unsupported/Eigen/CXX11/Tensor"  // from @eigen_archive

namespace tf_gba {
namespace functor {

// Algorithm 1's Update(g, gbar_old) for one coordinate, in SPEC section 2's order. `zp` is z', the
// accumulator the current learning rate alpha / sqrt(z') is computed from: max(z, z') with
// `use_max` (AdaptiveRevision), z itself without (the paper's AdaptiveRevision*). Keeping z' in
// both variants lets eta_old be "the rate in effect for the outstanding steps" in both.
// Requires zp > 0 on entry, and on exit (always true with use_max; checked by the callers).
template <typename A>
EIGEN_DEVICE_FUNC EIGEN_ALWAYS_INLINE void UpdateCoordinate(A alpha, A g, A gbar_old, bool use_max,
                                                            A* x, A* gbar, A* z, A* zp) {
  using std::sqrt;
  const A g_bck = *gbar - gbar_old;      // gradients applied while this one was outstanding
  const A eta_old = alpha / sqrt(*zp);
  *z = *z + g * g + A(2) * g * g_bck;
  *zp = use_max ? (*z > *zp ? *z : *zp) : *z;
  const A eta = alpha / sqrt(*zp);
  *x = *x - eta * g;                      // the gradient step
  *x = *x + (eta_old - eta) * g_bck;      // revision of the outstanding steps
  *gbar = *gbar + g;
}

// The accumulator z' after the update of one coordinate (what UpdateCoordinate stores in *zp),
// computed without writing anything, so a whole update can be validated before any of it lands.
template <typename A>
EIGEN_DEVICE_FUNC EIGEN_ALWAYS_INLINE A NextZPrime(A g, A g_bck, A z, A zp, bool use_max) {
  const A z_new = z + g * g + A(2) * g * g_bck;
  return use_max ? (z_new > zp ? z_new : zp) : z_new;
}

// Where validation of the accumulators failed: the flat element index and the offending value.
struct AccumulatorError {
  int64_t index = -1;        // -1: no error
  double value = 0.0;
  bool after_update = false;  // false: z' was already <= 0 before the update
};

// Dense update of every coordinate. All tensors have the same number of elements.
template <typename Device, typename T>
struct ApplyAdaptiveRevision {
  // Returns, without modifying anything, the first coordinate whose z' is not positive before the
  // update, or (use_max = false only) would not be positive after it.
  AccumulatorError Validate(const Device& d, typename tensorflow::TTypes<T>::ConstFlat gbar,
                            typename tensorflow::TTypes<T>::ConstFlat z,
                            typename tensorflow::TTypes<T>::ConstFlat zprime,
                            typename tensorflow::TTypes<T>::ConstFlat grad,
                            typename tensorflow::TTypes<T>::ConstFlat gbar_old, bool use_max);
  void operator()(const Device& d, typename tensorflow::TTypes<T>::Flat var,
                  typename tensorflow::TTypes<T>::Flat gbar, typename tensorflow::TTypes<T>::Flat z,
                  typename tensorflow::TTypes<T>::Flat zprime,
                  typename tensorflow::TTypes<T>::ConstScalar alpha,
                  typename tensorflow::TTypes<T>::ConstFlat grad,
                  typename tensorflow::TTypes<T>::ConstFlat gbar_old, bool use_max);
};

// Sparse update of the rows `indices` of variables viewed as [num_rows, row_size] matrices.
// Duplicate indices are summed first (one update per distinct row, with the summed gradient), the
// way TF's IndexedSlices gradients of a gather are summed; their gbar_old rows must be equal.
// Returns InvalidArgument (and modifies nothing) for an index out of range, duplicates with
// different gbar_old rows, or a non-positive accumulator.
template <typename Device, typename T, typename Tindex>
struct SparseApplyAdaptiveRevision {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const Device& d,
                                typename tensorflow::TTypes<T>::Matrix var,
                                typename tensorflow::TTypes<T>::Matrix gbar,
                                typename tensorflow::TTypes<T>::Matrix z,
                                typename tensorflow::TTypes<T>::Matrix zprime,
                                typename tensorflow::TTypes<T>::ConstScalar alpha,
                                typename tensorflow::TTypes<T>::ConstMatrix grad,
                                typename tensorflow::TTypes<Tindex>::ConstVec indices,
                                typename tensorflow::TTypes<T>::ConstMatrix gbar_old,
                                bool use_max);
};

}  // namespace functor
}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_ADAPTIVE_REVISION_CC_KERNELS_ADAPTIVE_REVISION_OP_H_
