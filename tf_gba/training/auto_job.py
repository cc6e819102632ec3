"""`--mode=auto`: synchronous training that moves to GBA while stragglers make it pay, and back.

The job starts in Sync. At every progress line the workers' own step times of the last interval
go to the switching policy (`tf_gba.training.auto_policy`), which predicts Sync's and GBA's
throughput with the cluster simulator's model and decides. A switch ends the current job where it
is, with its checkpoint in `model_dir`, and starts the other mode from it, exactly as a manual
switch does (`--mode=sync` then `--mode=gba` on the same `model_dir`): the same model, optimizer,
learning rate and global batch (GBA's M = the workers), the token count aligned with the global
step, and every worker's straggler position (so a trace goes on where it was). The run ends when
`--steps` worker steps have been trained over all stays.

Sync measures its step times in the worker processes (they gather them with an all-reduce and
reach the same decision together); GBA reads each worker's step counters from the coordinator.
Both modes read their input from static shards here: the Sync workers do, and the shared data
list's position would not carry through a Sync stay.

The summary is the last stay's (its evaluation, checkpoint, staleness) with `mode` "auto",
`steps`, `examples` and `wall_seconds` of the whole run (switches included), `switches` (each
with the step it happened at, the modes, the model's and the expected gain, the time it was to
save, its expected and measured cost and where that went, and the step times that caused it),
`stays` (each with its measured efficiency and step overhead) and a `timeline` of (seconds,
mode, QPS) for plotting.

Without a straggler profile the stays run the `timed` profile: every step timed, none slowed.
"""

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from typing import List, Optional, Sequence

import numpy as np
import tf_keras as keras

from tf_gba.distribute import stragglers as stragglers_lib
from tf_gba.simulate import auto as auto_sim
from tf_gba.training import auto_policy
from tf_gba.training import summary as summary_lib
from tf_gba.training.config import TrainConfig


def policy_config(config: TrainConfig) -> auto_policy.PolicyConfig:
  return auto_policy.PolicyConfig(
      margin=config.auto_margin, hysteresis=config.auto_hysteresis, dwell_s=config.auto_dwell_s,
      confirm=config.auto_confirm, sync_efficiency=config.auto_sync_efficiency,
      gba_efficiency=config.auto_gba_efficiency,
      learn_efficiency=config.auto_learn_efficiency, switch_cost_s=config.auto_switch_cost_s,
      horizon_s=config.auto_horizon_s, probe_s=config.auto_probe_s,
      measure_s=config.auto_measure_s)


def switch_costs(switches: List[dict]) -> List[float]:
  """The measured costs of `switches` (those whose next mode was observed)."""
  return [s["cost_s"] for s in switches if s.get("cost_s") is not None]


# The moments a switch passes through, in order: (name in `cost_events_s`, where it is read: the
# switch's own record, from the stay that decided, or the next stay's `stay_info`).
_EVENTS = (("checkpoint_begin", "switch", "checkpoint_begin_unix"),
           ("checkpoint_written", "switch", "saved_unix"),
           ("processes_exited", "switch", "returned_unix"),
           ("next_stay_called", "switch", "next_call_unix"),
           ("started", "next", "started_unix"),
           ("restored", "next", "restored_unix"),
           ("train_begin", "next", "train_begin_unix"),
           ("first_step", "next", "first_step_unix"),
           ("first_interval_end", "next", "first_interval_end_unix"))

# Each part of `cost_breakdown_s`: the time between two of those moments. The first three and
# the call from one stay to the next (milliseconds) add up to the cost; the others split them
# where both ends were recorded.
_PARTS = (
    # Ending the stay: its checkpoint and its processes' exit.
    ("end_stay_s", "decided", "processes_exited"),
    # Process start, TensorFlow import, cluster, model build and restore.
    ("start_s", "next_stay_called", "train_begin"),
    # Tracing and the first interval of steps (not an observation).
    ("first_interval_s", "train_begin", "first_interval_end"),
    ("to_checkpoint_s", "decided", "checkpoint_begin"),  # the loop's end (Sync: a digest)
    ("checkpoint_s", "checkpoint_begin", "checkpoint_written"),
    ("exit_s", "checkpoint_written", "processes_exited"),  # summary, processes gone
    ("processes_s", "next_stay_called", "started"),  # the next stay's processes up
    ("restore_s", "started", "restored"),  # cluster, model and optimizer built, restored
    ("to_train_s", "restored", "train_begin"),  # input pipeline, callbacks
    ("to_first_step_s", "train_begin", "first_step"),  # tracing
    ("first_steps_s", "first_step", "first_interval_end"))


def account_switch(switch: dict, stay_info: dict) -> None:
  """Fills in `switch` (a decision, with `decided_unix` and `returned_unix`, when the stay that
  decided had ended) from the next stay's `stay_info`: its cost, from the decision to the end of
  the next mode's first interval (the start of its first observed one), the moments it passed
  through (`cost_events_s`, seconds after the decision) and the parts between them
  (`cost_breakdown_s`)."""
  begin, first = stay_info.get("train_begin_unix"), stay_info.get("first_interval_end_unix")
  if begin is None or first is None or switch.get("decided_unix") is None:
    return  # the next stay ended before its first observation: no measured cost
  decided = switch["decided_unix"]
  switch["cost_s"] = first - decided
  at = {"decided": decided}
  for name, source, key in _EVENTS:
    value = (switch if source == "switch" else stay_info).get(key)
    if value is not None:
      at[name] = float(value)
  # A moment outside its neighbours' span (a clock read in another process, a worker whose
  # first step came before this stay) is left out rather than given a negative part.
  if "first_step" in at and not begin <= at["first_step"] <= first:
    del at["first_step"]
  switch["cost_events_s"] = {name: at[name] - decided for name, _, _ in _EVENTS if name in at}
  switch["cost_breakdown_s"] = {part: at[b] - at[a] for part, a, b in _PARTS
                                if a in at and b in at}


def probe_role(config: auto_policy.PolicyConfig, modes_before: Sequence[str],
               mode: str) -> Optional[str]:
  """The next stay's `probe` (`AutoPolicy`), given the modes of the stays before it: with
  --auto_probe_s the first stay probes its mode and hands over to measure the other ("first");
  a mode's first stay after another ("second": after the probe, or entered on the efficiency
  assumed for it) measures that efficiency and may be left after --auto_measure_s instead of
  --auto_dwell_s, by the usual rule; every other stay is a plain one (None). With
  --noauto_learn_efficiency nothing is measured, and no stay but a plain one
  (`tf_gba.simulate.auto.stay_role`, which the simulator's replay applies too)."""
  return auto_sim.stay_role(modes_before, mode, config.probe_s, config.learn_efficiency)


def _warm_ps_forker(log_dir: str) -> None:
  """Starts the server forker the GBA stays' LocalCluster will use (`local_cluster.warm_forker`);
  a failure here only leaves the first GBA stay to start it, as it would have."""
  from tf_gba.distribute import local_cluster  # pylint: disable=g-import-not-at-top
  from tf_gba.training import preflight  # pylint: disable=g-import-not-at-top
  try:
    local_cluster.warm_forker(log_dir)
  except Exception as e:  # pylint: disable=broad-except
    print(f"tf_gba: mode=auto: could not start the parameter servers' forker ahead of a "
          f"switch ({preflight.first_line(e)[:200]}); the first GBA stay starts it.", flush=True)


def validate(config: TrainConfig) -> None:
  """Raises ValueError, naming the flag, if `config` cannot run in auto mode."""
  policy_config(config)
  sync_batch = config.local_batch_size * config.num_workers
  if config.global_batch_size is not None and config.global_batch_size != sync_batch:
    raise ValueError(
        f"--mode=auto trains Sync's global batch, local batch x workers = {sync_batch}, in both "
        f"modes, but --global_batch_size={config.global_batch_size}. Leave it unset.")
  if os.environ.get("TF_CONFIG"):
    raise ValueError("--mode=auto starts its own processes on this machine (its Sync stays run "
                     "the local all-reduce workers); unset TF_CONFIG.")


class AutoWatch(keras.callbacks.Callback):
  """A GBA stay's observer: at each progress line, every worker's own step time over the interval
  from its counters, to the policy; stops `fit` (the runner then checkpoints) on a switch."""

  def __init__(self, policy: auto_policy.AutoPolicy, log=print):
    super().__init__()
    self.policy = policy
    self.job = None  # set by the runner
    self.decision: Optional[dict] = None
    self.skip_evaluation = False  # read by the runner: a stay that hands over is not evaluated
    self.timeline: List[dict] = []
    self._log = log
    self._last = None
    self._t0 = None
    self.first_interval_end_unix = None
    self.first_step_unix = None
    self.train_begin_unix = None

  def on_train_begin(self, logs=None):
    self._t0 = self.train_begin_unix = time.time()

  def on_epoch_end(self, epoch, logs=None):
    now = time.time()
    workers = self.job.strategy.worker_step_stats()
    steps = np.array([w["steps"] for w in workers], np.float64)
    own = np.array([stragglers_lib.in_step_seconds(w) for w in workers], np.float64)
    last, self._last = self._last, (now, steps, own)
    if last is None:
      self.first_interval_end_unix = now
      # When the first worker began its first step: tracing and dispatch done (a stay's workers
      # are new processes, so their op's first step is this stay's).
      firsts = [w["first_step_unix"] for w in workers if w.get("first_step_unix")]
      self.first_step_unix = min(firsts) if firsts else None
      self.policy.started(now)
      return  # the first interval pays for tracing and start-up: not an observation
    dt = max(now - last[0], 1e-9)
    d_steps, d_own = steps - last[1], own - last[2]
    # A worker that finished no step in the interval has been in one for at least its length.
    times = np.where(d_steps > 0, d_own / np.maximum(d_steps, 1.0), dt)
    trained_s = now - self._t0
    qps = float(d_steps.sum()) * self.policy.local_batch_size / dt
    decision = self.policy.observe(trained_s, times, qps)
    self.timeline.append({"trained_s": trained_s, "unix": now, "qps": qps,
                          "start_unix": last[0], "steps": int(steps.sum())})
    if decision is not None:
      decision["at_step"] = int(steps.sum())
      self.decision = decision
      self.skip_evaluation = True
      self._log(auto_policy.describe(decision))
      self.model.stop_training = True


def run(config: TrainConfig) -> dict:
  """Trains `config.steps` worker steps in Sync and GBA as the policy decides; the summary."""
  # Imported here: the runner imports this module to dispatch --mode=auto.
  from tf_gba.training import preflight  # pylint: disable=g-import-not-at-top
  from tf_gba.training import runner  # pylint: disable=g-import-not-at-top
  from tf_gba.training import sync_job  # pylint: disable=g-import-not-at-top

  validate(config)
  policy_cfg = policy_config(config)
  # Without a straggler profile the workers' steps would carry no timing op: time them anyway
  # (no slowdown), the policy's input.
  profile = stragglers_lib.parse(config.stragglers)
  stay_profile = config.stragglers if profile != "none" else stragglers_lib.timed(profile)
  base = dataclasses.replace(config, input="sharded", global_batch_size=None,
                             stragglers=stay_profile)
  print(f"tf_gba: mode=auto: starts in sync; to gba at an expected gain >= "
        f"{policy_cfg.enter_gba:.2f}, back below {policy_cfg.leave_gba:.2f}, when the time saved "
        f"over {policy_cfg.horizon:g} s exceeds a switch's cost (first estimate "
        f"{policy_cfg.switch_cost_s:g} s), after {policy_cfg.dwell_s:g} s in a mode and "
        f"{policy_cfg.confirm} agreeing observation(s); efficiencies before a first stay: sync "
        f"{policy_cfg.sync_efficiency:g}, gba {policy_cfg.gba_efficiency:g}"
        f"{'' if policy_cfg.learn_efficiency else ' (held)'}"
        + (f"; probes each mode for {policy_cfg.probe_s:g} s first" if policy_cfg.probe_s > 0
           else "") + "; input: static shards", flush=True)
  t_start = time.time()
  # The first switch to GBA would wait for the parameter-server cluster's server forker to import
  # TensorFlow (seconds; later switches find it running): start it now, beside the Sync stay.
  warm_dir = config.log_dir or tempfile.mkdtemp(prefix="tf_gba_auto_forker_")
  warming = threading.Thread(target=_warm_ps_forker, args=(warm_dir,), daemon=True,
                             name="auto-warm-forker")
  warming.start()
  remaining = config.steps
  mode = auto_policy.SYNC
  done_steps = 0
  stays, switches, timeline = [], [], []
  efficiency = policy_cfg.initial_efficiency()
  base_step_s = {}  # each mode's base step time, from its last stay
  overhead_s = {}   # and its step overhead (learned, as efficiencies are)
  summary = None
  while remaining > 0:
    # Sync observes at its own progress lines, every log_every global steps (N worker steps
    # each), as pure Sync prints them. Not more often: each line drains the workers' queued steps
    # and takes three all-reduces, and at every log_every / N global steps (both modes observing
    # about as many worker steps) a Sync stay trained 4-8 % slower than pure Sync (4 workers,
    # no floor: 17,241 and 17,503 QPS against 18,249-18,530; 18,971 at every log_every).
    stay = dataclasses.replace(base, mode=mode, steps=remaining)
    probe = probe_role(policy_cfg, [st["mode"] for st in stays], mode)
    policy = auto_policy.AutoPolicy(policy_cfg, mode, config.local_batch_size, efficiency,
                                    switch_costs(switches),
                                    switches[-1]["decided_unix"] if switches else None, probe,
                                    base_step_s, overhead_s)
    stay_t0 = time.time()
    if switches and "next_call_unix" not in switches[-1]:
      switches[-1]["next_call_unix"] = stay_t0
    if mode == auto_policy.SYNC:
      preflight.write_metadata(stay)
      summary = sync_job.run_sync(stay, auto=policy.to_dict())
      info = dict(summary.get("auto") or {})
      decision, points = info.get("decision"), info.get("timeline", [])
      observations = info.get("observations", [])
    else:
      watch = AutoWatch(policy)
      summary = runner.run_parameter_server(stay, callbacks=[watch])
      decision, points = watch.decision, watch.timeline
      observations = policy.observations
      phases = getattr(watch.job, "phase_unix", {}) if watch.job is not None else {}
      info = {"efficiency": policy.stay_efficiency(),
              "overhead_s": policy.stay_overhead_s(),
              "base_step_s": policy.stay_base_step_s(),
              "train_begin_unix": watch.train_begin_unix,
              "skipped": policy.skipped, "started_unix": phases.get("started"),
              "restored_unix": phases.get("restored"), "first_step_unix": watch.first_step_unix,
              "checkpoint_begin_unix": phases.get("checkpoint_begin"),
              "saved_unix": phases.get("saved")}
    returned = time.time()
    info["first_interval_end_unix"] = points[0]["start_unix"] if points else None
    if switches and switches[-1]["cost_s"] is None:
      account_switch(switches[-1], info)
    stay_efficiency = info.get("efficiency")
    if policy_cfg.learn_efficiency and stay_efficiency is not None:
      efficiency = dict(efficiency, **{mode: stay_efficiency})
    if policy_cfg.learn_efficiency and info.get("overhead_s") is not None:
      overhead_s = dict(overhead_s, **{mode: info["overhead_s"]})
    if info.get("base_step_s"):
      base_step_s = dict(base_step_s, **{mode: info["base_step_s"]})
    trained = int(summary["steps"])
    stays.append({"mode": mode, "probe": probe, "start_step": done_steps, "steps": trained,
                  "start_seconds": stay_t0 - t_start, "seconds": returned - stay_t0,
                  "train_seconds": summary["wall_seconds"], "global_qps": summary["global_qps"],
                  "start_global_step": summary["start_global_step"],
                  "global_step": summary["global_step"],
                  "efficiency": stay_efficiency, "overhead_s": info.get("overhead_s"),
                  "base_step_s": info.get("base_step_s"),
                  "observations": len(observations),
                  "skipped_observations": info.get("skipped", 0),
                  "step_seconds": [o["per_worker_step_seconds"] for o in observations],
                  "measured_qps": [o["measured_qps"] for o in observations]})
    timeline += [{"seconds": p["unix"] - t_start, "mode": mode, "qps": p["qps"],
                  "step": done_steps + p["steps"]} for p in points]
    if decision is not None:
      switches.append({
          "at_step": done_steps + decision["at_step"],
          # When the policy decided (its last observation), and when the next mode took over.
          "decided_at_seconds": points[-1]["unix"] - t_start if points else None,
          "decided_unix": points[-1]["unix"] if points else None,
          "returned_unix": returned,
          "checkpoint_begin_unix": info.get("checkpoint_begin_unix"),
          "saved_unix": info.get("saved_unix"),
          "at_seconds": returned - t_start,
          "from": decision["from"], "to": decision["to"], "probe": decision["probe"],
          "predicted_gain": decision["predicted_gain"], "threshold": decision["threshold"],
          "predicted_sync_qps": decision["predicted_sync_qps"],
          "predicted_gba_qps": decision["predicted_gba_qps"],
          "expected_gain": decision["expected_gain"],
          "expected_sync_qps": decision["expected_sync_qps"],
          "expected_gba_qps": decision["expected_gba_qps"],
          "measured_qps": decision["measured_qps"], "efficiency": decision["efficiency"],
          "other_efficiency": decision["other_efficiency"],
          "other_by": decision["other_by"], "other_overhead_s": decision["other_overhead_s"],
          "other_step_scale": decision["other_step_scale"], "saved_s": decision["saved_s"],
          "horizon_s": decision["horizon_s"],
          "expected_switch_cost_s": decision["switch_cost_s"], "cost_s": None,
          "per_worker_step_seconds": decision["per_worker_step_seconds"],
          "trained_s_in_mode": decision["trained_s"]})
      mode = decision["to"]
    done_steps += trained
    remaining -= trained
    if trained <= 0:
      break  # nothing more can be trained (not expected): do not loop
  wall = time.time() - t_start
  if not config.log_dir:
    shutil.rmtree(warm_dir, ignore_errors=True)  # the forker's log (the forker keeps it open)
  out = dict(summary)
  out.pop("auto", None)
  out.update({
      "mode": "auto", "final_mode": mode,
      "steps": done_steps, "examples": done_steps * config.local_batch_size,
      "wall_seconds": wall,
      "train_seconds": sum(s["train_seconds"] for s in stays),
      "global_qps": done_steps * config.local_batch_size / max(wall, 1e-9),
      "switches": switches, "num_switches": len(switches), "stays": stays,
      "switch_seconds": sum(switch_costs(switches)), "efficiency": efficiency,
      "base_step_s": base_step_s, "overhead_s": overhead_s,
      "timeline": timeline, "stragglers": config.stragglers,
      "policy": dataclasses.asdict(policy_cfg)})
  summary_lib.write(config.model_dir, out)
  print_auto(out)
  return out


# The parts of a switch's cost and the parts each splits into (`cost_breakdown_s`).
_SPLITS = (("end_stay_s", ("to_checkpoint_s", "checkpoint_s", "exit_s")),
           ("start_s", ("processes_s", "restore_s", "to_train_s")),
           ("first_interval_s", ("to_first_step_s", "first_steps_s")))


def describe_breakdown(breakdown: dict) -> str:
  """'end stay 3.0 (to checkpoint 0.4, checkpoint 1.2, exit 1.4), start ...' of a breakdown."""

  def name(key):
    return key[:-2].replace("_", " ")

  out = []
  for part, splits in _SPLITS:
    if part not in breakdown:
      continue
    inner = ", ".join(f"{name(k)} {breakdown[k]:.1f}" for k in splits if k in breakdown)
    out.append(f"{name(part)} {breakdown[part]:.1f}" + (f" ({inner})" if inner else ""))
  return ", ".join(out)


# How the summary names a stay's `probe` role (`probe_role`).
_STAY_ROLE = {"first": " (probe)", "second": " (first stay: measures its efficiency)"}


def print_auto(s: dict) -> None:
  lines = ["=" * 72,
           f"auto: {s['steps']} worker steps in {s['wall_seconds']:.1f} s (switches included; "
           f"{s['train_seconds']:.1f} s training), {s['global_qps']:,.0f} examples/s, "
           f"{s['num_switches']} switch(es), final AUC {s['eval_auc']:.4f}"]
  for st in s["stays"]:
    eff = "" if st.get("efficiency") is None else f", efficiency {st['efficiency']:.2f}"
    if st.get("overhead_s") is not None:
      eff += f", step overhead {st['overhead_s'] * 1e3:.1f} ms"
    lines.append(f"  {st['mode']:<5} from step {st['start_step']:>7}: {st['steps']} steps, "
                 f"{st['seconds']:.1f} s ({st['train_seconds']:.1f} s training, QPS "
                 f"{st['global_qps']:,.0f}{eff}){_STAY_ROLE.get(st.get('probe'), '')}")
  for sw in s["switches"]:
    cost = ("not measured (the run ended first)" if sw.get("cost_s") is None else
            f"{sw['cost_s']:.1f} s ({describe_breakdown(sw['cost_breakdown_s'])})")
    why = (f"saves {sw['saved_s']:.1f} s > expected cost {sw['expected_switch_cost_s']:.1f} s"
           if not sw.get("probe") else f"a probe of {sw['to']}")
    lines.append(f"  switch at step {sw['at_step']}: {sw['from']} -> {sw['to']}, expected gain "
                 f"{sw['expected_gain']:.2f} (threshold {sw['threshold']:.2f}; model "
                 f"{sw['predicted_gain']:.2f}), {why}; cost {cost}; step seconds "
                 + " ".join(f"{x:.3f}" for x in sw["per_worker_step_seconds"]))
  lines.append("=" * 72)
  print("\n".join(lines), flush=True)
