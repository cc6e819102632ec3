// Kernels of the expandable hash embedding table (hash_table.h): create, training and find-only
// lookups, the fused SGD / Adagrad / LazyAdam apply, size, eviction, counters, export and
// import (whole, or the delta of an incremental checkpoint), and the shard of a key. CPU only: the table is a parameter server's state, read and
// written by the host.
#include <algorithm>
#include <cmath>
#include <vector>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "custom_ops/common/kernel_util.h"
#include "custom_ops/common/resource_util.h"
#include "custom_ops/gba/cc/kernels/hash_table.h"

namespace tf_gba {
namespace {
void ReleaseFreedMemory();
}  // namespace

void HashTable::Apply(const int64_t* keys, const float* grads, int64_t n,
                      const HashApplyArgs& a) {
  const int64_t dim = config_.dim;
  // Duplicates summed first: one update per distinct key, in the order of first appearance.
  absl::flat_hash_map<int64_t, int64_t> first;
  first.reserve(n);
  std::vector<int64_t> unique_keys;
  std::vector<float> sum;
  for (int64_t i = 0; i < n; ++i) {
    auto ins = first.emplace(keys[i], static_cast<int64_t>(unique_keys.size()));
    const float* g = grads + i * dim;
    if (ins.second) {
      unique_keys.push_back(keys[i]);
      sum.insert(sum.end(), g, g + dim);
    } else {
      float* s = sum.data() + ins.first->second * dim;
      for (int64_t j = 0; j < dim; ++j) s[j] += g[j];
    }
  }
  // Adam's step size with the bias corrections of step t = iteration + 1 (Keras' and LazyAdam's
  // alpha), computed once.
  float alpha = a.lr;
  if (a.optimizer == HashOptimizer::kAdam) {
    const double t = static_cast<double>(a.iteration + 1);
    alpha = static_cast<float>(a.lr * std::sqrt(1.0 - std::pow(a.beta2, t)) /
                               (1.0 - std::pow(a.beta1, t)));
  }
  ::tensorflow::mutex_lock lock(mu_);
  if (a.optimizer != optimizer_ ||
      (a.optimizer == HashOptimizer::kAdagrad && num_rows_ == 0 &&
       a.initial_accumulator != initial_accumulator_)) {
    RelayoutLocked(a.optimizer, a.initial_accumulator);
  } else if (!slot_init_known_) {
    // The first apply after an import of Adagrad rows: new rows start from this optimizer's
    // accumulator, and so do the ones inserted since the import.
    initial_accumulator_ = a.initial_accumulator;
    for (int64_t key : slot_init_pending_) {
      auto it = index_.find(key);
      if (it == index_.end()) continue;  // evicted since
      float* row = RowLocked(it->second);
      std::fill(row + config_.dim, row + row_floats_, initial_accumulator_);
    }
  }
  slot_init_known_ = true;
  slot_init_pending_.clear();
  known_step_ = std::max(known_step_, a.iteration + 1);
  ++sequence_;
  for (size_t u = 0; u < unique_keys.size(); ++u) {
    int64_t r;
    if (config_.drops_missing()) {
      auto it = index_.find(unique_keys[u]);
      if (it == index_.end()) {
        ++filtered_;
        continue;
      }
      r = it->second;
    } else {
      r = FindOrInsertLocked(unique_keys[u]);
    }
    MetaLocked(r).changed = sequence_;
    float* row = RowLocked(r);
    const float* g = sum.data() + u * dim;
    switch (a.optimizer) {
      case HashOptimizer::kSgd:
        for (int64_t j = 0; j < dim; ++j) row[j] -= a.lr * g[j];
        break;
      case HashOptimizer::kAdagrad: {
        float* acc = row + dim;
        for (int64_t j = 0; j < dim; ++j) {
          acc[j] += g[j] * g[j];
          row[j] -= a.lr * g[j] / std::sqrt(acc[j] + a.epsilon);
        }
        break;
      }
      case HashOptimizer::kAdam: {
        float* m = row + dim;
        float* v = row + 2 * dim;
        for (int64_t j = 0; j < dim; ++j) {
          m[j] += (g[j] - m[j]) * (1.0f - a.beta1);
          v[j] += (g[j] * g[j] - v[j]) * (1.0f - a.beta2);
          row[j] -= m[j] * alpha / (std::sqrt(v[j]) + a.epsilon);
        }
        break;
      }
    }
  }
}

void HashTable::RelayoutLocked(HashOptimizer optimizer, float initial_accumulator) {
  const int64_t dim = config_.dim, old_floats = row_floats_;
  std::vector<Block> old;
  old.swap(blocks_);
  optimizer_ = optimizer;
  initial_accumulator_ = initial_accumulator;
  row_floats_ = dim * (1 + NumSlots(optimizer));
  const float slot_init = SlotInitLocked();
  for (size_t b = 0; b < old.size(); ++b) {
    Block nb;
    nb.floats.reset(new float[kBlockRows * row_floats_]);
    nb.meta = std::move(old[b].meta);
    const int64_t rows = std::min(kBlockRows, num_rows_ - static_cast<int64_t>(b) * kBlockRows);
    for (int64_t i = 0; i < rows; ++i) {
      const float* from = old[b].floats.get() + i * old_floats;
      float* to = nb.floats.get() + i * row_floats_;
      std::copy(from, from + dim, to);
      std::fill(to + dim, to + row_floats_, slot_init);
      nb.meta[i].changed = sequence_;  // slots restarted: a delta holds the row
    }
    old[b].floats.reset();
    blocks_.push_back(std::move(nb));
  }
}

int64_t HashTable::Evict(int64_t step, Evicted* removed) {
  ::tensorflow::mutex_lock lock(mu_);
  if (step < 0) step = known_step_;
  ++sequence_;
  const int64_t n = num_rows_;
  std::vector<int64_t> keys(n);
  for (const auto& kv : index_) keys[kv.second] = kv.first;
  std::vector<char> drop(n, 0);
  int64_t kept = n;
  if (config_.ttl_steps > 0) {
    for (int64_t r = 0; r < n; ++r) {
      if (step - MetaLocked(r).last_seen > config_.ttl_steps) {
        drop[r] = 1;
        --kept;
      }
    }
    const size_t pending_before = pending_.size();
    absl::erase_if(pending_, [&](const std::pair<const int64_t, Pending>& p) {
      return step - p.second.last_seen > config_.ttl_steps;
    });
    if (pending_.size() < pending_before && pending_.size() * 4 < pending_.capacity()) {
      pending_.rehash(0);  // give the memory back: the index shrinks to fit
    }
  }
  DecayFilterLocked(step);
  if (config_.max_rows > 0 && kept > config_.max_rows) {
    std::vector<int64_t> left;
    left.reserve(kept);
    for (int64_t r = 0; r < n; ++r) {
      if (!drop[r]) left.push_back(r);
    }
    const int64_t excess = kept - config_.max_rows;
    auto first_out = [&](int64_t a, int64_t b) {
      const Meta &ma = MetaLocked(a), &mb = MetaLocked(b);
      if (ma.frequency != mb.frequency) return ma.frequency < mb.frequency;
      if (ma.last_seen != mb.last_seen) return ma.last_seen < mb.last_seen;
      return keys[a] < keys[b];
    };
    std::nth_element(left.begin(), left.begin() + (excess - 1), left.end(), first_out);
    for (int64_t i = 0; i < excess; ++i) drop[left[i]] = 1;
    kept = config_.max_rows;
  }
  if (kept == n) {
    ReleaseFreedMemory();  // the key index's old slots after a growth, the pending counts'
    return 0;
  }
  const int64_t gone = RemoveRowsLocked(drop, keys, /*tombstones=*/true, removed);
  evicted_ += gone;
  ReleaseFreedMemory();
  return gone;
}

int64_t HashTable::RemoveRowsLocked(const std::vector<char>& drop,
                                    const std::vector<int64_t>& keys, bool tombstones,
                                    Evicted* removed) {
  const int64_t n = num_rows_, dim = config_.dim;
  // Compaction in row order: survivors keep their relative order, the freed tail blocks go.
  int64_t w = 0;
  for (int64_t r = 0; r < n; ++r) {
    if (drop[r]) {
      if (tombstones && tracking_) tombstones_[keys[r]] = sequence_;
      if (removed != nullptr) {
        removed->keys.push_back(keys[r]);
        removed->frequency.push_back(MetaLocked(r).frequency);
        const float* row = RowLocked(r);
        removed->values.insert(removed->values.end(), row, row + dim);
      }
      index_.erase(keys[r]);
      continue;
    }
    if (w != r) {
      const float* from = RowLocked(r);
      std::copy(from, from + row_floats_, RowLocked(w));
      MetaLocked(w) = MetaLocked(r);
      index_[keys[r]] = w;
    }
    ++w;
  }
  num_rows_ = w;
  blocks_.resize((w + kBlockRows - 1) >> kBlockShift);
  if (index_.size() * 4 < index_.capacity()) index_.rehash(0);
  return n - w;
}

void HashTable::Export(Snapshot* s, int64_t* num_slots) const {
  ::tensorflow::tf_shared_lock lock(mu_);
  const int64_t n = num_rows_, dim = config_.dim, slots = NumSlots(optimizer_);
  *num_slots = slots;
  s->keys.assign(n, 0);
  s->tags.resize(n);
  s->frequency.resize(n);
  s->last_seen.resize(n);
  s->values.resize(n * dim);
  s->slots.resize(n * slots * dim);
  for (const auto& kv : index_) s->keys[kv.second] = kv.first;
  for (int64_t r = 0; r < n; ++r) {
    const float* row = RowLocked(r);
    std::copy(row, row + dim, s->values.data() + r * dim);
    std::copy(row + dim, row + row_floats_, s->slots.data() + r * slots * dim);
    const Meta& m = MetaLocked(r);
    s->tags[r] = m.last_step;
    s->frequency[r] = m.frequency;
    s->last_seen[r] = m.last_seen;
  }
  s->pending_keys.clear();
  s->pending_counts.clear();
  s->pending_last_seen.clear();
  for (const auto& kv : pending_) {
    s->pending_keys.push_back(kv.first);
    s->pending_counts.push_back(kv.second.count);
    s->pending_last_seen.push_back(kv.second.last_seen);
  }
}

Status HashTable::CheckImportKeys(const Snapshot& s, const std::vector<int64_t>& deleted) const {
  const int64_t n = static_cast<int64_t>(s.keys.size());
  absl::flat_hash_set<int64_t> seen;
  seen.reserve(n + s.pending_keys.size());
  for (int64_t i = 0; i < n; ++i) {
    if (!seen.insert(s.keys[i]).second) {
      return errors::InvalidArgument("keys[", i, "] = ", s.keys[i],
                                     " appears twice in the rows to import into ", DebugString(),
                                     ".");
    }
  }
  for (size_t i = 0; i < deleted.size(); ++i) {
    if (seen.contains(deleted[i])) {
      return errors::InvalidArgument("deleted_keys[", i, "] = ", deleted[i],
                                     " also has a row in the delta to import into ",
                                     DebugString(), ".");
    }
  }
  for (size_t i = 0; i < s.pending_keys.size(); ++i) {
    if (!seen.insert(s.pending_keys[i]).second) {
      return errors::InvalidArgument("pending_keys[", i, "] = ", s.pending_keys[i],
                                     " appears twice, or also has a row, in the rows to import "
                                     "into ", DebugString(), ".");
    }
  }
  return ::tensorflow::OkStatus();
}

Status HashTable::Import(const Snapshot& s, int64_t num_slots) {
  const int64_t n = static_cast<int64_t>(s.keys.size());
  TF_RETURN_IF_ERROR(CheckImportKeys(s, {}));
  if (num_slots < 0 || num_slots > 2) {
    return errors::InvalidArgument("Rows have 0 (SGD), 1 (Adagrad) or 2 (Adam) slots, got ",
                                   num_slots, ".");
  }
  absl::flat_hash_map<int64_t, int64_t> index;
  index.reserve(n);
  for (int64_t i = 0; i < n; ++i) index.emplace(s.keys[i], i);
  absl::flat_hash_map<int64_t, Pending> pending;
  pending.reserve(s.pending_keys.size());
  for (size_t i = 0; i < s.pending_keys.size(); ++i) {
    pending.emplace(s.pending_keys[i], Pending{s.pending_counts[i], s.pending_last_seen[i]});
  }
  const int64_t dim = config_.dim, slots = num_slots;
  ::tensorflow::mutex_lock lock(mu_);
  ++sequence_;
  tombstones_.clear();  // the content is the snapshot's: no removal before it matters
  index_.swap(index);
  pending_.swap(pending);
  blocks_.clear();
  num_rows_ = 0;
  optimizer_ = static_cast<HashOptimizer>(num_slots);
  row_floats_ = dim * (1 + slots);
  MarkSlotInitUnknownLocked();
  known_step_ = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = AppendLocked(s.keys[i]);
    float* row = RowLocked(r);
    std::copy(s.values.data() + i * dim, s.values.data() + (i + 1) * dim, row);
    std::copy(s.slots.data() + i * slots * dim, s.slots.data() + (i + 1) * slots * dim,
              row + dim);
    MetaLocked(r) = Meta{s.tags[i], s.frequency[i], s.last_seen[i], sequence_};
    known_step_ = std::max({known_step_, s.tags[i] + 1, s.last_seen[i]});
  }
  return ::tensorflow::OkStatus();
}

void HashTable::ExportDelta(int64_t since, Snapshot* s, std::vector<int64_t>* deleted,
                            int64_t* num_slots, int64_t* sequence) const {
  ::tensorflow::tf_shared_lock lock(mu_);
  const int64_t dim = config_.dim, slots = NumSlots(optimizer_);
  *num_slots = slots;
  *sequence = sequence_;
  for (const auto& kv : index_) {
    const int64_t r = kv.second;
    const Meta& m = MetaLocked(r);
    if (m.changed <= since) continue;
    s->keys.push_back(kv.first);
    const float* row = RowLocked(r);
    s->values.insert(s->values.end(), row, row + dim);
    s->slots.insert(s->slots.end(), row + dim, row + row_floats_);
    s->tags.push_back(m.last_step);
    s->frequency.push_back(m.frequency);
    s->last_seen.push_back(m.last_seen);
  }
  for (const auto& kv : pending_) {
    s->pending_keys.push_back(kv.first);
    s->pending_counts.push_back(kv.second.count);
    s->pending_last_seen.push_back(kv.second.last_seen);
  }
  if (since < 0) return;  // every row: nothing before it to remove
  for (const auto& t : tombstones_) {
    if (t.second > since) deleted->push_back(t.first);
  }
}

Status HashTable::ImportDelta(const Snapshot& s, const std::vector<int64_t>& deleted,
                              int64_t num_slots) {
  TF_RETURN_IF_ERROR(CheckImportKeys(s, deleted));
  const int64_t n = static_cast<int64_t>(s.keys.size()), dim = config_.dim;
  ::tensorflow::mutex_lock lock(mu_);
  if (num_rows_ == 0) {
    if (num_slots < 0 || num_slots > 2) {
      return errors::InvalidArgument("Rows have 0 (SGD), 1 (Adagrad) or 2 (Adam) slots, got ",
                                     num_slots, ".");
    }
    blocks_.clear();
    optimizer_ = static_cast<HashOptimizer>(num_slots);
    row_floats_ = dim * (1 + num_slots);
    MarkSlotInitUnknownLocked();
  } else if (n > 0 && num_slots != NumSlots(optimizer_)) {
    return errors::InvalidArgument(
        "The delta's rows have ", num_slots, " slots, but the rows of ", DebugString(), " have ",
        NumSlots(optimizer_), ": restore the full checkpoint the delta follows first.");
  }
  ++sequence_;
  for (int64_t i = 0; i < n; ++i) {
    auto it = index_.find(s.keys[i]);
    int64_t r;
    if (it != index_.end()) {
      r = it->second;
    } else {
      r = AppendLocked(s.keys[i]);
      index_.emplace(s.keys[i], r);
    }
    float* row = RowLocked(r);
    std::copy(s.values.data() + i * dim, s.values.data() + (i + 1) * dim, row);
    std::copy(s.slots.data() + i * num_slots * dim, s.slots.data() + (i + 1) * num_slots * dim,
              row + dim);
    MetaLocked(r) = Meta{s.tags[i], s.frequency[i], s.last_seen[i], sequence_};
    known_step_ = std::max({known_step_, s.tags[i] + 1, s.last_seen[i]});
  }
  if (!deleted.empty()) {
    std::vector<int64_t> keys(num_rows_);
    for (const auto& kv : index_) keys[kv.second] = kv.first;
    std::vector<char> drop(num_rows_, 0);
    int64_t any = 0;
    for (int64_t key : deleted) {
      auto it = index_.find(key);
      if (it != index_.end()) {
        drop[it->second] = 1;
        ++any;
      }
    }
    if (any > 0) RemoveRowsLocked(drop, keys, /*tombstones=*/false, nullptr);
  }
  pending_.clear();
  for (size_t i = 0; i < s.pending_keys.size(); ++i) {
    pending_.emplace(s.pending_keys[i], Pending{s.pending_counts[i], s.pending_last_seen[i]});
  }
  return ::tensorflow::OkStatus();
}

namespace {
void ReleaseFreedMemory() {
#ifdef __GLIBC__
  // Freed blocks, a grown index's old slots and the eviction's own vectors go back to the
  // system instead of staying in the allocator's free lists: a table at its budget then holds,
  // as resident memory, what its rows take (benchmarks/hash_embedding.py --budget_stream).
  malloc_trim(0);
#endif
}
}  // namespace

Status HashTable::ImportFilter(const uint8_t* cells, int64_t n) {
  ::tensorflow::mutex_lock lock(mu_);
  if (static_cast<int64_t>(filter_.size()) != n) {
    return errors::InvalidArgument(
        "The admission filter to import has ", n, " cells, but ", DebugString(), " has ",
        filter_.size(), " (admission_filter_cells; 0 without a filter): restore with the value "
        "the checkpoint was written with.");
  }
  std::copy(cells, cells + n, filter_.begin());
  filter_decayed_at_ = known_step_;
  return ::tensorflow::OkStatus();
}

namespace {

Status ParseTableConfig(OpKernelConstruction* ctx, HashTableConfig* c) {
  std::string init;
  float a, b;
  TF_RETURN_IF_ERROR(ctx->GetAttr("dim", &c->dim));
  TF_RETURN_IF_ERROR(ctx->GetAttr("seed", &c->seed));
  TF_RETURN_IF_ERROR(ctx->GetAttr("initializer", &init));
  TF_RETURN_IF_ERROR(ctx->GetAttr("init_a", &a));
  TF_RETURN_IF_ERROR(ctx->GetAttr("init_b", &b));
  TF_RETURN_IF_ERROR(ctx->GetAttr("min_frequency", &c->min_frequency));
  TF_RETURN_IF_ERROR(ctx->GetAttr("ttl_steps", &c->ttl_steps));
  TF_RETURN_IF_ERROR(ctx->GetAttr("max_rows", &c->max_rows));
  TF_RETURN_IF_ERROR(ctx->GetAttr("filter_cells", &c->filter_cells));
  if (c->filter_cells < 0) {
    return errors::InvalidArgument("filter_cells must be >= 0 (0: exact admission counts), got ",
                                   c->filter_cells, ".");
  }
  if (c->min_frequency < 0 || c->ttl_steps < 0 || c->max_rows < 0) {
    return errors::InvalidArgument("min_frequency, ttl_steps and max_rows must be >= 0 (0: off), "
                                   "got ", c->min_frequency, ", ", c->ttl_steps, ", ",
                                   c->max_rows, ".");
  }
  if (c->dim < 1) {
    return errors::InvalidArgument("dim (the embedding width) must be >= 1, got ", c->dim, ".");
  }
  // initializer and optimizer list their choices in the op's attributes: TF checked them.
  c->init = init == "normal" ? HashTableConfig::kNormal
                             : (init == "zeros" ? HashTableConfig::kZeros
                                                : HashTableConfig::kUniform);
  c->init_a = a;
  c->init_b = b;
  if (c->init == HashTableConfig::kNormal && !(b >= 0.0f)) {
    return errors::InvalidArgument("A normal initializer's stddev (init_b) must be >= 0, got ", b,
                                   ".");
  }
  return ::tensorflow::OkStatus();
}

class HashTableCreateOp : public OpKernel {
 public:
  explicit HashTableCreateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseTableConfig(ctx, &config_));
    OP_REQUIRES_OK(ctx, name_.FromAttrs(ctx));
  }
  void Compute(OpKernelContext* ctx) override {
    CreateResourceAndOutputHandle<HashTable>(ctx, name_, [this](HashTable** out) {
      *out = new HashTable(config_);
      return ::tensorflow::OkStatus();
    });
  }

 private:
  HashTableConfig config_;
  ResourceName name_;
};

// The int64 vector of keys at input `index`.
Status ReadKeys(OpKernelContext* ctx, int index, const char* what, const Tensor** keys) {
  *keys = &ctx->input(index);
  if (!::tensorflow::TensorShapeUtils::IsVector((*keys)->shape())) {
    return errors::InvalidArgument(what, " must be a vector of int64 keys, got shape ",
                                   (*keys)->shape().DebugString(),
                                   " (flatten the ids first; the layer does).");
  }
  return ::tensorflow::OkStatus();
}

// Rows [len(keys), dim] of `what` at input `index`, checked against the table.
Status ReadRows(OpKernelContext* ctx, int index, const char* what, int64_t n,
                const HashTable& table, int64_t width, const Tensor** rows) {
  *rows = &ctx->input(index);
  TensorShape expected({n});
  if (width > 1) expected.AddDim(width);
  expected.AddDim(table.dim());
  if ((*rows)->shape() != expected) {
    return errors::InvalidArgument(what, " must have shape ", expected.DebugString(),
                                   " (len(keys), ", width > 1 ? "num_slots, " : "",
                                   "dim) for ", table.DebugString(), ", got ",
                                   (*rows)->shape().DebugString(), ".");
  }
  return ::tensorflow::OkStatus();
}

// Training (insert = true) or find-only lookup.
template <bool kInsert>
class HashTableLookupOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    const Tensor* keys;
    OP_REQUIRES_OK(ctx, ReadKeys(ctx, 1, "keys", &keys));
    const int64_t n = keys->dim_size(0);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, table->dim()}), &out));
    if (kInsert) {
      int64_t step;
      OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 2, "global_step", &step));
      table->LookupOrInsert(keys->vec<int64_t>().data(), n, step, out->flat<float>().data());
    } else {
      table->Find(keys->vec<int64_t>().data(), n, out->flat<float>().data());
    }
  }
};

class HashTableApplyOp : public OpKernel {
 public:
  explicit HashTableApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string optimizer;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("optimizer", &optimizer));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initial_accumulator", &initial_accumulator_));
    optimizer_ = optimizer == "adam" ? HashOptimizer::kAdam
                                     : (optimizer == "adagrad" ? HashOptimizer::kAdagrad
                                                               : HashOptimizer::kSgd);
    OP_REQUIRES(ctx, initial_accumulator_ >= 0.0f,
                errors::InvalidArgument("initial_accumulator must be >= 0, got ",
                                        initial_accumulator_, "."));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    const Tensor *keys, *grads;
    OP_REQUIRES_OK(ctx, ReadKeys(ctx, 1, "keys", &keys));
    const int64_t n = keys->dim_size(0);
    OP_REQUIRES_OK(ctx, ReadRows(ctx, 2, "gradients", n, *table, 1, &grads));
    HashApplyArgs a;
    a.optimizer = optimizer_;
    a.initial_accumulator = initial_accumulator_;
    const char* names[] = {"learning_rate", "beta_1", "beta_2", "epsilon"};
    float* dests[] = {&a.lr, &a.beta1, &a.beta2, &a.epsilon};
    for (int i = 0; i < 4; ++i) {
      const Tensor& t = ctx->input(3 + i);
      OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(t.shape()),
                  errors::InvalidArgument(names[i], " must be a scalar, got shape ",
                                          t.shape().DebugString(), "."));
      *dests[i] = t.scalar<float>()();
    }
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 7, "iteration", &a.iteration));
    OP_REQUIRES(ctx, a.iteration >= 0,
                errors::InvalidArgument("iteration must be >= 0, got ", a.iteration, "."));
    table->Apply(keys->vec<int64_t>().data(), grads->flat<float>().data(), n, a);
  }

 private:
  HashOptimizer optimizer_;
  float initial_accumulator_;
};

class HashTableSizeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    Tensor *size, *bytes;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &size));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &bytes));
    size->scalar<int64_t>()() = table->Size();
    bytes->scalar<int64_t>()() = table->AllocatedBytes();
  }
};

template <typename T>
Status CopyOut(OpKernelContext* ctx, int index, TensorShape shape, const std::vector<T>& from) {
  Tensor* out;
  TF_RETURN_IF_ERROR(ctx->allocate_output(index, shape, &out));
  std::copy(from.begin(), from.end(), out->flat<T>().data());
  return ::tensorflow::OkStatus();
}

class HashTableExportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    HashTable::Snapshot s;
    int64_t num_slots;
    table->Export(&s, &num_slots);
    const int64_t n = static_cast<int64_t>(s.keys.size());
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 0, TensorShape({n}), s.keys));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 1, TensorShape({n, table->dim()}), s.values));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 2, TensorShape({n, num_slots, table->dim()}), s.slots));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 3, TensorShape({n}), s.tags));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 4, TensorShape({n}), s.frequency));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 5, TensorShape({n}), s.last_seen));
    const int64_t np = static_cast<int64_t>(s.pending_keys.size());
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 6, TensorShape({np}), s.pending_keys));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 7, TensorShape({np}), s.pending_counts));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 8, TensorShape({np}), s.pending_last_seen));
  }
};

class HashTableEvictOp : public OpKernel {
 public:
  explicit HashTableEvictOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("with_rows", &with_rows_));
  }
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    int64_t step;
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 1, "global_step", &step));
    HashTable::Evicted removed;
    // Without the rows, an eviction of many rows allocates nothing for them.
    table->Evict(step, with_rows_ ? &removed : nullptr);
    const int64_t n = static_cast<int64_t>(removed.keys.size());
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 0, TensorShape({n}), removed.keys));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 1, TensorShape({n, table->dim()}), removed.values));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 2, TensorShape({n}), removed.frequency));
  }

 private:
  bool with_rows_;
};

class HashTableCountersOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    const HashTable::Counters c = table->GetCounters();
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({5}), &out));
    auto o = out->vec<int64_t>();
    o(0) = c.rows;
    o(1) = c.pending;
    o(2) = c.admitted;
    o(3) = c.filtered;
    o(4) = c.evicted;
  }
};

// The rows and pending counts of an import, inputs first..first+8 (keys, values, slots, tags,
// frequency, last_seen, pending_keys, pending_counts, pending_last_seen), checked against the
// table; *num_slots from the slots' shape.
Status ReadSnapshot(OpKernelContext* ctx, int first, const HashTable& table,
                    HashTable::Snapshot* s, int64_t* num_slots) {
  const Tensor *keys, *values;
  TF_RETURN_IF_ERROR(ReadKeys(ctx, first, "keys", &keys));
  const int64_t n = keys->dim_size(0);
  TF_RETURN_IF_ERROR(ReadRows(ctx, first + 1, "values", n, table, 1, &values));
  // Slots: [n, num_slots, dim]; SGD's [n, 0, dim] is empty.
  const Tensor& slots = ctx->input(first + 2);
  if (!(slots.dims() == 3 && slots.dim_size(0) == n && slots.dim_size(1) <= 2 &&
        slots.dim_size(2) == table.dim())) {
    return errors::InvalidArgument("slots must have shape [", n, ", num_slots <= 2, ",
                                   table.dim(), "] (len(keys), num_slots, dim) for ",
                                   table.DebugString(), ", got ", slots.shape().DebugString(),
                                   ".");
  }
  *num_slots = slots.dim_size(1);
  const char* names[] = {"tags", "frequency", "last_seen"};
  for (int i = 0; i < 3; ++i) {
    const Tensor& t = ctx->input(first + 3 + i);
    if (t.shape() != TensorShape({n})) {
      return errors::InvalidArgument(names[i], " must have shape [", n, "] (len(keys)), got ",
                                     t.shape().DebugString(), ".");
    }
  }
  auto vec = [](const Tensor& t) {
    auto v = t.flat<int64_t>();
    return std::vector<int64_t>(v.data(), v.data() + v.size());
  };
  s->keys = vec(*keys);
  s->tags = vec(ctx->input(first + 3));
  s->frequency = vec(ctx->input(first + 4));
  s->last_seen = vec(ctx->input(first + 5));
  for (int64_t i = 0; i < n; ++i) {
    if (s->tags[i] < -1) {
      return errors::InvalidArgument("tags[", i, "] = ", s->tags[i], " must be >= -1.");
    }
  }
  const Tensor* pending_keys;
  TF_RETURN_IF_ERROR(ReadKeys(ctx, first + 6, "pending_keys", &pending_keys));
  const int64_t np = pending_keys->dim_size(0);
  const char* pending_names[] = {"pending_counts", "pending_last_seen"};
  for (int i = 0; i < 2; ++i) {
    const Tensor& t = ctx->input(first + 7 + i);
    if (t.shape() != TensorShape({np})) {
      return errors::InvalidArgument(pending_names[i], " must have shape [", np,
                                     "] (len(pending_keys)), got ", t.shape().DebugString(), ".");
    }
  }
  s->pending_keys = vec(*pending_keys);
  s->pending_counts = vec(ctx->input(first + 7));
  s->pending_last_seen = vec(ctx->input(first + 8));
  for (int64_t i = 0; i < np; ++i) {
    if (s->pending_counts[i] < 1) {
      return errors::InvalidArgument("pending_counts[", i, "] = ", s->pending_counts[i],
                                     " must be >= 1.");
    }
  }
  auto fv = values->flat<float>();
  s->values.assign(fv.data(), fv.data() + fv.size());
  auto sv = slots.flat<float>();
  s->slots.assign(sv.data(), sv.data() + sv.size());
  return ::tensorflow::OkStatus();
}

class HashTableImportOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    HashTable::Snapshot s;
    int64_t num_slots;
    OP_REQUIRES_OK(ctx, ReadSnapshot(ctx, 1, *table, &s, &num_slots));
    OP_REQUIRES_OK(ctx, table->Import(s, num_slots));
  }
};

class HashTableExportDeltaOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    int64_t since, num_slots, sequence;
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 1, "since", &since));
    HashTable::Snapshot s;
    std::vector<int64_t> deleted;
    table->ExportDelta(since, &s, &deleted, &num_slots, &sequence);
    const int64_t n = static_cast<int64_t>(s.keys.size()), dim = table->dim();
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 0, TensorShape({n}), s.keys));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 1, TensorShape({n, dim}), s.values));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 2, TensorShape({n, num_slots, dim}), s.slots));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 3, TensorShape({n}), s.tags));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 4, TensorShape({n}), s.frequency));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 5, TensorShape({n}), s.last_seen));
    const int64_t np = static_cast<int64_t>(s.pending_keys.size());
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 6, TensorShape({np}), s.pending_keys));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 7, TensorShape({np}), s.pending_counts));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 8, TensorShape({np}), s.pending_last_seen));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 9, TensorShape({static_cast<int64_t>(deleted.size())}),
                                deleted));
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 10, TensorShape({}), std::vector<int64_t>{sequence}));
  }
};

class HashTableImportDeltaOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    const Tensor& replace = ctx->input(1);
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(replace.shape()),
                errors::InvalidArgument("replace must be a scalar bool, got shape ",
                                        replace.shape().DebugString(), "."));
    HashTable::Snapshot s;
    int64_t num_slots;
    OP_REQUIRES_OK(ctx, ReadSnapshot(ctx, 2, *table, &s, &num_slots));
    const Tensor* deleted;
    OP_REQUIRES_OK(ctx, ReadKeys(ctx, 11, "deleted_keys", &deleted));
    auto d = deleted->vec<int64_t>();
    const std::vector<int64_t> deleted_keys(d.data(), d.data() + d.size());
    if (replace.scalar<bool>()()) {
      OP_REQUIRES(ctx, deleted_keys.empty(),
                  errors::InvalidArgument("A full import (replace = true) takes no deleted_keys, "
                                          "got ", deleted_keys.size(), "."));
      OP_REQUIRES_OK(ctx, table->Import(s, num_slots));
    } else {
      OP_REQUIRES_OK(ctx, table->ImportDelta(s, deleted_keys, num_slots));
    }
  }
};

class HashTableTrackChangesOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    int64_t prune_through;
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 1, "prune_through", &prune_through));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = table->TrackChanges(prune_through);
  }
};

class HashTableExportFilterOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    const std::vector<uint8_t> cells = table->ExportFilter();
    OP_REQUIRES_OK(ctx, CopyOut(ctx, 0, TensorShape({static_cast<int64_t>(cells.size())}), cells));
  }
};

class HashTableImportFilterOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<HashTable> table;
    OP_REQUIRES_OK(ctx, LookupScalarHandle(ctx, 0, "hash table", &table));
    const Tensor& cells = ctx->input(1);
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsVector(cells.shape()),
                errors::InvalidArgument("cells must be a vector, got shape ",
                                        cells.shape().DebugString(), "."));
    OP_REQUIRES_OK(ctx, table->ImportFilter(cells.flat<uint8_t>().data(), cells.dim_size(0)));
  }
};

// shard = mix64(key) mod num_shards, as int32.
class HashKeyShardOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    int64_t num_shards;
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 1, "num_shards", &num_shards));
    OP_REQUIRES(ctx, num_shards >= 1 && num_shards < (int64_t{1} << 31),
                errors::InvalidArgument("num_shards must be in [1, 2^31), got ", num_shards, "."));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &out));
    auto k = keys.flat<int64_t>();
    auto o = out->flat<int32_t>();
    for (int64_t i = 0; i < k.size(); ++i) {
      o(i) = static_cast<int32_t>(Mix64(static_cast<uint64_t>(k(i))) %
                                  static_cast<uint64_t>(num_shards));
    }
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("GBA>HashTableCreate").Device(::tensorflow::DEVICE_CPU),
                        HashTableCreateOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableLookup").Device(::tensorflow::DEVICE_CPU),
                        HashTableLookupOp<true>);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableFind").Device(::tensorflow::DEVICE_CPU),
                        HashTableLookupOp<false>);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableApply").Device(::tensorflow::DEVICE_CPU),
                        HashTableApplyOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableSize").Device(::tensorflow::DEVICE_CPU),
                        HashTableSizeOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableExport").Device(::tensorflow::DEVICE_CPU),
                        HashTableExportOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableImport").Device(::tensorflow::DEVICE_CPU),
                        HashTableImportOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableExportDelta").Device(::tensorflow::DEVICE_CPU),
                        HashTableExportDeltaOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableImportDelta").Device(::tensorflow::DEVICE_CPU),
                        HashTableImportDeltaOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableTrackChanges").Device(::tensorflow::DEVICE_CPU),
                        HashTableTrackChangesOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableEvict").Device(::tensorflow::DEVICE_CPU),
                        HashTableEvictOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableCounters").Device(::tensorflow::DEVICE_CPU),
                        HashTableCountersOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableExportFilter").Device(::tensorflow::DEVICE_CPU),
                        HashTableExportFilterOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashTableImportFilter").Device(::tensorflow::DEVICE_CPU),
                        HashTableImportFilterOp);
REGISTER_KERNEL_BUILDER(Name("GBA>HashKeyShard").Device(::tensorflow::DEVICE_CPU),
                        HashKeyShardOp);

}  // namespace tf_gba
