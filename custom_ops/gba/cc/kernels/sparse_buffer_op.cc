// Sparse GBA gradient buffer for embedding rows (SPEC section 1, "Embeddings: per-ID staleness").
//
// Every row carries last_step[id], the global step that last updated it (-1: never). A push's
// weight for an id is decided by the id's own staleness max(0, last_step[id] + 1 - token), which
// is exact at push time because tags only change at aggregation. Aggregation k produces version
// k + 1 and token t stands for version t, so a row tagged j has changed since version t iff
// j >= t: the `+ 1` makes a row updated in every step exactly as stale as the dense variables.
// A row's weighted sum is divided by M by default (an all-reduce Sync's mean, absent entries
// counting as zero rows) or, with sparse_normalize='per_id', by c(id) (the paper's rule).
// Accumulators exist only for the ids touched in the current global batch (a compact pool indexed
// through slot_[id]), so the extra memory per row is one int64 tag and one int32 slot.
//
// A keyed buffer (keyed=true, for an expandable hash table, SPEC section 6) names rows by int64
// keys instead of row numbers: its slots are a hash map of the current batch's keys, and each
// key's tag is the one kept in the table's row (read under the buffer's lock at push time, written
// by the aggregation), so a hash row is judged exactly as a partitioned row is.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <numeric>
#include <vector>

#include "custom_ops/common/kernel_util.h"
#include "absl/container/flat_hash_map.h"
#include "custom_ops/gba/cc/kernels/buffer_core.h"
#include "custom_ops/gba/cc/kernels/hash_table.h"
#include "custom_ops/common/resource_util.h"
#include "custom_ops/gba/cc/kernels/sparse_buffer_functor.h"
#include "tensorflow/core/framework/register_types.h"

namespace tf_gba {

template <typename Device, typename Acc>
struct RowPool;

// The buffer of one embedding table (shard). Its state is private and guarded by mu_; a push runs
// under the lock from the ticket check to the hand-out of a completed aggregate.
class SparseGradientBuffer : public ::tensorflow::ResourceBase {
 public:
  // What the create op's own attributes say besides the shared BufferConfig.
  struct Params {
    DataType dtype;
    int64_t num_rows;
    TensorShape row_shape;
    bool keyed = false;  // rows named by hash-table keys (num_rows must be 0)

    static Status FromAttrs(OpKernelConstruction* ctx, BufferConfig* config, Params* p) {
      std::string sparse_normalize;  // the op's attr lists the choices: TF checks the value
      TF_RETURN_IF_ERROR(ctx->GetAttr("sparse_normalize", &sparse_normalize));
      config->sparse_per_id_divisor = sparse_normalize == "per_id";
      TF_RETURN_IF_ERROR(ctx->GetAttr("dtype", &p->dtype));
      TF_RETURN_IF_ERROR(ctx->GetAttr("num_rows", &p->num_rows));
      TF_RETURN_IF_ERROR(ctx->GetAttr("keyed", &p->keyed));
      if (p->keyed && p->num_rows != 0) {
        return errors::InvalidArgument("A keyed buffer (for a hash table) has no row numbers: "
                                       "num_rows must be 0, got ", p->num_rows, ".");
      }
      if (p->num_rows < 0 || p->num_rows >= (int64_t{1} << 31)) {
        return errors::InvalidArgument("num_rows must be in [0, 2^31) per buffer (shard larger "
                                       "tables), got ", p->num_rows, ".");
      }
      PartialTensorShape row_shape;
      TF_RETURN_IF_ERROR(ctx->GetAttr("row_shape", &row_shape));
      if (!row_shape.IsFullyDefined() || !row_shape.AsTensorShape(&p->row_shape)) {
        return errors::InvalidArgument("row_shape must be fully defined, got ",
                                       row_shape.DebugString(), ".");
      }
      return ::tensorflow::OkStatus();
    }
  };

  SparseGradientBuffer(const Params& params, const BufferConfig& config, int64_t initial_step)
      : dtype_(params.dtype),
        num_rows_(params.num_rows),
        keyed_(params.keyed),
        row_shape_(params.row_shape),
        row_size_(params.row_shape.num_elements()),
        core_(config, initial_step),
        tags_(params.num_rows, -1),
        slot_(params.num_rows, -1) {}

  std::string DebugString() const override {
    return ::tensorflow::strings::StrCat("GBA SparseGradientBuffer(", DataTypeString(dtype_), "[",
                                         num_rows_, "]", row_shape_.DebugString(), ")");
  }

  DataType dtype() const { return dtype_; }
  int64_t num_rows() const { return num_rows_; }
  bool keyed() const { return keyed_; }
  const TensorShape& row_shape() const { return row_shape_; }
  int64_t row_size() const { return row_size_; }
  // Immutable after construction: readable without the lock.
  bool error_on_nonfinite() const { return config_.error_on_nonfinite; }

  // Adds the push's rows, each with its id's weight, and, when the push completes the global
  // batch, writes the aggregate into outputs 1 and 2 (defined below the row pools). A keyed
  // buffer reads and writes the tags of `table`'s rows (lock order: buffer, then table).
  template <typename Device, typename T, typename Tindex>
  Status Push(OpKernelContext* ctx, const Tindex* ids, const T* rows, int64_t n, int64_t token,
              int64_t ticket, bool finite, bool* ready, int64_t* step,
              HashTable* table = nullptr) TF_LOCKS_EXCLUDED(mu_);

  // (global step, row tags) for a checkpoint.
  void Export(int64_t* step, int64_t* tags) const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    *step = core_.step();
    std::copy(tags_.begin(), tags_.end(), tags);
  }

  // Restoring a checkpoint: the pending batch belongs to gradients whose tokens are gone.
  void Import(int64_t step, const int64_t* tags) TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    core_.Reset(step);
    ClearBatch();
    std::copy(tags, tags + num_rows_, tags_.begin());
  }

  void WriteStats(OpKernelContext* ctx) const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    WriteBufferStats(ctx, core_);
  }

 private:
  template <typename Device, typename Acc>
  friend struct RowPool;

  // The accumulator rows of the current batch, one per slot (see RowPool).
  template <typename Acc>
  std::vector<Acc>& host_pool() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Tensor& device_pool() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return device_pool_; }

  struct Touched {
    int64_t id;
    int32_t count;      // pushes of this batch whose ids contained id: c(id)
    int32_t kept;       // of those, pushes with a non-zero weight
    int64_t last_push;  // sequence number of the last push that counted this id
  };

  // The bookkeeping of one push, on the host: each id's slot in the pool and its weight in this
  // push (slot -1: weight 0, nothing to add), the per-id counts and the statistics.
  // `key_tags`: a keyed buffer's tags of ids[0, n), read from its table; else tags_[id].
  template <typename Tindex, typename Acc>
  void Bookkeep(const Tindex* ids, int64_t n, int64_t token, bool finite,
                const int64_t* key_tags, int32_t* slot_of, Acc* weight_of)
      TF_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The batch slot of id (-1: not in the batch yet), by row number or, keyed, by key.
  int32_t& SlotOf(int64_t id) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!keyed_) return slot_[id];
    return keyed_slot_.try_emplace(id, -1).first->second;
  }

  // Writes the aggregate of the completed global batch into outputs 1 and 2 (ids in the order
  // they were first pushed; ids whose every weight was zero left out), tags the aggregated rows
  // with the step k being applied, and clears the batch.
  template <typename Device, typename T, typename Tindex, typename Acc>
  Status Aggregate(OpKernelContext* ctx, const Acc* pool, HashTable* table)
      TF_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Forgets the current batch's accumulators (after aggregation, or on restore).
  void ClearBatch() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (keyed_) {
      keyed_slot_.clear();
    } else {
      for (const Touched& t : touched_) slot_[t.id] = -1;
    }
    touched_.clear();
    pool_f_.clear();
    pool_d_.clear();
  }

  const DataType dtype_;
  const int64_t num_rows_;
  const bool keyed_;
  const TensorShape row_shape_;
  const int64_t row_size_;
  mutable ::tensorflow::mutex mu_;
  BufferCore core_ TF_GUARDED_BY(mu_);
  const BufferConfig& config_ = core_.config();  // immutable: no lock needed
  std::vector<int64_t> tags_ TF_GUARDED_BY(mu_);   // last_step per row
  std::vector<int32_t> slot_ TF_GUARDED_BY(mu_);   // index into touched_ for ids of the batch
  absl::flat_hash_map<int64_t, int32_t> keyed_slot_ TF_GUARDED_BY(mu_);  // the same, keyed
  std::vector<Touched> touched_ TF_GUARDED_BY(mu_);
  std::vector<float> pool_f_ TF_GUARDED_BY(mu_);   // accumulator rows (float, half, bfloat16)
  std::vector<double> pool_d_ TF_GUARDED_BY(mu_);  // accumulator rows (double gradients)
  Tensor device_pool_ TF_GUARDED_BY(mu_);  // GPU: accumulator rows (capacity grown by doubling)
  int64_t push_seq_ TF_GUARDED_BY(mu_) = 0;
};

template <>
inline std::vector<float>& SparseGradientBuffer::host_pool<float>() {
  return pool_f_;
}
template <>
inline std::vector<double>& SparseGradientBuffer::host_pool<double>() {
  return pool_d_;
}

// The accumulator rows of the current batch, one per slot, in the device's memory. Reserve makes
// room for up to `max_rows` rows keeping the first `old_rows` (it may fail: call it before any
// bookkeeping changes); Grow then zeroes rows [old_rows, new_rows) and returns the pool. The
// caller holds the buffer's lock.
template <typename Device, typename Acc>
struct RowPool;

template <typename Acc>
struct RowPool<CPUDevice, Acc> {
  static Status Reserve(OpKernelContext*, SparseGradientBuffer*, int64_t, int64_t) {
    return ::tensorflow::OkStatus();
  }
  static Acc* Grow(OpKernelContext*, SparseGradientBuffer* buf, int64_t, int64_t new_rows)
      TF_EXCLUSIVE_LOCKS_REQUIRED(buf->mu_) {
    std::vector<Acc>& pool = buf->host_pool<Acc>();
    pool.resize(new_rows * buf->row_size(), Acc(0));
    return pool.data();
  }
};

#if GOOGLE_CUDA
template <typename Acc>
struct RowPool<GPUDevice, Acc> {
  static Status Reserve(OpKernelContext* ctx, SparseGradientBuffer* buf, int64_t old_rows,
                        int64_t max_rows) TF_EXCLUSIVE_LOCKS_REQUIRED(buf->mu_) {
    Tensor& pool = buf->device_pool();
    const int64_t capacity = pool.IsInitialized() ? pool.NumElements() : 0;
    const int64_t needed = max_rows * buf->row_size();
    if (needed <= capacity) return ::tensorflow::OkStatus();
    Tensor grown;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DataTypeToEnum<Acc>::value,
                                          TensorShape({std::max(needed, 2 * capacity)}), &grown));
    const int64_t used = old_rows * buf->row_size();
    functor::SparsePoolGrow<GPUDevice, Acc>()(ctx->eigen_device<GPUDevice>(),
                                              used ? pool.flat<Acc>().data() : nullptr, used,
                                              grown.flat<Acc>().data(), used);
    pool = grown;  // the old rows' memory is reused only after the copy, in stream order
    return ::tensorflow::OkStatus();
  }
  static Acc* Grow(OpKernelContext* ctx, SparseGradientBuffer* buf, int64_t old_rows,
                   int64_t new_rows) TF_EXCLUSIVE_LOCKS_REQUIRED(buf->mu_) {
    if (!buf->device_pool().IsInitialized()) return nullptr;  // no rows yet
    Acc* pool = buf->device_pool().flat<Acc>().data();
    functor::SparsePoolGrow<GPUDevice, Acc>()(ctx->eigen_device<GPUDevice>(), pool,
                                              old_rows * buf->row_size(), pool,
                                              new_rows * buf->row_size());
    return pool;
  }
};
#endif  // GOOGLE_CUDA

namespace functor {

// CPU: one thread accumulates (the bookkeeping already runs under the buffer's mutex); the
// aggregate rows are independent and written in parallel.
template <typename T>
struct SparseAllFinite<CPUDevice, T> {
  bool operator()(const CPUDevice&, const T* x, int64_t n) const { return AllFinite(x, n); }
};

template <typename T, typename Acc>
struct SparseAccumulateRows<CPUDevice, T, Acc> {
  void operator()(const CPUDevice&, const T* rows, int64_t n, int64_t row_size,
                  const int32_t* slot, const Acc* weight, Acc* pool) const {
    constexpr int64_t kAhead = 8;  // rows whose accumulator is fetched ahead (random slots)
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n && slot[i + kAhead] >= 0) {
        __builtin_prefetch(pool + static_cast<int64_t>(slot[i + kAhead]) * row_size, 1);
      }
      if (slot[i] < 0) continue;
      Acc* acc = pool + static_cast<int64_t>(slot[i]) * row_size;
      const T* row = rows + i * row_size;
      const Acc wa = weight[i];
      for (int64_t j = 0; j < row_size; ++j) acc[j] += wa * static_cast<Acc>(row[j]);
    }
  }
};

template <typename T, typename Acc>
struct SparseGatherRows<CPUDevice, T, Acc> {
  void operator()(const CPUDevice& d, const Acc* pool, int64_t row_size, const int32_t* order,
                  const Acc* inv, int64_t k, T* out) const {
    d.parallelFor(k,
                  Eigen::TensorOpCost(row_size * sizeof(Acc) + 16, row_size * sizeof(T) + 16,
                                      row_size),
                  [&](Eigen::Index begin, Eigen::Index end) {
                    for (Eigen::Index i = begin; i < end; ++i) {
                      const Acc* acc = pool + static_cast<int64_t>(order[i]) * row_size;
                      T* dst = out + i * row_size;
                      for (int64_t j = 0; j < row_size; ++j) {
                        dst[j] = static_cast<T>(acc[j] * inv[i]);
                      }
                    }
                  });
  }
};

}  // namespace functor

template <typename Device, typename T, typename Tindex>
Status SparseGradientBuffer::Push(OpKernelContext* ctx, const Tindex* ids, const T* rows, int64_t n,
                                  int64_t token, int64_t ticket, bool finite, bool* ready,
                                  int64_t* step, HashTable* table) {
  using Acc = Accumulator<T>;
  ::tensorflow::mutex_lock lock(mu_);
  // Room in the pool for this push's new ids comes first: when it cannot be allocated, the
  // buffer must be left as it was (the push can then be retried with the same ticket).
  const int64_t old_rows = static_cast<int64_t>(touched_.size());
  TF_RETURN_IF_ERROR((RowPool<Device, Acc>::Reserve(ctx, this, old_rows, old_rows + n)));
  if (core_.AcceptTicket(ticket)) {  // a ticket seen before: the same push delivered again
    if (!finite) ++core_.stats().nonfinite;
    std::vector<int32_t> slot_of(n, -1);
    std::vector<Acc> weight_of(n, Acc(0));
    // Keyed: the tags of the rows as they are now. They change only in this buffer's
    // aggregation, which needs its lock (held here).
    std::vector<int64_t> key_tags;
    if (table != nullptr) {
      key_tags.resize(n);
      std::vector<int64_t> keys(ids, ids + n);
      table->GetTags(keys.data(), n, key_tags.data());
    }
    Bookkeep<Tindex, Acc>(ids, n, token, finite, table ? key_tags.data() : nullptr,
                          slot_of.data(), weight_of.data());
    Acc* pool = RowPool<Device, Acc>::Grow(ctx, this, old_rows,
                                           static_cast<int64_t>(touched_.size()));
    // The rows are added on the device, after the bookkeeping.
    functor::SparseAccumulateRows<Device, T, Acc>()(ctx->eigen_device<Device>(), rows, n,
                                                    row_size_, slot_of.data(), weight_of.data(),
                                                    pool);
    const int64_t push_staleness = std::max<int64_t>(0, core_.step() - token);
    const double push_weight = finite ? config_.decay.Weight(push_staleness) : 0.0;
    const bool counts = config_.per_id_staleness ? (finite || config_.count_dropped)
                                                 : (push_weight != 0.0 || config_.count_dropped);
    if (core_.AddEntry(counts)) {
      *ready = true;
      TF_RETURN_IF_ERROR((Aggregate<Device, T, Tindex, Acc>(ctx, pool, table)));
      core_.FinishAggregation();
    }
  }
  *step = core_.step();
  return ::tensorflow::OkStatus();
}

template <typename Tindex, typename Acc>
void SparseGradientBuffer::Bookkeep(const Tindex* ids, int64_t n, int64_t token, bool finite,
                                    const int64_t* key_tags, int32_t* slot_of, Acc* weight_of) {
  const int64_t seq = ++push_seq_;
  // Hop-BW (per_id_staleness = false): one decision for the whole push, from its dense
  // staleness; a push dropped without taking a place in the batch leaves no trace in the
  // pool (not even in the per-id divisors c(id)), as if it had never been sent.
  const int64_t push_staleness = std::max<int64_t>(0, core_.step() - token);
  const double push_weight = finite ? config_.decay.Weight(push_staleness) : 0.0;
  const bool ignore_push =
      !config_.per_id_staleness && push_weight == 0.0 && !config_.count_dropped;
  if (ignore_push) {
    std::vector<int64_t> unique_ids(ids, ids + n);
    std::sort(unique_ids.begin(), unique_ids.end());
    const int64_t num_unique =
        std::unique(unique_ids.begin(), unique_ids.end()) - unique_ids.begin();
    for (int64_t i = 0; i < num_unique; ++i) core_.RecordStaleness(push_staleness);
    core_.stats().dropped += num_unique;
    return;  // slots stay -1: nothing is added
  }
  constexpr int64_t kAhead = 16;  // ids whose slot and tag are fetched ahead (random rows)
  for (int64_t i = 0; i < n; ++i) {
    if (!keyed_ && i + kAhead < n) {
      __builtin_prefetch(&slot_[ids[i + kAhead]], 1);
      __builtin_prefetch(&tags_[ids[i + kAhead]]);
    }
    const int64_t id = static_cast<int64_t>(ids[i]);
    int32_t& sl = SlotOf(id);
    if (sl < 0) {
      sl = static_cast<int32_t>(touched_.size());
      touched_.push_back({id, 0, 0, -1});
    }
    Touched& t = touched_[sl];
    const int64_t staleness = config_.per_id_staleness
                                  ? std::max<int64_t>(
                                        0, (key_tags ? key_tags[i] : tags_[id]) + 1 - token)
                                  : push_staleness;
    const double w = config_.per_id_staleness ? (finite ? config_.decay.Weight(staleness) : 0.0)
                                              : push_weight;
    if (t.last_push != seq) {  // duplicates within one push count once
      t.last_push = seq;
      ++t.count;
      core_.RecordStaleness(staleness);
      if (w == 0.0) {
        ++core_.stats().dropped;
      } else {
        ++t.kept;
      }
    }
    slot_of[i] = w != 0.0 ? sl : -1;
    weight_of[i] = static_cast<Acc>(w);
  }
}

template <typename Device, typename T, typename Tindex, typename Acc>
Status SparseGradientBuffer::Aggregate(OpKernelContext* ctx, const Acc* pool,
                                       HashTable* table) {
  const bool by_kept = config_.normalize == Normalize::kKept;
  const int64_t m = config_.num_aggregate;
  std::vector<int32_t> order;
  std::vector<Acc> inv;
  order.reserve(touched_.size());
  inv.reserve(touched_.size());
  for (int32_t s = 0; s < static_cast<int32_t>(touched_.size()); ++s) {
    const Touched& t = touched_[s];
    if (t.kept > 0) {
      order.push_back(s);
      int64_t divisor;
      if (config_.sparse_per_id_divisor) {
        divisor = by_kept ? t.kept : t.count;
      } else {
        // Out of the M entries, those whose weight for this id was 0 are the only ones not
        // kept (an entry without the id contributes a kept zero row).
        divisor = by_kept ? std::max<int64_t>(t.kept, m - (t.count - t.kept)) : m;
      }
      inv.push_back(Acc(1) / static_cast<Acc>(divisor));
    }
  }
  const int64_t k = static_cast<int64_t>(order.size());
  Tensor *ids_t, *rows_t;
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({k}), &ids_t));
  TensorShape rows_shape({k});
  rows_shape.AppendShape(row_shape_);
  TF_RETURN_IF_ERROR(ctx->allocate_output(2, rows_shape, &rows_t));
  Tindex* out_ids = ids_t->vec<Tindex>().data();  // host memory on every device
  const int64_t step = core_.step();
  for (int64_t i = 0; i < k; ++i) {
    const int64_t id = touched_[order[i]].id;
    out_ids[i] = static_cast<Tindex>(id);
    if (table == nullptr) tags_[id] = step;  // the weights of this batch used the old tags
  }
  if (table != nullptr) {  // the same, in the hash table's rows
    std::vector<int64_t> keys(k);
    for (int64_t i = 0; i < k; ++i) keys[i] = touched_[order[i]].id;
    table->SetTags(keys.data(), k, step);
  }
  // Entries are independent (distinct ids): the device writes the scaled rows in parallel.
  functor::SparseGatherRows<Device, T, Acc>()(ctx->eigen_device<Device>(), pool, row_size_,
                                              order.data(), inv.data(), k,
                                              rows_t->flat<T>().data());
  ClearBatch();
  return ::tensorflow::OkStatus();
}

// GBA>SparseBufferPush (kKeyed = false: ids are row numbers) and GBA>HashBufferPush (kKeyed:
// ids are the keys of the hash table at input 5, whose rows hold the tags).
template <typename Device, typename T, typename Tindex, bool kKeyed = false>
class SparseBufferPushOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<SparseGradientBuffer> buf;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &buf));
    OP_REQUIRES(ctx, buf->keyed() == kKeyed,
                errors::InvalidArgument(
                    buf->DebugString(), kKeyed
                        ? " is not keyed: push hash-table rows to a buffer created with keyed=True."
                        : " is keyed (hash-table rows): push with GBA>HashBufferPush."));
    ::tensorflow::core::RefCountPtr<HashTable> table;
    if (kKeyed) OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 5, "hash table", &table));
    int64_t token, ticket;
    OP_REQUIRES_OK(ctx, ReadTokenAndTicket(ctx, &token, &ticket));
    const Tensor& indices = ctx->input(3);
    const Tensor& values = ctx->input(4);
    OP_REQUIRES(ctx, DataTypeToEnum<T>::value == buf->dtype(),
                errors::InvalidArgument("Embedding gradient dtype ",
                                        DataTypeString(DataTypeToEnum<T>::value),
                                        " does not match the buffer's dtype ",
                                        DataTypeString(buf->dtype()), "."));
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsVector(indices.shape()),
                errors::InvalidArgument("indices must be a vector, got shape ",
                                        indices.shape().DebugString(), "."));
    const int64_t n = indices.dim_size(0);
    TensorShape expected({n});
    expected.AppendShape(buf->row_shape());
    OP_REQUIRES(ctx, values.shape() == expected,
                errors::InvalidArgument("values must have shape [len(indices)] + row_shape = ",
                                        expected.DebugString(), ", got ",
                                        values.shape().DebugString(), " for ",
                                        buf->DebugString(), "."));
    OP_REQUIRES(ctx, !kKeyed || buf->row_size() == table->dim(),
                errors::InvalidArgument("The buffer's rows (", buf->row_shape().DebugString(),
                                        ") do not match ", kKeyed ? table->DebugString() : "",
                                        "."));
    const Tindex* ids = indices.vec<Tindex>().data();
    for (int64_t i = 0; i < n && !kKeyed; ++i) {
      const int64_t id = static_cast<int64_t>(ids[i]);
      OP_REQUIRES(ctx, id >= 0 && id < buf->num_rows(),
                  errors::InvalidArgument("indices[", i, "] = ", id, " is out of range [0, ",
                                          buf->num_rows(), ") of ", buf->DebugString(),
                                          " (ids must be shard-local row numbers)."));
    }
    const T* rows = values.flat<T>().data();  // in the device's memory
    const bool finite = functor::SparseAllFinite<Device, T>()(ctx->eigen_device<Device>(), rows,
                                                              n * buf->row_size());
    OP_REQUIRES(ctx, finite || !buf->error_on_nonfinite(),
                errors::InvalidArgument("Embedding gradient pushed to ", buf->DebugString(),
                                        " contains NaN or Inf (token ", token,
                                        "). Lower the learning rate or clip gradients, or create "
                                        "the buffer with nonfinite='drop' to skip such pushes."));

    bool ready = false;
    int64_t step_out;
    OP_REQUIRES_OK(ctx, (buf->Push<Device, T, Tindex>(ctx, ids, rows, n, token, ticket, finite,
                                                      &ready, &step_out, table.get())));

    Tensor* ready_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &ready_t));
    ready_t->scalar<bool>()() = ready;
    if (!ready) {
      Tensor* unused;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({0}), &unused));
      TensorShape rows_shape({0});
      rows_shape.AppendShape(buf->row_shape());
      OP_REQUIRES_OK(ctx, ctx->allocate_output(2, rows_shape, &unused));
    }
    Tensor* step_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &step_t));
    step_t->scalar<int64_t>()() = step_out;
  }
};

class SparseBufferExportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<SparseGradientBuffer> buf;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &buf));
    Tensor *step, *tags;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &step));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({buf->num_rows()}), &tags));
    buf->Export(&step->scalar<int64_t>()(), tags->vec<int64_t>().data());
  }
};

class SparseBufferImportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<SparseGradientBuffer> buf;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &buf));
    int64_t step;
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 1, "global_step", &step));
    OP_REQUIRES(ctx, step >= 0,
                errors::InvalidArgument("global_step must be >= 0, got ", step, "."));
    const Tensor& tags = ctx->input(2);
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsVector(tags.shape()) &&
                         tags.dim_size(0) == buf->num_rows(),
                errors::InvalidArgument("row_tags must have shape [", buf->num_rows(), "] for ",
                                        buf->DebugString(), ", got ", tags.shape().DebugString(),
                                        " (a checkpoint from another shard layout?)."));
    auto t = tags.vec<int64_t>();
    for (int64_t i = 0; i < buf->num_rows(); ++i) {
      OP_REQUIRES(ctx, t(i) >= -1 && t(i) < step,
                  errors::InvalidArgument("row_tags[", i, "] = ", t(i),
                                          " must be in [-1, global_step = ", step, ")."));
    }
    buf->Import(step, t.data());
  }
};

TF_GBA_REGISTER_BUFFER_CREATE_AND_STATS(Sparse, SparseGradientBuffer);
REGISTER_KERNEL_BUILDER(Name("GBA>SparseBufferExport").Device(::tensorflow::DEVICE_CPU),
                        SparseBufferExportOp);
REGISTER_KERNEL_BUILDER(Name("GBA>SparseBufferImport").Device(::tensorflow::DEVICE_CPU),
                        SparseBufferImportOp);

#define REGISTER_PUSH_T_I(T, I)                                         \
  REGISTER_KERNEL_BUILDER(Name("GBA>SparseBufferPush")                  \
                              .Device(::tensorflow::DEVICE_CPU)         \
                              .TypeConstraint<T>("T")                   \
                              .TypeConstraint<I>("Tindices"),           \
                          SparseBufferPushOp<CPUDevice, T, I>);
#define REGISTER_PUSH(T)            \
  REGISTER_PUSH_T_I(T, int32_t)     \
  REGISTER_PUSH_T_I(T, int64_t)
TF_CALL_half(REGISTER_PUSH);
TF_CALL_bfloat16(REGISTER_PUSH);
TF_CALL_float(REGISTER_PUSH);
TF_CALL_double(REGISTER_PUSH);
#undef REGISTER_PUSH
#undef REGISTER_PUSH_T_I
// Hash tables hold float rows.
REGISTER_KERNEL_BUILDER(
    Name("GBA>HashBufferPush").Device(::tensorflow::DEVICE_CPU).TypeConstraint<float>("T"),
    (SparseBufferPushOp<CPUDevice, float, int64_t, true>));

#if GOOGLE_CUDA
// GPU: the accumulator rows live in GPU memory and the row arithmetic runs there
// (sparse_buffer_op_gpu.cu.cc). The ids, the tags and every other piece of bookkeeping stay on the
// host, so `indices`, `aggregate_indices` and the scalars are in host memory; only the gradient
// rows (`values`, `aggregate_values`) are in GPU memory. The other ops only touch the bookkeeping;
// they have GPU registrations so that a buffer created under tf.device("/GPU:0") lives in that
// device's resource manager, next to its pushes.
REGISTER_KERNEL_BUILDER(Name("GBA>SparseBufferExport")
                            .Device(::tensorflow::DEVICE_GPU)
                            .HostMemory("global_step")
                            .HostMemory("row_tags"),
                        SparseBufferExportOp);
REGISTER_KERNEL_BUILDER(Name("GBA>SparseBufferImport")
                            .Device(::tensorflow::DEVICE_GPU)
                            .HostMemory("global_step")
                            .HostMemory("row_tags"),
                        SparseBufferImportOp);

#define REGISTER_GPU_PUSH_T_I(T, I)                                     \
  REGISTER_KERNEL_BUILDER(Name("GBA>SparseBufferPush")                  \
                              .Device(::tensorflow::DEVICE_GPU)         \
                              .TypeConstraint<T>("T")                   \
                              .TypeConstraint<I>("Tindices")            \
                              .HostMemory("token")                      \
                              .HostMemory("ticket")                     \
                              .HostMemory("indices")                    \
                              .HostMemory("ready")                      \
                              .HostMemory("aggregate_indices")          \
                              .HostMemory("global_step"),               \
                          SparseBufferPushOp<GPUDevice, T, I>);
#define REGISTER_GPU_PUSH(T)            \
  REGISTER_GPU_PUSH_T_I(T, int32_t)     \
  REGISTER_GPU_PUSH_T_I(T, int64_t)
TF_CALL_half(REGISTER_GPU_PUSH);
TF_CALL_bfloat16(REGISTER_GPU_PUSH);
TF_CALL_float(REGISTER_GPU_PUSH);
TF_CALL_double(REGISTER_GPU_PUSH);
#undef REGISTER_GPU_PUSH
#undef REGISTER_GPU_PUSH_T_I
#endif  // GOOGLE_CUDA

}  // namespace tf_gba
