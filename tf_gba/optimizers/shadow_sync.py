"""ShadowSync's synchronisation rules (SPEC section 4, seed 001 Algorithms 2-4).

Dense parameters are replicated per worker and trained locally; a background ("shadow") thread
pulls the replicas together. These are the rules it applies, as small functions on tensors (the
`*_values` functions, pure: they return new values) and as updates of variables (the `apply_*`
functions, what the runtime runs on the cluster). Every function works on a list of tensors or
variables (one per dense variable of the model), in the same order everywhere.

  S-EASGD  w_ps = (1 - alpha) * w_ps + alpha * w_i;  w_i = (1 - alpha) * w_i + alpha * w_ps
           (the new w_ps; w_ps lives on the parameter servers, one worker at a time)
  S-MA     w_g = mean_j w_j;  w_i = (1 - alpha) * w_i + alpha * w_g
  S-BMUF   w_c = mean_j w_j;  d = w_c - w_global;  v = momentum * v + eta * d;
           w_global = w_global + v;  w_i = (1 - alpha) * w_i + alpha * target,
           target = w_global + momentum * v with Nesterov, else w_global
           (momentum = 0: the paper's plain step w_global += eta * d; block momentum and Nesterov
           as in BMUF, Chen & Huo 2016, the options Algorithm 4 line 8 leaves open)

The worker's pull is applied as `w_i += alpha * (target - snapshot_i)`, where snapshot_i is the
value the synchroniser read: equal to the formula when nothing changed w_i meanwhile, and, while
the training thread keeps updating w_i (the point of ShadowSync), it keeps those local steps
instead of overwriting them with a value computed from a stale read.
"""

from typing import List, Sequence, Tuple

import tensorflow as tf


def _check_alpha(alpha: float, what: str = "alpha") -> float:
  alpha = float(alpha)
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"{what} must be in [0, 1], got {alpha}.")
  return alpha


def check_bmuf(eta: float, momentum: float) -> None:
  """Raises ValueError for a BMUF step size or block momentum out of range."""
  if not eta > 0:
    raise ValueError(f"BMUF step size eta must be > 0, got {eta}.")
  if not 0.0 <= momentum < 1.0:
    raise ValueError(f"BMUF block momentum must be in [0, 1), got {momentum}.")


# ---- pure rules (values in, values out) ---------------------------------------------------------
def easgd_values(w_ps: Sequence, w_i: Sequence, alpha: float) -> Tuple[List, List]:
  """One S-EASGD exchange of worker i with the sync PS: (new w_ps, new w_i)."""
  alpha = _check_alpha(alpha)
  new_ps = [(1.0 - alpha) * p + alpha * w for p, w in zip(w_ps, w_i)]
  new_w = [(1.0 - alpha) * w + alpha * p for p, w in zip(new_ps, w_i)]
  return new_ps, new_w


def mean_values(replicas: Sequence[Sequence]) -> List:
  """The element-wise mean of the replicas (a list per replica, same order)."""
  if not replicas:
    raise ValueError("mean of no replicas.")
  n = len(replicas)
  return [tf.add_n([tf.convert_to_tensor(r[k]) for r in replicas]) / n
          for k in range(len(replicas[0]))]


def ma_values(replicas: Sequence[Sequence], alpha: float) -> List[List]:
  """One S-MA round over all replicas: every w_i pulled towards their mean."""
  alpha = _check_alpha(alpha)
  w_g = mean_values(replicas)
  return [[(1.0 - alpha) * w + alpha * g for w, g in zip(r, w_g)] for r in replicas]


def bmuf_global_values(w_c: Sequence, w_global: Sequence, v: Sequence, eta: float,
                       momentum: float = 0.0, nesterov: bool = False
                       ) -> Tuple[List, List, List]:
  """The BMUF block step: (new w_global, new v, target the workers are pulled towards)."""
  check_bmuf(eta, momentum)
  new_v = [momentum * vk + eta * (c - g) for c, g, vk in zip(w_c, w_global, v)]
  new_g = [g + vk for g, vk in zip(w_global, new_v)]
  target = [g + momentum * vk for g, vk in zip(new_g, new_v)] if nesterov else new_g
  return new_g, new_v, target


def bmuf_values(replicas: Sequence[Sequence], w_global: Sequence, v: Sequence, eta: float,
                alpha: float, momentum: float = 0.0, nesterov: bool = False
                ) -> Tuple[List[List], List, List]:
  """One S-BMUF round: (new replicas, new w_global, new v)."""
  alpha = _check_alpha(alpha)
  new_g, new_v, target = bmuf_global_values(mean_values(replicas), w_global, v, eta, momentum,
                                            nesterov)
  return ([[(1.0 - alpha) * w + alpha * t for w, t in zip(r, target)] for r in replicas],
          new_g, new_v)


# ---- the same rules on variables (what the synchroniser runs) -----------------------------------
def read(variables: Sequence[tf.Variable]) -> List[tf.Tensor]:
  """A snapshot of `variables` (identity reads, on the variables' devices)."""
  return [tf.identity(v.read_value()) for v in variables]


def pull(local: Sequence[tf.Variable], target: Sequence, snapshot: Sequence, alpha: float):
  """w_i += alpha * (target - snapshot): the worker side of every ShadowSync rule."""
  alpha = _check_alpha(alpha)
  return [w.assign_add(alpha * (tf.convert_to_tensor(t) - s), read_value=False)
          for w, t, s in zip(local, target, snapshot)]


def apply_easgd_ps(w_ps: Sequence[tf.Variable], snapshot: Sequence, alpha: float) -> List:
  """The sync-PS side of S-EASGD: w_ps = (1 - alpha) w_ps + alpha w_i; returns the new w_ps."""
  alpha = _check_alpha(alpha)
  return [p.assign((1.0 - alpha) * p.read_value() + alpha * tf.convert_to_tensor(s))
          for p, s in zip(w_ps, snapshot)]


def apply_bmuf_global(w_global: Sequence[tf.Variable], v: Sequence[tf.Variable], w_c: Sequence,
                      eta: float, momentum: float = 0.0, nesterov: bool = False) -> List:
  """Applies the BMUF block step to the variables; returns the target of the workers' pull."""
  new_g, new_v, target = bmuf_global_values(w_c, [g.read_value() for g in w_global],
                                            [x.read_value() for x in v], eta, momentum, nesterov)
  with tf.control_dependencies([g.assign(x) for g, x in zip(w_global, new_g)] +
                               [x.assign(y) for x, y in zip(v, new_v)]):
    return [tf.identity(t) for t in target]
