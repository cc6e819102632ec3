// GPU version of the dense AdaptiveRevision update: functor::ApplyAdaptiveRevision<GpuDevice, T>
// (adaptive_revision_op.h) for half, bfloat16, float and double, explicitly instantiated here.
//
// Both members do what the CPU specialisation in adaptive_revision_op.cc does, with the same
// device-agnostic UpdateCoordinate / NextZPrime, so results agree with the CPU kernel (bit for bit
// with the flags setup.py and Bazel use: -fmad=false and IEEE division and square root):
//   Validate   finds the first coordinate whose z' is not positive (before, or with use_max=false
//              after, the update) with an atomicMin over the flat index, then copies that
//              coordinate back to describe the error. It waits for the GPU (the kernel must know
//              before it updates anything).
//   operator() updates every coordinate in place; alpha is read on the GPU (device memory).
//
// The kernel class and its GPU registration live with the CPU ones in adaptive_revision_op.cc.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <cstdint>

#include "custom_ops/adaptive_revision/cc/kernels/adaptive_revision_op.h"
#include "custom_ops/common/gpu_util.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_gba {
namespace functor {
namespace {

using GPUDevice = Eigen::GpuDevice;
using gpu::Check;
using gpu::kThreads;
using gpu::NumBlocks;

template <typename T>
T CopyElementToHost(const GPUDevice& d, const T* src) {
  T value;
  gpu::CopyToHostSync(d, &value, src, sizeof(T));
  return value;
}

constexpr unsigned long long kNoError = ~0ull;  // NOLINT(runtime/int): atomicMin's type

template <typename T>
__global__ void FindFirstBadAccumulator(const T* __restrict__ gbar, const T* __restrict__ z,
                                        const T* __restrict__ zprime, const T* __restrict__ grad,
                                        const T* __restrict__ gbar_old, int64_t n, bool use_max,
                                        unsigned long long* __restrict__ first_bad) {  // NOLINT
  using A = Accumulator<T>;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const A zp = static_cast<A>(zprime[i]);
    bool bad = !(zp > A(0));  // also rejects NaN
    if (!bad && !use_max) {
      const A next = NextZPrime<A>(static_cast<A>(grad[i]),
                                   static_cast<A>(gbar[i]) - static_cast<A>(gbar_old[i]),
                                   static_cast<A>(z[i]), zp, use_max);
      bad = !(next > A(0));
    }
    if (bad) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));  // NOLINT
      return;  // later indices of this thread cannot be smaller
    }
  }
}

template <typename T>
__global__ void Update(T* __restrict__ var, T* __restrict__ gbar, T* __restrict__ z,
                       T* __restrict__ zprime, const T* __restrict__ alpha,
                       const T* __restrict__ grad, const T* __restrict__ gbar_old, int64_t n,
                       bool use_max) {
  using A = Accumulator<T>;
  const A a = static_cast<A>(*alpha);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    A x = static_cast<A>(var[i]), gb = static_cast<A>(gbar[i]);
    A zz = static_cast<A>(z[i]), zp = static_cast<A>(zprime[i]);
    UpdateCoordinate<A>(a, static_cast<A>(grad[i]), static_cast<A>(gbar_old[i]), use_max, &x,
                        &gb, &zz, &zp);
    var[i] = static_cast<T>(x);
    gbar[i] = static_cast<T>(gb);
    z[i] = static_cast<T>(zz);
    zprime[i] = static_cast<T>(zp);
  }
}

}  // namespace

template <typename T>
struct ApplyAdaptiveRevision<GPUDevice, T> {
  using A = Accumulator<T>;

  AccumulatorError Validate(const GPUDevice& d, typename tensorflow::TTypes<T>::ConstFlat gbar,
                            typename tensorflow::TTypes<T>::ConstFlat z,
                            typename tensorflow::TTypes<T>::ConstFlat zprime,
                            typename tensorflow::TTypes<T>::ConstFlat grad,
                            typename tensorflow::TTypes<T>::ConstFlat gbar_old, bool use_max) {
    AccumulatorError error;
    const int64_t n = zprime.size();
    if (n == 0) return error;
    auto* first_bad = static_cast<unsigned long long*>(  // NOLINT(runtime/int)
        d.allocate(sizeof(unsigned long long)));         // NOLINT(runtime/int)
    if (first_bad == nullptr) Check(cudaErrorMemoryAllocation, "allocating scratch memory");
    Check(cudaMemsetAsync(first_bad, 0xFF, sizeof(kNoError), d.stream()), "cudaMemsetAsync");
    FindFirstBadAccumulator<T><<<NumBlocks(n), kThreads, 0, d.stream()>>>(
        gbar.data(), z.data(), zprime.data(), grad.data(), gbar_old.data(), n, use_max, first_bad);
    Check(cudaGetLastError(), "tf_gba::functor::FindFirstBadAccumulator");
    const unsigned long long found = CopyElementToHost(d, first_bad);  // NOLINT(runtime/int)
    d.deallocate(first_bad);
    if (found == kNoError) return error;

    // Describe the failure exactly as the CPU specialisation does.
    const int64_t i = static_cast<int64_t>(found);
    const A zp = static_cast<A>(CopyElementToHost(d, zprime.data() + i));
    error.index = i;
    error.after_update = zp > A(0);
    if (error.after_update) {
      const A g = static_cast<A>(CopyElementToHost(d, grad.data() + i));
      const A g_bck = static_cast<A>(CopyElementToHost(d, gbar.data() + i)) -
                      static_cast<A>(CopyElementToHost(d, gbar_old.data() + i));
      const A zz = static_cast<A>(CopyElementToHost(d, z.data() + i));
      error.value = static_cast<double>(NextZPrime<A>(g, g_bck, zz, zp, use_max));
    } else {
      error.value = static_cast<double>(zp);
    }
    return error;
  }

  void operator()(const GPUDevice& d, typename tensorflow::TTypes<T>::Flat var,
                  typename tensorflow::TTypes<T>::Flat gbar, typename tensorflow::TTypes<T>::Flat z,
                  typename tensorflow::TTypes<T>::Flat zprime,
                  typename tensorflow::TTypes<T>::ConstScalar alpha,
                  typename tensorflow::TTypes<T>::ConstFlat grad,
                  typename tensorflow::TTypes<T>::ConstFlat gbar_old, bool use_max) {
    const int64_t n = var.size();
    if (n == 0) return;
    Update<T><<<NumBlocks(n), kThreads, 0, d.stream()>>>(var.data(), gbar.data(), z.data(),
                                                         zprime.data(), alpha.data(), grad.data(),
                                                         gbar_old.data(), n, use_max);
    Check(cudaGetLastError(), "tf_gba::functor::Update (AdaptiveRevision)");
  }
};

template struct ApplyAdaptiveRevision<GPUDevice, Eigen::half>;
template struct ApplyAdaptiveRevision<GPUDevice, Eigen::bfloat16>;
template struct ApplyAdaptiveRevision<GPUDevice, float>;
template struct ApplyAdaptiveRevision<GPUDevice, double>;

}  // namespace functor
}  // namespace tf_gba

#endif  // GOOGLE_CUDA
