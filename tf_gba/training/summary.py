"""The run summary: one schema, one writer, one printer, for every mode.

Every run returns a dict with at least the keys of `SCHEMA` (a mode without such a thing keeps the
default: an all-reduce has no staleness, no dropped gradients); `new` builds one. A mode may add the
keys its registry entry lists in `summary_fields` (training/mode_registry.py), and a run the keys of
`RUN_FIELDS` (data checks, the shared data list, recovery, logs). `unknown_keys` says which keys of
a summary are none of these: tests call it on the summaries they produce, so a key spelled anew
(`eval_log_loss` beside `eval_logloss`) fails there.

`write` writes `model_dir/summary.json`; `print_summary` prints the block users read.
"""

import json
import os
from typing import List

# Key -> default (None: every run sets it). Order is the summary.json order.
SCHEMA = {
    "mode": None, "model": None, "data": None, "num_ps": 0, "num_workers": None,
    "num_aggregate": None, "local_batch_size": None, "global_batch_size": None,
    "stragglers": "none",
    # Where the parameter-server modes' stragglers sleep (the others': at the end of the step).
    "straggler_delay": "after_push",
    # The all-reduce modes divide every gradient, embedding rows included, by N.
    "sparse_normalize": "num_aggregate",
    "steps": None, "examples": None, "wall_seconds": None, "global_qps": None,
    "qps_measured_over_steps": None, "per_worker": None, "global_step": None,
    "start_global_step": 0,
    # Gradients pushed and what happened to them (synchronous modes: every one applied to the step
    # it was computed for, none dropped; `pushes` then defaults to `steps`).
    "pushes": None, "mean_staleness": 0.0, "max_staleness": 0, "staleness_histogram": [],
    "dropped_batches": 0, "dropped_gradients": 0, "dropped_embedding_rows": 0,
    "nonfinite_gradients": 0, "duplicate_pushes": 0,
    # Hop-BW: gradients of an older version ignored; Hop-BS / Hop-BW: time blocked at the barrier
    # over all workers; Hop-BS: the largest lead seen.
    "ignored_gradients": 0, "blocked_seconds": 0.0, "max_lead": None,
    "final_train_loss": None, "eval_auc": None, "eval_logloss": None, "eval_examples": None,
    "checkpoint": None,
}

# Keys a run adds beside the schema, whatever its mode.
RUN_FIELDS = frozenset({
    "malformed_rows", "data_rows_checked", "data_fully_checked",       # preflight data scan
    "input", "data_list", "duplicates", "missed",                      # the shared data list
    "skipped_checkpoints", "periodic_checkpoints",                     # checkpoints
    "target_global_step", "restarts", "restart_causes", "steps_redone", "batches_reread",
    "worker_restarts", "tfdata_worker_restarts",                       # recovery
    "logs", "logs_kept",                                               # --keep_logs
    "embedding", "hash_tables",           # --embedding; with hash, training/hash_tables.py
    "steps_per_execution",                # parameter-server modes: worker steps per function
})


def new(config, **fields) -> dict:
  """A summary of `config`'s run: the schema's defaults, the config's names, then `fields`."""
  out = dict(SCHEMA)
  out.update(mode=config.mode, model=config.model, data=config.data,
             num_workers=config.num_workers, local_batch_size=config.local_batch_size,
             stragglers=config.stragglers)
  out.update(fields)
  if out["pushes"] is None:
    out["pushes"] = out["steps"]
  return out


def unknown_keys(summary: dict) -> List[str]:
  """Keys of `summary` that neither the schema, its mode's summary_fields, nor RUN_FIELDS name."""
  from tf_gba.training import mode_registry  # pylint: disable=g-import-not-at-top
  own = set(mode_registry.get(summary["mode"]).summary_fields)
  return sorted(k for k in summary if k not in SCHEMA and k not in RUN_FIELDS and k not in own)


def write(model_dir: str, summary: dict) -> None:
  with open(os.path.join(model_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)


def data_fields(report: dict) -> dict:
  """The preflight data scan's counts (tf_gba.training.preflight.check) as summary keys."""
  return {"malformed_rows": report["malformed_rows"], "data_rows_checked": report["rows_checked"],
          "data_fully_checked": report["fully_checked"]}


def log_fields(config) -> dict:
  """Where the binary put the processes' logs (`--keep_logs`), as summary keys; none without."""
  return {"logs": config.log_dir, "logs_kept": config.keep_logs} if config.log_dir else {}


def data_line(s: dict) -> str:
  scope = "" if s["data_fully_checked"] else " (of the first rows, read before training)"
  return (f"  malformed rows        {s['malformed_rows']} of {s['data_rows_checked']:,} rows "
          f"checked{scope}, skipped")


def _number(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def print_summary(s: dict) -> None:
  lines = [
      "=" * 72,
      f"summary ({s['mode']}, {s['model']}, {s['data']}): {s['steps']} worker steps, "
      f"{s['examples']:,} examples in {s['wall_seconds']:.1f} s",
      f"  global QPS            {s['global_qps']:,.0f}  (over the last "
      f"{s['qps_measured_over_steps']} steps, after start-up)",
      "  per-worker QPS        " + "  ".join(
          f"w{w['worker']}=" + ("?" if w["qps"] is None else f"{w['qps']:,.0f}")
          for w in s["per_worker"])
      + ("  (?: restarted, not measured)" if any(w["qps"] is None for w in s["per_worker"])
         else ""),
      f"  global step           {s['global_step']} (M={s['num_aggregate']}, {s['pushes']} pushes, "
      f"started at {s['start_global_step']})",
      f"  dense staleness       mean {s['mean_staleness']:.2f}  max {s['max_staleness']}",
      f"  dropped batches       {s['dropped_batches']}  (dropped gradients over all variables "
      f"{s['dropped_gradients']}, embedding rows {s['dropped_embedding_rows']})",
      *([f"  hop_bs barrier        blocked {s['blocked_seconds']:.1f} s over all workers  "
         f"max lead {s['max_lead']}  per worker "
         + "  ".join(f"w{w['worker']}={w.get('blocked_seconds', 0):.1f}s"
                     for w in s["per_worker"])] if s.get("max_lead") is not None else []),
      *([f"  hop_bw                {s['ignored_gradients']} gradients of an older version "
         "ignored"] if s["mode"] == "hop_bw" else []),
      *([f"  dts                   delay {s['dts_delay']}, period {s['dts_period']}: "
         f"{s['exchanges']} all-reduces"] if s["mode"] == "dts" else []),
      *([f"  dense replicas        mean sync gap {_number(s['sync'].get('mean_sync_gap'), '.2f')} "
         f"steps; spread {_number(s['replica_spread_before_final_sync'], '.3g')} -> "
         f"{_number(s['replica_spread_after_final_sync'], '.3g')} at the final sync"]
        if s.get("sync") else []),
      *([f"  data list             {s['data_list']['batches']} batches "
         f"({s['data_list']['examples']:,} examples) of {s['data_list']['listed_batches']} "
         f"listed; per worker "
         + "  ".join(f"w{i}={b}" for i, b in enumerate(s['data_list']['per_worker_batches']))
         + (f"; duplicates {s['data_list']['duplicates']}  missed {s['data_list']['missed']}"
            if s['data_list']['missed'] is not None else "")
         + (f"  STALLED: {s['data_list']['stalled']}" if s['data_list']['stalled'] else "")]
        if s.get("data_list") else []),
      *([f"  hash table {name:<10} {t['rows']:,} rows ("
         + (" + ".join(f"{r:,}" for r in t["rows_per_shard"]) + " per parameter server), "
            if s["mode"] != "sync" else "a copy on every worker), ")
         + f"{_number(t['bytes_per_row'], ',.1f')} bytes per row allocated (row floats "
         + f"{_number(t['row_bytes'], 'd')} B)"
         + (f"; admitted {t['admitted']:,}  filtered {t['filtered']:,}  evicted "
            f"{t['evicted']:,}  pending {t['pending']:,}" if "admitted" in t else "")
         for name, t in (s.get("hash_tables") or {}).items()]),
      f"  eval AUC              {s['eval_auc']:.4f}",
      f"  eval logloss          {s['eval_logloss']:.4f}",
      f"  checkpoint            {s['checkpoint']}",
      *([f"  recovery              {s['restarts']} restarts"
         + (f" ({', '.join(s['restart_causes'])})" if s.get("restart_causes") else "")
         + f", {s['steps_redone']} global steps "
         f"redone ({s['batches_reread']} batches re-read), {s['worker_restarts']} workers "
         f"and {s.get('tfdata_worker_restarts', 0)} tf.data workers restarted"]
        if s.get("restarts") or s.get("worker_restarts") or s.get("tfdata_worker_restarts")
        else []),
      *([data_line(s)] if s.get("data_rows_checked") else []),
      *([f"  logs                  {s['logs']}"
         + ("" if s["logs_kept"] else "  (deleted at exit; --keep_logs keeps them)")]
        if s.get("logs") else []),
      "=" * 72,
  ]
  print("\n".join(lines), flush=True)
