// Row arithmetic of the sparse GBA gradient buffer, one functor per computation, templated on the
// device. CPU specialisations live in sparse_buffer_op.cc, the GPU ones in
// sparse_buffer_op_gpu.cu.cc (declared below as explicit specialisations of the members).
//
// The split between host and device: the bookkeeping of a push (ids' slots in the pool of the
// current batch, per-(push, id) weights from the row tags, counts, statistics, tags) always runs
// on the host, under the buffer's mutex, with the ids in host memory. What these functors do is
// the work proportional to the embedding rows: accumulating the weighted rows into the pool and
// writing the scaled aggregate. `rows`, `pool` and `out` are in the device's memory; the small
// per-row arrays (`slot`, `weight`, `order`, `inv`) are host arrays, which the GPU functors copy to
// the GPU themselves.
#ifndef TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_SPARSE_BUFFER_FUNCTOR_H_
#define TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_SPARSE_BUFFER_FUNCTOR_H_

#include <cstdint>

#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_gba {
namespace functor {

// True when x[0, n) holds no NaN and no Inf.
template <typename Device, typename T>
struct SparseAllFinite {
  bool operator()(const Device& d, const T* x, int64_t n) const;
};

// pool[slot[i]] += weight[i] * rows[i] for every i < n with weight[i] != 0, rows of `row_size`
// values; for each slot the rows are added in increasing i (a deterministic order, the same on
// every device).
template <typename Device, typename T, typename Acc>
struct SparseAccumulateRows {
  void operator()(const Device& d, const T* rows, int64_t n, int64_t row_size,
                  const int32_t* slot, const Acc* weight, Acc* pool) const;
};

// out[i] = T(pool[order[i]] * inv[i]) for i < k: the aggregate rows of a completed batch.
template <typename Device, typename T, typename Acc>
struct SparseGatherRows {
  void operator()(const Device& d, const Acc* pool, int64_t row_size, const int32_t* order,
                  const Acc* inv, int64_t k, T* out) const;
};

// Grows the pool: dst[0, used) = src[0, used) (nothing to copy when dst is src), dst[used, size)
// = 0. Counted in values, not rows.
template <typename Device, typename Acc>
struct SparsePoolGrow {
  void operator()(const Device& d, const Acc* src, int64_t used, Acc* dst, int64_t size) const;
};

#if GOOGLE_CUDA
// Defined in sparse_buffer_op_gpu.cu.cc for every dtype the push op declares.
#define TF_GBA_DECLARE_SPARSE_GPU(T, Acc)                                                        \
  template <>                                                                                    \
  bool SparseAllFinite<Eigen::GpuDevice, T>::operator()(const Eigen::GpuDevice&, const T*,       \
                                                        int64_t) const;                          \
  template <>                                                                                    \
  void SparseAccumulateRows<Eigen::GpuDevice, T, Acc>::operator()(                               \
      const Eigen::GpuDevice&, const T*, int64_t, int64_t, const int32_t*, const Acc*, Acc*)     \
      const;                                                                                     \
  template <>                                                                                    \
  void SparseGatherRows<Eigen::GpuDevice, T, Acc>::operator()(                                   \
      const Eigen::GpuDevice&, const Acc*, int64_t, const int32_t*, const Acc*, int64_t, T*)     \
      const;
TF_GBA_DECLARE_SPARSE_GPU(Eigen::half, float)
TF_GBA_DECLARE_SPARSE_GPU(Eigen::bfloat16, float)
TF_GBA_DECLARE_SPARSE_GPU(float, float)
TF_GBA_DECLARE_SPARSE_GPU(double, double)
#undef TF_GBA_DECLARE_SPARSE_GPU

template <>
void SparsePoolGrow<Eigen::GpuDevice, float>::operator()(const Eigen::GpuDevice&, const float*,
                                                         int64_t, float*, int64_t) const;
template <>
void SparsePoolGrow<Eigen::GpuDevice, double>::operator()(const Eigen::GpuDevice&,
                                                          const double*, int64_t, double*,
                                                          int64_t) const;
#endif  // GOOGLE_CUDA

}  // namespace functor
}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_SPARSE_BUFFER_FUNCTOR_H_
