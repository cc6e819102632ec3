"""The mode registry: what the binary, TrainConfig, the runner and the benchmarks read from it."""

import dataclasses
import importlib
import os

import pytest

from tests import script_process
from tests import train_binary
from tf_gba.training import mode_registry
from tf_gba.training.config import TrainConfig


def _reference_m(mode, n, local, global_batch=None, b2=None, b3=None):
  """M by the SPEC's rules, written out here."""
  default_fifth = max(1, int(n / 5 + 0.5))  # round(N / 5), N / 5 never a tie at .5 below
  if mode in ("async", "async_tuned", "dts", "shadow_easgd", "shadow_ma", "shadow_bmuf",
              "asgd_nodelay"):
    return 1  # every push (or replica step) applies at once
  if mode == "bsp":
    return b2 or default_fifth
  if mode == "hop_bs":
    return n
  if mode == "hop_bw":
    return n - (default_fifth if b3 is None else b3) if n > 1 else n
  return (global_batch or local * n) // local  # gba, sync: the synchronous global batch


@pytest.mark.parametrize("mode", mode_registry.names())
@pytest.mark.parametrize("n,local,global_batch,b2,b3", [
    (4, 256, None, None, None), (8, 128, 2048, 3, 2), (12, 64, 384, None, None),
    (1, 32, None, None, None)])
def test_m_rule_of_every_mode(mode, n, local, global_batch, b2, b3):
  if mode != "gba":
    global_batch = None  # only GBA takes another global batch
  cfg = TrainConfig(mode=mode, num_workers=n, local_batch_size=local,
                    global_batch_size=global_batch, bsp_aggregate=b2,
                    hop_bw_backup=b3 if n > 1 else None, steps=10)
  cfg.validate()
  want = _reference_m(mode, n, local, global_batch, b2, b3 if n > 1 else None)
  assert cfg.num_aggregate == want
  if mode in ("bsp", "hop_bs", "hop_bw"):
    assert cfg.global_batch == want * local
  else:
    assert cfg.global_batch == (global_batch or local * n)


def test_every_mode_runs_an_existing_function_and_names_its_flags():
  flags_of_binary = _binary_flags()
  for mode in mode_registry.all_modes():
    module, _, attr = mode.run.target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), mode.name
    assert mode.flags <= flags_of_binary, (mode.name, mode.flags - flags_of_binary)
    assert mode.help and "\n" not in mode.help
    if mode.run.target == "tf_gba.training.runner:run_parameter_server":
      from tf_gba.distribute import modes  # pylint: disable=g-import-not-at-top
      assert mode.strategy_mode in modes.MODES, mode.name
    if mode.parameter:
      assert mode.parameter in mode.flags


def _binary_flags():
  return set(train_binary.load().FLAGS)


def test_binary_mode_enum_and_help_come_from_the_registry():
  _binary_flags()
  from absl import flags  # pylint: disable=g-import-not-at-top
  flag = flags.FLAGS["mode"]
  assert tuple(flag.parser.enum_values) == mode_registry.names()
  for mode in mode_registry.all_modes():
    assert f"{mode.name}: {mode.help}" in flag.help


def test_hash_embedding_modes_are_the_registry_entries_that_say_so():
  """--embedding=hash: the modes whose embeddings are updated on parameter servers through GBA,
  and sync (every worker holds the table; written out here), the registry's `hash_embedding`
  entries, and the binary's help lists them."""
  assert mode_registry.hash_embedding_modes() == ("sync", "gba", "async", "bsp", "hop_bs",
                                                  "hop_bw", "async_tuned")
  for mode in mode_registry.all_modes():
    assert mode.hash_embedding == (mode.name == "sync" or (
        mode.kind == mode_registry.PARAMETER_SERVER and mode.strategy_mode is not None))
  _binary_flags()
  from absl import flags  # pylint: disable=g-import-not-at-top
  assert ", ".join(mode_registry.hash_embedding_modes()) + "." in flags.FLAGS["embedding"].help


def test_unused_flags():
  assert mode_registry.unused_flags("async", ["bsp_aggregate", "steps", "model"]) == [
      "bsp_aggregate"]
  assert mode_registry.unused_flags("bsp", ["bsp_aggregate", "input", "stragglers"]) == []
  assert mode_registry.unused_flags("sync", ["input", "hop_bw_backup", "stragglers"]) == [
      "hop_bw_backup", "input"]
  assert mode_registry.unused_flags("dts", ["dts_delay", "stragglers"]) == ["stragglers"]
  # The data list's readers: the parameter-server modes built on the dense buffer's runner.
  assert mode_registry.reads_input("gba") and mode_registry.reads_input("hop_bw")
  assert not mode_registry.reads_input("sync") and not mode_registry.reads_input("shadow_ma")
  message = mode_registry.unused_flags_message("async", ["bsp_aggregate"])
  assert message == "--mode=async does not use --bsp_aggregate (used by bsp); drop it"


@pytest.mark.parametrize("args,flag", [
    (["--mode=async", "--bsp_aggregate=3"], "--bsp_aggregate"),
    (["--mode=sync", "--input=sharded"], "--input"),
    (["--mode=gba", "--dts_delay=2"], "--dts_delay"),
])
def test_binary_refuses_a_flag_the_mode_does_not_use(tmp_path, args, flag):
  proc = script_process.run([*args, f"--model_dir={tmp_path / 'm'}"], timeout=120)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and flag in lines[0]
  assert "does not use" in lines[0]
  assert not os.path.exists(tmp_path / "m")  # refused before anything ran


def test_a_registered_mode_is_known_to_config_and_benchmarks():
  """Adding a mode is one register() call: the config validates it, the lists show it."""
  calls = []
  mode = mode_registry.register(mode_registry.Mode(
      name="test_only_mode", help="a mode of this test", kind=mode_registry.COLLECTIVE,
      run=lambda cfg: calls.append(cfg) or {"mode": cfg.mode},
      num_aggregate=lambda cfg: 7, flags=frozenset({"dts_delay"})))
  try:
    cfg = TrainConfig(mode="test_only_mode", steps=5)
    cfg.validate()
    assert cfg.num_aggregate == 7 and not cfg.uses_data_list
    assert "test_only_mode" in mode_registry.names()
    assert mode_registry.unused_flags("test_only_mode", ["dts_delay", "input"]) == ["input"]
    assert mode_registry.get("test_only_mode").run(cfg) == {"mode": "test_only_mode"}
    assert calls == [cfg]
    with pytest.raises(ValueError, match="registered twice"):
      mode_registry.register(mode)
  finally:
    mode_registry._REGISTRY.pop("test_only_mode")  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="--mode must be one of"):
    TrainConfig(mode="test_only_mode", steps=5).validate()


def test_benchmarks_read_the_registry():
  from benchmarks import switching  # pylint: disable=g-import-not-at-top
  assert switching.ALL_MODES == mode_registry.names(compared=True)
  assert set(switching.EXTRA_MODES) == {"async_tuned", "shadow_easgd", "shadow_ma",
                                        "shadow_bmuf", "asgd_nodelay"}
  assert switching.SWEPT == {"bsp": "bsp_aggregate", "hop_bs": "hop_bs_bound",
                             "hop_bw": "hop_bw_backup"}


def test_replayed_modes_are_the_registry_entries_that_say_so():
  """Replay's modes (tf_gba.training.replay, benchmarks.replay) are the registry's `replayed`
  entries (written out here), each one the simulator models and whose push is sync's mean or a
  buffer rule of the parameter servers."""
  from benchmarks import replay as replay_bench  # pylint: disable=g-import-not-at-top
  from tf_gba import simulate  # pylint: disable=g-import-not-at-top
  from tf_gba.distribute import modes as ps_modes  # pylint: disable=g-import-not-at-top
  from tf_gba.training import replay  # pylint: disable=g-import-not-at-top
  replayed = ("sync", "gba", "async", "bsp", "hop_bs", "hop_bw")
  assert mode_registry.replayed_modes() == replayed
  assert replay_bench.MODES == replayed
  assert replay_bench.parse_args([]).modes_list == list(replayed)
  for mode in mode_registry.all_modes():
    if mode.replayed:
      assert mode.name in simulate.MODES
      assert mode.name == "sync" or mode.strategy_mode in ps_modes.MODES
      replay.ModeConfig(mode.name, num_workers=4)
    else:
      with pytest.raises(ValueError, match="mode must be one of"):
        replay.ModeConfig(mode.name, num_workers=4)
  # ModeConfig reads the registry when it is made: a mode registered as replayed is accepted.
  mode_registry.register(mode_registry.Mode(
      name="test_only_replayed", help="a mode of this test", kind=mode_registry.COLLECTIVE,
      run=lambda cfg: {}, num_aggregate=lambda cfg: 1, replayed=True))
  try:
    assert replay.ModeConfig("test_only_replayed", num_workers=4).mode == "test_only_replayed"
  finally:
    mode_registry._REGISTRY.pop("test_only_replayed")  # pylint: disable=protected-access


def test_mode_checks_of_a_mode_live_with_its_entry():
  with pytest.raises(ValueError, match="--dts_delay and --dts_period must be >= 1"):
    TrainConfig(mode="dts", dts_delay=0, steps=5).validate()
  with pytest.raises(ValueError, match="--eval_day is not supported with --mode=dts"):
    TrainConfig(mode="dts", eval_day=1, steps=5).validate()
  cfg = dataclasses.replace(TrainConfig(mode="dts", steps=5), dts_inner="adam")
  with pytest.raises(ValueError, match="--dts_inner must be 'sgd' or 'momentum'"):
    cfg.validate()


def test_auto_policy_defaults_are_the_same_in_the_binary_the_config_and_the_policy():
  # Each --auto_* default is written three times (the flag, TrainConfig, PolicyConfig); a user of
  # the binary, of `train(TrainConfig(...))` and of the policy alone must get the same policy.
  from absl import flags  # pylint: disable=g-import-not-at-top
  from tf_gba.training import auto_job, auto_policy  # pylint: disable=g-import-not-at-top
  _binary_flags()
  config = TrainConfig()
  auto_fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name.startswith("auto_")]
  assert "auto_switch_cost_s" in auto_fields
  for name in auto_fields:
    assert flags.FLAGS[name].default == getattr(config, name), name
  assert auto_job.policy_config(config) == auto_policy.PolicyConfig()


def test_the_progress_interval_is_the_same_in_the_binary_and_the_config():
  # The binary's flag is written apart from TrainConfig (its supervisor does not import
  # TensorFlow, which the config does); the default's cost is measured in docs/step_cost.md.
  from absl import flags  # pylint: disable=g-import-not-at-top
  _binary_flags()
  assert flags.FLAGS["log_every"].default == TrainConfig().log_every == 200
