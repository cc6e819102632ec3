"""The GBA buffers' GPU functors against host references, through the standalone check program.

`custom_ops/gba/cc/tests/buffer_functors_gpu_check.cu.cc` needs no TensorFlow to run, only a GPU
and its driver (docs/building.md). This builds it (`setup.py build_gpu_check`, nvcc) and runs it;
skipped where there is no nvcc or no GPU.
"""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROGRAM = os.path.join(_ROOT, "build", "gpu_check", "buffer_functors_gpu_check")


def _has_gpu() -> bool:
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return False
  listed = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
  return listed.returncode == 0 and "GPU" in listed.stdout


def _has_nvcc() -> bool:
  cuda_home = os.environ.get("CUDA_HOME", "")
  return bool(os.environ.get("NVCC") or shutil.which("nvcc") or
              os.path.exists(os.path.join(cuda_home, "bin", "nvcc")) or
              os.path.exists("/usr/local/cuda/bin/nvcc"))


@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not _has_nvcc(), reason="needs nvcc to build the check program")
def test_every_functor_matches_its_host_reference():
  subprocess.run([sys.executable, "setup.py", "-q", "build_gpu_check"], cwd=_ROOT, check=True,
                 capture_output=True, timeout=900)
  run = subprocess.run([_PROGRAM], capture_output=True, text=True, timeout=600, check=False)
  lines = run.stdout.splitlines()
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
  assert not [l for l in lines if l.startswith("FAIL")]
  for what in ("dense", "sparse", "pool grow"):
    for dtype in ("half", "bfloat16", "float", "double"):
      if what == "pool grow" and dtype in ("half", "bfloat16"):
        continue  # the pool is kept in the accumulation type only
      assert any(l.startswith(f"ok   {what} {dtype}") for l in lines), (what, dtype)
  assert lines[-1] == "passed: 0 check(s) failed"
