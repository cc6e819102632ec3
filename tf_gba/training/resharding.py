"""Restores a training checkpoint into a model whose variables are split into other shards.

A model moves between synchronous training (MultiWorkerMirroredStrategy or no strategy: every
variable whole) and parameter-server training (`GBAStrategy`: embedding tables split across the
parameter servers), or between PS clusters of different sizes. Each move changes how many shards a
large variable has, and what `tf.train.Checkpoint(model=model).restore` does with that depends on
the state:

  * model variables and the inner optimizer's slots are saved as whole logical tensors (a
    ShardedVariable is written as slices of one tensor, and tf_keras groups the per-shard slots of
    one variable into one ShardedVariable per slot), so their checkpoint keys do not depend on the
    shard count;
  * the GBA wrapper's buffers are saved per shard, as `gba/buffer_<i>` with `i` the shard's
    position in the optimizer's variable list and, for embedding buffers, the row tags of that
    shard only. With another shard count the indices point at other variables, the tag vectors
    have other lengths, and TF restores them (at once or, deferred, when a buffer is created on the
    first step) into the wrong buffer or fails there;
  * a plain-Adam checkpoint has no token count, so a GBA optimizer built before the restore keeps
    handing out tokens of step 0 while the global step is k: every gradient looks k steps stale.

`restore_training_state` restores everything explicitly, eagerly from the coordinator (the chief
under a `GBAStrategy`): it matches each saved object to the target's by its path in the
checkpoint's object graph (the way TF matches them), reads each target shard's rows of every
logical tensor, re-splits the GBA row tags by rows, and aligns the token count with the global step.
The GBA part goes through GBA's public state API (`GBA.STATE_KEY`, `buffer_index`,
`variable_index`, `buffer`, `gba_state`, `token_generator`) and its documented checkpoint layout.

Example:

  with strategy.scope():
    model = build_model()
    optimizer = tf_gba.optimizers.GBA(tf_keras.optimizers.Adam(1e-3))
    model.compile(optimizer, loss="binary_crossentropy")
    optimizer.build(model.trainable_variables)
  report = restore_training_state(checkpoint_path, model, optimizer)
"""

from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tensorflow.core.protobuf import trackable_object_graph_pb2
from tf_gba.optimizers.gba import GBA

_VALUE = "VARIABLE_VALUE"
_ShardedVariable = tf.__internal__.distribute.ShardedVariable

_HOW_TO_MATCH = ("Build the model (layers, vocabulary sizes, embedding widths) and the optimizer "
                 "(its class and slot options such as amsgrad) exactly as in the job that wrote "
                 "the checkpoint; only the strategy and the number of parameter servers may "
                 "differ.")


class CheckpointMismatchError(ValueError):
  """The checkpoint does not hold this model's state (another model or optimizer wrote it)."""


def restore_training_state(checkpoint_path: str, model, optimizer) -> dict:
  """Restores weights, optimizer slots and step, and GBA state, whatever the shard counts.

  Args:
    checkpoint_path: a checkpoint prefix written by `tf.train.Checkpoint(model=model)` (or a
      directory: its latest checkpoint), with the optimizer under `model/optimizer`.
    model: the target tf_keras model, built (under a `GBAStrategy`, a MultiWorkerMirroredStrategy
      or no strategy).
    optimizer: the target optimizer (plain tf_keras or `tf_gba.optimizers.GBA`), already built
      with `optimizer.build(model.trainable_variables)`. It stands for `model/optimizer` of the
      checkpoint, whether or not the model was compiled with it.

  Returns:
    What was done: {"checkpoint", "model_variables", "optimizer_variables", "resharded" (path ->
    [saved shards, target shards] for each tensor whose shard count changed), "gba" (None, or the
    token count and buffer counts), "ignored" (saved paths with no place in the target)}.

  Raises:
    CheckpointMismatchError: the checkpoint misses one of the target's variables, or holds one
      with another full shape or dtype. Nothing is assigned in that case.
  """
  prefix = _checkpoint_prefix(checkpoint_path)
  # tf_keras optimizers have no public "built" flag; GBA has.
  built = (optimizer.is_built if isinstance(optimizer, GBA)
           else getattr(optimizer, "_built", False))
  if not built:
    raise ValueError(
        "The optimizer has no slots yet: call optimizer.build(model.trainable_variables) (under "
        "the strategy's scope) before restore_training_state, so that each slot already lives on "
        "its parameter server and can be assigned there.")
  reader = tf.train.load_checkpoint(prefix)
  shapes = reader.get_variable_to_shape_map()
  dtypes = reader.get_variable_to_dtype_map()
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
  matched, ignored, gba_node = _match(graph, prefix, model, optimizer)

  # Check everything before assigning anything: a refused restore leaves the target untouched.
  debug = b"\n" + reader.debug_string()
  variables = []  # (path, checkpoint key, target variable or ShardedVariable)
  others = []     # (path, {attribute: checkpoint key}, target trackable)
  saved_rows = {}  # checkpoint key -> rows of each slice it was saved in
  for path, node, target in matched:
    keys = {a.name: a.checkpoint_key for a in node.attributes}
    if _VALUE in keys:
      key = keys[_VALUE]
      _check_variable(prefix, path, key, target, shapes, dtypes)
      saved_rows[key] = _saved_rows(debug, key, shapes[key])
      variables.append((path, key, target))
    elif hasattr(target, "_restore_from_tensors"):
      others.append((path, keys, target))
    else:
      ignored.append(path)
  _check_nothing_missing(prefix, model, optimizer, {id(t) for _, _, t in variables}, ignored)
  gba_plan = None
  if isinstance(optimizer, GBA):
    keys_of = {id(t): key for _, key, t in variables}
    gba_plan = _plan_gba(reader, graph, gba_node, model, optimizer,
                         lambda v: saved_rows[keys_of[id(v)]])

  report = {"checkpoint": prefix, "model_variables": 0, "optimizer_variables": 0,
            "resharded": {}, "gba": None, "ignored": sorted(ignored)}
  for path, key, target in variables:
    _assign(prefix, key, target, shapes[key])
    kind = "optimizer_variables" if path.startswith("model/optimizer/") else "model_variables"
    report[kind] += 1
    shards = len(target.variables) if isinstance(target, _ShardedVariable) else 1
    if len(saved_rows[key]) != shards:
      report["resharded"][path] = [len(saved_rows[key]), shards]
  for _, keys, target in others:
    # Other checkpointed resources (lookup tables, ...) are whole objects: restored as saved.
    tensors = {name: _read(prefix, key, dtypes[key]) for name, key in keys.items()}
    target._restore_from_tensors(tensors)  # pylint: disable=protected-access
  if gba_plan is not None:
    report["gba"] = _apply_gba(optimizer, *gba_plan)
  return report


# ---- matching saved objects to the target's ------------------------------------------------------
def _checkpoint_prefix(checkpoint_path: str) -> str:
  if tf.io.gfile.isdir(checkpoint_path):
    latest = tf.train.latest_checkpoint(checkpoint_path)
    if latest is None:
      raise FileNotFoundError(f"No checkpoint in directory {checkpoint_path}.")
    return latest
  if not tf.io.gfile.exists(checkpoint_path + ".index"):
    raise FileNotFoundError(f"No checkpoint at {checkpoint_path} (no {checkpoint_path}.index). "
                            "Pass the prefix that tf.train.Checkpoint.save returned.")
  return checkpoint_path


def _match(graph, prefix, model, optimizer):
  """Pairs each saved object holding values with the target object at the same path.

  Follows the checkpoint's object graph from `model` by child names, as TF's own restore does.
  tf_keras optimizers record no slot-to-variable links in that graph (its `slot_variables` stay
  empty); a slot is saved twice over, as `_variables/<i>` and as `_momentums/<j>` (`j`: its
  variable's place in the optimizer's variable list). Both names must lead to the same target
  object, which checks that slot i belongs to the target's variable j as it did when saved.
  Returns ([(path, node, target)], [saved paths with no target], node id of the GBA state).
  """
  roots = {c.local_name: c.node_id for c in graph.nodes[0].children}
  if "model" not in roots:
    raise CheckpointMismatchError(
        f"{prefix} holds no 'model' (its top-level objects: {sorted(roots)}). "
        "restore_training_state reads checkpoints written by tf.train.Checkpoint(model=model).")
  matched, ignored, gba_node = [], [], None
  found = {roots["model"]: (model, "model")}  # node id -> (target, first path)
  queue = [roots["model"]]
  while queue:
    node_id = queue.pop(0)
    obj, path = found[node_id]
    children = None
    for child in graph.nodes[node_id].children:
      name, child_path = child.local_name, f"{path}/{child.local_name}"
      if obj is model and name == "optimizer":
        target = optimizer
      elif obj is optimizer and name == GBA.STATE_KEY and isinstance(optimizer, GBA):
        gba_node = child.node_id  # per-shard state: mapped by rows in _plan_gba
        continue
      else:
        if children is None:
          children = tf.train.TrackableView.children(obj)
        target = children.get(name)
      if child.node_id in found:  # another name of a saved object (layer-1, _momentums/0)
        first, first_path = found[child.node_id]
        if target is not None and first is not None and target is not first:
          raise CheckpointMismatchError(
              f"In the checkpoint '{child_path}' is '{first_path}', in the target they are "
              f"different objects: its optimizer slots belong to other variables. {_HOW_TO_MATCH}")
        continue
      found[child.node_id] = (target, child_path)
      if target is None:
        if _holds_values(graph, child.node_id):
          ignored.append(child_path)
        continue
      if graph.nodes[child.node_id].attributes:
        matched.append((child_path, graph.nodes[child.node_id], target))
      queue.append(child.node_id)
  return matched, ignored, gba_node


def _holds_values(graph, node_id) -> bool:
  stack, seen = [node_id], set()
  while stack:
    n = stack.pop()
    if n in seen:
      continue
    seen.add(n)
    if graph.nodes[n].attributes:
      return True
    stack.extend(c.node_id for c in graph.nodes[n].children)
  return False


def _check_variable(prefix, path, key, target, shapes, dtypes) -> None:
  if not (isinstance(target, (tf.Variable, _ShardedVariable))):
    raise CheckpointMismatchError(
        f"{prefix} holds a variable at '{path}' but the target has a {type(target).__name__} "
        f"there. {_HOW_TO_MATCH}")
  saved, wanted = list(shapes[key]), target.shape.as_list()
  if saved != wanted:
    raise CheckpointMismatchError(
        f"'{path}' ({_name(target)}) has full shape {wanted} in the target but {saved} in "
        f"{prefix}. Shards may differ, the full shape may not: the checkpoint comes from another "
        f"model configuration. {_HOW_TO_MATCH}")
  if dtypes[key].base_dtype != target.dtype.base_dtype:
    raise CheckpointMismatchError(
        f"'{path}' ({_name(target)}) is {target.dtype.name} in the target but "
        f"{dtypes[key].name} in {prefix} (mixed precision on one side only?). {_HOW_TO_MATCH}")


def _check_nothing_missing(prefix, model, optimizer, restored_ids, ignored) -> None:
  """Every model weight and optimizer variable must have been found in the checkpoint."""
  missing = [("model", v) for v in model.weights if id(_logical(v)) not in restored_ids]
  missing += [("optimizer", v) for v in optimizer.variables
              if id(_logical(v)) not in restored_ids]
  if missing:
    names = ", ".join(f"{kind} variable {_name(_logical(v))}" for kind, v in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    hint = ""
    if all(kind == "optimizer" for kind, _ in missing) and not any(
        p.startswith("model/optimizer") for p in ignored):
      hint = (" The checkpoint may hold model weights only; to start the optimizer afresh, "
              "restore them with tf.train.Checkpoint(model=model).restore(path).expect_partial().")
    raise CheckpointMismatchError(f"{prefix} has no value for {names}{more}.{hint} "
                                  f"{_HOW_TO_MATCH}")
  extra = [p for p in ignored if p.startswith("model/optimizer/_variables/")
           or not p.startswith("model/optimizer")]
  if extra:
    raise CheckpointMismatchError(
        f"{prefix} holds values the target has no place for: {', '.join(extra[:5])}. "
        f"{_HOW_TO_MATCH}")


def _name(v) -> str:
  return v.name if not isinstance(v, _ShardedVariable) else v.variables[0].name.split("/part_")[0]


# ---- reading and assigning -----------------------------------------------------------------------
def saved_module(path: Optional[str], name: str,
                 fields: Sequence[str]) -> Optional[Dict[str, np.ndarray]]:
  """The values of the variables `fields` of the tf.Module saved at the root of checkpoint `path`
  as `name` (`tf.train.Checkpoint(..., name=module)`: the data, straggler and shard positions),
  or None without a checkpoint (`path` None) or when it lacks any of them."""
  if not path:
    return None
  reader = tf.train.load_checkpoint(path)
  shapes = reader.get_variable_to_shape_map()
  keys = {f: f"{name}/{f}/.ATTRIBUTES/VARIABLE_VALUE" for f in fields}
  if not all(k in shapes for k in keys.values()):
    return None
  return {f: reader.get_tensor(k) for f, k in keys.items()}


def _read(prefix, key, dtype, full_shape=None, rows=None):
  """The saved tensor `key`, or only `rows` = (start, count) of its first dimension.

  Reading a slice lets the checkpoint reader assemble those rows from however many slices they
  were saved in, without holding the whole logical tensor (a large embedding table) in memory.
  """
  spec = ""
  if rows is not None:
    spec = " ".join(str(d) for d in full_shape) + " " + ":".join(
        [f"{rows[0]},{rows[1]}"] + ["-"] * (len(full_shape) - 1))
  with tf.device("CPU:0"):  # this process (the coordinator): it reads the files
    return tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[key], shape_and_slices=[spec],
                                dtypes=[dtype])[0]


def _assign(prefix, key, target, full_shape) -> None:
  if not isinstance(target, _ShardedVariable):
    target.assign(_read(prefix, key, target.dtype))
    return
  start = 0
  for shard in target.variables:
    rows = int(shard.shape[0])
    shard.assign(_read(prefix, key, shard.dtype, full_shape, (start, rows)))
    start += rows


def _saved_rows(debug: bytes, key: str, full_shape) -> List[int]:
  """Row counts of the slices the tensor `key` was saved in (one count if it was saved whole).

  The checkpoint reader hands out whole tensors only; its listing (`debug_string()`) also has one
  line per saved slice: the slice's key, its dtype and its shape in words (`(DT_FLOAT) [6,2]`).
  The lines come in key order, and a tensor's slice keys sort by their first row, so the rows of
  the shapes, in order, are the slices' row counts (ShardedVariables split the first dimension
  only). Only the key's name part is matched (its escaping of 0x00 and 0xff bytes); the offsets
  encoded after it are not decoded.
  """
  rows = int(full_shape[0]) if full_shape else 1
  name = key.encode().replace(b"\xff", b"\xff\x00").replace(b"\x00", b"\x00\xff")
  marker = b"\n\x00" + name + b"\x00\x01"
  slices, pos = [], debug.find(marker)
  while pos >= 0:
    dtype = debug.find(b" (DT_", pos + len(marker))
    open_, close = debug.find(b") [", dtype), debug.find(b"]\n", dtype)
    if min(dtype, open_, close) < 0:
      raise CheckpointMismatchError(f"Cannot read the slices of {key} from the checkpoint's "
                                    "listing: it was not written by this TensorFlow's saver.")
    shape = debug[open_ + 3:close].split(b",")
    slices.append(int(shape[0]))
    pos = debug.find(marker, close)
  if not slices:
    return [rows]
  if sum(slices) != rows:
    raise CheckpointMismatchError(
        f"{key} was saved in slices of {slices} rows that do not add up to its {rows}: it was "
        "not written by a ShardedVariable, the only partitioning handled here.")
  return slices


# ---- GBA state -----------------------------------------------------------------------------------
def _plan_gba(reader, graph, gba_node, model, optimizer, saved_rows_of):
  """What each target shard's GBA buffer gets: (shard, sparse, step or None, row tags).

  Saved buffers are numbered by shard in the optimizer's variable list: the logical variables in
  `model.trainable_variables` order, each expanded into its saved shards (the checkpoint's slices
  give how many, and their rows). Row tags are re-split by rows. A buffer's global step counts
  the aggregates applied to its shard; a target shard takes the largest step among the saved
  shards its rows come from (the kernel requires every row tag, the step of the row's last
  update, to be below its buffer's step), or the restored global step (None here) if none.
  Returns (plan, token count or None, number of saved buffers, whether the checkpoint had GBA).
  """
  saved, count = {}, None
  for child in graph.nodes[gba_node].children if gba_node is not None else []:
    keys = {a.name: a.checkpoint_key for a in graph.nodes[child.node_id].attributes}
    index = GBA.buffer_index(child.local_name)
    if child.local_name == GBA.TOKENS_KEY and "count" in keys:
      count = int(reader.get_tensor(keys["count"]))
    elif index is not None and "global_step" in keys:
      tags = reader.get_tensor(keys["row_tags"]) if "row_tags" in keys else None
      saved[index] = (int(reader.get_tensor(keys["global_step"])), tags)

  plan, index = [], 0
  for logical, shards in _logical_trainable_variables(model, optimizer) if saved else []:
    saved_rows = saved_rows_of(logical)
    ids = range(index, index + len(saved_rows))
    index += len(saved_rows)
    present = [saved.get(i) for i in ids]
    if not any(present):
      continue  # no buffer was saved for it (no gradient yet): made on its first push
    sparse = any(p is not None and p[1] is not None for p in present)
    tags = None
    if sparse:
      parts = [np.full(rows, -1, np.int64) if p is None else p[1]
               for rows, p in zip(saved_rows, present)]
      for i, rows, part in zip(ids, saved_rows, parts):
        if part is None or len(part) != rows:
          raise CheckpointMismatchError(
              f"GBA buffer_{i} of the checkpoint does not line up with the {rows} rows of that "
              f"shard of {_name(logical)}: the optimizer that wrote it was built with other "
              f"variables, or another order, than model.trainable_variables. {_HOW_TO_MATCH}")
      tags = np.concatenate(parts)
    bounds = np.cumsum([0] + saved_rows)
    start = 0
    for shard in shards:
      rows = int(shard.shape[0]) if shard.shape.rank else 1
      steps = [p[0] for p, lo, hi in zip(present, bounds[:-1], bounds[1:])
               if p is not None and lo < start + rows and start < hi]
      plan.append((shard, sparse, max(steps) if steps else None,
                   tags[start:start + rows] if sparse else None))
      start += rows
  if saved and max(saved) >= index:
    raise CheckpointMismatchError(
        f"The checkpoint has GBA buffer_{max(saved)} but the model's variables make only {index} "
        f"shards there: it was written for another model or variable order. {_HOW_TO_MATCH}")
  return plan, count, len(saved), gba_node is not None


def _apply_gba(optimizer, plan, count, num_saved, from_checkpoint) -> dict:
  step = int(optimizer.iterations.numpy())  # restored by now
  done = set()
  for shard, sparse, shard_step, tags in plan:
    buffer = optimizer.buffer(shard, sparse)
    if sparse:
      buffer.import_state(step if shard_step is None else shard_step, tags)
    else:
      buffer.set_step(step if shard_step is None else shard_step)
    done.add(id(buffer))
  # Buffers the target already had (it trained before this restore) and the checkpoint has nothing
  # for start afresh at the restored step: their old steps and tags belong to another run.
  for entry in optimizer.gba_state()["buffers"].values():
    buffer = entry["buffer"]
    if id(buffer) not in done:
      if hasattr(buffer, "import_state"):
        buffer.import_state(step, np.full(buffer.num_rows, -1, np.int64))
      else:
        buffer.set_step(step)
  # Tokens: the saved count, never behind the global step (as GBA.build does after a restore). A
  # plain-optimizer checkpoint has none; without this every gradient would look `step` steps old.
  tokens = optimizer.token_generator
  current = int(tokens.count().numpy()) if count is None else count
  tokens.reset(max(current, step * tokens.num_aggregate))
  return {"token_count": int(tokens.count().numpy()), "saved_buffers": num_saved,
          "restored_buffers": len(plan), "from_checkpoint": from_checkpoint}


def _logical(v):
  container = getattr(v, "_sharded_container", None)  # a shard: its ShardedVariable
  return container() if container is not None else v


def _logical_trainable_variables(model, optimizer):
  """[(logical variable, [its shards])], in the order of the optimizer's variable list."""
  groups = {}
  for v in model.trainable_variables:
    groups.setdefault(id(_logical(v)), (_logical(v), []))[1].append(
        (optimizer.variable_index(v), v))
  ordered = sorted(groups.values(), key=lambda g: min(i for i, _ in g[1]))
  return [(logical, [v for _, v in sorted(shards, key=lambda t: t[0])])
          for logical, shards in ordered]
