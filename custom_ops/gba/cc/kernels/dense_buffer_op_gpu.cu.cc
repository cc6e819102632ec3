// GPU arithmetic of the dense GBA gradient buffer: the functors of dense_buffer_functor.h for
// Eigen::GpuDevice, for every dtype GBA>DenseBufferPush declares.
//
// The push op keeps its bookkeeping on the host and holds the buffer's mutex while these run, so
// DenseAllFinite and DenseAccumulate answer synchronously: one flag is copied back from the GPU.
// Unlike the CPU's single fused pass (check a block, add it, undo everything on NaN/Inf), the GPU
// checks the whole gradient first and only then accumulates, so a dropped push leaves the sum
// exactly as it was.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include <cstdint>

#include "custom_ops/gba/cc/kernels/dense_buffer_functor.h"
#include "custom_ops/common/gpu_util.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_gba {
namespace functor {
namespace {

using GPUDevice = Eigen::GpuDevice;
using gpu::kThreads;
using gpu::NumBlocks;

template <typename T, typename Acc>
__global__ void Accumulate(const T* __restrict__ g, Acc* __restrict__ s, int64_t n, Acc f,
                           bool assign) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const Acc term = f * gpu::ToAcc<Acc>(g[i]);
    s[i] = assign ? term : s[i] + term;
  }
}

// Not __restrict__: `out` is `s` itself when T is Acc.
template <typename T, typename Acc>
__global__ void Scale(const Acc* s, T* out, int64_t n, Acc scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    out[i] = static_cast<T>(s[i] * scale);
  }
}

}  // namespace

#define TF_GBA_DEFINE_DENSE_GPU(T, Acc)                                                       \
  template <>                                                                                 \
  bool DenseAllFinite<GPUDevice, T>::operator()(const GPUDevice& d, const T* g, int64_t n)    \
      const {                                                                                 \
    return gpu::AllFinite<T, Acc>(d, g, n);                                                   \
  }                                                                                           \
  template <>                                                                                 \
  bool DenseAccumulate<GPUDevice, T, Acc>::operator()(const GPUDevice& d, const T* g, Acc* s, \
                                                      int64_t n, Acc f, bool assign) const {  \
    if (!gpu::AllFinite<T, Acc>(d, g, n)) return false;                                       \
    if (n > 0) {                                                                              \
      Accumulate<T, Acc><<<NumBlocks(n), kThreads, 0, d.stream()>>>(g, s, n, f, assign);      \
      gpu::CheckLaunch("tf_gba::functor::Accumulate");                                        \
    }                                                                                         \
    return true;                                                                              \
  }                                                                                           \
  template <>                                                                                 \
  void DenseScale<GPUDevice, T, Acc>::operator()(const GPUDevice& d, const Acc* s, T* out,    \
                                                 int64_t n, Acc scale) const {                \
    if (n <= 0) return;                                                                       \
    Scale<T, Acc><<<NumBlocks(n), kThreads, 0, d.stream()>>>(s, out, n, scale);               \
    gpu::CheckLaunch("tf_gba::functor::Scale");                                               \
  }                                                                                           \
  template <>                                                                                 \
  void DenseFillZero<GPUDevice, T>::operator()(const GPUDevice& d, T* out, int64_t n) const { \
    gpu::Zero(d, out, n * sizeof(T)); /* all-zero bits are +0 in every dtype */              \
  }
TF_GBA_DEFINE_DENSE_GPU(Eigen::half, float)
TF_GBA_DEFINE_DENSE_GPU(Eigen::bfloat16, float)
TF_GBA_DEFINE_DENSE_GPU(float, float)
TF_GBA_DEFINE_DENSE_GPU(double, double)
#undef TF_GBA_DEFINE_DENSE_GPU

}  // namespace functor
}  // namespace tf_gba

#endif  // GOOGLE_CUDA
