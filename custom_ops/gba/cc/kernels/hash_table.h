// Expandable hash embedding table (SPEC section 6): one resource per parameter-server shard,
// int64 key -> one row holding the embedding [dim], the inner optimizer's slots for that row, GBA's
// `last_step` tag, the key's training-lookup count and the global step of its latest training
// lookup. A row's first value depends on (seed, key) only, so every process, shard count and
// arrival order gives a key the same row.
//
// The slots follow the optimizer that applies to the table: none until the first apply (or an
// import) says which, then SGD 0, Adagrad 1, Adam 2 per row. The layer creates the table before
// the model is compiled, so the optimizer cannot be an attribute of the creating op; an apply with
// another optimizer than the rows hold re-lays them out once (slots restart from their initial
// values).
//
// Admission and eviction (optional, SPEC section 6): with min_frequency = k > 1 a key gets a row
// only at its k-th training lookup; until then an exact pending count (and the step it was last
// seen) is kept per key, lookups return the zero row and gradients of the key are dropped and
// counted as filtered. With filter_cells = C > 0 the counts live instead in a counting Bloom
// filter of C one-byte cells (kFilterHashes cells per key, conservative update, saturating at 255):
// fixed memory whatever the stream, at the price of false positives that admit a key early. Its
// estimate of a key's count is the minimum of its cells, never below the true count. An eviction
// halves every cell (the filter's way to forget keys not seen lately) when more than half of
// them are in use, or, with ttl_steps, when the last halving is ttl_steps or more steps back:
// false positives stay rare (a key's three cells all in use) and counts of keys seen once go.
// Evict() removes rows not seen for more than ttl_steps global steps, then,
// while more than max_rows remain, the least frequent (ties: oldest last_seen, then smallest key),
// compacting the survivors in their order so that whole blocks are freed. With any of the three
// on, an apply or tag write for a key without a row drops it (counted as filtered) instead of
// inserting the row: the row was evicted since the lookup, or never admitted.
//
// Rows live in fixed-size blocks (never moved once written, no doubling of a contiguous array
// when the table grows); the key -> row-number index is an absl::flat_hash_map. All state is
// private and guarded by one mutex: lookups that insert and applies take it exclusively, find-only
// lookups, exports and tag reads share it.
//
// Incremental checkpoints: every call that changes rows (a training lookup, an apply, a tag
// write, an eviction, an import) takes the next number of the table's write sequence, and each
// row keeps the number of its latest change. ExportDelta(since) returns the rows changed after
// `since`, the keys removed after it and the current number, and changes nothing: an export that
// is never written loses nothing, the next one starts from the same `since`. Removed keys are
// kept (as tombstones: key -> number) only once TrackChanges has been called, and TrackChanges
// drops those at or below the number of the last full checkpoint written, so they never outgrow
// the keys evicted between two full checkpoints.
#ifndef TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_HASH_TABLE_H_
#define TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_HASH_TABLE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "custom_ops/common/kernel_util.h"

namespace tf_gba {

// splitmix64's finaliser: a bijective 64-bit mixer. Shards (mix64(key) mod P) and initial rows
// are both derived from it, so sequential keys spread evenly.
inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;  // splitmix64's increment

// The i-th (i >= 1) uniform in [0, 1) of the counter-based stream of (seed, key): 53 bits of
// Mix64(base + i * gamma), base = Mix64(key + Mix64(seed)). No state: any process computes it.
inline double KeyUniform(uint64_t base, uint64_t i) {
  return static_cast<double>(Mix64(base + i * kGoldenGamma) >> 11) * 0x1.0p-53;
}

inline uint64_t KeyStreamBase(int64_t seed, int64_t key) {
  return Mix64(static_cast<uint64_t>(key) + Mix64(static_cast<uint64_t>(seed)));
}

enum class HashOptimizer { kSgd = 0, kAdagrad = 1, kAdam = 2 };

inline int64_t NumSlots(HashOptimizer o) { return static_cast<int64_t>(o); }

struct HashTableConfig {
  enum Init { kUniform, kNormal, kZeros };
  int64_t dim = 0;
  int64_t seed = 0;
  Init init = kUniform;
  double init_a = -0.05;  // uniform: minval; normal: mean
  double init_b = 0.05;   // uniform: maxval; normal: stddev
  int64_t min_frequency = 0;  // <= 1: every training lookup inserts
  int64_t ttl_steps = 0;      // 0: no time-to-live
  int64_t max_rows = 0;       // 0: no budget
  int64_t filter_cells = 0;   // admission counts: 0 exact per key, else a counting Bloom filter

  // Whether admission counts live in the counting Bloom filter.
  bool uses_filter() const { return min_frequency > 1 && filter_cells > 0; }

  // Whether keys without a row are dropped, not inserted, by applies and tag writes.
  bool drops_missing() const { return min_frequency > 1 || ttl_steps > 0 || max_rows > 0; }

  // Writes key's initial embedding (dim values). Uniform: a + (b - a) * u_j with u_j the
  // (j+1)-th uniform; normal: Box-Muller on the uniforms 2j+1 and 2j+2, a + b * z_j.
  void InitialRow(int64_t key, float* out) const {
    if (init == kZeros) {
      std::fill(out, out + dim, 0.0f);
      return;
    }
    const uint64_t base = KeyStreamBase(seed, key);
    for (int64_t j = 0; j < dim; ++j) {
      if (init == kUniform) {
        out[j] = static_cast<float>(init_a + (init_b - init_a) * KeyUniform(base, j + 1));
      } else {
        const double u1 = KeyUniform(base, 2 * j + 1), u2 = KeyUniform(base, 2 * j + 2);
        const double z = std::sqrt(-2.0 * std::log1p(-u1)) * std::cos(2.0 * M_PI * u2);
        out[j] = static_cast<float>(init_a + init_b * z);
      }
    }
  }
};

// The optimizer and scalars of one fused apply.
struct HashApplyArgs {
  HashOptimizer optimizer = HashOptimizer::kSgd;
  float initial_accumulator = 0.1f;  // Adagrad's accumulator starts here (Keras' default)
  float lr = 0.0f;
  float beta1 = 0.9f, beta2 = 0.999f;
  float epsilon = 1e-7f;
  int64_t iteration = 0;  // the optimizer's `iterations` before this step (Adam: t = iteration+1)
};

// Cells of a key in a counting Bloom filter of `cells` cells: kFilterHashes indices from the
// key's own mixed stream (independent of the shard and of the row's initial value).
constexpr int kFilterHashes = 3;
constexpr uint64_t kFilterSalt = 0xA0761D6478BD642FULL;

inline void FilterCells(int64_t key, int64_t cells, int64_t out[kFilterHashes]) {
  const uint64_t h = Mix64(static_cast<uint64_t>(key) ^ kFilterSalt);
  for (int j = 0; j < kFilterHashes; ++j) {
    out[j] = static_cast<int64_t>(Mix64(h + static_cast<uint64_t>(j + 1) * kGoldenGamma) %
                                  static_cast<uint64_t>(cells));
  }
}

class HashTable : public ::tensorflow::ResourceBase {
 public:
  explicit HashTable(const HashTableConfig& config) : config_(config), row_floats_(config.dim) {
    if (config.uses_filter()) filter_.assign(config.filter_cells, 0);
  }

  std::string DebugString() const override {
    return ::tensorflow::strings::StrCat("GBA HashTable(dim=", config_.dim, ")");
  }

  // Immutable after construction: readable without the lock.
  const HashTableConfig& config() const { return config_; }
  int64_t dim() const { return config_.dim; }
  int64_t num_slots() const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    return NumSlots(optimizer_);
  }

  // Training lookup: find-or-insert every key (insert: initial value, zero slots or Adagrad's
  // initial accumulator, tag -1, frequency 0), then frequency += 1 and last_seen = step, or,
  // with step < 0, the global step as far as this table knows it (one past the iteration of its
  // latest apply). out: [n, dim].
  // With admission on, a key without a row counts the lookup in its pending count and gets the
  // zero row until the count reaches min_frequency; the row it then gets starts with that count
  // as its frequency.
  void LookupOrInsert(const int64_t* keys, int64_t n, int64_t step, float* out)
      TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    if (step < 0) step = known_step_;
    ++sequence_;
    for (int64_t i = 0; i < n; ++i) {
      auto it = index_.find(keys[i]);
      int64_t r;
      if (it != index_.end()) {
        r = it->second;
      } else if (config_.uses_filter()) {
        const int64_t count = FilterAddLocked(keys[i]);
        if (count < config_.min_frequency) {
          std::fill(out + i * config_.dim, out + (i + 1) * config_.dim, 0.0f);
          continue;
        }
        r = InsertLocked(keys[i]);
        MetaLocked(r).frequency = count - 1;  // this lookup adds the last one below
      } else if (config_.min_frequency > 1) {
        auto p = pending_.try_emplace(keys[i], Pending{0, step}).first;
        const int64_t count = ++p->second.count;
        p->second.last_seen = step;
        if (count < config_.min_frequency) {
          std::fill(out + i * config_.dim, out + (i + 1) * config_.dim, 0.0f);
          continue;
        }
        pending_.erase(p);
        r = InsertLocked(keys[i]);
        MetaLocked(r).frequency = count - 1;  // this lookup adds the last one below
      } else {
        r = InsertLocked(keys[i]);
      }
      Meta& m = MetaLocked(r);
      ++m.frequency;
      m.last_seen = step;
      m.changed = sequence_;
      const float* row = RowLocked(r);
      std::copy(row, row + config_.dim, out + i * config_.dim);
    }
  }

  // Evaluation and serving lookup: a missing key gets its initial value (the zero row with
  // admission on); nothing is inserted or counted.
  void Find(const int64_t* keys, int64_t n, float* out) const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = out + i * config_.dim;
      auto it = index_.find(keys[i]);
      if (it == index_.end()) {
        if (config_.min_frequency > 1) {
          std::fill(dst, dst + config_.dim, 0.0f);
        } else {
          config_.InitialRow(keys[i], dst);
        }
      } else {
        const float* row = RowLocked(it->second);
        std::copy(row, row + config_.dim, dst);
      }
    }
  }

  // The fused sparse update of the table's optimizer for rows `keys` (duplicates summed first, as
  // Keras does for IndexedSlices); a key without a row gets one first (initial value). Row-local:
  // no other row or slot changes (Adam is LazyAdam). With admission or eviction on, a key without
  // a row is dropped and counted as filtered instead.
  void Apply(const int64_t* keys, const float* grads, int64_t n, const HashApplyArgs& a)
      TF_LOCKS_EXCLUDED(mu_);

  // last_step of every key (-1 for a key without a row: never updated).
  void GetTags(const int64_t* keys, int64_t n, int64_t* tags) const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    for (int64_t i = 0; i < n; ++i) {
      auto it = index_.find(keys[i]);
      tags[i] = it == index_.end() ? -1 : MetaLocked(it->second).last_step;
    }
  }

  // last_step = step for every key (inserting rows that do not exist yet; with admission or
  // eviction on, skipping them: their gradients are filtered by the apply that follows).
  void SetTags(const int64_t* keys, int64_t n, int64_t step) TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    ++sequence_;
    for (int64_t i = 0; i < n; ++i) {
      if (config_.drops_missing()) {
        auto it = index_.find(keys[i]);
        if (it != index_.end()) {
          Meta& m = MetaLocked(it->second);
          m.last_step = step;
          m.changed = sequence_;
        }
      } else {
        Meta& m = MetaLocked(FindOrInsertLocked(keys[i]));
        m.last_step = step;
        m.changed = sequence_;
      }
    }
  }

  // The rows an eviction removed, in their former row order.
  struct Evicted {
    std::vector<int64_t> keys, frequency;
    std::vector<float> values;  // [n, dim]
  };

  // Removes the rows with step - last_seen > ttl_steps (and forgets pending counts last seen
  // that long ago), then, while more than max_rows remain, the lowest frequency, ties to the
  // oldest last_seen, then to the smallest key. step < 0: the step the table knows. Returns the
  // number of rows removed; `removed` (may be null) receives them.
  int64_t Evict(int64_t step, Evicted* removed) TF_LOCKS_EXCLUDED(mu_);

  // This shard's counters since it was created (an import leaves them as they are).
  struct Counters {
    int64_t rows, pending, admitted, filtered, evicted;
  };
  Counters GetCounters() const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    // With the filter, `pending` is its cells in use (a key without a row holds up to
    // kFilterHashes of them; keys share cells).
    const int64_t pending = config_.uses_filter() ? FilterCellsInUseLocked()
                                                  : static_cast<int64_t>(pending_.size());
    return Counters{num_rows_, pending, admitted_, filtered_, evicted_};
  }

  int64_t Size() const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    return num_rows_;
  }

  // Bytes the table holds: row blocks (value and slots), per-row tags and counters, and the
  // slots and control bytes of the key index, of the pending counts and of the tombstones.
  int64_t AllocatedBytes() const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    const int64_t per_block = kBlockRows * (row_floats_ * sizeof(float) + sizeof(Meta));
    // The last block is counted whole: its unused rows are allocated too.
    const int64_t index = static_cast<int64_t>(index_.capacity()) *
                          (sizeof(std::pair<const int64_t, int64_t>) + 1);
    const int64_t pending = static_cast<int64_t>(pending_.capacity()) *
                            (sizeof(std::pair<const int64_t, Pending>) + 1);
    const int64_t tombstones = static_cast<int64_t>(tombstones_.capacity()) *
                               (sizeof(std::pair<const int64_t, int64_t>) + 1);
    return static_cast<int64_t>(blocks_.size()) * per_block + index + pending + tombstones +
           static_cast<int64_t>(filter_.capacity());
  }

  // The admission filter's cells (empty without one).
  std::vector<uint8_t> ExportFilter() const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    return filter_;
  }

  // Replaces the admission filter's cells; an error when the table has no filter or one of
  // another size.
  Status ImportFilter(const uint8_t* cells, int64_t n) TF_LOCKS_EXCLUDED(mu_);

  struct Snapshot {
    std::vector<int64_t> keys, tags, frequency, last_seen;
    std::vector<float> values, slots;  // [n, dim] and [n, num_slots, dim]
    // Admission: keys without a row yet, their lookup counts and last-seen steps.
    std::vector<int64_t> pending_keys, pending_counts, pending_last_seen;
  };

  // Every row, in row-number order (the order of first insertion); s->num_slots says how many
  // slots each row has.
  void Export(Snapshot* s, int64_t* num_slots) const TF_LOCKS_EXCLUDED(mu_);

  // Replaces the whole content with `s`, whose rows have `num_slots` slots (0: SGD, 1: Adagrad,
  // 2: Adam), the table's layout from now on (checkpoint restore), and its pending counts with
  // them. Returns an error, leaving the table as it was, when a key appears twice.
  Status Import(const Snapshot& s, int64_t num_slots) TF_LOCKS_EXCLUDED(mu_);

  // The rows changed after write number `since` (all rows and no removed keys with since < 0;
  // any order), the pending counts (all of them: they are not numbered), the keys removed after
  // `since` (known once TrackChanges was called) and the current write number. Changes nothing.
  void ExportDelta(int64_t since, Snapshot* s, std::vector<int64_t>* deleted, int64_t* num_slots,
                   int64_t* sequence) const TF_LOCKS_EXCLUDED(mu_);

  // Applies a delta on top of the content: inserts or overwrites the rows of `s` (whose slots
  // must be the table's layout, unless the table is empty), then removes the keys of `deleted`
  // (absent ones are skipped), and replaces the pending counts with those of `s`. Returns an
  // error, leaving the table as it was, when a key appears twice or both in `s` and `deleted`.
  Status ImportDelta(const Snapshot& s, const std::vector<int64_t>& deleted, int64_t num_slots)
      TF_LOCKS_EXCLUDED(mu_);

  // Starts keeping removed keys (if not yet), forgets those removed at or before write number
  // `prune_through` (a full checkpoint of that number was written: no delta needs them) and
  // returns the current write number.
  int64_t TrackChanges(int64_t prune_through) TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    tracking_ = true;
    const size_t before = tombstones_.size();
    absl::erase_if(tombstones_, [&](const std::pair<const int64_t, int64_t>& t) {
      return t.second <= prune_through;
    });
    if (tombstones_.size() < before && tombstones_.size() * 4 < tombstones_.capacity()) {
      tombstones_.rehash(0);
    }
    return sequence_;
  }

 private:
  // Rows per block: 16K rows of dim 64 with Adam's two slots are 12 MiB.
  static constexpr int64_t kBlockShift = 14;
  static constexpr int64_t kBlockRows = int64_t{1} << kBlockShift;

  struct Meta {
    int64_t last_step;
    int64_t frequency;
    int64_t last_seen;
    int64_t changed;  // the write number of the row's latest change
  };
  struct Pending {
    int64_t count;
    int64_t last_seen;
  };
  struct Block {
    std::unique_ptr<float[]> floats;  // kBlockRows rows of row_floats_ values
    std::unique_ptr<Meta[]> meta;
  };

  float* RowLocked(int64_t r) const TF_SHARED_LOCKS_REQUIRED(mu_) {
    return blocks_[r >> kBlockShift].floats.get() + (r & (kBlockRows - 1)) * row_floats_;
  }
  Meta& MetaLocked(int64_t r) const TF_SHARED_LOCKS_REQUIRED(mu_) {
    return blocks_[r >> kBlockShift].meta[r & (kBlockRows - 1)];
  }

  // A new row numbered num_rows_ holding key's initial state.
  int64_t AppendLocked(int64_t key) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t r = num_rows_++;
    if ((r >> kBlockShift) >= static_cast<int64_t>(blocks_.size())) {
      Block b;
      b.floats.reset(new float[kBlockRows * row_floats_]);
      b.meta.reset(new Meta[kBlockRows]);
      blocks_.push_back(std::move(b));
    }
    float* row = RowLocked(r);
    config_.InitialRow(key, row);
    std::fill(row + config_.dim, row + row_floats_, SlotInitLocked());
    MetaLocked(r) = Meta{-1, 0, -1, sequence_};
    return r;
  }

  // Counts one training lookup of a key without a row in the filter (conservative update: only
  // the key's cells at its current minimum grow) and returns the key's estimated count.
  int64_t FilterAddLocked(int64_t key) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int64_t cells[kFilterHashes];
    FilterCells(key, config_.filter_cells, cells);
    uint8_t low = 255;
    for (int64_t c : cells) low = std::min(low, filter_[c]);
    if (low == 255) return 255;
    for (int64_t c : cells) {
      if (filter_[c] == low) filter_[c] = low + 1;
    }
    return low + 1;
  }

  int64_t FilterCellsInUseLocked() const TF_SHARED_LOCKS_REQUIRED(mu_) {
    return static_cast<int64_t>(filter_.size() -
                                std::count(filter_.begin(), filter_.end(), uint8_t{0}));
  }

  // Halves every filter cell when more than half are in use or ttl_steps have passed since the
  // last halving (see the top of this file).
  void DecayFilterLocked(int64_t step) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (filter_.empty()) return;
    const int64_t used = FilterCellsInUseLocked();
    const bool due = config_.ttl_steps > 0 && step - filter_decayed_at_ >= config_.ttl_steps;
    if (!due && 2 * used <= static_cast<int64_t>(filter_.size())) return;
    for (uint8_t& c : filter_) c >>= 1;
    filter_decayed_at_ = step;
  }

  // After an import: an Adagrad table's initial accumulator is the next apply's.
  void MarkSlotInitUnknownLocked() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    slot_init_known_ = optimizer_ != HashOptimizer::kAdagrad;
    slot_init_pending_.clear();
  }

  float SlotInitLocked() const TF_SHARED_LOCKS_REQUIRED(mu_) {
    return optimizer_ == HashOptimizer::kAdagrad ? initial_accumulator_ : 0.0f;
  }

  // Gives every row the slots of `optimizer` (values kept, slots at their initial values).
  void RelayoutLocked(HashOptimizer optimizer, float initial_accumulator)
      TF_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A new indexed row for key (not in the index), counted as admitted.
  int64_t InsertLocked(int64_t key) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t r = AppendLocked(key);
    index_.emplace(key, r);
    if (!slot_init_known_) slot_init_pending_.push_back(key);
    if (tracking_) tombstones_.erase(key);  // back again: a delta holds its row, not a removal
    ++admitted_;
    return r;
  }

  // Removes the rows with drop[r] set (keys[r]: row r's key), compacting the survivors in their
  // order and freeing the tail blocks; `removed` (may be null) receives the rows removed, and
  // the tombstones (when tracking) their keys. Returns the number removed.
  int64_t RemoveRowsLocked(const std::vector<char>& drop, const std::vector<int64_t>& keys,
                           bool tombstones, Evicted* removed) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Checks the keys and pending keys of a snapshot to import: each at most once, none also in
  // `deleted`, pending keys without rows.
  Status CheckImportKeys(const Snapshot& s, const std::vector<int64_t>& deleted) const;

  int64_t FindOrInsertLocked(int64_t key) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = index_.find(key);
    if (it != index_.end()) return it->second;
    return InsertLocked(key);
  }

  const HashTableConfig config_;
  mutable ::tensorflow::mutex mu_;
  HashOptimizer optimizer_ TF_GUARDED_BY(mu_) = HashOptimizer::kSgd;
  float initial_accumulator_ TF_GUARDED_BY(mu_) = 0.0f;
  // Imported Adagrad rows carry their accumulators, but not the value a new row's starts at
  // (the optimizer's, known at the next apply): until then it is unknown, and the keys inserted
  // meanwhile get theirs at that apply (see Apply).
  bool slot_init_known_ TF_GUARDED_BY(mu_) = true;
  std::vector<int64_t> slot_init_pending_ TF_GUARDED_BY(mu_);
  int64_t row_floats_ TF_GUARDED_BY(mu_);  // dim * (1 + slots): the value, then each slot
  absl::flat_hash_map<int64_t, int64_t> index_ TF_GUARDED_BY(mu_);
  std::vector<Block> blocks_ TF_GUARDED_BY(mu_);
  int64_t num_rows_ TF_GUARDED_BY(mu_) = 0;
  // The global step the table has seen: an apply at iteration k makes it k + 1.
  int64_t known_step_ TF_GUARDED_BY(mu_) = 0;
  // Admission's exact counts of keys without a row (min_frequency > 1 only).
  absl::flat_hash_map<int64_t, Pending> pending_ TF_GUARDED_BY(mu_);
  // Admission's counting Bloom filter (filter_cells > 0 only) and the step it last decayed at.
  std::vector<uint8_t> filter_ TF_GUARDED_BY(mu_);
  int64_t filter_decayed_at_ TF_GUARDED_BY(mu_) = 0;
  int64_t admitted_ TF_GUARDED_BY(mu_) = 0;  // rows created by lookups, applies, tag writes
  int64_t filtered_ TF_GUARDED_BY(mu_) = 0;  // gradient rows dropped: their key had no row
  int64_t evicted_ TF_GUARDED_BY(mu_) = 0;   // rows removed by Evict
  // Incremental checkpoints (see the top of this file): the number of the latest change, whether
  // removed keys are kept, and those kept (key -> number of its removal).
  int64_t sequence_ TF_GUARDED_BY(mu_) = 0;
  bool tracking_ TF_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<int64_t, int64_t> tombstones_ TF_GUARDED_BY(mu_);
};

}  // namespace tf_gba

#endif  // TF_GBA_CUSTOM_OPS_GBA_CC_KERNELS_HASH_TABLE_H_
