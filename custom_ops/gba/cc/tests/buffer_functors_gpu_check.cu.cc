// The GBA buffers' GPU functors (dense_buffer_op_gpu.cu.cc, sparse_buffer_op_gpu.cu.cc) on a real
// GPU, against references computed here on the host, for every dtype the push ops declare; then
// their throughput. A standalone program: the functors include nothing of TensorFlow but Eigen, so
// this runs on a GPU machine that has the CUDA driver and no TensorFlow (tests/ops/
// test_gpu_functor_check.py builds and runs it where nvcc and a GPU are present; `make
// gpu-functor-check` builds it).
//
// The references add in the functors' documented order, in the accumulation type, and both sides
// are built without FMA contraction (-fmad=false here, no -mfma for the host), so the sums are
// expected to agree exactly; the tolerance only covers one rounding of the stored dtype.
//
// Exit status: 0 when every check passed, 1 otherwise (each failure is printed).
#define EIGEN_USE_GPU

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "custom_ops/gba/cc/kernels/dense_buffer_functor.h"
#include "custom_ops/gba/cc/kernels/sparse_buffer_functor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace {

using Eigen::GpuDevice;

void Cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "buffer_functors_gpu_check: %s: %s\n", what, cudaGetErrorString(err));
  std::exit(2);
}

// What Eigen::GpuDevice asks of a stream: plain cudaMalloc'ed memory and one stream (TensorFlow
// gives its own allocator; the functors use only allocate, deallocate and stream).
class Stream : public Eigen::StreamInterface {
 public:
  Stream() {
    Cuda(cudaSetDevice(0), "cudaSetDevice");
    Cuda(cudaStreamCreate(&stream_), "cudaStreamCreate");
    Cuda(cudaGetDeviceProperties(&props_, 0), "cudaGetDeviceProperties");
  }
  ~Stream() override { cudaStreamDestroy(stream_); }
  const cudaStream_t& stream() const override { return stream_; }
  const cudaDeviceProp& deviceProperties() const override { return props_; }
  void* allocate(size_t bytes) const override {
    void* p = nullptr;
    Cuda(cudaMalloc(&p, bytes), "cudaMalloc");
    return p;
  }
  void deallocate(void* p) const override {
    Cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    Cuda(cudaFree(p), "cudaFree");
  }
  void* scratchpad() const override { return nullptr; }
  unsigned int* semaphore() const override { return nullptr; }
  const cudaDeviceProp& props() const { return props_; }

 private:
  cudaStream_t stream_;
  cudaDeviceProp props_;
};

// A device array with its host copy.
template <typename T>
struct DeviceArray {
  explicit DeviceArray(size_t n) : size(n) { Cuda(cudaMalloc(&ptr, n * sizeof(T) + 1), "malloc"); }
  ~DeviceArray() { cudaFree(ptr); }
  void Put(const std::vector<T>& host) {
    Cuda(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "put");
  }
  std::vector<T> Get() const {
    std::vector<T> host(size);
    Cuda(cudaDeviceSynchronize(), "sync");
    Cuda(cudaMemcpy(host.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost), "get");
    return host;
  }
  T* ptr = nullptr;
  size_t size;
};

int failures = 0;

template <typename T>
double D(T x) {
  return static_cast<double>(static_cast<float>(x));
}
template <>
double D<double>(double x) {
  return x;
}

// |got - want| <= tol * max(1, |want|) for every element; one line per check.
template <typename T, typename U>
void Expect(const std::string& what, const std::vector<T>& got, const std::vector<U>& want,
            double tol) {
  double worst = 0;
  size_t at = 0;
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < got.size(); ++i) {
    const double g = D(got[i]), w = D(want[i]);
    const double err = std::fabs(g - w) / std::max(1.0, std::fabs(w));
    if (!(err <= tol)) ok = false, at = i;
    if (err > worst) worst = err;
  }
  std::printf("%s %-58s max rel. error %.3g\n", ok ? "ok  " : "FAIL", what.c_str(), worst);
  if (!ok) {
    ++failures;
    if (got.size() == want.size())
      std::printf("     first bad element %zu: got %.9g, want %.9g\n", at, D(got[at]), D(want[at]));
  }
}

void ExpectTrue(const std::string& what, bool ok) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

template <typename T>
std::vector<T> Normal(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist;
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(dist(rng));
  return v;
}

template <typename T, typename Acc>
void CheckDense(const GpuDevice& d, const std::string& name, double tol) {
  using namespace tf_gba::functor;  // NOLINT
  const int64_t n = (1 << 20) + 37;  // not a multiple of any block size
  const Acc f = static_cast<Acc>(0.375);
  std::vector<T> g = Normal<T>(n, 1);
  std::vector<Acc> s0 = Normal<Acc>(n, 2);
  DeviceArray<T> dg(n);
  DeviceArray<Acc> ds(n);
  dg.Put(g);
  ds.Put(s0);

  std::vector<Acc> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = s0[i] + f * static_cast<Acc>(g[i]);
  bool kept = DenseAccumulate<GpuDevice, T, Acc>()(d, dg.ptr, ds.ptr, n, f, false);
  ExpectTrue("dense " + name + ": a finite push is kept", kept);
  Expect("dense " + name + ": s += f * g", ds.Get(), want, 0);

  for (int64_t i = 0; i < n; ++i) want[i] = f * static_cast<Acc>(g[i]);
  DenseAccumulate<GpuDevice, T, Acc>()(d, dg.ptr, ds.ptr, n, f, true);
  Expect("dense " + name + ": s = f * g (assign)", ds.Get(), want, 0);

  // A NaN in the last element: refused, and s exactly as it was.
  std::vector<T> bad = g;
  bad[n - 1] = static_cast<T>(std::nan(""));
  dg.Put(bad);
  ExpectTrue("dense " + name + ": all finite (false on a NaN)",
             !DenseAllFinite<GpuDevice, T>()(d, dg.ptr, n));
  kept = DenseAccumulate<GpuDevice, T, Acc>()(d, dg.ptr, ds.ptr, n, f, false);
  ExpectTrue("dense " + name + ": a push with a NaN is refused", !kept);
  Expect("dense " + name + ": s untouched by the refused push", ds.Get(), want, 0);
  dg.Put(g);
  ExpectTrue("dense " + name + ": all finite (true)", DenseAllFinite<GpuDevice, T>()(d, dg.ptr, n));

  const Acc scale = static_cast<Acc>(1.0 / 3.0);
  DeviceArray<T> dout(n);
  DenseScale<GpuDevice, T, Acc>()(d, ds.ptr, dout.ptr, n, scale);
  std::vector<T> scaled(n);
  for (int64_t i = 0; i < n; ++i) scaled[i] = static_cast<T>(want[i] * scale);
  Expect("dense " + name + ": out = T(s / M)", dout.Get(), scaled, tol);

  DenseFillZero<GpuDevice, T>()(d, dout.ptr, n);
  Expect("dense " + name + ": out = 0", dout.Get(), std::vector<T>(n, static_cast<T>(0)), 0);
}

template <typename T, typename Acc>
void CheckSparse(const GpuDevice& d, const std::string& name, int64_t row_size, double tol) {
  using namespace tf_gba::functor;  // NOLINT
  const int64_t n = 5003, slots = 701;
  std::mt19937 rng(7 + row_size);
  std::vector<T> rows = Normal<T>(n * row_size, 3);
  std::vector<Acc> pool0 = Normal<Acc>(slots * row_size, 4);
  std::vector<int32_t> slot(n);
  std::vector<Acc> weight(n);
  std::uniform_int_distribution<int32_t> pick(0, slots - 1);
  std::uniform_real_distribution<double> wdist(0.0, 1.0);
  for (int64_t i = 0; i < n; ++i) {
    slot[i] = pick(rng);
    weight[i] = i % 7 == 3 ? Acc(0) : static_cast<Acc>(wdist(rng));  // some rows weigh nothing
  }
  DeviceArray<T> drows(n * row_size);
  DeviceArray<Acc> dpool(slots * row_size);
  drows.Put(rows);
  dpool.Put(pool0);
  const std::string tag = "sparse " + name + " (row " + std::to_string(row_size) + ")";

  std::vector<Acc> want = pool0;  // in increasing i for each slot, as documented
  for (int64_t i = 0; i < n; ++i) {
    if (weight[i] == Acc(0)) continue;
    for (int64_t j = 0; j < row_size; ++j)
      want[slot[i] * row_size + j] += weight[i] * static_cast<Acc>(rows[i * row_size + j]);
  }
  SparseAccumulateRows<GpuDevice, T, Acc>()(d, drows.ptr, n, row_size, slot.data(), weight.data(),
                                            dpool.ptr);
  Expect(tag + ": pool[slot] += w * row", dpool.Get(), want, 0);

  const int64_t k = 300;
  std::vector<int32_t> order(k);
  std::vector<Acc> inv(k);
  for (int64_t i = 0; i < k; ++i) {
    order[i] = static_cast<int32_t>((i * 7 + 5) % slots);
    inv[i] = static_cast<Acc>(1.0 / (1 + i % 5));
  }
  DeviceArray<T> dout(k * row_size);
  SparseGatherRows<GpuDevice, T, Acc>()(d, dpool.ptr, row_size, order.data(), inv.data(), k,
                                        dout.ptr);
  std::vector<T> gathered(k * row_size);
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < row_size; ++j)
      gathered[i * row_size + j] = static_cast<T>(want[order[i] * row_size + j] * inv[i]);
  Expect(tag + ": out = T(pool[order] * inv)", dout.Get(), gathered, tol);

  std::vector<T> bad = rows;
  bad[n * row_size / 2] = static_cast<T>(INFINITY);
  drows.Put(bad);
  ExpectTrue(tag + ": all finite (false on an Inf)",
             !SparseAllFinite<GpuDevice, T>()(d, drows.ptr, n * row_size));
  drows.Put(rows);
  ExpectTrue(tag + ": all finite (true)",
             SparseAllFinite<GpuDevice, T>()(d, drows.ptr, n * row_size));
}

template <typename Acc>
void CheckPoolGrow(const GpuDevice& d, const std::string& name) {
  using namespace tf_gba::functor;  // NOLINT
  const int64_t used = 1003, size = 4099;
  std::vector<Acc> src = Normal<Acc>(size, 9);
  DeviceArray<Acc> dsrc(size), ddst(size);
  dsrc.Put(src);
  ddst.Put(Normal<Acc>(size, 10));  // garbage that must be overwritten
  std::vector<Acc> want(size, Acc(0));
  for (int64_t i = 0; i < used; ++i) want[i] = src[i];
  SparsePoolGrow<GpuDevice, Acc>()(d, dsrc.ptr, used, ddst.ptr, size);
  Expect("pool grow " + name + ": copy the used part, zero the rest", ddst.Get(), want, 0);
  SparsePoolGrow<GpuDevice, Acc>()(d, dsrc.ptr, used, dsrc.ptr, size);
  Expect("pool grow " + name + ": in place", dsrc.Get(), want, 0);
}

// Milliseconds per call of fn, the mean of `iters` after two warm-up calls.
template <typename Fn>
double TimeMs(const Stream& stream, Fn fn, int iters) {
  fn();
  fn();
  cudaEvent_t start, stop;
  Cuda(cudaEventCreate(&start), "event");
  Cuda(cudaEventCreate(&stop), "event");
  Cuda(cudaEventRecord(start, stream.stream()), "record");
  for (int i = 0; i < iters; ++i) fn();
  Cuda(cudaEventRecord(stop, stream.stream()), "record");
  Cuda(cudaEventSynchronize(stop), "sync");
  float ms = 0;
  Cuda(cudaEventElapsedTime(&ms, start, stop), "elapsed");
  return ms / iters;
}

void Throughput(const Stream& stream, const GpuDevice& d) {
  using namespace tf_gba::functor;  // NOLINT
  const int64_t n = int64_t{1} << 26;  // 64M float gradient values, 256 MiB
  DeviceArray<float> g(n), s(n);
  Cuda(cudaMemset(g.ptr, 0, n * sizeof(float)), "memset");
  Cuda(cudaMemset(s.ptr, 0, n * sizeof(float)), "memset");
  const double ms = TimeMs(stream, [&] {
    DenseAccumulate<GpuDevice, float, float>()(d, g.ptr, s.ptr, n, 0.5f, false);
  }, 20);
  // Reads g and s, writes s (the finiteness check reads g once more).
  std::printf("time dense accumulate, float, %lld values: %.3f ms per push, %.0f GB/s "
              "(12 bytes a value; 16 with the finiteness read)\n",
              static_cast<long long>(n), ms, 12.0 * n / ms / 1e6);

  const int64_t rows = 1 << 20, row_size = 64, slots = 1 << 18;
  DeviceArray<float> drows(rows * row_size), pool(slots * row_size);
  Cuda(cudaMemset(drows.ptr, 0, rows * row_size * sizeof(float)), "memset");
  Cuda(cudaMemset(pool.ptr, 0, slots * row_size * sizeof(float)), "memset");
  std::vector<int32_t> slot(rows);
  std::vector<float> weight(rows, 1.0f);
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> pick(0, slots - 1);
  for (auto& x : slot) x = pick(rng);
  const double sparse_ms = TimeMs(stream, [&] {
    SparseAccumulateRows<GpuDevice, float, float>()(d, drows.ptr, rows, row_size, slot.data(),
                                                    weight.data(), pool.ptr);
  }, 5);
  std::printf("time sparse accumulate, float, %lld rows of %lld into %lld slots: %.3f ms per "
              "push, %.1f M rows/s (host grouping and copies included)\n",
              static_cast<long long>(rows), static_cast<long long>(row_size),
              static_cast<long long>(slots), sparse_ms, rows / sparse_ms / 1e3);
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "buffer_functors_gpu_check: no CUDA GPU\n");
    return 3;
  }
  Stream stream;
  GpuDevice d(&stream);
  std::printf("GPU: %s (sm_%d%d)\n", stream.props().name, stream.props().major,
              stream.props().minor);
  CheckDense<Eigen::half, float>(d, "half", 1e-3);
  CheckDense<Eigen::bfloat16, float>(d, "bfloat16", 1e-2);
  CheckDense<float, float>(d, "float", 1e-6);
  CheckDense<double, double>(d, "double", 1e-12);
  for (int64_t row_size : {16, 33}) {
    CheckSparse<Eigen::half, float>(d, "half", row_size, 1e-3);
    CheckSparse<Eigen::bfloat16, float>(d, "bfloat16", row_size, 1e-2);
    CheckSparse<float, float>(d, "float", row_size, 1e-6);
    CheckSparse<double, double>(d, "double", row_size, 1e-12);
  }
  CheckPoolGrow<float>(d, "float");
  CheckPoolGrow<double>(d, "double");
  if (argc > 1 && std::string(argv[1]) == "--time") Throughput(stream, d);
  std::printf("%s: %d check(s) failed\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
