"""The run summary's account of a model's hash tables (--embedding=hash): rows and bytes per row.

For each `tf_gba.layers.HashEmbedding` of the model, read from its shards on the parameter servers
(in sync, the one shard of the worker reading it, the same on every worker) with the table's size op (`HashTableShard.size`: rows, and the bytes the shard holds as
`allocated_bytes` counts them, the figure benchmarks/hash_embedding.py reports per row):

  rows                the table's rows (keys looked up in training; evaluation inserts none)
  rows_per_shard      the rows of each parameter server's shard, in shard order
  allocated_bytes     bytes of the row blocks (whole blocks of 16,384 rows) and the key index
  bytes_per_row       allocated_bytes / rows (None without rows); a small table pays for its
                      first block whole, so this falls toward row_bytes as the table fills
  row_bytes           the floats of one row: dim * (1 + optimizer slots) * 4
  min_frequency, ttl_steps, max_rows
                      the table's admission and eviction options (0: off; --hash_*)
  pending             keys looked up fewer than min_frequency times, without a row yet
  admitted            rows created (a key's first training lookup, or its min_frequency-th)
  filtered            gradient rows dropped because their key had no row (not yet admitted,
                      or evicted between the lookup and the update)
  evicted             rows removed by eviction (time-to-live, then the max_rows budget)
The counters are the sums over the shards since the parameter servers started (a restore does not
bring them back), so rows = admitted - evicted in a run that did not restore rows.
"""

from typing import Dict

from tf_gba.layers.hash_embedding import HashEmbedding
from tf_gba.ops import hash_table_ops
from tf_gba.optimizers import GBA
from tf_gba.optimizers import hash_rows


def report(model, optimizer) -> Dict[str, dict]:
  """{layer name: the fields above} for every HashEmbedding of `model` ({} if none)."""
  out = {}
  slots = None
  for layer in model.layers:
    if not isinstance(layer, HashEmbedding) or layer.table is None:
      continue
    if slots is None:
      # The optimizer that updated the rows: GBA's inner one, or the Keras optimizer itself in
      # sync (hash_rows.apply_replicated). Asked only when there is a table: a model without one
      # may train with an optimizer the table could not apply.
      inner = optimizer.inner_optimizer if isinstance(optimizer, GBA) else optimizer
      kind, _, _ = hash_rows.fused_optimizer(inner)
      slots = hash_table_ops.NUM_SLOTS[kind]
    sizes = [shard.size() for shard in layer.table.shards]
    rows = [int(r.numpy()) for r, _ in sizes]
    allocated = sum(int(b.numpy()) for _, b in sizes)
    total = sum(rows)
    counters = layer.table.counters()
    out[layer.name] = {
        "rows": total, "rows_per_shard": rows, "allocated_bytes": allocated,
        "bytes_per_row": round(allocated / total, 1) if total else None,
        "row_bytes": layer.output_dim * (1 + slots) * 4,
        "min_frequency": layer.min_frequency, "ttl_steps": layer.ttl_steps,
        "max_rows": layer.max_rows, "admission_filter_cells": layer.admission_filter_cells,
        **{f: counters[f] for f in ("pending", "admitted", "filtered", "evicted")}}
  return out
