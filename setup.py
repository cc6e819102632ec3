"""Builds tf_gba and its custom TensorFlow op libraries.

Each folder `custom_ops/<area>/cc` becomes one shared library `tf_gba/ops/_<area>_ops*.so`, compiled
with exactly the flags the installed TensorFlow reports (`tf.sysconfig`), never hard-coded ones:
the C++ standard and the `_GLIBCXX_USE_CXX11_ABI` flag must match the wheel or the library will not
load. TensorFlow must therefore be importable at build time, so install with
`pip install --no-build-isolation .` (the Makefile does).

With TF_NEED_CUDA=1 the libraries also get their CUDA kernels: every `custom_ops/<area>/cc/kernels/
*.cu.cc` is compiled with nvcc ($NVCC, else $CUDA_HOME/bin/nvcc, else nvcc from PATH, else
/usr/local/cuda/bin/nvcc) for the architectures in TF_GBA_CUDA_ARCHS (default "75,80,90"), the
C++ sources with GOOGLE_CUDA=1 (their GPU kernel registrations), and the libraries are linked with
nvcc's static CUDA runtime. See docs/building.md, also for the check of nvcc's CUDA version against
the one TensorFlow was built with (TF_GBA_CUDA_VERSION_CHECK=strict makes a mismatch an error).
"""

import glob
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Command, Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


# Headers every op library compiles in (custom_ops/common/*.h); header-only, so no library of its
# own. A change to any of them rebuilds every object (see BuildTfOps._headers).
COMMON_DIR = os.path.join(ROOT, "custom_ops", "common")


def _op_libraries():
  libs = []
  for area_dir in sorted(glob.glob(os.path.join(ROOT, "custom_ops", "*", "cc"))):
    if os.path.dirname(area_dir) == COMMON_DIR:
      continue
    area = os.path.basename(os.path.dirname(area_dir))
    sources = sorted(glob.glob(os.path.join(area_dir, "ops", "*.cc")) +
                     glob.glob(os.path.join(area_dir, "kernels", "*.cc")))
    sources = [s for s in sources if not s.endswith(".cu.cc")]
    if sources:
      libs.append(Extension(f"tf_gba.ops._{area}_ops",
                            [os.path.relpath(s, ROOT) for s in sources]))
  return libs


DEFAULT_CUDA_ARCHS = "75,80,90"


class CudaConfig:
  """nvcc, its CUDA version and runtime library, for a TF_NEED_CUDA=1 build."""

  def __init__(self, tf, check_tensorflow=True):
    self.nvcc = self._find_nvcc()
    if not self.nvcc:
      raise SystemExit(
          "TF_NEED_CUDA=1 but nvcc was not found: set NVCC or CUDA_HOME, or put nvcc on PATH "
          "(or unset TF_NEED_CUDA to build the CPU kernels only).")
    out = subprocess.run([self.nvcc, "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    self.version = f"{match.group(1)}.{match.group(2)}" if match else "unknown"
    self.lib_dir = self._find_lib_dir()
    archs = os.environ.get("TF_GBA_CUDA_ARCHS", DEFAULT_CUDA_ARCHS).replace(";", ",")
    self.archs = [a.strip().replace("sm_", "").replace("compute_", "").replace(".", "")
                  for a in archs.split(",") if a.strip()]
    if not self.archs:
      raise SystemExit("TF_GBA_CUDA_ARCHS lists no GPU architecture (e.g. \"75,80,90\").")
    if check_tensorflow:
      self._check_version(tf)

  @staticmethod
  def _find_nvcc():
    if os.environ.get("NVCC"):
      return os.environ["NVCC"]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
      return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)

  def _find_lib_dir(self):
    # nvcc knows its toolkit's root (it may be a wrapper script elsewhere on PATH).
    dry = subprocess.run([self.nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True, check=False)
    top = re.search(r"^#\$ TOP=(.*)$", dry.stdout + dry.stderr, re.MULTILINE)
    roots = [top.group(1).strip()] if top else []
    roots.append(os.path.dirname(os.path.dirname(os.path.realpath(self.nvcc))))
    for root in roots:
      for sub in ("targets/x86_64-linux/lib", "lib64", "lib"):
        lib_dir = os.path.realpath(os.path.join(root, sub))
        if os.path.exists(os.path.join(lib_dir, "libcudart_static.a")):
          return lib_dir
    raise SystemExit(f"libcudart_static.a was not found next to {self.nvcc} (searched {roots}).")

  def _check_version(self, tf):
    """Compares nvcc's CUDA major version with the one TensorFlow was built with."""
    info = tf.sysconfig.get_build_info()
    tf_cuda = info.get("cuda_version", "") if info.get("is_cuda_build") else ""
    strict = os.environ.get("TF_GBA_CUDA_VERSION_CHECK", "warn") == "strict"
    if not tf_cuda:
      problem = (f"TensorFlow {tf.__version__} is not a CUDA build: it cannot run the CUDA kernels "
                 "being built.")
    elif tf_cuda.split(".")[0] != self.version.split(".")[0]:
      problem = (f"nvcc is CUDA {self.version} but TensorFlow {tf.__version__} was built with CUDA "
                 f"{tf_cuda}. The kernels are compiled against nvcc's own CUDA headers and linked "
                 "with its static runtime (libcudart_static), so they need an NVIDIA driver that "
                 f"supports CUDA {self.version.split('.')[0]}; use a CUDA "
                 f"{tf_cuda.split('.')[0]}.x toolkit (NVCC=...) to match TensorFlow exactly.")
    else:
      print(f"tf_gba: nvcc CUDA {self.version} matches TensorFlow's CUDA {tf_cuda}.", flush=True)
      return
    if strict:
      raise SystemExit("error: " + problem + " (TF_GBA_CUDA_VERSION_CHECK=strict)")
    print("WARNING: " + problem + " Set TF_GBA_CUDA_VERSION_CHECK=strict to make this an error.",
          file=sys.stderr, flush=True)

  def gencode_flags(self):
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in self.archs]
    lowest = min(self.archs, key=int)  # PTX too, so that newer GPUs can JIT-compile it
    return flags + [f"-gencode=arch=compute_{lowest},code=compute_{lowest}"]


def _import_tensorflow_quietly():
  """TensorFlow, imported for its build flags without its start-up notices on the terminal.

  TF's runtime logs a few INFO lines (oneDNN, CUDA drivers) on file descriptor 2 before its log
  level applies, on every build; they say nothing about the build. A failed import still raises
  here, with its message.
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)
  return tf


def _nvcc_flags(cuda, tf_cflags):
  """nvcc's flags for a *.cu.cc file: TensorFlow's headers as system headers (their warnings are
  not ours), its defines (C++11 ABI, Eigen alignment) as they are, and our own -std. -fmad=false
  keeps the GPU's sums identical to the CPU kernels' (no fused multiply-add contraction)."""
  tf_flags = []
  for flag in tf_cflags:
    if flag.startswith("-I"):
      tf_flags += ["-isystem", flag[2:]]
    elif flag.startswith("-D"):
      tf_flags.append(flag)
  return ["-x", "cu", "-std=c++17", "-O3", "-DNDEBUG", "-DGOOGLE_CUDA=1",
          "--expt-relaxed-constexpr", "-fmad=false", "-Xcompiler", "-Wno-deprecated-declarations",
          *cuda.gencode_flags(), "-I", ROOT, *tf_flags]


class BuildTfOps(build_ext):
  """Compiles each op library with g++ and TensorFlow's own flags, in parallel."""

  def build_extensions(self):
    tf = _import_tensorflow_quietly()
    self._cflags = tf.sysconfig.get_compile_flags()
    self._lflags = tf.sysconfig.get_link_flags()
    self._cxx = os.environ.get("CXX", "g++")
    self._cuda = CudaConfig(tf) if os.environ.get("TF_NEED_CUDA", "0") == "1" else None
    jobs = int(os.environ.get("TF_GBA_BUILD_JOBS", os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
      for ext in self.extensions:
        sources = list(ext.sources) + (self._cuda_sources(ext) if self._cuda else [])
        objects = list(pool.map(lambda s, e=ext: self._compile(e, s), sources))
        self._link(ext, objects)
    self._stamp(tf)

  @staticmethod
  def _cuda_sources(ext):
    area = ext.name.rsplit(".", 1)[-1][1:-len("_ops")]  # tf_gba.ops._<area>_ops -> <area>
    return [os.path.relpath(s, ROOT) for s in sorted(
        glob.glob(os.path.join(ROOT, "custom_ops", area, "cc", "kernels", "*.cu.cc")))]

  def _run(self, cmd):
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.check_call(cmd, cwd=ROOT)

  def _compile(self, ext, source):
    # One object cache in the source tree for every way of building (pip's editable install,
    # build_ext --inplace): each source is compiled once and rebuilt only when it changes.
    # CUDA builds compile the same sources differently (GOOGLE_CUDA=1): objects of their own.
    objs = "objs-cuda" if self._cuda else "objs"
    obj = os.path.join(ROOT, "build", objs, ext.name, source.replace(os.sep, "_") + ".o")
    os.makedirs(os.path.dirname(obj), exist_ok=True)
    src = os.path.join(ROOT, source)
    if os.path.exists(obj) and os.path.getmtime(obj) >= max(
        [os.path.getmtime(src)] + [os.path.getmtime(h) for h in self._headers()]):
      return obj
    if source.endswith(".cu.cc"):
      self._run(self._nvcc_command(src, obj))
      return obj
    cuda_flags = ["-DGOOGLE_CUDA=1"] if self._cuda else []
    self._run([self._cxx, "-c", "-fPIC", "-O3", "-DNDEBUG", "-Wno-sign-compare", "-Wno-deprecated-declarations", "-Wno-interference-size",
               *cuda_flags, "-I", ROOT, *self._cflags, src, "-o", obj])
    return obj

  def _nvcc_command(self, src, obj):
    return [self._cuda.nvcc, "-c", *_nvcc_flags(self._cuda, self._cflags), "-Xcompiler", "-fPIC",
            src, "-o", obj]

  def _headers(self):
    return glob.glob(os.path.join(ROOT, "custom_ops", "**", "*.h"), recursive=True)

  def _link(self, ext, objects):
    out = self.get_ext_fullpath(ext.name)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # nvcc's static CUDA runtime goes before TensorFlow's library, which exports a CUDA runtime
    # API of its own (stubs forwarding to the runtime TensorFlow loads): the kernels must bind to
    # the runtime of the nvcc that compiled them. --exclude-libs keeps its symbols private.
    cuda_libs = ([f"-L{self._cuda.lib_dir}", "-l:libcudart_static.a",
                  "-Wl,--exclude-libs,libcudart_static.a"] if self._cuda else [])
    cuda_sys = ["-ldl", "-lrt", "-lpthread"] if self._cuda else []
    self._run([self._cxx, "-shared", "-fPIC", *objects, "-o", out, *cuda_libs, *self._lflags,
               *cuda_sys])

  def _stamp(self, tf):
    # The loader quotes this when a library fails to load, so the error says what it was built for.
    compiler = subprocess.run([self._cxx, "--version"], capture_output=True, text=True,
                              check=False).stdout.splitlines()[:1]
    info = {
        "tf_version": tf.__version__,
        "compiler": compiler[0] if compiler else self._cxx,
        "cuda": bool(self._cuda),
        "python": platform.python_version(),
        "builder": "setup.py",
    }
    if self._cuda:
      info["cuda_version"] = self._cuda.version
      info["cuda_archs"] = ",".join(self._cuda.archs)
    for target_dir in {os.path.dirname(self.get_ext_fullpath(e.name)) for e in self.extensions}:
      with open(os.path.join(target_dir, "_build_info.py"), "w") as f:
        f.write("# Generated by setup.py at build time.\nBUILD_INFO = %r\n" % info)


GPU_CHECK = os.path.join("build", "gpu_check", "buffer_functors_gpu_check")


class BuildGpuCheck(Command):
  """Builds GPU_CHECK: the GBA buffers' GPU functors against host references, a program that needs
  only the CUDA driver to run (no TensorFlow), so any GPU machine can run it
  (custom_ops/gba/cc/tests/buffer_functors_gpu_check.cu.cc)."""

  description = "build " + GPU_CHECK + " (nvcc; TF_GBA_CUDA_ARCHS as for TF_NEED_CUDA=1)"
  user_options = []

  def initialize_options(self):
    pass

  def finalize_options(self):
    pass

  def run(self):
    tf = _import_tensorflow_quietly()
    cuda = CudaConfig(tf, check_tensorflow=False)  # the program does not run in TensorFlow
    sources = ["custom_ops/gba/cc/tests/buffer_functors_gpu_check.cu.cc",
               "custom_ops/gba/cc/kernels/dense_buffer_op_gpu.cu.cc",
               "custom_ops/gba/cc/kernels/sparse_buffer_op_gpu.cu.cc"]
    os.makedirs(os.path.join(ROOT, os.path.dirname(GPU_CHECK)), exist_ok=True)
    cmd = [cuda.nvcc, *_nvcc_flags(cuda, tf.sysconfig.get_compile_flags()), *sources,
           "-o", GPU_CHECK, "-cudart", "static"]
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.check_call(cmd, cwd=ROOT)


setup(
    name="tf_gba",
    version="0.1.0",
    description=("Global Batch gradients Aggregation (GBA) and friends for TensorFlow 2 "
                 "parameter-server training of recommendation models"),
    packages=find_packages(include=["tf_gba", "tf_gba.*"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow==2.21.0",
        "tf-keras==2.21.0",
        "tensorflow-recommenders==0.7.7",
        "numpy>=1.26",
        "absl-py>=2.1",
        "tensorboard>=2.21",
        "matplotlib>=3.8",
    ],
    extras_require={"test": ["pytest==9.2.0"]},
    ext_modules=_op_libraries(),
    cmdclass={"build_ext": BuildTfOps, "build_gpu_check": BuildGpuCheck},
    zip_safe=False,
)
