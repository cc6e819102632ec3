// Which worker a kernel runs on, read from its own device name: the straggler ops and the worker
// clock run on the worker's CPU, /job:worker/replica:0/task:<i>.
#ifndef TF_GBA_CUSTOM_OPS_COMMON_WORKER_INDEX_H_
#define TF_GBA_CUSTOM_OPS_COMMON_WORKER_INDEX_H_

#include <cstdint>
#include <cstdlib>
#include <string>

namespace tf_gba {

inline int64_t WorkerIndex(const std::string& device) {
  const std::string key = "/job:worker/replica:0/task:";
  const size_t pos = device.find(key);
  if (pos == std::string::npos) return 0;  // not on a worker (single process): worker 0
  return std::atoll(device.c_str() + pos + key.size());
}

}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_COMMON_WORKER_INDEX_H_
