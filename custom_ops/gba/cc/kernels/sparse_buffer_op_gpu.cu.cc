// GPU row arithmetic of the sparse GBA gradient buffer: the functors of sparse_buffer_functor.h
// for Eigen::GpuDevice, for every dtype GBA>SparseBufferPush declares.
//
// The push op decides on the host, from the ids (in host memory) and the row tags, which pool slot
// each pushed row goes to and with which weight. SparseAccumulateRows groups those (slot, weight)
// pairs by slot on the host (a stable sort, so each slot keeps the push's order), copies the
// groups to the GPU and runs one thread per (slot, column): it adds the slot's rows one after
// another, in the order the CPU adds them, so there are no atomics and the sums are deterministic
// (and, built with -fmad=false, identical to the CPU's). SparseGatherRows writes the scaled
// aggregate rows of a completed batch, one thread per value.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "custom_ops/common/gpu_util.h"
#include "custom_ops/gba/cc/kernels/sparse_buffer_functor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_gba {
namespace functor {
namespace {

using GPUDevice = Eigen::GpuDevice;
using gpu::kThreads;
using gpu::NumBlocks;

// Thread e handles column e % row_size of group e / row_size: the group's rows
// pos[begin[g]], ..., pos[begin[g + 1] - 1], with weights w[...], go to pool row slot[g].
template <typename T, typename Acc>
__global__ void AccumulateGroups(const T* __restrict__ rows, int64_t row_size,
                                 const int32_t* __restrict__ slot,
                                 const int32_t* __restrict__ begin,
                                 const int32_t* __restrict__ pos, const Acc* __restrict__ w,
                                 int64_t num_values, Acc* __restrict__ pool) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < num_values;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t g = e / row_size, j = e - g * row_size;
    Acc* acc = pool + static_cast<int64_t>(slot[g]) * row_size + j;
    Acc sum = *acc;
    for (int32_t k = begin[g]; k < begin[g + 1]; ++k) {
      sum += w[k] * gpu::ToAcc<Acc>(rows[static_cast<int64_t>(pos[k]) * row_size + j]);
    }
    *acc = sum;
  }
}

template <typename T, typename Acc>
__global__ void GatherScaled(const Acc* __restrict__ pool, int64_t row_size,
                             const int32_t* __restrict__ order, const Acc* __restrict__ inv,
                             int64_t num_values, T* __restrict__ out) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < num_values;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t i = e / row_size, j = e - i * row_size;
    out[e] = static_cast<T>(pool[static_cast<int64_t>(order[i]) * row_size + j] * inv[i]);
  }
}

// Copies host arrays into one device allocation (each part aligned to 16 bytes). The staging
// bytes live on the heap until the stream has passed the copy (a host function queued after it
// frees them), so the copy stays asynchronous whether or not the driver stages pageable memory.
class Upload {
 public:
  Upload() : bytes_(new std::vector<char>()) {}
  ~Upload() { delete bytes_; }
  Upload(const Upload&) = delete;
  Upload& operator=(const Upload&) = delete;

  template <typename P>
  size_t Add(const std::vector<P>& v) {
    const size_t offset = bytes_->size();
    const char* data = reinterpret_cast<const char*>(v.data());
    bytes_->insert(bytes_->end(), data, data + v.size() * sizeof(P));
    bytes_->resize((bytes_->size() + 15) / 16 * 16);
    return offset;
  }
  size_t size() const { return bytes_->size(); }

  // Queues the copy into `dst` (size() bytes); the staging bytes are freed in stream order.
  void Send(const GPUDevice& d, gpu::Scratch* dst) {
    gpu::CopyToDevice(d, dst->as<char>(), bytes_->data(), bytes_->size());
    gpu::Check(cudaLaunchHostFunc(d.stream(), &Free, bytes_), "cudaLaunchHostFunc");
    bytes_ = nullptr;
  }

 private:
  static void CUDART_CB Free(void* bytes) { delete static_cast<std::vector<char>*>(bytes); }
  std::vector<char>* bytes_;
};

template <typename T, typename Acc>
void AccumulateRowsGpu(const GPUDevice& d, const T* rows, int64_t n, int64_t row_size,
                       const int32_t* slot, const Acc* weight, Acc* pool) {
  if (n <= 0 || row_size <= 0) return;
  std::vector<int32_t> pos;
  pos.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    if (slot[i] >= 0) pos.push_back(static_cast<int32_t>(i));
  }
  if (pos.empty()) return;
  std::stable_sort(pos.begin(), pos.end(), [slot](int32_t a, int32_t b) {
    return slot[a] < slot[b];
  });
  std::vector<int32_t> group_slot, group_begin;
  std::vector<Acc> w(pos.size());
  for (size_t k = 0; k < pos.size(); ++k) {
    if (k == 0 || slot[pos[k]] != slot[pos[k - 1]]) {
      group_slot.push_back(slot[pos[k]]);
      group_begin.push_back(static_cast<int32_t>(k));
    }
    w[k] = weight[pos[k]];
  }
  group_begin.push_back(static_cast<int32_t>(pos.size()));

  Upload upload;
  const size_t slot_at = upload.Add(group_slot), begin_at = upload.Add(group_begin);
  const size_t pos_at = upload.Add(pos), w_at = upload.Add(w);
  gpu::Scratch dev(d, upload.size());
  upload.Send(d, &dev);
  const char* base = dev.as<char>();
  const int64_t num_values = static_cast<int64_t>(group_slot.size()) * row_size;
  AccumulateGroups<T, Acc><<<NumBlocks(num_values), kThreads, 0, d.stream()>>>(
      rows, row_size, reinterpret_cast<const int32_t*>(base + slot_at),
      reinterpret_cast<const int32_t*>(base + begin_at),
      reinterpret_cast<const int32_t*>(base + pos_at), reinterpret_cast<const Acc*>(base + w_at),
      num_values, pool);
  gpu::CheckLaunch("tf_gba::functor::AccumulateGroups");
}

template <typename T, typename Acc>
void GatherRowsGpu(const GPUDevice& d, const Acc* pool, int64_t row_size, const int32_t* order,
                   const Acc* inv, int64_t k, T* out) {
  const int64_t num_values = k * row_size;
  if (num_values <= 0) return;
  Upload upload;
  const size_t order_at = upload.Add(std::vector<int32_t>(order, order + k));
  const size_t inv_at = upload.Add(std::vector<Acc>(inv, inv + k));
  gpu::Scratch dev(d, upload.size());
  upload.Send(d, &dev);
  const char* base = dev.as<char>();
  GatherScaled<T, Acc><<<NumBlocks(num_values), kThreads, 0, d.stream()>>>(
      pool, row_size, reinterpret_cast<const int32_t*>(base + order_at),
      reinterpret_cast<const Acc*>(base + inv_at), num_values, out);
  gpu::CheckLaunch("tf_gba::functor::GatherScaled");
}

}  // namespace

#define TF_GBA_DEFINE_SPARSE_GPU(T, Acc)                                                         \
  template <>                                                                                    \
  bool SparseAllFinite<GPUDevice, T>::operator()(const GPUDevice& d, const T* x, int64_t n)      \
      const {                                                                                    \
    return gpu::AllFinite<T, Acc>(d, x, n);                                                      \
  }                                                                                              \
  template <>                                                                                    \
  void SparseAccumulateRows<GPUDevice, T, Acc>::operator()(                                      \
      const GPUDevice& d, const T* rows, int64_t n, int64_t row_size, const int32_t* slot,       \
      const Acc* weight, Acc* pool) const {                                                      \
    AccumulateRowsGpu<T, Acc>(d, rows, n, row_size, slot, weight, pool);                         \
  }                                                                                              \
  template <>                                                                                    \
  void SparseGatherRows<GPUDevice, T, Acc>::operator()(const GPUDevice& d, const Acc* pool,      \
                                                       int64_t row_size, const int32_t* order,   \
                                                       const Acc* inv, int64_t k, T* out) const { \
    GatherRowsGpu<T, Acc>(d, pool, row_size, order, inv, k, out);                                \
  }
TF_GBA_DEFINE_SPARSE_GPU(Eigen::half, float)
TF_GBA_DEFINE_SPARSE_GPU(Eigen::bfloat16, float)
TF_GBA_DEFINE_SPARSE_GPU(float, float)
TF_GBA_DEFINE_SPARSE_GPU(double, double)
#undef TF_GBA_DEFINE_SPARSE_GPU

#define TF_GBA_DEFINE_POOL_GROW_GPU(Acc)                                                     \
  template <>                                                                                \
  void SparsePoolGrow<GPUDevice, Acc>::operator()(const GPUDevice& d, const Acc* src,        \
                                                  int64_t used, Acc* dst, int64_t size) const { \
    if (src != dst) gpu::CopyOnDevice(d, dst, src, used * sizeof(Acc));                      \
    if (size > used) gpu::Zero(d, dst + used, (size - used) * sizeof(Acc));                  \
  }
TF_GBA_DEFINE_POOL_GROW_GPU(float)
TF_GBA_DEFINE_POOL_GROW_GPU(double)
#undef TF_GBA_DEFINE_POOL_GROW_GPU

}  // namespace functor
}  // namespace tf_gba

#endif  // GOOGLE_CUDA
