// Helpers shared by the GPU functors of every op library (*_gpu.cu.cc); nvcc only.
//
// The op libraries are compiled by nvcc from a CUDA toolkit that need not be the one TensorFlow
// was built with (see docs/building.md), so these helpers only pass plain handles across that
// boundary: the CUDA stream and device memory from Eigen::GpuDevice. They never read
// Eigen::GpuDevice's cudaDeviceProp (deviceProperties(), getNumGpuMultiProcessors(), ...), whose
// layout differs between CUDA releases, and they call the CUDA runtime directly so that every
// error is checked.
#ifndef TF_GBA_CUSTOM_OPS_COMMON_GPU_UTIL_H_
#define TF_GBA_CUSTOM_OPS_COMMON_GPU_UTIL_H_

#if GOOGLE_CUDA && defined(__CUDACC__)

#ifndef EIGEN_USE_GPU
#error "Define EIGEN_USE_GPU before the first include of a *_gpu.cu.cc file."
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_gba {
namespace gpu {

using GPUDevice = Eigen::GpuDevice;

constexpr int kThreads = 256;
// Grid-stride loops cover what one grid does not; this many blocks keep any current GPU busy.
constexpr int64_t kMaxBlocks = 4096;

inline int NumBlocks(int64_t n) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < kMaxBlocks ? (wanted > 0 ? wanted : 1) : kMaxBlocks);
}

// A failed CUDA call leaves the buffer's state unknown, so it stops the process with the reason
// (as TensorFlow's own kernels do on a failed launch) instead of returning wrong numbers. The
// usual cause is a GPU the kernels were not compiled for.
inline void Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr,
               "tf_gba: CUDA error in %s: %s (%s). If this GPU's architecture is not among the "
               "ones the op library was built for, rebuild it with TF_GBA_CUDA_ARCHS set to it "
               "(docs/building.md).\n",
               what, cudaGetErrorString(err), cudaGetErrorName(err));
  std::abort();
}

inline void CheckLaunch(const char* kernel) { Check(cudaGetLastError(), kernel); }

// Device memory for the duration of one functor call, from TensorFlow's GPU allocator (freed in
// stream order, so kernels queued before the free still see it).
class Scratch {
 public:
  Scratch(const GPUDevice& d, size_t bytes) : d_(d), ptr_(bytes ? d.allocate(bytes) : nullptr) {
    if (bytes && ptr_ == nullptr) {
      Check(cudaErrorMemoryAllocation, "allocating tf_gba scratch memory");
    }
  }
  ~Scratch() {
    if (ptr_ != nullptr) d_.deallocate(ptr_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename P>
  P* as() const {
    return static_cast<P*>(ptr_);
  }

 private:
  const GPUDevice& d_;
  void* ptr_;
};

inline void CopyToDevice(const GPUDevice& d, void* dst, const void* src, size_t bytes) {
  if (bytes) Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, d.stream()),
                   "cudaMemcpyAsync (host to device)");
}

// Copies to the host and waits for the copy (and all work queued before it) to finish.
inline void CopyToHostSync(const GPUDevice& d, void* dst, const void* src, size_t bytes) {
  if (bytes) Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, d.stream()),
                   "cudaMemcpyAsync (device to host)");
  Check(cudaStreamSynchronize(d.stream()), "cudaStreamSynchronize");
}

inline void CopyOnDevice(const GPUDevice& d, void* dst, const void* src, size_t bytes) {
  if (bytes) Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, d.stream()),
                   "cudaMemcpyAsync (device to device)");
}

inline void Zero(const GPUDevice& d, void* dst, size_t bytes) {
  if (bytes) Check(cudaMemsetAsync(dst, 0, bytes, d.stream()), "cudaMemsetAsync");
}

// The accumulation-type view of a gradient value (half and bfloat16 convert to float).
template <typename Acc, typename T>
__device__ __forceinline__ Acc ToAcc(T x) {
  return static_cast<Acc>(x);
}

// *bad = 1 when x[0, n) holds NaN or Inf (racing writers all write 1).
template <typename T, typename Acc>
__global__ void FindNonFinite(const T* __restrict__ x, int64_t n, int* __restrict__ bad) {
  bool ok = true;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    ok &= static_cast<bool>(isfinite(ToAcc<Acc>(x[i])));
  }
  if (__syncthreads_or(!ok) && threadIdx.x == 0) *bad = 1;
}

// True when x[0, n) holds neither NaN nor Inf; waits for the answer.
template <typename T, typename Acc>
bool AllFinite(const GPUDevice& d, const T* x, int64_t n) {
  if (n <= 0) return true;
  Scratch bad(d, sizeof(int));
  Zero(d, bad.as<int>(), sizeof(int));
  FindNonFinite<T, Acc><<<NumBlocks(n), kThreads, 0, d.stream()>>>(x, n, bad.as<int>());
  CheckLaunch("tf_gba::gpu::FindNonFinite");
  int host_bad = 0;
  CopyToHostSync(d, &host_bad, bad.as<int>(), sizeof(int));
  return host_bad == 0;
}

}  // namespace gpu
}  // namespace tf_gba

#endif  // GOOGLE_CUDA && defined(__CUDACC__)

#endif  // TF_GBA_CUSTOM_OPS_COMMON_GPU_UTIL_H_
