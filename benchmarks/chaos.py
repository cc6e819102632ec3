"""Chaos drill: a long run of the training binary under a seeded schedule of repeated faults.

  python -m benchmarks.chaos --mode=gba --seed=0 --duration_s=600 --faults=10
  python -m benchmarks.chaos --short            # the schedule tests/e2e/test_chaos_drill.py runs

The binary runs as a user runs it (its supervisor, a local cluster of real server processes in
its own network namespace, `--private_network`), with periodic checkpoints and the shared data
list. The drill injects, at global steps drawn from --seed (read from the progress lines):

  kill_ps, kill_worker                        kill -9 of one server of the local cluster
  kill_tfdata                                 kill -9 of a tf.data worker or of the dispatcher
  kill_job                                    kill -9 of the job's process under its supervisor:
                                              the coordinator
  kill_coordinator                            kill -9 of the command itself; the drill reruns it
  sigterm                                     a preemption: SIGTERM to the command (exit 143,
                                              checkpoint); the drill reruns it
  double                                      two kills within 5 s
  during_recovery                             a kill while the job restarts after another one
  during_checkpoint                           a kill while a checkpoint is being written
  stall                                       one server's port dropped (iptables) for 5-30 s while
                                              its process lives
  partition                                   the coordinator cut off from every server (its ports
                                              dropped) for 10-30 s while every process lives
  bandwidth                                   loopback limited to 20-100 Mbit/s (tc tbf)
  loss                                        1-5 % of the packets dropped (iptables statistic)

Network faults are made inside the job's namespace (`nsenter -t <the command's pid> -n`); the
drill installs iptables (apt-get) where it is missing, as `make` installs what it needs. Where it
cannot (not root, no package, no private namespace) it says so in one line and skips them,
counted in the verdict.

Each fault is printed with its time and what the job did (restarted, resumed at which global step,
how many global steps it trained again, how long until it trained again; for a stall: whether the
others went on or the job waited). At the end the drill reads the run's summary.json and checks:
the target global step reached; the data list's exactly-once count (batches restored from the
checkpoint plus batches trained make --steps, none trained twice in one pass, none lost); global
steps redone per fault <= one checkpoint interval; the gradients applied agree with the pushes;
nothing hung (the run's longest gap without progress, against the stall limit); with
--reference_seeds, the AUC against the spread of undisturbed runs and the wall time against
theirs. Results JSON under runs/ (or --out).
"""

import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from benchmarks import ArgumentParser
from benchmarks import process_tree
from benchmarks import refuse

PROGRAM = "benchmarks.chaos"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")

KILLS = ("kill_ps", "kill_worker", "kill_tfdata", "kill_job", "kill_coordinator")
COMPOUND = ("sigterm", "double", "during_recovery", "during_checkpoint")
NETWORK = ("stall", "partition", "bandwidth", "loss")
KINDS = KILLS + COMPOUND + NETWORK
# The kinds each mode can be given. sync (MultiWorkerMirroredStrategy) has no parameter server,
# no shared data list and no supervisor: its job is the command.
MODE_KINDS = {
    "gba": KINDS,
    # (sync has no coordinator to cut off: its chief is worker 0, whose stall is a `stall`.)
    # Its "double" is two workers (or a worker and the command) within 5 s; its "during_recovery"
    # a worker killed, then the rerun command's new worker killed as it comes up.
    "sync": ("kill_worker", "kill_coordinator", "sigterm", "double", "during_recovery",
             "during_checkpoint", "stall", "bandwidth", "loss"),
}
# The short schedule (tests/e2e/test_chaos_drill.py): at these global steps of a 1,600-step gba
# run (M = 2: 800 global steps), five faults of four kinds, each injected once its step is reached
# and the fault before it is over. A preemption is left to tests/e2e/test_preemption.py: the short
# schedule is what fits in `make test`. The run is twice as long as the last fault's step: during
# the worker stall the other worker goes on alone (on a faster machine, 284 global steps in 8 s),
# and a shorter run ended before the last faults were due. The stalled worker is not the killed
# one, and its stall comes first: a worker restarted in place is not read at a progress line
# (TF's runtime no longer knows it as a device of the coordinator), and while TF's coordinator
# takes a restarted worker back, it updates every server, and waits for a stalled link. The stall
# comes after the first checkpoint (global step 50): that checkpoint's first run of its ops
# registers them on every server, which waits out a stalled link (docs/fault_tolerance.md), and a
# stall at step 40 held the coordinator for the whole stall in one run of the test (the line: "the
# coordinator was held up") when the stall began as that checkpoint did.
SHORT = (
    dict(kind="stall", at=60, target="worker:1", duration_s=12.0),
    dict(kind="kill_worker", at=90, target="worker:0"),
    dict(kind="stall", at=150, target="ps", duration_s=18.0),
    dict(kind="during_recovery", at=230, target="ps", second="kill_ps", gap_s=0.5),
    dict(kind="loss", at=320, loss_pct=3.0, duration_s=10.0),
)
SHORT_STEPS, SHORT_CHECKPOINT_EVERY, SHORT_STALL_LIMIT_S = 1600, 100, 15.0
# Undisturbed speed measured here (gba, 2 workers, local batch 64, the binary's defaults, the
# quiet 2-core machine): about 134 worker steps a second (24,000 in 179 s; 60 before the step's
# transfers were cut, 22 at one step per function on a shared machine). Under the 20 faults of
# a drill the same run took 429 s, about 56 a second: a run of --duration_s gets this many steps
# per second of it, so that the faults' restarts and stalls fill the rest.
STEPS_PER_SECOND = 60
# Faults after which the job restarts (or the command is rerun); a worker or a tf.data worker is
# restarted in place, and a network fault may or may not restart it.
_RESTARTS = ("kill_ps", "kill_job", "kill_coordinator", "sigterm", "double", "during_recovery",
             "during_checkpoint")
# How tf_gba.training.slow_interval's lines begin (not imported: the drill runs without TF): a
# slow interval's, and a worker's that did not answer a progress line (`SilentWorkers`).
_SLOW_INTERVAL = "tf_gba: the last "
# tf_gba.training.save_watch's line: a periodic save held past its limit ended the job.
_SAVE_HELD = "tf_gba: a checkpoint save has waited"
_SILENT_WORKER = re.compile(r"^tf_gba: worker:\d+ (did not answer in|answers again after) ")
_CLEAN_EXITS = (0, 75, 143, -signal.SIGKILL)
_PROGRESS = re.compile(r"^step (\d+)/\d+\s+global step (\d+)")
_RESUMED = re.compile(r"resuming an interrupted run \(restart (\d+)\): global step (\d+)")


def _port_drops(ports: List[int]) -> List[List[str]]:
  """iptables rules dropping every TCP packet to or from these local ports."""
  return [["-p", "tcp", direction, str(port), "-j", "DROP"]
          for port in ports for direction in ("--dport", "--sport")]


# Worker steps between the binary's progress lines.
LOG_EVERY = 20


@dataclasses.dataclass
class Fault:
  kind: str
  at: int                        # global step after which it comes
  target: str = ""               # ps / worker / tfdata / job / coordinator
  duration_s: float = 0.0        # network faults
  rate_mbit: int = 0             # bandwidth
  loss_pct: float = 0.0          # loss
  second: str = ""               # double / during_recovery: the second kill
  gap_s: float = 0.0             # double: seconds between the two; during_recovery: after restart


def schedule(mode: str, seed: int, faults: int, global_steps: int, long_window: float = 60.0,
             short: bool = False) -> List[Fault]:
  """`faults` faults at global steps spread over the run, every kind of `mode` at least once when
  there are as many faults as kinds, drawn from `seed`."""
  if short:
    return [Fault(**f) for f in SHORT]
  rng = random.Random(seed)
  kinds = list(MODE_KINDS[mode])
  rng.shuffle(kinds)
  picked = kinds[:faults] + [rng.choice(kinds) for _ in range(faults - len(kinds))]
  rng.shuffle(picked)
  lo, hi = 0.06 * global_steps, 0.88 * global_steps
  slot = (hi - lo) / max(1, faults)
  kills = [k for k in KILLS if k in MODE_KINDS[mode] and k != "kill_coordinator"]
  roles = ["ps", "worker"] if mode != "sync" else ["worker"]
  out = []
  for i, kind in enumerate(picked):
    at = int(lo + slot * i + rng.uniform(0.1, 0.5) * slot)
    f = Fault(kind=kind, at=at)
    if kind == "stall":
      f.target, f.duration_s = rng.choice(roles), float(rng.randint(5, 30))
    elif kind == "partition":
      f.target, f.duration_s = "job", float(rng.randint(10, 30))
    elif kind == "bandwidth":
      f.rate_mbit, f.duration_s = rng.choice((20, 50, 100)), long_window
    elif kind == "loss":
      f.loss_pct, f.duration_s = float(rng.randint(1, 5)), long_window
    elif kind == "double":
      f.target = rng.choice(kills)[len("kill_"):]
      f.second, f.gap_s = rng.choice(kills), rng.uniform(1.0, 5.0)
    elif kind == "during_recovery":
      second = ("kill_ps", "kill_job") if mode != "sync" else ("kill_worker",)
      f.target, f.second, f.gap_s = roles[0], rng.choice(second), rng.uniform(0, 2)
    elif kind == "during_checkpoint":
      f.target = rng.choice(("job", "ps")) if mode != "sync" else "worker"
    elif kind in KILLS:
      f.target = kind[len("kill_"):]
    out.append(f)
  return out


def command(mode: str, embedding: str, steps: int, checkpoint_every: int, stall_limit_s: float,
            seed: int, model_dir: str) -> List[str]:
  cmd = [sys.executable, TRAIN, f"--mode={mode}", "--num_workers=2", f"--steps={steps}",
         f"--log_every={LOG_EVERY}", f"--checkpoint_every_steps={checkpoint_every}",
         "--local_batch_size=64", "--eval_examples=4096", "--stragglers=none",
         "--data_options=num_examples=20000", "--export_dir=", f"--seed={seed}",
         f"--model_dir={model_dir}"]
  if mode != "sync":
    cmd += ["--num_ps=1", f"--stall_timeout_s={stall_limit_s:g}", "--max_restarts=50"]
  if embedding != "vocab":
    cmd.append(f"--embedding={embedding}")
  return cmd


def _env(model_dir: str) -> Dict[str, str]:
  # TMPDIR beside model_dir: a killed process cannot remove what it wrote there.
  tmp = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "tmp")
  os.makedirs(tmp, exist_ok=True)
  return dict(os.environ, TMPDIR=tmp, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


# --- the network inside the job's namespace ---------------------------------------------------

class Network:
  """iptables and tc inside the job's network namespace, or why not (`why`)."""

  def __init__(self, install: bool = True):
    self.iptables, self.why = None, None
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
      self.why = "not root (nsenter and iptables need CAP_NET_ADMIN in the job's namespace)"
      return
    if shutil.which("nsenter") is None or shutil.which("tc") is None:
      self.why = "nsenter or tc not found (util-linux, iproute2)"
      return
    if shutil.which("iptables") is None and install:
      env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
      for cmd in (["apt-get", "install", "-y", "-q", "iptables"],
                  ["sh", "-c", "apt-get update -q && apt-get install -y -q iptables"]):
        if shutil.which("apt-get") and subprocess.run(cmd, env=env, capture_output=True,
                                                      check=False).returncode == 0:
          break
    self.candidates = [c for c in ("iptables", "iptables-legacy") if shutil.which(c)]
    if not self.candidates:
      self.why = "iptables is not installed and could not be (apt-get install iptables)"

  def _run(self, pid: int, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "-t", str(pid), "-n", *args], capture_output=True,
                          text=True, check=False, timeout=30)

  def ready(self, pid: int) -> bool:
    """Whether `pid`'s namespace is a private one where iptables works (chooses the variant)."""
    if self.why:
      return False
    try:
      if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
        self.why = "the job shares this machine's network (no --private_network)"
        return False
    except OSError:
      return False
    if self.iptables is None:
      for c in self.candidates:
        if self._run(pid, c, "-S", "INPUT").returncode == 0:
          self.iptables = c
          break
      else:
        self.why = "iptables fails inside the job's namespace (" + ", ".join(self.candidates) + ")"
        return False
    return True

  def rule(self, pid: int, add: bool, rule: List[str]) -> bool:
    return self._run(pid, self.iptables, "-I" if add else "-D", "INPUT", *rule).returncode == 0

  def tc(self, pid: int, *args) -> bool:
    return self._run(pid, "tc", *args).returncode == 0


# --- the run ----------------------------------------------------------------------------------

class Drill:
  """One run of the binary (and its reruns) under a schedule of faults."""

  def __init__(self, cmd, model_dir, faults, stall_limit_s, checkpoint_every, num_aggregate,
               time_limit_s, network: Optional[Network], seed: int, log=None):
    self.cmd, self.model_dir, self.faults = cmd, model_dir, faults
    self.stall_limit_s, self.interval = stall_limit_s, checkpoint_every // num_aggregate
    self.m = num_aggregate
    self.deadline = time.time() + time_limit_s
    self.network = network
    self.log = log or (lambda line: print(line, flush=True))
    self.rng = random.Random(seed + 1)
    self.lock = threading.Lock()
    self.t0 = time.time()
    self.progress = []       # (t, global step)
    self.resumes = []        # (t, restart, global step)
    self.events = []         # (t, text): the binary's stderr lines, the drill's reruns
    self.stdout, self.stderr = [], []
    self.reruns, self.rcs = 0, []
    # A bound on the reruns, against a command that fails at once every time: each fault ends
    # the command at most twice (sync's double and kill during recovery: both kills end it), and
    # a runtime fault may add one more. 20 outright ended a 26-fault sync run whose 20 reruns
    # had each resumed.
    self.max_reruns = max(20, 3 * len(faults))
    self.proc = None
    self.finished = False
    self.hung = None
    self.records = []

  # the binary
  def _start(self):
    self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=_env(self.model_dir), cwd=ROOT,
                                 start_new_session=True)
    for stream, is_err in ((self.proc.stdout, False), (self.proc.stderr, True)):
      threading.Thread(target=self._pump, args=(stream, is_err), daemon=True).start()

  def _pump(self, stream, is_err):
    path = os.path.join(os.path.dirname(self.model_dir), "stderr.log" if is_err else "stdout.log")
    with open(path, "a", encoding="utf-8") as log:
      for line in stream:
        log.write(line)
        log.flush()
        self._line(line, is_err)

  def _line(self, line, is_err):
    now = time.time()
    with self.lock:
      (self.stderr if is_err else self.stdout).append(line)
      # From stdout only: a failed sync job's traceback on stderr quotes its workers' logs,
      # resumption lines included (a sync run counted a resumption twice, at the wrong time).
      m = None if is_err else _PROGRESS.match(line)
      if m:
        self.progress.append((now, int(m.group(2))))
      r = None if is_err else _RESUMED.search(line)
      if r:
        self.resumes.append((now, int(r.group(1)), int(r.group(2))))
      # The job's own lines: its errors and restarts on stderr; what it did about a slow
      # interval (tf_gba.training.slow_interval) on stdout, beside its progress lines.
      if (is_err and line.startswith(("train.py:", "tf_gba:"))) or line.startswith(
          _SLOW_INTERVAL) or _SILENT_WORKER.match(line):
        self.events.append((now, line.strip()))

  def step(self) -> int:
    with self.lock:
      return self.progress[-1][1] if self.progress else 0

  def progress_since(self, t: float) -> int:
    """Progress lines after time t."""
    with self.lock:
      return sum(1 for pt, _ in self.progress if pt > t)

  def tick(self) -> None:
    """Reruns the command when it ended without finishing; fails on the time limit."""
    if time.time() > self.deadline:
      if self.hung is None:
        self.hung = f"no end within the time limit (global step {self.step()})"
        self._kill_all()
      return
    if self.proc is None or self.finished or self.hung:
      return
    rc = self.proc.poll()
    if rc is None:
      return
    self.rcs.append(rc)
    if rc == 0:
      self.finished = True
      return
    if rc == 2 or self.reruns >= self.max_reruns:
      self.hung = (f"the command ended with exit code {rc} (reruns {self.reruns}, at most "
                   f"{self.max_reruns})")
      return
    self._wait_tree_gone()
    self.reruns += 1
    with self.lock:
      self.events.append((time.time(), f"drill: the command ended with exit code {rc}; rerun "
                                       f"{self.reruns} of the same command"))
    self._start()

  def _wait_tree_gone(self):
    # The job and servers of a killed command go by themselves (they watch their parent).
    tree = getattr(self, "_tree", [])
    end = time.time() + 60
    while time.time() < end and any(process_tree.alive(p) for p in tree):
      time.sleep(0.2)

  def _kill_all(self):
    if self.proc is None:
      return
    for p in [self.proc.pid] + process_tree.descendants(self.proc.pid):
      try:
        os.kill(p, signal.SIGKILL)
      except ProcessLookupError:
        pass

  def wait(self, seconds: float, until=None) -> bool:
    """Ticks for `seconds` or until `until()`; False when the run ended or hung first."""
    end = time.time() + seconds
    while time.time() < end:
      self.tick()
      if self.finished or self.hung:
        return False
      if until is not None and until():
        return True
      time.sleep(0.05)
    return until is None

  def training(self) -> bool:
    """A progress line since the last resumption or rerun started."""
    with self.lock:
      last = max([t for t, _ in self.events] + [t for t, _, _ in self.resumes] + [self.t0])
      return bool(self.progress) and self.progress[-1][0] > last

  # the faults
  def _pid(self, target: str) -> Optional[int]:
    root = self.proc.pid
    if target == "coordinator":
      return root
    if target == "job":
      return process_tree.job_process(root) or root  # sync: the command is the job
    # "tfdata": any server of the tf.data service, its workers and its dispatcher; "worker:1"
    # that one.
    prefix = "tfdata_" if target == "tfdata" else target + ":"
    servers = sorted((name, pid) for name, pid in process_tree.servers(root).items()
                     if name == target or name.startswith(prefix))
    return self.rng.choice(servers)[1] if servers else None

  def _kill(self, target: str, sig=signal.SIGKILL) -> str:
    pid = self._pid(target)
    if pid is None:
      return f"no {target} to kill"
    name = process_tree.task(pid) or target
    if target == "coordinator":
      self._tree = [pid] + process_tree.descendants(pid)
    try:
      os.kill(pid, sig)
    except ProcessLookupError:
      return f"{name} (pid {pid}) already gone"
    return f"{signal.Signals(sig).name} {name} (pid {pid})"

  def inject(self, f: Fault) -> dict:
    rec = {"kind": f.kind, "at_global_step": f.at, "step_seen": self.step(),
           "t": round(time.time() - self.t0, 1), "did": []}
    rec["last_step_before"] = self.step()
    if f.kind in KILLS:
      rec["did"].append(self._kill(f.target))
    elif f.kind == "sigterm":
      self._tree = [self.proc.pid] + process_tree.descendants(self.proc.pid)
      rec["did"].append(self._kill("coordinator", signal.SIGTERM))
    elif f.kind == "double":
      rec["did"].append(self._kill(f.target))
      self.wait(f.gap_s)
      second = f.second[len("kill_"):]
      if self._pid(second) is None:
        # The first kill took it with it (sync: the command ended, and its rerun has no worker
        # yet; a restarted worker not yet listed): the second fault is the command's, within
        # the same seconds, rather than none.
        second = "coordinator"
      rec["did"].append(f"+{f.gap_s:.1f} s: " + self._kill(second))
    elif f.kind == "during_recovery":
      old = set(process_tree.servers(self.proc.pid).values())  # the failing job's
      n = len(self.events)
      rec["did"].append(self._kill(f.target))
      # The supervisor's restart, or (sync: no supervisor) the command's end and the rerun.
      self.wait(120, lambda: any("restarting the job" in e or e.startswith("drill: the command")
                                 for _, e in self.events[n:]))
      target = f.second[len("kill_"):]
      # The restarted job's servers are up (or its job process is): it is restoring.
      self.wait(120, lambda: self._fresh(target, old))
      self.wait(f.gap_s)
      before = self.training()
      rec["did"].append(f"+{f.gap_s:.1f} s after the restarted job's {target} came up, "
                        f"{'after' if before else 'before'} its first progress line: "
                        + self._kill(target))
    elif f.kind == "during_checkpoint":
      seen = self.wait(120, self._checkpoint_being_written)
      # The fault is the kill: its time and step are the kill's.
      rec["t"], rec["step_seen"] = round(time.time() - self.t0, 1), self.step()
      rec["did"].append(("while a checkpoint was being written: " if seen else
                         "no checkpoint write caught in 120 s: ") + self._kill(f.target))
    elif f.kind in NETWORK:
      rec.update(self._network(f))
    rec["t_end"] = round(time.time() - self.t0, 1)
    return rec

  def _restarted_in_place(self, rec: dict) -> bool:
    """Only servers the local cluster starts again in place were killed (a parameter-server
    mode's workers and tf.data workers): the job goes on, and no restart of it comes to wait
    for. (A hash run's `double` of a tf.data worker and a worker waited 120 s for one, while the
    job trained on: the faults due meanwhile came late, and six came after the run's end.)"""
    if "--mode=sync" in self.cmd:
      return False  # a sync worker's loss ends the command
    killed = re.findall(r"SIG[A-Z]+ (\S+) \(pid", " ".join(rec["did"]))
    return bool(killed) and all(re.fullmatch(r"(tfdata_)?worker:\d+", k) for k in killed)

  def _fresh(self, target, old) -> bool:
    if target == "job":
      pid = process_tree.job_process(self.proc.pid)
      return pid is not None and pid not in getattr(self, "_old_jobs", set())
    return any(p not in old for n, p in process_tree.servers(self.proc.pid).items()
               if n.startswith(target + ":"))

  def _checkpoint_being_written(self) -> bool:
    try:
      return any("_temp" in name for name in os.listdir(self.model_dir))
    except OSError:
      return False

  def _network(self, f: Fault) -> dict:
    root = self.proc.pid
    net = self.network
    if net is None or not net.ready(root):
      why = net.why if net is not None else "--no_network"
      return {"skipped": why, "did": [f"skipped: {why}"]}
    start, step0 = time.time(), self.step()
    rules, did = [], []
    if f.kind == "stall":
      pid = self._pid(f.target)
      ports = process_tree.listening_ports(pid) if pid else []
      rules += _port_drops(ports)
      did.append(f"{process_tree.task(pid) if pid else f.target}'s port(s) {ports} dropped for "
                 f"{f.duration_s:g} s ({net.iptables})")
    elif f.kind == "partition":
      # The coordinator cut off from every server while they live and reach each other: the
      # local ports of the connections the job process holds to the servers (and any port it
      # listens on). (A connection it opens anew, on a new port, gets
      # through; TF's channels are long-lived.)
      pid = self._pid("job")
      ports = process_tree.local_ports(pid) if pid else []
      rules += _port_drops(ports)
      did.append(f"the coordinator (pid {pid}) cut off: its {len(ports)} port(s) dropped for "
                 f"{f.duration_s:g} s ({net.iptables})")
    elif f.kind == "loss":
      rules.append(["-m", "statistic", "--mode", "random", "--probability",
                    f"{f.loss_pct / 100:.4f}", "-j", "DROP"])
      did.append(f"{f.loss_pct:g} % of packets dropped for {f.duration_s:g} s ({net.iptables})")
    if f.kind == "bandwidth":
      ok = net.tc(root, "qdisc", "replace", "dev", "lo", "root", "tbf", "rate",
                  f"{f.rate_mbit}mbit", "burst", "256kb", "latency", "200ms")
      # The burst must hold a whole packet: loopback's MTU is 64 KiB, and tbf drops a packet
      # larger than its burst (with 256kbit, 32 KiB, a first run's 100 Mbit/s limit stopped
      # every large transfer: no step in 60 s, a Stalled restart).
      did.append(f"loopback limited to {f.rate_mbit} Mbit/s for {f.duration_s:g} s (tc tbf)"
                 + ("" if ok else ": tc failed"))
    added = [r for r in rules if net.rule(root, True, r)]
    if len(added) != len(rules):
      did.append(f"{len(rules) - len(added)} iptables rule(s) failed")
    self.wait(f.duration_s)
    if self.proc.pid == root and process_tree.alive(root):  # else the namespace went with it
      for r in added:
        net.rule(root, False, r)
      if f.kind == "bandwidth":
        net.tc(root, "qdisc", "del", "dev", "lo", "root")
    elapsed = time.time() - start
    with self.lock:
      during = [(t, s) for t, s in self.progress if start < t <= start + elapsed]
    return {"did": did, "window_s": round(elapsed, 1), "window_start": start, "step0": step0,
            "global_steps_during": (during[-1][1] - step0) if during else 0,
            "progress_lines_during": len(during)}

  def stall_reaction(self, rec: dict) -> str:
    """What the job did about a stall, from the stall's start until it trained again: one line."""
    start, elapsed = rec["window_start"], rec["window_s"]
    with self.lock:
      # The supervisor's restart, or (sync: no supervisor) the command's end and rerun.
      restarted = [e for t, e in self.events if t > start and (
          "restarting the job" in e or e.startswith("drill: the command ended"))]
      # The job's own line about the slow interval (tf_gba.training.slow_interval), printed with
      # the first progress line after the stall: it knows which worker fell behind, where the
      # drill sees no progress line at all while the line waits for the stalled link.
      said = [e for t, e in self.events if start < t <= start + elapsed + 30
              and (e.startswith(_SLOW_INTERVAL) or " did not answer in " in e)]
    if restarted:
      # Why, in the job's own first line after the stall began (Stalled past --stall_timeout_s,
      # a save held past its limit, a lost server, sync's lost peer).
      with self.lock:
        cause = next((e for t, e in self.events if t > start and (
            e.startswith("train.py:") or e.startswith(_SAVE_HELD))), restarted[0])
      return f"restarted from the last checkpoint ({cause})"
    if said:
      verdict = "worked around" if "worked around" in said[0] else "waited for"
      return f"{verdict}: the job said so ({said[0][len('tf_gba: '):]})"
    if rec["global_steps_during"] > 0:
      return (f"worked around: the others went on ({rec['global_steps_during']} global steps "
              f"during the {elapsed:.0f} s stall)")
    return f"waited for: no global step during the {elapsed:.0f} s stall"

  def run(self) -> None:
    self._start()
    for f in self.faults:
      def due():
        return self.step() >= f.at and self.training()
      if not self.wait(1e9, due):
        self.records.append({"kind": f.kind, "at_global_step": f.at,
                             "did": ["not injected: the run ended first"]})
        continue
      self._old_jobs = {process_tree.job_process(self.proc.pid)}
      n_events, t_inject = len(self.events), time.time()
      rec = self.inject(f)
      # What followed: the job's reaction (a line of its own, or two progress lines: it went on),
      # then until it trains again (or its end).
      if f.kind in _RESTARTS and not self._restarted_in_place(rec):
        # Until the job's restart (or the command's rerun) is under way: it may print a progress
        # line or two before it notices.
        self.wait(120, lambda: any(("restarting the job" in e or e.startswith("drill:"))
                                   for _, e in self.events[n_events:]))
      elif f.kind in ("stall", "partition"):
        # Until the job has either restarted or shown two progress lines since the stall ended: a
        # job that worked around a stalled worker can still restart once its next checkpoint has
        # waited for that worker past the stall limit (the reaction is judged after that).
        ended = time.time()
        self.wait(self.stall_limit_s + 60, lambda: self.progress_since(ended) >= 2 or any(
            "restarting the job" in e or e.startswith("drill:") for _, e in self.events[n_events:]))
      else:
        self.wait(60, lambda: len(self.events) > n_events or self.progress_since(t_inject) >= 2 +
                  int(rec.get("progress_lines_during", 0)))
      self.wait(float(self.deadline - time.time()), lambda: self.training())
      rec["trained_again_after_s"] = round(time.time() - self.t0 - rec["t"], 1)
      if f.kind in ("stall", "partition") and "window_s" in rec:
        rec["reaction"] = self.stall_reaction(rec)
      self.records.append(rec)
      self.log(_fault_line(rec))
    self.wait(1e9)
    self._attribute()

  def _attribute(self) -> None:
    """Each resumption to the fault before it; steps redone = the last global step a progress
    line showed before the failure minus the step resumed at."""
    with self.lock:
      events = list(self.events)
      resumes = list(self.resumes)
      progress = list(self.progress)
    for i, rec in enumerate(self.records):
      if "t" not in rec:
        continue
      t0 = self.t0 + rec["t"]
      t1 = (self.t0 + self.records[i + 1]["t"]) if i + 1 < len(self.records) and \
          "t" in self.records[i + 1] else float("inf")
      rec["job_said"] = [e for t, e in events if t0 <= t < t1]
      mine = [(t, k, s) for t, k, s in resumes if t0 <= t < t1]
      rec["resumed_at"] = [s for _, _, s in mine]
      redone = []
      for t, _, s in mine:
        before = [g for pt, g in progress if pt < t]
        # The failure's last progress line: the last one before this fault (or its resumption).
        last = max([g for pt, g in progress if pt <= t0] or [0]) if not redone else \
            (before[-1] if before else 0)
        redone.append(max(0, last - s))
      rec["steps_redone"] = redone


def _fault_line(rec: dict) -> str:
  return (f"[{rec.get('t', float('nan')):7.1f} s] global step {rec.get('step_seen', '?'):>5}  {rec['kind']:<18} "
          + "; ".join(rec["did"]) + (f"  -> {rec['reaction']}" if "reaction" in rec else "")
          + f"  (training again {rec.get('trained_again_after_s', '?')} s later)")


# --- the verdict ------------------------------------------------------------------------------

def verdict(drill: Drill, summary: Optional[dict], steps: int, reference: Optional[dict]) -> dict:
  checks = {}

  def check(name, ok, detail):
    checks[name] = {"ok": ok, "detail": detail}

  if summary is None:
    check("target_reached", False, drill.hung or "no summary.json")
    check("no_hang", drill.hung is None, drill.hung or "ended without a summary")
    return checks
  target = summary.get("target_global_step")
  check("target_reached", drill.finished and summary["global_step"] >= target,
        f"global step {summary['global_step']} of {target}, exit codes {drill.rcs}")
  dl = summary.get("data_list") or {}
  if dl:
    restored = dl.get("restored_batches", 0) or 0
    uncounted = dl.get("uncounted_batches", 0) or 0
    # Trained in the last run by a worker restarted in place, after the coordinator's last read
    # of its counts: at most one progress interval and one function per such worker; none
    # without one (then a difference is a miscount).
    in_run = dl.get("uncounted_by_restarted_workers", 0) or 0
    restarted = dl.get("workers_restarted_in_run") or 0
    bound = restarted * (LOG_EVERY + (summary.get("steps_per_execution") or 1))
    total = restored + dl["batches"] + uncounted + in_run
    check("exactly_once", total == steps and dl.get("duplicates", 0) == 0 and
          not dl.get("lost") and 0 <= in_run <= bound,
          f"restored {restored} + trained {dl['batches']} + uncounted by the checkpoint "
          f"(reported, trained again) {uncounted} + uncounted by {restarted} worker(s) restarted "
          f"in the last run {in_run} (at most {bound}) = {total} of {steps} batches; duplicates "
          f"in a pass {dl.get('duplicates')}, lost {dl.get('lost')}; re-read after failures "
          f"(reported) {summary.get('batches_reread')}")
  else:
    check("exactly_once", None, "no shared data list in this mode (not checked)")
  # How the command may end: done (0), restartable with its one line (75, where no supervisor
  # restarts the job), preempted (143) or killed by the drill (-9). Any other exit (1: a
  # traceback) is a fault the job did not handle, even though the rerun resumes.
  unhandled = [rc for rc in drill.rcs if rc not in _CLEAN_EXITS]
  check("clean_exits", not unhandled,
        f"exit codes {drill.rcs}" + (f"; unhandled: {unhandled}" if unhandled else ""))
  redone = [(r["kind"], s) for r in drill.records for s in r.get("steps_redone", [])]
  worst = max([s for _, s in redone] or [0])
  check("redone_per_fault", worst <= drill.interval,
        f"global steps redone per resumption {[s for _, s in redone]} (at most "
        f"{drill.interval}, one checkpoint interval); summary steps_redone "
        f"{summary.get('steps_redone')}, batches_reread {summary.get('batches_reread')}")
  m = summary["num_aggregate"]
  applied = (summary["global_step"] - summary.get("start_global_step", 0)) * m
  pushes = summary.get("pushes")
  slack = summary.get("worker_restarts", 0) + summary.get("num_workers", 0)
  dropped = summary.get("dropped_batches", 0)
  # Every push takes a token and M tokens make a global step; a gradient dropped as too stale
  # keeps its place in the step (zero), so dropped pushes are among the step's M.
  check("gradients", pushes is not None and 0 <= pushes - applied <= slack and
        not summary.get("duplicate_pushes"),
        f"last segment: {pushes} pushes vs {applied} = (global step - start) x M (a retried step "
        f"after a worker restart or a step in flight at the end may add up to {slack}); "
        f"{dropped} dropped as too stale; duplicate pushes {summary.get('duplicate_pushes')}")
  gaps = _gaps(drill)
  check("no_hang", drill.hung is None and drill.finished,
        (drill.hung or "ended") + f"; longest time without a progress line {gaps:.0f} s "
        f"(stall limit {drill.stall_limit_s:g} s + a restart)")
  net = [r for r in drill.records if r["kind"] in NETWORK]
  skipped = [r for r in net if "skipped" in r]
  check("network_faults", None if skipped else True,
        f"{len(net) - len(skipped)} made, {len(skipped)} skipped"
        + (f" ({skipped[0]['skipped']})" if skipped else ""))
  if reference:
    lo, hi = min(reference["auc"]), max(reference["auc"])
    check("auc", summary["eval_auc"] >= lo - 0.005,
          f"{summary['eval_auc']:.4f} against undisturbed {lo:.4f}-{hi:.4f} "
          f"(seeds {reference['seeds']}; one-sided, 0.005 below the lowest)")
  else:
    check("auc", None, f"{summary['eval_auc']:.4f} (no undisturbed runs: --reference_seeds)")
  return checks


def _gaps(drill: Drill) -> float:
  times = [drill.t0] + [t for t, _ in drill.progress]
  return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def undisturbed(args, seed: int, steps: int, out_dir: str) -> dict:
  """An undisturbed run of the same command (cached under out_dir by command)."""
  key = f"chaos_undisturbed_{args.mode}_{args.embedding}_{steps}_seed{seed}.json"
  path = os.path.join(out_dir, key)
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  model_dir = os.path.join(args.work_dir, f"undisturbed_{args.mode}_{args.embedding}_{seed}", "m")
  shutil.rmtree(os.path.dirname(model_dir), ignore_errors=True)
  cmd = command(args.mode, args.embedding, steps, args.checkpoint_every, args.stall_limit_s,
                seed, model_dir)
  start = time.time()
  rc = subprocess.run(cmd, env=_env(model_dir), cwd=ROOT, capture_output=True, text=True,
                      check=False).returncode
  with open(os.path.join(model_dir, "summary.json")) as f:
    s = json.load(f)
  out = {"seed": seed, "rc": rc, "wall_s": time.time() - start, "auc": s["eval_auc"],
         "global_step": s["global_step"]}
  os.makedirs(out_dir, exist_ok=True)  # a fresh clone has no runs/ yet
  with open(path, "w") as f:
    json.dump(out, f)
  return out


def main(argv=None) -> int:
  p = ArgumentParser(prog="python -m benchmarks.chaos", program=PROGRAM,
                     description=__doc__.split("\n\n")[0])
  p.add_argument("--mode", default="gba", choices=sorted(MODE_KINDS))
  p.add_argument("--embedding", default="vocab", choices=["vocab", "hash"])
  p.add_argument("--seed", type=int, default=0, help="the schedule's and the binary's seed")
  p.add_argument("--duration_s", type=float, default=600.0,
                 help=f"sets --steps to {STEPS_PER_SECOND} worker steps per second of it")
  p.add_argument("--steps", type=int, default=None, help="worker steps of the run")
  p.add_argument("--faults", type=int, default=13,
                 help="faults in the schedule (every kind of the mode at least once from 13)")
  p.add_argument("--checkpoint_every", type=int, default=None,
                 help="--checkpoint_every_steps of the binary (default 200; short: 100)")
  p.add_argument("--stall_limit_s", type=float, default=None,
                 help="--stall_timeout_s of the binary: a stall longer than this restarts the "
                      "job (default 20; short: 15)")
  p.add_argument("--network_window_s", type=float, default=60.0,
                 help="seconds a bandwidth limit or packet loss lasts")
  p.add_argument("--short", action="store_true",
                 help="the test's schedule: 1200 gba steps, 6 faults of 5 kinds, seeded")
  p.add_argument("--reference_seeds", default="",
                 help="comma-separated binary seeds of undisturbed runs to compare AUC and wall "
                      "time with (cached under the output directory)")
  p.add_argument("--references_only", action="store_true",
                 help="run (or read from the cache) the --reference_seeds' undisturbed runs only")
  p.add_argument("--no_network", action="store_true", help="skip the network faults")
  p.add_argument("--time_limit_s", type=float, default=None,
                 help="a run not ended by then is a hang (default 3 x duration + 600; short: 420)")
  p.add_argument("--work_dir", default=None, help="model_dir's parent (default: a temporary one)")
  p.add_argument("--out", default=None, help="results JSON (default runs/chaos_<mode>_...json)")
  p.add_argument("--dry_run", action="store_true",
                 help="print the command and the schedule; run nothing")
  args = p.parse_args(argv)
  if args.short and (args.mode != "gba" or args.embedding != "vocab"):
    refuse(PROGRAM, "--short is the gba schedule: drop --mode / --embedding, or --short")
  if args.embedding == "hash" and args.mode == "sync":
    refuse(PROGRAM, "--embedding=hash is drilled with --mode=gba")
  if args.faults < 1:
    refuse(PROGRAM, "--faults must be >= 1")
  short = args.short
  steps = SHORT_STEPS if short else (args.steps or
                                     int(args.duration_s * STEPS_PER_SECOND) // 20 * 20)
  args.checkpoint_every = args.checkpoint_every or (SHORT_CHECKPOINT_EVERY if short else 200)
  args.stall_limit_s = args.stall_limit_s or (SHORT_STALL_LIMIT_S if short else 20.0)
  m = 2  # --num_workers=2, global batch = 2 local batches (gba, sync)
  faults = schedule(args.mode, args.seed, args.faults, steps // m, args.network_window_s,
                    short=short)
  time_limit = args.time_limit_s or (420.0 if short else 3 * args.duration_s + 600)
  args.work_dir = args.work_dir or os.path.join(
      os.environ.get("TMPDIR", "/tmp"), f"tf_gba_chaos_{args.mode}_{args.embedding}_{args.seed}")
  model_dir = os.path.join(args.work_dir, "m")
  cmd = command(args.mode, args.embedding, steps, args.checkpoint_every, args.stall_limit_s,
                args.seed, model_dir)
  name = "short" if short else f"{args.mode}_{args.embedding}_seed{args.seed}"
  out = args.out or os.path.join(ROOT, "runs", f"chaos_{name}.json")
  # As a line of its own, relative to the repository: the documented commands' check dry-runs it.
  print("chaos drill: the binary's command (rerun after a killed command or a preemption):")
  print(" ".join([os.path.relpath(cmd[1], ROOT)] + [shlex.quote(a) for a in cmd[2:]]),
        flush=True)
  limit = (f"stall limit {args.stall_limit_s:g} s (--stall_timeout_s)" if args.mode != "sync"
           else "no stall limit (sync has no --stall_timeout_s)")
  print(f"  {limit}, checkpoint every "
        f"{args.checkpoint_every} worker steps ({args.checkpoint_every // m} global), time limit "
        f"{time_limit:.0f} s", flush=True)
  for f in faults:
    extra = {k: v for k, v in dataclasses.asdict(f).items() if v and k not in ("kind", "at")}
    print(f"  at global step {f.at:>5}: {f.kind} {extra or ''}", flush=True)
  if args.dry_run:
    return 0
  network = None if args.no_network else Network()
  if network is not None and network.why:
    print(f"chaos drill: network faults skipped: {network.why}", flush=True)
  shutil.rmtree(args.work_dir, ignore_errors=True)
  os.makedirs(args.work_dir)
  reference = None
  if args.reference_seeds:
    refs = [undisturbed(args, int(s), steps, os.path.dirname(out))
            for s in args.reference_seeds.split(",")]
    reference = {"seeds": [r["seed"] for r in refs], "auc": [r["auc"] for r in refs],
                 "wall_s": [r["wall_s"] for r in refs]}
    print(f"undisturbed: AUC {reference['auc']}, wall {[round(w) for w in reference['wall_s']]} s",
          flush=True)
  if args.references_only:
    return 0
  drill = Drill(cmd, model_dir, faults, args.stall_limit_s, args.checkpoint_every, m,
                time_limit, network, args.seed)
  drill.run()
  wall = time.time() - drill.t0
  try:
    with open(os.path.join(model_dir, "summary.json")) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    summary = None
  checks = verdict(drill, summary, steps, reference)
  ok = all(c["ok"] is not False for c in checks.values())
  print("=" * 72)
  for r in drill.records:
    print(_fault_line(r))
    print(f"{'':12}job: {' | '.join(r.get('job_said', [])) or 'nothing on stderr'}; resumed at "
          f"{r.get('resumed_at')}, global steps redone {r.get('steps_redone')}")
  stalls = [r for r in drill.records if "reaction" in r]
  for r in stalls:
    print(f"{r['kind']}: {r['did'][0]} -> {r['reaction']}")
  if summary:
    print(f"summary: restarts {summary.get('restarts')} {summary.get('restart_causes')}, "
          f"worker restarts {summary.get('worker_restarts')}, tf.data worker restarts "
          f"{summary.get('tfdata_worker_restarts')}, steps redone {summary.get('steps_redone')}, "
          f"batches re-read {summary.get('batches_reread')}, AUC {summary.get('eval_auc'):.4f}")
  ref_wall = f" (undisturbed {[round(w) for w in reference['wall_s']]} s)" if reference else ""
  print(f"wall time {wall:.0f} s{ref_wall}, reruns of the command {drill.reruns}")
  for name_, c in checks.items():
    state = {True: "PASS", False: "FAIL", None: "SKIP"}[c["ok"]]
    print(f"  {state}  {name_:<18} {c['detail']}")
  print(f"verdict: {'PASS' if ok else 'FAIL'}", flush=True)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump({"command": cmd, "seed": args.seed, "steps": steps, "wall_s": wall,
               "faults": drill.records, "checks": checks, "verdict": "PASS" if ok else "FAIL",
               "reference": reference, "reruns": drill.reruns, "exit_codes": drill.rcs,
               "longest_gap_s": _gaps(drill), "network": None if network is None else
               {"iptables": network.iptables, "skipped": network.why},
               "summary": summary}, f, indent=1, default=str)
  print(f"results: {out}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
