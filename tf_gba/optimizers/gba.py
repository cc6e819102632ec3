"""GBA: the Keras optimizer wrapper that aggregates a global batch of gradients on the PS.

Each worker step pushes (token, gradient) of every variable to that variable's buffer on its
parameter server and returns without waiting (SPEC section 1). The push that completes the M-th
entry of a buffer's global batch gets the decayed aggregate and applies the inner optimizer's
update to that variable, right there on the parameter server; the inner optimizer's `iterations`
advances once per global step. With the same M * local batch as the synchronous global batch, the
same learning rate and inner optimizer work in both modes, and checkpoints move between them.

Example:

  inner = tf_keras.optimizers.Adam(learning_rate=1e-3)
  optimizer = tf_gba.optimizers.GBA(inner, global_batch_size=4096, local_batch_size=1024)
  model.compile(optimizer=optimizer, loss="binary_crossentropy")
"""

import collections
import copy
from typing import Dict, List, Optional

import numpy as np

import tensorflow as tf
import tf_keras as keras

from tf_gba.common import arguments
from tf_gba.distribute import packed_reads
from tf_gba.distribute import step_context
from tf_gba.layers import hash_embedding
from tf_gba.layers import hash_updates
from tf_gba.ops import gba_ops
from tf_gba.optimizers import hash_rows
from tf_gba.optimizers import wrapping


def resolve_num_aggregate(num_aggregate: Optional[int], global_batch_size: Optional[int],
                          local_batch_size: Optional[int]) -> Optional[int]:
  """M given, or derived as global / local batch size (SPEC: refuse when not divisible)."""
  if num_aggregate is not None:
    if int(num_aggregate) != num_aggregate or num_aggregate < 1:
      raise ValueError(f"num_aggregate must be an integer >= 1, got {num_aggregate!r}.")
    if global_batch_size and local_batch_size and (
        global_batch_size != num_aggregate * local_batch_size):
      raise ValueError(
          f"num_aggregate={num_aggregate} x local_batch_size={local_batch_size} != "
          f"global_batch_size={global_batch_size}. Pass only two of the three.")
    return int(num_aggregate)
  if global_batch_size is None and local_batch_size is None:
    return None
  if global_batch_size is None or local_batch_size is None:
    raise ValueError("Pass both global_batch_size and local_batch_size (or num_aggregate).")
  if global_batch_size <= 0 or local_batch_size <= 0:
    raise ValueError(f"Batch sizes must be positive, got global={global_batch_size}, "
                     f"local={local_batch_size}.")
  if global_batch_size % local_batch_size:
    raise ValueError(
        f"global_batch_size={global_batch_size} is not a multiple of local_batch_size="
        f"{local_batch_size}, so no whole number M of local batches makes one synchronous "
        "global batch. Choose a local batch size that divides it, or pass num_aggregate "
        "explicitly to accept a different global batch.")
  return global_batch_size // local_batch_size


class _GBAState(tf.Module):
  """Checkpointed GBA state: buffers (step, row tags) and the token count."""


def _one_transfer_per_device(grads_and_vars, info=None) -> tuple:
  """`grads_and_vars` with the gradients of each device's variables sent there together.

  Each tensor a worker sends to a parameter server is a transfer of its own (an RPC the server
  serves); concatenated on the worker and split on the server, the dense gradients of one server
  are one transfer per step, where they were one per variable (the fusion Horovod and PyTorch DDP
  do for all-reduce). One sparse gradient per server (its embedding table's shard) rides along:
  its rows and their ids, the ids' bits carried as float32 (`tf.bitcast`, exact), its number of
  rows found on the server from the transfer's size. So do the step's riders for that server
  (`step_context.ride`, taken from `info`; one that waits for the pushes only where every
  gradient goes to that server), returned with their values there. The values are the same to
  the bit.
  """
  dense = collections.defaultdict(list)
  sparse = {}
  for i, (grad, var) in enumerate(grads_and_vars):
    if isinstance(grad, tf.IndexedSlices):
      if (grad.values.dtype == tf.float32 and grad.values.shape[1:].is_fully_defined()
          and grad.indices.dtype in (tf.int32, tf.int64)):
        sparse.setdefault((step_context.same_device(var.device), grad.values.dtype), i)
    elif grad.shape.is_fully_defined():
      dense[(step_context.same_device(var.device), grad.dtype)].append(i)
  riders = collections.defaultdict(list)
  devices = {key[0] for key in [*dense, *sparse]}
  for rider in (info.riders if info is not None else []):
    if rider.values.shape.is_fully_defined() and (not rider.after_pushes or len(devices) == 1):
      riders[(rider.device, tf.float32)].append(rider)
  arrived = []
  out = list(grads_and_vars)
  # In the order the gradients came: a set's order would differ from process to process.
  for key in dict.fromkeys([*dense, *sparse]):
    device = key[0]
    indices = dense.get(key, [])
    rows = sparse.get(key)
    riding = riders.get(key, [])
    if len(indices) + (2 if rows is not None else 0) + len(riding) < 2:
      continue
    grads = [grads_and_vars[i][0] for i in indices]
    parts = [tf.reshape(g, [-1]) for g in grads] + [tf.reshape(r.values, [-1]) for r in riding]
    if rows is not None:
      slices = grads_and_vars[rows][0]
      row_size = slices.values.shape[1:].num_elements()
      id_size = 2 if slices.indices.dtype == tf.int64 else 1  # float32 words per id
      parts += [tf.reshape(slices.values, [-1]),
                tf.reshape(tf.bitcast(slices.indices, tf.float32), [-1])]
    packed = tf.concat(parts, 0)
    with tf.device(device):
      sizes = [g.shape.num_elements() for g in grads] + [r.values.shape.num_elements()
                                                         for r in riding]
      if rows is not None:
        n = (tf.size(packed) - sum(sizes)) // (row_size + id_size)
        pieces = tf.split(packed, tf.stack(sizes + [n * row_size, n * id_size]),
                          num=len(sizes) + 2)
        ids = tf.reshape(pieces[-1], [-1, id_size]) if id_size == 2 else pieces[-1]
        out[rows] = (tf.IndexedSlices(
            tf.reshape(pieces[-2], [-1] + slices.values.shape[1:].as_list()),
            tf.bitcast(ids, slices.indices.dtype), slices.dense_shape), grads_and_vars[rows][1])
        pieces = pieces[:-2]
      else:
        pieces = tf.split(packed, sizes)
      for i, grad, part in zip(indices, grads, pieces):
        out[i] = (tf.reshape(part, grad.shape), grads_and_vars[i][1])
    for rider, part in zip(riding, pieces[len(indices):]):
      info.riders.remove(rider)
      arrived.append((rider, part))
  return out, arrived


def _after(deps: List[tf.Tensor], grad):
  """`grad` (a tensor or IndexedSlices) read only once `deps` have run; `grad` if none."""
  if not deps:
    return grad
  with tf.control_dependencies(deps):
    if isinstance(grad, tf.IndexedSlices):
      return tf.IndexedSlices(tf.identity(grad.values), tf.identity(grad.indices),
                              grad.dense_shape)
    return tf.identity(grad)


def _track(state: _GBAState, name: str, resource) -> None:
  # Tracking may restore the resource right away (a checkpoint restored before it existed).
  # That restore runs as a function on the current default device; run it on the resource's own
  # parameter server, since parameter servers cannot reach each other.
  with tf.init_scope(), tf.device(resource._resource_device):  # pylint: disable=protected-access
    setattr(state, name, resource)


@keras.utils.register_keras_serializable(package="tf_gba")
class GBA(wrapping.InnerOptimizerDelegation, keras.optimizers.Optimizer):
  """Wraps a tf_keras optimizer so that it applies one aggregate per global batch.

  Args:
    inner: a tf_keras optimizer (`tf_keras.optimizers.SGD`, `Adam`, `Adagrad`, ...; not a
      `legacy` one). Its hyper-parameters, slots and checkpoint format are kept.
    num_aggregate: M, gradients per global step. Or give `global_batch_size` and
      `local_batch_size` (M = global / local). Under a `GBAStrategy`, default: the strategy's M
      (the number of workers); outside any strategy, default 1.
    staleness_threshold: iota; gradients with staleness <= iota keep weight 1.
    decay: "threshold" (drop gradients staler than iota) or "exponential"
      (weight decay_alpha ** (staleness - iota)).
    normalize: "num_aggregate" (divide by M, SPEC default) or "kept".
    sparse_normalize: embedding rows: "num_aggregate" (divide by M, rows absent from an entry
      counting as zero, which is what the all-reduce Sync mode applies) or "per_id" (divide by
      the number of entries that contained the row, the paper's rule).
    nonfinite: "drop" (a gradient with NaN/Inf gets weight 0 and is counted) or "error".

  Checkpoint layout, under the optimizer's path (`optimizer/` in `tf.train.Checkpoint(
  optimizer=...)`, `model/optimizer/` when the model holds it):
    * the inner optimizer's entries (`iter`, `_variables/<i>`, its slot lists), unchanged, so a
      checkpoint moves between synchronous training with the inner optimizer and GBA;
    * `gba/token_generator/count`: tokens handed out so far (int64);
    * `gba/buffer_<i>/global_step`: aggregates applied to variable i, and for an embedding buffer
      `gba/buffer_<i>/row_tags`: per row of that variable the global step of its last update
      (-1: never). A HashEmbedding's anchor weight has instead one keyed buffer per table shard,
      `gba/hash_buffer_<i>_<s>/global_step` (its row tags are in the table's own checkpoint).
      `i` is the variable's index in the optimizer's variable list (the
      `model.trainable_variables` order, a sharded variable counting once per shard); a buffer is
      made on its variable's first gradient, so a variable that never had one has no entry.
  `GBA.STATE_KEY`, `GBA.TOKENS_KEY` and `GBA.buffer_key(i)` / `GBA.buffer_index(name)` name these;
  `gba_state()` returns the live objects behind them.

  tf_keras internals kept (no public equivalent): `inner._trackable_children` (the inner
  optimizer's checkpoint entries stand in the wrapper's place: Sync <-> GBA switching),
  `inner._compute_current_learning_rate` (advances a schedule once per step; the public
  `apply_gradients` would also step `iterations` per variable), `inner._clip_gradients` and
  `inner._use_weight_decay` (clipping and weight-decay exclusions exactly as the inner optimizer
  applies them, to each aggregate), and the base class's `_build_index_dict` / `_var_key`
  (the variable order that names the buffers).

  Strategy: create GBA inside a `tf_gba.distribute.GBAStrategy`'s scope (the workers then share
  the buffers on the parameter servers). Outside any strategy it aggregates the M gradients of
  one process (single-process runs and tests). Created under another strategy, or applied under a
  different strategy than the one it was created under, it raises RuntimeError.
  """

  STATE_KEY = "gba"
  TOKENS_KEY = "token_generator"
  _BUFFER_PREFIX = "buffer_"

  @classmethod
  def buffer_key(cls, index: int) -> str:
    """The checkpoint name, under `STATE_KEY`, of the buffer of variable `index`."""
    return f"{cls._BUFFER_PREFIX}{index}"

  @classmethod
  def buffer_index(cls, name: str) -> Optional[int]:
    """The variable index of a buffer's checkpoint name under `STATE_KEY`, or None."""
    if name.startswith(cls._BUFFER_PREFIX) and name[len(cls._BUFFER_PREFIX):].isdigit():
      return int(name[len(cls._BUFFER_PREFIX):])
    return None

  def __init__(self, inner: keras.optimizers.Optimizer, num_aggregate: Optional[int] = None,
               global_batch_size: Optional[int] = None, local_batch_size: Optional[int] = None,
               staleness_threshold: int = 3, decay: str = "threshold", decay_alpha: float = 0.5,
               normalize: str = "num_aggregate", nonfinite: str = "drop", name: str = "GBA",
               sparse_normalize: str = "num_aggregate", **kwargs):
    if isinstance(inner, str):
      inner = keras.optimizers.get(inner)
    if not isinstance(inner, keras.optimizers.Optimizer):
      raise TypeError(
          f"GBA wraps a tf_keras optimizer such as tf_keras.optimizers.Adam(); got "
          f"{type(inner).__name__}. Legacy optimizers (tf_keras.optimizers.legacy.*) and "
          "Keras 3 optimizers (tf.keras.optimizers.* in TF 2.16+) are not supported.")
    if isinstance(inner, GBA):
      raise TypeError("GBA cannot wrap another GBA optimizer.")
    if inner.global_clipnorm:
      raise ValueError(
          "global_clipnorm needs every variable's gradient of a step at once, but GBA applies "
          "each variable's aggregate as soon as its own buffer is full. Use clipnorm (applied to "
          "each aggregate) or clipvalue on the inner optimizer instead.")
    if inner.use_ema:
      raise ValueError("use_ema is not supported inside GBA: the moving average would be taken "
                       "per variable at different moments. Keep an EMA outside the optimizer.")
    staleness_threshold = arguments.integer("staleness_threshold", staleness_threshold,
                                            minimum=0, owner="GBA")
    decay_alpha = arguments.number("decay_alpha", decay_alpha, owner="GBA")
    kwargs.pop("jit_compile", None)
    kwargs.pop("is_legacy_optimizer", None)
    super().__init__(name=name, jit_compile=False, **kwargs)
    self._inner = inner
    self._requested_m = resolve_num_aggregate(num_aggregate, global_batch_size, local_batch_size)
    self._config_args = dict(staleness_threshold=staleness_threshold, decay=decay,
                             decay_alpha=decay_alpha, normalize=normalize, nonfinite=nonfinite,
                             sparse_normalize=sparse_normalize)
    # Validate now, with the user's arguments, rather than at the first training step.
    gba_ops.BufferConfig(num_aggregate=self._requested_m or 1, **self._config_args)
    strategy = tf.distribute.get_strategy()
    if tf.distribute.has_strategy() and not hasattr(strategy, "register_num_aggregate"):
      raise RuntimeError(
          f"GBA needs tf_gba.distribute.GBAStrategy but was created under "
          f"{type(strategy).__name__}: create the strategy with GBAStrategy(...) and the "
          "optimizer inside its scope.")
    self._gba_strategy = strategy if hasattr(strategy, "register_num_aggregate") else None
    if self._gba_strategy is not None:
      self._num_aggregate = self._gba_strategy.register_num_aggregate(self._requested_m)
      # Hop-BW judges gradients by the version (global step) read at the start of their step.
      self._gba_strategy.register_version_reader(self._read_version)
    else:
      self._num_aggregate = self._requested_m or 1
    self._gba_state = _GBAState()
    self._buffers: Dict[int, object] = {}
    self._variables_by_key: Dict[int, object] = {}
    self._sparse_keys: set = set()
    self._buffer_order: List[int] = []
    self._local_tokens = None
    self._hash_optimizer = None  # (kind, hyper-parameters, initial accumulator) of hash rows

  # ---- delegation to the inner optimizer -------------------------------------------------------
  @property
  def num_aggregate(self) -> int:
    return self._num_aggregate

  def buffer_config(self) -> gba_ops.BufferConfig:
    config = gba_ops.BufferConfig(num_aggregate=self._num_aggregate, **self._config_args)
    if self._gba_strategy is not None:
      config = self._gba_strategy.buffer_config(config)
    return config

  def _wrapper_state(self):
    # Beside the inner optimizer's children: a checkpoint written with plain Adam (synchronous
    # training) restores into GBA(Adam) and back; only "gba" is added.
    return self.STATE_KEY, self._gba_state

  # ---- building ----------------------------------------------------------------------------------
  def _read_version(self):
    with tf.device(self.iterations.device):
      return tf.cast(self.iterations.read_value(), tf.int64)

  def _token_source(self):
    if self._gba_strategy is not None:
      return self._gba_strategy.token_generator
    if self._local_tokens is None:
      self._local_tokens = gba_ops.TokenGenerator(self._num_aggregate, name="local_tokens")
    return self._local_tokens

  def build(self, var_list):
    """Builds the inner optimizer's slots and aligns the token count with the global step."""
    if getattr(self, "_built", False):
      return
    with tf.init_scope():
      self._inner.build(var_list)
      self._build_index_dict(var_list)
      tokens = self._token_source()
      # After a restore (or a switch from synchronous training) the global step is k; tokens
      # must start at k too, or every gradient would look k steps stale.
      step = int(self._inner.iterations.numpy())
      floor = step * tokens.num_aggregate
      if int(tokens.count().numpy()) < floor:
        tokens.reset(floor)
      _track(self._gba_state, self.TOKENS_KEY, tokens)
    self._built = True

  def _buffer_for(self, var, grad):
    key = self._var_key(var)
    sparse = isinstance(grad, tf.IndexedSlices)
    buf = self._buffers.get(key)
    if buf is not None:
      if sparse != (key in self._sparse_keys):
        raise ValueError(f"Variable {var.name} got a {'sparse' if sparse else 'dense'} gradient "
                         "after a different kind in an earlier step; GBA buffers are one kind.")
      return buf
    with tf.init_scope():
      index = self._index_dict[key]
      step = int(self._inner.iterations.numpy())
      config = self.buffer_config()
      table = hash_embedding.table_of(var)
      if table is not None:
        if not sparse:
          raise ValueError(f"{var.name} (a HashEmbedding's anchor) got a dense gradient: its "
                           "rows' gradient is IndexedSlices of the layer's ids.")
        self._hash_optimizer = hash_rows.fused_optimizer(self._inner)
        buf = hash_rows.HashBuffers(table, config, initial_step=step)
        for s, shard_buffer in enumerate(buf.buffers):
          _track(self._gba_state, f"hash_{self.buffer_key(index)}_{s}", shard_buffer)
        self._sparse_keys.add(key)
        self._buffers[key] = buf
        self._variables_by_key[key] = var
        self._buffer_order.append(key)
        return buf
      if sparse:
        buf = gba_ops.SparseBuffer(var.shape[0], var.shape[1:], var.dtype, config,
                                   device=var.device, initial_step=step, name="sparse_buffer")
        self._sparse_keys.add(key)
      else:
        buf = gba_ops.DenseBuffer(var.shape, var.dtype, config, device=var.device,
                                  initial_step=step, name="dense_buffer")
      # Named by the variable's index in the model's trainable variables: stable across runs.
      _track(self._gba_state, self.buffer_key(index), buf)
      self._buffers[key] = buf
      self._variables_by_key[key] = var
      self._buffer_order.append(key)
    return buf

  # ---- state ---------------------------------------------------------------------------------------
  @property
  def is_built(self) -> bool:
    """Whether `build(var_list)` ran (the inner optimizer's slots exist)."""
    return bool(getattr(self, "_built", False))

  @property
  def token_generator(self) -> gba_ops.TokenGenerator:
    """The token source: the GBAStrategy's (on PS 0), or this process's outside a strategy."""
    return self._token_source()

  @property
  def inner_optimizer(self) -> keras.optimizers.Optimizer:
    """The wrapped optimizer, whose rule applies each aggregate (and, fused, each hash row's)."""
    return self._inner

  def variable_index(self, variable) -> int:
    """`variable`'s index in the optimizer's variable list (its buffer is `buffer_key(index)`)."""
    if not self.is_built:
      raise ValueError("GBA is not built yet: call optimizer.build(model.trainable_variables).")
    key = self._var_key(variable)
    if key not in self._index_dict:
      raise ValueError(f"The optimizer was not built with {variable.name}: build it with "
                       "optimizer.build(model.trainable_variables).")
    return self._index_dict[key]

  def buffer(self, variable, sparse: bool):
    """`variable`'s buffer (SparseBuffer if `sparse`), made now if no gradient made it yet.

    Call eagerly, on the coordinator. Refuses the other kind than an existing buffer's.
    """
    # The buffer's kind follows the gradient's type; an empty one says which without a push.
    marker = tf.IndexedSlices(tf.zeros([0]), tf.zeros([0], tf.int64)) if sparse else None
    return self._buffer_for(variable, marker)

  def gba_state(self) -> dict:
    """The live GBA state, by checkpoint name (see the class docstring's layout).

    Returns {"token_generator": TokenGenerator, "buffers": {index: {"variable", "buffer",
    "sparse"}}} for the buffers made so far, `index` as in `buffer_key(index)`.
    """
    buffers = {}
    for key in self._buffer_order:
      index = self._index_dict[key]
      buffers[index] = {"variable": self._variables_by_key[key], "buffer": self._buffers[key],
                        "sparse": key in self._sparse_keys}
    return {self.TOKENS_KEY: self._token_source(), "buffers": buffers}

  # ---- applying ----------------------------------------------------------------------------------
  def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                      **kwargs):
    """Pushes each gradient to its buffer; applies the inner update where a batch completes."""
    del skip_gradients_aggregation, kwargs  # one replica per worker: nothing to all-reduce
    self._check_strategy()
    packed_reads.close()  # the step's reads after its updates read the variables themselves
    grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
    if not grads_and_vars:
      return self.iterations
    with tf.name_scope(name or self.name):
      self.build([v for _, v in grads_and_vars])
      info = step_context.current()
      if info is not None and info.token is not None:
        token, ticket = info.token, info.ticket
      else:
        token, ticket = self._token_source().fetch()
      self._inner._compute_current_learning_rate()  # pylint: disable=protected-access
      skip = info.skip if info is not None else None
      # A slow machine's delay (`--straggler_delay=before_push`): after the gradients, before
      # any push, so the gradients arrive late and stale.
      slept = ([info.delay_before_push([g for g, _ in grads_and_vars])]
               if info is not None and info.delay_before_push is not None else [])
      leader_ready = None
      readies = []
      grads_and_vars, arrived = _one_transfer_per_device(
          [(_after(slept, grad), var) for grad, var in grads_and_vars], info)
      for grad, var in grads_and_vars:
        if skip is None:
          ready = self._push_and_maybe_apply(token, ticket, grad, var)
        else:
          # Hop-BW: a step released from its barrier without a new version pushes nothing.
          self._buffer_for(var, grad)
          ready = tf.cond(skip, lambda: tf.constant(False),
                          lambda g=grad, v=var: self._push_and_maybe_apply(token, ticket, g, v))
        readies.append(ready)
        if leader_ready is None:
          leader_ready = ready
      if info is not None:
        info.pushed = list(readies)
      for rider, there in arrived:
        # After the pushes on its own server only: a server cannot wait on another.
        on_device = [r for r, (_, var) in zip(readies, grads_and_vars)
                     if step_context.same_device(var.device) == rider.device]
        with tf.control_dependencies(on_device if rider.after_pushes else []):
          step_context.send(rider, there)
      if skip is not None:
        # Hop-BW: how many buffers this push completed, known once their updates ran (its
        # barrier moves the version on when every buffer has completed it).
        info.completed = tf.add_n([tf.cast(r, tf.int64) for r in readies])
        info.num_buffers = len(readies)
      # Once per global step, after the variable updates above (program order orders them on
      # the `iterations` resource, which Adam & co. read for bias correction).
      with tf.device(self.iterations.device):
        tf.cond(leader_ready, lambda: self.iterations.assign_add(1).op, tf.no_op)
      return self.iterations

  def _check_strategy(self):
    """Refuses to run under another strategy than the one GBA was created under.

    Created under a GBAStrategy, GBA pushes to buffers that every worker shares; created outside
    any strategy it aggregates in this process only (single-process use). Either applied under
    another strategy would silently train something else.
    """
    current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if current is self._gba_strategy:
      return
    if self._gba_strategy is None:
      raise RuntimeError(
          f"GBA was created outside any strategy but runs under {type(current).__name__}: "
          "create the optimizer inside `with strategy.scope():` of a "
          "tf_gba.distribute.GBAStrategy.")
    raise RuntimeError(
        f"GBA was created under a GBAStrategy but runs under "
        f"{type(current).__name__ if current else 'no strategy'}: apply it under the strategy "
        "whose scope created it (model.compile and fit inside that scope).")

  def _push_and_maybe_apply(self, token, ticket, grad, var):
    buf = self._buffer_for(var, grad)
    if isinstance(buf, hash_rows.HashBuffers):
      return buf.push_and_maybe_apply(token, ticket, grad, self._apply_hash_aggregate)
    with tf.device(var.device):
      if isinstance(grad, tf.IndexedSlices):
        ready, ids, rows, _ = buf.push(token, ticket, grad.indices, grad.values)
        aggregate = tf.IndexedSlices(rows, ids, grad.dense_shape)
      else:
        ready, aggregate, _ = buf.push(token, ticket, grad)

      def apply():
        self._apply_aggregate(aggregate, var)
        return tf.constant(True)

      # Under the variable's device, the branch runs on its parameter server: no round trip.
      return tf.cond(ready, apply, lambda: tf.constant(False))

  def _apply_aggregate(self, aggregate, var):
    inner = self._inner
    aggregate = inner._clip_gradients([aggregate])[0]  # pylint: disable=protected-access
    if inner.weight_decay and inner._use_weight_decay(var):  # pylint: disable=protected-access
      lr = tf.cast(inner.learning_rate, var.dtype)
      var.assign_sub(var * tf.cast(inner.weight_decay, var.dtype) * lr)
    inner.update_step(aggregate, var)
    if var.constraint is not None:
      var.assign(var.constraint(var))

  def _apply_hash_aggregate(self, aggregate: tf.IndexedSlices, shard):
    """The table's fused update of an aggregate of hash rows, on the shard's device."""
    aggregate = self._inner._clip_gradients([aggregate])[0]  # pylint: disable=protected-access
    return hash_updates.fused_apply(shard, self._inner, aggregate.indices, aggregate.values,
                                    self._inner.iterations, self._hash_optimizer)

  def update_step(self, gradient, variable):
    raise NotImplementedError("GBA applies through apply_gradients(); call that instead.")

  # ---- statistics and config ---------------------------------------------------------------------
  def stats(self) -> dict:
    """Counters of the buffers, read eagerly (on the coordinator, between steps).

    "dense" comes from the first variable's buffer: one entry per push, so its pushes, dropped
    gradients and staleness are per step, not per variable. "sparse" sums the embedding buffers
    over (push, id) pairs.
    """
    keys = tuple(self._buffer_order)
    step, tokens, outputs = self._read_stats(keys)
    # A hash table's buffers (one per shard) count as one, as HashBuffers.stats() merges them.
    by_key = {k: gba_ops.merge_stats([gba_ops.BufferStats.from_outputs(*o) for o in parts])
              for k, parts in zip(keys, outputs)}
    dense = [by_key[k] for k in keys if k not in self._sparse_keys]
    sparse = [by_key[k] for k in keys if k in self._sparse_keys]
    first_dense = dense[0] if dense else None
    return {
        "num_aggregate": self._num_aggregate,
        "global_step": step,
        "dense": first_dense.as_dict() if first_dense else None,
        "dense_all_variables": gba_ops.merge_stats(dense).as_dict() if dense else None,
        "sparse": gba_ops.merge_stats(sparse).as_dict() if sparse else None,
        "tokens_fetched": tokens if self._built else 0,
    }

  def _read_stats(self, keys):
    """(global step, tokens fetched, per key the stats outputs of its buffers as arrays).

    One function packs every counter into one vector, copied here once: read one by one, each
    counter of each buffer was a round trip to its parameter server (about 140 for DeepFM), the
    bulk of the coordinator's CPU at a progress line.
    """
    signature = (keys, self._built)
    if getattr(self, "_stats_reader", (None, None, None))[0] != signature:
      # A hash table's HashBuffers: its shards' buffers.
      buffers = [getattr(self._buffers[k], "buffers", [self._buffers[k]]) for k in keys]
      built = self._built
      ranks = []  # per key, per buffer, of each stats output, as the function was traced

      @tf.function
      def read():
        parts = [self.iterations.read_value(),
                 self._token_source().count() if built else tf.constant(0, tf.int64)]
        ranks.clear()
        for group in buffers:
          ranks.append([])
          for b in group:
            outputs = b.stats_tensors()
            ranks[-1].append([t.shape.rank for t in outputs])
            parts.extend(outputs)
        parts = [tf.reshape(tf.cast(t, tf.int64), [-1]) for t in parts]
        # The parts' sizes first, then the parts.
        return tf.concat([tf.stack([tf.size(t, out_type=tf.int64) for t in parts])] + parts, 0)

      read.get_concrete_function()  # traces now: `ranks` is known before the first read
      # Not an attribute Keras tracks: a function is no part of the optimizer's state.
      object.__setattr__(self, "_stats_reader", (signature, read, ranks))
    _, read, ranks = self._stats_reader
    flat = read().numpy()
    num_parts = 2 + sum(len(r) for group in ranks for r in group)
    arrays, at = [], num_parts
    for size in flat[:num_parts]:
      arrays.append(flat[at:at + size])
      at += size
    step, tokens, rest = int(arrays[0][0]), int(arrays[1][0]), iter(arrays[2:])
    # (ranks first: zip stops on it before taking another array from `rest`.)
    outputs = [[[a[0] if rank == 0 else a for rank, a in zip(buffer_ranks, rest)]
                for buffer_ranks in group] for group in ranks]
    return step, tokens, outputs

  def get_config(self):
    return {
        "name": self.name,
        "inner": keras.optimizers.serialize(self._inner),
        "num_aggregate": self._requested_m,
        **self._config_args,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    # Deep: tf_keras' deserialize rewrites the class name inside the dict it is given.
    config = copy.deepcopy(config)
    inner = keras.optimizers.deserialize(config.pop("inner"), custom_objects=custom_objects)
    return cls(inner, **config)
