// Arithmetic of the dense GBA gradient buffer, one functor per computation, templated on the
// device. CPU specialisations live in dense_buffer_op.cc; the GPU ones in dense_buffer_op_gpu.cu.cc
// (compiled by nvcc with GOOGLE_CUDA=1), declared below as explicit specialisations of the
// members so that the kernel in dense_buffer_op.cc only links against them.
//
// Pointers are in the device's memory: host memory for Eigen::ThreadPoolDevice, GPU memory for
// Eigen::GpuDevice. This header includes nothing but Eigen, so that nvcc compiles the GPU file
// without TensorFlow's framework headers.
#ifndef TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_DENSE_BUFFER_FUNCTOR_H_
#define TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_DENSE_BUFFER_FUNCTOR_H_

#include <cstdint>

#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_gba {
namespace functor {

// True when g[0, n) holds no NaN and no Inf.
template <typename Device, typename T>
struct DenseAllFinite {
  bool operator()(const Device& d, const T* g, int64_t n) const;
};

// The checked accumulate of a push: s += f * g (s = f * g when `assign`), s in the accumulation
// type Acc (float for half and bfloat16). Returns false, and does not keep the push, when g holds
// NaN or Inf: s is then left as it was (CPU: up to rounding, the blocks already added are
// subtracted back; GPU: exactly, g is checked before s is touched), or undefined when assigning.
template <typename Device, typename T, typename Acc>
struct DenseAccumulate {
  bool operator()(const Device& d, const T* g, Acc* s, int64_t n, Acc f, bool assign) const;
};

// The final scaling of an aggregate: out = T(s * scale), scale = 1 / M (or 1 / kept). `out` may be
// `s` itself when T is Acc.
template <typename Device, typename T, typename Acc>
struct DenseScale {
  void operator()(const Device& d, const Acc* s, T* out, int64_t n, Acc scale) const;
};

// out = 0: the aggregate of a global batch whose gradients were all dropped.
template <typename Device, typename T>
struct DenseFillZero {
  void operator()(const Device& d, T* out, int64_t n) const;
};

#if GOOGLE_CUDA
// Defined in dense_buffer_op_gpu.cu.cc for every dtype the push op declares.
#define TF_GBA_DECLARE_DENSE_GPU(T, Acc)                                                         \
  template <>                                                                                    \
  bool DenseAllFinite<Eigen::GpuDevice, T>::operator()(const Eigen::GpuDevice&, const T*,        \
                                                       int64_t) const;                           \
  template <>                                                                                    \
  bool DenseAccumulate<Eigen::GpuDevice, T, Acc>::operator()(const Eigen::GpuDevice&, const T*,  \
                                                             Acc*, int64_t, Acc, bool) const;    \
  template <>                                                                                    \
  void DenseScale<Eigen::GpuDevice, T, Acc>::operator()(const Eigen::GpuDevice&, const Acc*, T*, \
                                                        int64_t, Acc) const;                     \
  template <>                                                                                    \
  void DenseFillZero<Eigen::GpuDevice, T>::operator()(const Eigen::GpuDevice&, T*, int64_t) const;
TF_GBA_DECLARE_DENSE_GPU(Eigen::half, float)
TF_GBA_DECLARE_DENSE_GPU(Eigen::bfloat16, float)
TF_GBA_DECLARE_DENSE_GPU(float, float)
TF_GBA_DECLARE_DENSE_GPU(double, double)
#undef TF_GBA_DECLARE_DENSE_GPU
#endif  // GOOGLE_CUDA

}  // namespace functor
}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_DENSE_BUFFER_FUNCTOR_H_
