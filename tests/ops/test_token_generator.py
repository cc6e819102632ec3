"""Token generator: the i-th fetch is floor(i / M) (SPEC section 1, "Tokens")."""

import threading

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import gba_ops


@pytest.mark.parametrize("m", [1, 3, 8])
def test_token_sequence_is_floor_i_over_m(m):
  gen = gba_ops.TokenGenerator(m)
  got = [tuple(int(x) for x in gen.fetch()) for _ in range(5 * m + 2)]
  expected = [(i // m, i) for i in range(5 * m + 2)]
  assert got == expected
  assert int(gen.count()) == 5 * m + 2


def test_reset_and_checkpoint_round_trip(tmp_path):
  gen = gba_ops.TokenGenerator(4)
  for _ in range(10):
    gen.fetch()
  ckpt = tf.train.Checkpoint(gen=gen)
  path = ckpt.save(str(tmp_path / "ck"))
  gen.reset(100)
  assert int(gen.fetch()[0]) == 25
  ckpt.restore(path)
  assert int(gen.count()) == 10
  token, ticket = gen.fetch()
  assert (int(token), int(ticket)) == (2, 10)


def test_fetch_inside_tf_function():
  gen = gba_ops.TokenGenerator(2)

  @tf.function
  def two():
    a = gen.fetch()
    with tf.control_dependencies([a[1]]):
      b = gen.fetch()
    return a[0], b[0]

  assert [int(x) for x in two()] == [0, 0]
  assert [int(x) for x in two()] == [1, 1]


def test_concurrent_fetches_hand_out_each_ticket_once():
  gen = gba_ops.TokenGenerator(5)
  results = [[] for _ in range(4)]

  def worker(out):
    for _ in range(250):
      out.append(int(gen.fetch()[1]))

  threads = [threading.Thread(target=worker, args=(r,)) for r in results]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  tickets = sorted(sum(results, []))
  np.testing.assert_array_equal(tickets, np.arange(1000))


@pytest.mark.parametrize("bad", [0, -2])
def test_bad_num_aggregate(bad):
  with pytest.raises(ValueError, match="num_aggregate"):
    gba_ops.TokenGenerator(bad)
  # The kernel refuses it too, for users of the raw op.
  with pytest.raises(tf.errors.InvalidArgumentError, match="num_aggregate"):
    gba_ops._ops().gba_token_generator_create(num_aggregate=bad, shared_name="bad_m")


def test_negative_reset_is_refused():
  gen = gba_ops.TokenGenerator(2)
  with pytest.raises(tf.errors.InvalidArgumentError, match="must be >= 0"):
    gen.reset(-1)
