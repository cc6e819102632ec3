"""The shared data list: every worker pulls the next batch of the day from one queue.

In the GBA paper the parameter-server side keeps a "data list" of batch addresses and each worker
takes the next one when it starts a step, so a fast worker reads more batches than a slow one and
every batch of a day is read once (SPEC.md, "Data list"). Here the queue is a tf.data service job
with dynamic sharding: the dispatcher hands out the elements of a small source dataset, one element
per batch (its batch id), to whichever worker asks next. The worker turns the id into the batch's
rows itself, from the day's rows held in its input pipeline, so only 8-byte ids cross the service
(one element per batch, not per row: one split per row measured 3-4x slower).

Pieces:

* `load_rows(spec, day, ...)`: one day's train rows of any source, as NumPy columns.
* `DataList`: batches of those rows in a seeded order; `dataset(service, job_name)` is what each
  parameter-server worker reads: `(features, label, batch_id)` through the service.
* `start_dispatcher` / `start_worker`: the tf.data service servers (in this process).
* `DayCounters`: per-worker counters of what reached the train step (batch ids seen, examples,
  batches, whether the worker has seen the end of the day), to check exactly-once delivery from
  what was trained on rather than from the dispatcher's view.

End of the day: a worker reads with `get_next_as_optional()`; once the job is exhausted it gets an
empty optional (never an OutOfRange error, which would make the coordinator cancel the other
workers' steps and lose the batches their service clients had already fetched). The run keeps
scheduling steps until every worker has seen the end, so every fetched batch is trained on.
"""

from typing import Dict, List, Optional, Tuple
import warnings

import numpy as np
import tensorflow as tf

from tf_gba import data as data_lib
from tf_gba.common import autograph
from tf_gba.data import pipeline

# tf.data warns whenever a dataset's options are read while a graph is built, which the service
# dataset does in every worker's dataset_fn; the options it reads are its own, so the warning
# says nothing a user could act on.
warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data options",
                        category=UserWarning)

# Errors of reading a per-worker value while its worker is down (or being started again).
_WORKER_DOWN = (tf.errors.CancelledError, tf.errors.UnavailableError, tf.errors.AbortedError,
                tf.errors.NotFoundError)

# The dispatcher forgets a tf.data worker that missed heartbeats for this long.
DEFAULT_WORKER_TIMEOUT_MS = 5000


def load_rows(spec: str, day: Optional[int], strict: bool = False,
              **options) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
  """The train rows of `day` (None: every day, in order) as NumPy columns and labels."""
  ds = data_lib.make_dataset(spec, split="train", batch_size=65536, day=day, repeat=False,
                             shuffle_seed=None, strict=strict, **options)
  feats: Dict[str, list] = {}
  labels = []
  for x, y in ds:
    for name, value in x.items():
      feats.setdefault(name, []).append(value.numpy())
    labels.append(y.numpy())
  if not labels:
    raise ValueError(f"Data spec {spec!r} has no train rows for day {day}.")
  return ({name: np.concatenate(v) for name, v in feats.items()},
          np.concatenate(labels).astype(np.float32))


class DataList:
  """A day's rows cut into batches, handed out one batch id at a time by a tf.data service job.

  Args:
    features, labels: the day's rows (`load_rows`).
    batch_size: rows per batch; the last batch of the day may be smaller.
    seed: rows are shuffled into batches with this seed, and each pass over the day visits the
      batches in its own seeded order; None keeps the rows and batches in order.
    passes: how many times the source lists every batch (runs of a fixed step count may need
      more than one pass over the day).
  """

  def __init__(self, features: Dict[str, np.ndarray], labels: np.ndarray, batch_size: int,
               seed: Optional[int] = 0, passes: int = 1):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if passes < 1:
      raise ValueError(f"passes must be >= 1, got {passes}.")
    self.num_rows = int(len(labels))
    if self.num_rows == 0:
      raise ValueError("DataList needs at least one row.")
    for name, col in features.items():
      if len(col) != self.num_rows:
        raise ValueError(f"Feature {name!r} has {len(col)} rows, labels have {self.num_rows}.")
    self.batch_size = int(batch_size)
    self.num_batches = -(-self.num_rows // self.batch_size)
    self.passes = int(passes)
    rng = np.random.default_rng(seed)
    self.row_order = (rng.permutation(self.num_rows) if seed is not None
                      else np.arange(self.num_rows)).astype(np.int64)
    orders = [rng.permutation(self.num_batches) if seed is not None
              else np.arange(self.num_batches) for _ in range(self.passes)]
    self.batch_order = np.concatenate(orders).astype(np.int64)
    self._rng = rng if seed is not None else None
    self._features = features
    self._labels = labels.astype(np.float32)

  def skip_trained(self, seen: np.ndarray, min_entries: int = 0) -> int:
    """Drops from the list what `seen[b]` (times batch b was trained) says is done; returns how
    many entries were dropped.

    Pass k of the list keeps batch b only if it was trained at most k times: a resumed run takes
    up the list at the pass and position it had reached, as far as per-batch counts can tell
    (within a pass the list's order is not kept as a position: any untrained batch of the pass,
    e.g. one a worker had fetched but not trained when its run died, is listed again). Further
    seeded passes are appended while the list has fewer than `min_entries` entries.
    """
    seen = np.asarray(seen, np.int64)
    if seen.shape != (self.num_batches,):
      raise ValueError(f"seen has shape {seen.shape}, the list has {self.num_batches} batches.")
    orders = self.batch_order.reshape(self.passes, self.num_batches)
    kept = [order[seen[order] <= k] for k, order in enumerate(orders)]
    before = len(self.batch_order)
    order = np.concatenate(kept).astype(np.int64)
    dropped = before - len(order)
    while len(order) < min_entries:
      extra = (self._rng.permutation(self.num_batches) if self._rng is not None
               else np.arange(self.num_batches))
      order = np.concatenate([order, extra.astype(np.int64)])
      self.passes += 1
    self.batch_order = order
    return dropped

  def rows_of(self, batch_id: int) -> np.ndarray:
    """Row indices (into the day's rows) of batch `batch_id`."""
    return self.row_order[batch_id * self.batch_size:(batch_id + 1) * self.batch_size]

  def batch_sizes(self) -> np.ndarray:
    sizes = np.full(self.num_batches, self.batch_size, np.int64)
    sizes[-1] = self.num_rows - self.batch_size * (self.num_batches - 1)
    return sizes

  def source(self) -> tf.data.Dataset:
    """What the dispatcher splits: one element (a batch id) per batch, in the list's order."""
    order = tf.constant(self.batch_order)
    return tf.data.Dataset.range(len(self.batch_order)).map(lambda i: tf.gather(order, i))

  def dataset(self, service: str, job_name: str,
              max_outstanding_requests: Optional[int] = 1) -> tf.data.Dataset:
    """`(features, label, batch_id)` batches, each taken from the shared list when asked for.

    Every reader of the same `job_name` shares one queue: together they read each listed batch
    once. Call it in a ParameterServerStrategy `dataset_fn`; each worker then pulls batches as
    fast as it consumes them.

    `max_outstanding_requests`: batches a worker's service client may have asked for ahead of
    its step. The default 1 keeps the next batch in flight (its fetch overlaps the step) and no
    more: a client left to prefetch takes batches at its fetch rate, not its training rate, and
    a slow worker would hold batches that faster workers could have trained on. For the same
    reason the strategy's per-worker iterator must not buffer either
    (`SharedInput.dataset_creator`).
    """
    # TF caches the reader's decompression function per process (one trace for every dataset);
    # a process that starts a second cluster (tests, benchmarks) would send the new workers a
    # graph calling a function they were never given. A fresh trace per dataset avoids that.
    from tensorflow.python.data.experimental.ops import data_service_ops  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
    getattr(data_service_ops, "_get_uncompress_func", None) and (
        data_service_ops._get_uncompress_func.cache_clear())  # pylint: disable=protected-access
    # Without autotuning both where the service iterates the registered dataset and, below,
    # where a worker iterates what it reads.
    ids = pipeline.on_a_worker(self.source()).apply(tf.data.experimental.service.distribute(
        processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC,
        service=service if "://" in service else f"grpc://{service}", job_name=job_name,
        max_outstanding_requests=max_outstanding_requests,
        compression=None))  # 8-byte ids
    columns = {name: tf.constant(np.asarray(col)) for name, col in self._features.items()}
    label = tf.constant(self._labels)
    row_order = tf.constant(self.row_order)
    batch, num_rows = self.batch_size, self.num_rows

    @tf.autograph.experimental.do_not_convert
    def gather(batch_id):
      start = batch_id * batch
      rows = row_order[start:tf.minimum(start + batch, num_rows)]
      return ({name: tf.gather(col, rows) for name, col in columns.items()},
              tf.gather(label, rows), batch_id)

    # No prefetch here: a batch prefetched by a worker is a batch no faster worker can take.
    # The reader's own options, for the worker's iterator of it (`pipeline.on_a_worker`).
    return pipeline.on_a_worker(ids.map(gather))


def start_dispatcher(port: int = 0, worker_timeout_ms: int = DEFAULT_WORKER_TIMEOUT_MS
                     ) -> tf.data.experimental.service.DispatchServer:
  """A tf.data service dispatcher in this process; `.target` is its "grpc://host:port"."""
  return tf.data.experimental.service.DispatchServer(
      tf.data.experimental.service.DispatcherConfig(port=port,
                                                    worker_timeout_ms=worker_timeout_ms))


def start_worker(dispatcher_address: str, port: int, host: str = "127.0.0.1"
                 ) -> tf.data.experimental.service.WorkerServer:
  """A tf.data service worker in this process, registered with the dispatcher.

  The worker's address is given explicitly: the default ("localhost:port") may resolve to an
  interface the worker does not listen on, and on a real cluster must be reachable by readers.
  """
  address = dispatcher_address.split("://", 1)[-1]
  return tf.data.experimental.service.WorkerServer(
      tf.data.experimental.service.WorkerConfig(dispatcher_address=address,
                                                worker_address=f"{host}:{port}", port=port))


_READ_TOGETHER = {}


def _worker_variables(var) -> Optional[list]:
  """Each worker's copy of a per-worker variable as the coordinator holds it (an object of its
  own once the worker restarted and the variable was created again); None if not per-worker."""
  remotes = getattr(getattr(var, "_per_worker_vars", None), "_values", None)
  if remotes is None:
    return None
  # `_get_values` waits while a worker's variable is being created again, as `read_each` does.
  return [remote._get_values() for remote in remotes]  # pylint: disable=protected-access


def _read_together(handles, dtype):
  """Reads per-worker variables (their handles on the workers) in one function call."""
  # One function per dtype and number of workers: TF's retracing cannot generalise a signature
  # to another number of arguments (a process that runs jobs of 2, then 4 workers).
  key = (dtype, len(handles))
  if key not in _READ_TOGETHER:
    _READ_TOGETHER[key] = tf.function(
        lambda *hs: [tf.raw_ops.ReadVariableOp(resource=h, dtype=dtype) for h in hs],
        autograph=False)
  return _READ_TOGETHER[key](*handles)


class DayCounters:
  """What the workers trained on: per worker, times each batch id was trained, and totals.

  Variables live on each worker (per-worker variables: no round trip to a parameter server in the
  step). Create under the strategy's scope after its ClusterCoordinator exists.
  """

  def __init__(self, num_batches: int):
    self.num_batches = int(num_batches)
    self.seen = tf.Variable(tf.zeros([self.num_batches], tf.int32), trainable=False,
                            per_worker_variable=True, name="data_list_seen")
    self.examples = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                per_worker_variable=True, name="data_list_examples")
    self.batches = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                               per_worker_variable=True, name="data_list_batches")
    self.exhausted = tf.Variable(tf.constant(0, tf.int32), trainable=False,
                                 per_worker_variable=True, name="data_list_exhausted")
    # Per counter (by id), per worker: the last value read, what the worker had counted before
    # each restart of its process, and its copy of the variable when read (read_counts).
    self._last, self._base, self._variables = {}, {}, {}

  @autograph.framework_function
  def handles(self):
    """This worker's counters, for `record_step`: read in the scheduled function itself, outside
    any cond or loop (a per-worker variable is bound to the worker running the function where the
    function captures it, which a cond branch's or a loop body's captures are not; a handle taken
    there is an ordinary tensor inside them)."""
    return (self.seen.handle, self.examples.handle, self.batches.handle, self.exhausted.handle)

  @autograph.framework_function
  def record_step(self, handles, batch_id, num_examples) -> tf.Operation:
    """After one step, inside the function's loop: counts the batch it trained (`batch_id` >= 0)
    or, for -1 (a read that found the list exhausted), marks the worker as having seen the end;
    other negative ids (a step skipped, see `tf_gba.training.rerun_ledger`) count nothing.

    Step by step rather than once after the function's steps, so that the counts a progress line
    reads are those of the steps finished by then, whatever the steps per function.
    """
    seen, examples, batches, exhausted = handles
    batch_id = tf.cast(batch_id, tf.int64)
    trained = batch_id >= 0
    index = tf.where(trained, batch_id % self.num_batches, tf.zeros_like(batch_id))
    ended = tf.cast(tf.equal(batch_id, -1), tf.int32)
    was_ended = tf.raw_ops.ReadVariableOp(resource=exhausted, dtype=tf.int32)
    return tf.group(
        tf.raw_ops.ResourceScatterAdd(resource=seen, indices=index[tf.newaxis],
                                      updates=tf.cast(trained, tf.int32)[tf.newaxis]),
        tf.raw_ops.AssignAddVariableOp(resource=examples,
                                       value=tf.cast(num_examples, tf.int64)),
        tf.raw_ops.AssignAddVariableOp(resource=batches, value=tf.cast(trained, tf.int64)),
        tf.raw_ops.AssignVariableOp(resource=exhausted, value=tf.maximum(was_ended, ended)))

  @staticmethod
  def read_each(var) -> List[Optional[np.ndarray]]:
    """Each worker's value of a per-worker variable; None for a worker that is down.

    A worker that died and was started again gets its per-worker variables created afresh, so
    its counts start again from zero.
    """
    # One call that reads every worker's copy (the runtime sends the reads together): a progress
    # line reads the data position this way, and one round trip per worker was the largest part
    # of the coordinator's CPU at a progress line. A worker being started again has no variable
    # yet (None): then one worker at a time, that one's None.
    remotes = var._per_worker_vars._values  # pylint: disable=protected-access
    local = [remote._get_values() for remote in remotes]  # pylint: disable=protected-access
    if all(v is not None for v in local):
      try:
        return [np.asarray(v) for v in _read_together([v.handle for v in local], var.dtype)]
      except _WORKER_DOWN:
        pass
    out = []
    for remote in remotes:
      try:
        out.append(np.asarray(remote.get()))
      except _WORKER_DOWN:
        out.append(None)
    return out

  def read_counts(self, var) -> List[Optional[np.ndarray]]:
    """`read_each` of a counter, carried over a worker's restart: a worker started again counts
    from zero in a variable created afresh, so a new variable on the worker, or a value below the
    one read before (counts never go down in one process), adds that earlier value to what the
    worker is credited with. What it trained between the last read (a progress line, a
    checkpoint) and its death stays uncounted: listed again on a resumption, as a batch in flight
    is. Measured by the chaos drill (benchmarks/chaos.py) before this: a worker killed at global
    step 69 left 81 of 1200 batches out of every later checkpoint's data position, trained twice
    and reported by nothing. A value alone does not tell: in the short drill a restarted worker
    that the coordinator could not read for 8 s (its link stalled) had counted past its old
    process's 100 by the next read, and those 100 went uncounted."""
    variables = _worker_variables(var)  # before the read: a restart meanwhile lowers the value
    each = self.read_each(var)
    variables = variables or [None] * len(each)
    last = self._last.setdefault(id(var), [None] * len(each))
    base = self._base.setdefault(id(var), [0] * len(each))
    known = self._variables.setdefault(id(var), [None] * len(each))
    out = []
    for w, value in enumerate(each):
      if value is None:
        out.append(None)
        continue
      value = np.asarray(value, np.int64)
      created_afresh = (known[w] is not None and variables[w] is not None
                        and variables[w] is not known[w])
      if last[w] is not None and (created_afresh or np.any(value < last[w])):
        base[w] = base[w] + last[w]
      last[w] = value
      known[w] = variables[w]
      out.append(value + base[w])
    return out

  def exhausted_each(self) -> List[bool]:
    """Per worker, whether it has seen the end of the list (read from the coordinator). A worker
    that is down (being started again) has not: asked again at the next epoch's end."""
    return [x is not None and bool(int(x)) for x in self.read_each(self.exhausted)]

  def report(self, batch_sizes: Optional[np.ndarray] = None, passes: int = 1,
             restored: Optional[np.ndarray] = None) -> dict:
    """Per-worker batches and examples, and how the trained batches cover the list.

    `duplicates` counts trainings of a batch beyond `passes`, `missed` the batches trained fewer
    than `passes` times (in batches; `missed_examples` in rows when `batch_sizes` is given).
    `restored`: per-batch trainings before this run (a resumed run), counted in the coverage.
    """
    seen_each = self.read_counts(self.seen)
    unreadable = [i for i, v in enumerate(seen_each) if v is None]
    seen = np.stack([np.zeros(self.num_batches, np.int64) if v is None else v
                     for v in seen_each]).astype(np.int64)
    total = seen.sum(0)
    if restored is not None:
      total = total + np.asarray(restored, np.int64)
    as_ints = lambda values: [0 if v is None else int(v) for v in values]  # pylint: disable=unnecessary-lambda-assignment
    # Each worker's batches (and, with `batch_sizes`, examples) from its per-batch counts, which
    # `read_counts` carries over a restart of the worker's process because every progress line
    # reads them. The plain `batches` and `examples` counters are read only here: a worker
    # restarted in place since the start of the run would be credited with its new process's
    # count alone (measured: 1,590 of the about 2,700 batches a worker killed mid-run had trained in the run).
    per_worker_batches = [0 if v is None else int(v.sum()) for v in seen_each]
    if batch_sizes is not None:
      sizes = np.asarray(batch_sizes, np.int64)
      per_worker_examples = [0 if v is None else int((np.asarray(v, np.int64) * sizes).sum())
                             for v in seen_each]
    else:
      per_worker_examples = as_ints(self.read_counts(self.examples))
    out = {
        "per_worker_batches": per_worker_batches,
        "per_worker_examples": per_worker_examples,
        "exhausted": as_ints(self.read_each(self.exhausted)),
        # Workers whose counts could not be read at the end (down); their batches count as 0.
        "unreadable_workers": unreadable,
        "listed_batches": self.num_batches * passes,
        "duplicates": int(np.maximum(total - passes, 0).sum()),
        "missed": int(np.maximum(passes - total, 0).sum()),
    }
    out["batches"] = sum(out["per_worker_batches"])
    out["examples"] = sum(out["per_worker_examples"])
    if batch_sizes is not None:
      out["missed_examples"] = int((np.maximum(passes - total, 0) * batch_sizes).sum())
    return out
