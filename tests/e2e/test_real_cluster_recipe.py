"""The TF_CONFIG recipe for a real cluster (docs/real_clusters.md), run as written.

Separate processes on 127.0.0.1: the lines between the recipe's code fences are run by bash as
they are, with the hosts and ports of the page's example replaced by free ports on 127.0.0.1,
`.venv/bin/python` by this interpreter, and the chief given a small job (later flags override
earlier ones).
"""

import json
import os
import re
import signal
import subprocess
import sys

from tf_gba.distribute.local_cluster import free_ports

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recipe() -> str:
  with open(os.path.join(_ROOT, "docs", "real_clusters.md")) as f:
    text = f.read()
  block = re.search(r"<!-- tf-config-recipe.*?-->\n```\n(.*?)```", text, re.S)
  assert block, "docs/real_clusters.md has no TF_CONFIG recipe"
  return block.group(1)


def test_documented_tf_config_recipe_trains(tmp_path):
  script = _recipe()
  hosts = sorted(set(re.findall(r"\b[ab]:\d+", script)))
  assert hosts == ["a:2222", "a:2223", "a:2224", "a:2225", "b:2222", "b:2223"]
  for host, port in zip(hosts, free_ports(len(hosts))):
    script = script.replace(host, f"127.0.0.1:{port}")
  script = script.replace(".venv/bin/python", sys.executable)
  small = (f" --model_dir={tmp_path / 'run'} --steps=40 --log_every=20 --local_batch_size=64"
           " --eval_examples=512 --stragglers=none --data_options=num_examples=20000"
           " --num_workers=2")
  chief = '\\"type\\": \\"chief\\"'  # as written in the TF_CONFIG of the chief's line
  lines = [l + small if chief in l else l for l in script.splitlines()]
  assert sum(chief in l for l in lines) == 1 and sum(l.endswith("&") for l in lines) == 5
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  # Output to files: the servers keep theirs open after bash (and the chief) are done.
  with open(tmp_path / "out", "w") as out_f, open(tmp_path / "err", "w") as err_f:
    proc = subprocess.Popen(["bash", "-c", "\n".join(lines)], cwd=_ROOT, env=env, stdout=out_f,
                            stderr=err_f, start_new_session=True)
  try:
    proc.wait(timeout=400)
  finally:
    # The servers serve until stopped (as on a real cluster); they are this session's processes.
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
  assert proc.returncode == 0, err[-3000:]
  with open(tmp_path / "run" / "summary.json") as f:
    summary = json.load(f)
  assert summary["num_workers"] == 2 and summary["num_ps"] == 1
  assert summary["global_step"] == 20 and summary["steps"] == 40  # M = 2
  assert "eval AUC" in out
