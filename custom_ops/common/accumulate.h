// Numeric helpers shared by every op library's kernels, CPU and GPU: the type values are summed
// in, the finiteness check, and the CPU block size. Only Eigen is included, so that nvcc compiles
// the GPU files that use it without TensorFlow's framework headers.
#ifndef TF_GBA_CUSTOM_OPS_COMMON_ACCUMULATE_H_
#define TF_GBA_CUSTOM_OPS_COMMON_ACCUMULATE_H_

#include <cstdint>

#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_gba {

// Accumulation type: half and bfloat16 values are summed (and updates computed) in float. They
// have 11 and 8 significant bits: M summed gradients, or differences such as gbar - gbar_old,
// would be mostly rounding error in them, so only the stored results are rounded.
template <typename T>
struct AccumulatorType {
  using type = T;
};
template <>
struct AccumulatorType<Eigen::half> {
  using type = float;
};
template <>
struct AccumulatorType<Eigen::bfloat16> {
  using type = float;
};

template <typename T>
using Accumulator = typename AccumulatorType<T>::type;

// True when data[0, n) holds no NaN and no Inf.
template <typename T>
bool AllFinite(const T* data, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!Eigen::numext::isfinite(data[i])) return false;
  }
  return true;
}

// CPU kernels split flat arrays into blocks of this many values: a block of each operand stays
// in the core's cache between a block's passes (check, then accumulate), and one block is worth
// handing to another thread.
constexpr int64_t kCpuBlock = 16384;

inline int64_t NumCpuBlocks(int64_t n, int64_t block = kCpuBlock) {
  return (n + block - 1) / block;
}

}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_COMMON_ACCUMULATE_H_
