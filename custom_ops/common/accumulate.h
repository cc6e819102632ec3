// Numeric helpers shared by every op library's kernels, CPU and GPU: the type values are summed
// in, the finiteness check, and the CPU block size. Only Eigen is included, so that nvcc compiles
// the GPU files that use it without TensorFlow's framework headers.
#ifndef TF_GBA_CUSTOM_OPS_COMMON_ACCUMULATE_H_
#define TF_GBA_CUSTOM_OPS_COMMON_ACCUMULATE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

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

// True when data[0, n) holds no NaN and no Inf: |x| <= max is false for both. An OR of compares
// into an int (no early exit, no floating-point reduction order to respect) lets g++ vectorise
// the loop; a bool accumulator (`ok &= ...`) does not, and was measured 9x slower.
template <typename T>
bool BlockFinite(const T* __restrict__ data, int64_t n) {
  using Acc = Accumulator<T>;
  const Acc limit = std::numeric_limits<Acc>::max();
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= !(std::abs(static_cast<Acc>(data[i])) <= limit);
  return bad == 0;
}

// Values a check reads before it may stop early, and that a kernel checks and then uses while
// they are still in the core's L1 cache (8 KiB of float).
constexpr int64_t kL1Piece = 2048;

// BlockFinite piece by piece, stopping at the first piece that is not finite.
template <typename T>
bool AllFinite(const T* data, int64_t n) {
  for (int64_t start = 0; start < n; start += kL1Piece) {
    if (!BlockFinite(data + start, std::min(kL1Piece, n - start))) return false;
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
