// The TensorFlow names every kernel file uses, brought into namespace tf_gba once, and the
// monotonic clock the timing kernels share.
#ifndef TF_GBA_CUSTOM_OPS_COMMON_KERNEL_UTIL_H_
#define TF_GBA_CUSTOM_OPS_COMMON_KERNEL_UTIL_H_

#include <chrono>
#include <cstdint>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/platform/thread_annotations.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_gba {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::DataType;
using ::tensorflow::DataTypeString;
using ::tensorflow::DataTypeToEnum;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::PartialTensorShape;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;
using CPUDevice = Eigen::ThreadPoolDevice;
using GPUDevice = Eigen::GpuDevice;

// Nanoseconds of the steady clock: for durations, never for wall-clock time.
inline int64_t MonoNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_COMMON_KERNEL_UTIL_H_
