"""Repository rule `tf_configure`: the installed TensorFlow as a local Bazel repository.

Nothing is downloaded. The rule runs the Python interpreter that has TensorFlow installed and asks
`tf.sysconfig` for the header directory, the directory of `libtensorflow_framework.so.2` and the
compile flags TensorFlow was built with (the `_GLIBCXX_USE_CXX11_ABI` flag among them), then
symlinks the headers and the library into the repository and writes:

  BUILD           cc_library `tf_header_lib` (headers and TensorFlow's defines, which propagate to
                  dependents) and cc_library `libtensorflow_framework` (the shared library);
  tf_config.bzl   TF_VERSION, TF_CXX11_ABI_FLAG, TF_DEFINES, TF_CUDA_VERSION, TF_INCLUDE_DIR,
                  PYTHON_BIN, and what the CUDA build (--config=cuda) needs: NVCC, its
                  NVCC_CUDA_VERSION, CUDA_LIB_DIR (libcudart_static.a), CUDA_ARCH_FLAGS and
                  CUDA_VERSION_WARNING (non-empty when nvcc's CUDA major version differs from the
                  one TensorFlow was built with; see docs/building.md).
  pytest.sh       runs pytest from that Python against the Bazel-built op libraries (tests).

The interpreter is $PYTHON_BIN_PATH; without it, the workspace's `.venv/bin/python` when present,
else `python3` from PATH. nvcc is $NVCC, else $CUDA_HOME/bin/nvcc, else `nvcc` from PATH, else
/usr/local/cuda/bin/nvcc; none is needed unless --config=cuda. $TF_GBA_CUDA_ARCHS (default
"75,80,90") lists the GPU architectures to compile for: SASS for each, and PTX for the lowest so
that newer GPUs can JIT-compile it. The rule re-runs when one of these variables changes (or with
`bazel sync --configure`).
"""

_DEFAULT_CUDA_ARCHS = "75,80,90"

_QUERY = """
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
info = tf.sysconfig.get_build_info()
print(json.dumps({
    "version": tf.__version__,
    "include_dir": tf.sysconfig.get_include(),
    "lib_dir": tf.sysconfig.get_lib(),
    "compile_flags": tf.sysconfig.get_compile_flags(),
    "link_flags": tf.sysconfig.get_link_flags(),
    "abi_flag": int(tf.sysconfig.CXX11_ABI_FLAG),
    "cuda_version": info.get("cuda_version", "") if info.get("is_cuda_build") else "",
    "python": sys.executable,
}))
"""

def _fail(msg):
    fail("\n[tf_configure] " + msg + "\n")

def _find_python(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH", "").strip()
    if python:
        return python
    venv = rctx.path(Label("@//:WORKSPACE")).dirname.get_child(".venv").get_child("bin").get_child("python")
    if venv.exists:
        return str(venv)
    found = rctx.which("python3")
    if found == None:
        _fail("No Python found: set PYTHON_BIN_PATH to a Python that has TensorFlow installed " +
              "(e.g. --repo_env=PYTHON_BIN_PATH=$PWD/.venv/bin/python), or run `make venv`.")
    return str(found)

def _library_name(link_flags):
    # "-l:libtensorflow_framework.so.2" -> "libtensorflow_framework.so.2"
    for flag in link_flags:
        if flag.startswith("-l:"):
            return flag[3:]
        if flag.startswith("-l"):
            return "lib" + flag[2:] + ".so"
    return "libtensorflow_framework.so.2"

def _find_nvcc(rctx):
    nvcc = rctx.os.environ.get("NVCC", "").strip()
    if nvcc:
        return nvcc
    cuda_home = rctx.os.environ.get("CUDA_HOME", "").strip()
    if cuda_home and rctx.path(cuda_home + "/bin/nvcc").exists:
        return cuda_home + "/bin/nvcc"
    found = rctx.which("nvcc")
    if found != None:
        return str(found)
    if rctx.path("/usr/local/cuda/bin/nvcc").exists:
        return "/usr/local/cuda/bin/nvcc"
    return ""

def _cuda_config(rctx, tf_version, tf_cuda_version):
    """Returns the CUDA settings of tf_config.bzl (empty strings when there is no nvcc)."""
    config = {
        "NVCC": "",
        "NVCC_CUDA_VERSION": "",
        "CUDA_LIB_DIR": "",
        "CUDA_ARCH_FLAGS": [],
        "CUDA_VERSION_WARNING": "",
    }
    archs = [a.strip().replace("sm_", "").replace("compute_", "").replace(".", "")
             for a in rctx.os.environ.get("TF_GBA_CUDA_ARCHS", _DEFAULT_CUDA_ARCHS).replace(";", ",").split(",")
             if a.strip()]
    flags = ["-gencode=arch=compute_%s,code=sm_%s" % (a, a) for a in archs]
    if archs:
        lowest = archs[0]
        for a in archs:
            if int(a) < int(lowest):
                lowest = a
        flags.append("-gencode=arch=compute_%s,code=compute_%s" % (lowest, lowest))
    config["CUDA_ARCH_FLAGS"] = flags

    nvcc = _find_nvcc(rctx)
    if not nvcc:
        return config
    config["NVCC"] = nvcc
    version = rctx.execute([nvcc, "--version"], quiet = True)
    for line in version.stdout.splitlines():
        if "release " in line:
            config["NVCC_CUDA_VERSION"] = line.split("release ")[1].split(",")[0].strip()
    dryrun = rctx.execute([nvcc, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"], quiet = True)
    top = ""
    for line in (dryrun.stdout + dryrun.stderr).splitlines():
        if line.startswith("#$ TOP="):
            top = line[len("#$ TOP="):].strip()
    for lib_dir in [top + "/targets/x86_64-linux/lib", top + "/lib64", top + "/lib"]:
        if top and rctx.path(lib_dir + "/libcudart_static.a").exists:
            config["CUDA_LIB_DIR"] = str(rctx.path(lib_dir).realpath)
            break
    nvcc_major = config["NVCC_CUDA_VERSION"].split(".")[0]
    tf_major = tf_cuda_version.split(".")[0]
    if nvcc_major and tf_major and nvcc_major != tf_major:
        config["CUDA_VERSION_WARNING"] = (
            "WARNING: nvcc is CUDA %s but TensorFlow %s was built with CUDA %s. The tf_gba " +
            "CUDA kernels are compiled against the CUDA headers of that nvcc and linked with its " +
            "static runtime (libcudart_static), so they need an NVIDIA driver that supports " +
            "CUDA %s; see docs/building.md."
        ) % (config["NVCC_CUDA_VERSION"], tf_version, tf_cuda_version, nvcc_major)
    return config

def _tf_configure_impl(rctx):
    python = _find_python(rctx)
    result = rctx.execute([python, "-c", _QUERY], quiet = True)
    if result.return_code != 0:
        _fail("Could not import TensorFlow with " + python + " (PYTHON_BIN_PATH):\n" + result.stderr)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        _fail("Unexpected output from " + python + ":\n" + result.stdout + result.stderr)
    info = json.decode(lines[-1])

    # Defines TensorFlow was built with (the C++11 ABI, Eigen's alignment, ...); -I and -std are
    # set by the rules themselves.
    defines = []
    for flag in info["compile_flags"]:
        if flag.startswith("-D"):
            defines.append(flag[2:])
    abi = "_GLIBCXX_USE_CXX11_ABI=%d" % info["abi_flag"]
    if abi not in defines:
        defines.append(abi)

    lib_name = _library_name(info["link_flags"])
    lib_path = rctx.path(info["lib_dir"]).get_child(lib_name)
    if not lib_path.exists:
        _fail("TensorFlow's framework library is missing: " + str(lib_path))

    rctx.symlink(info["include_dir"], "include")
    rctx.symlink(lib_path, lib_name)

    cuda = _cuda_config(rctx, info["version"], info["cuda_version"])
    cudart = []
    if cuda["CUDA_LIB_DIR"]:
        rctx.symlink(cuda["CUDA_LIB_DIR"] + "/libcudart_static.a", "cuda/libcudart_static.a")
        cudart = ["cuda/libcudart_static.a"]

    rctx.file("BUILD", """# Generated by //third_party/tf:tf_configure.bzl from TensorFlow {version} ({python}).
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "tf_header_lib",
    hdrs = glob(["include/**"], exclude = ["include/**/*.py"]),
    includes = ["include"],
    defines = {defines},
)

cc_library(
    name = "libtensorflow_framework",
    srcs = ["{lib_name}"],
)

# nvcc's static CUDA runtime, for --config=cuda (empty without nvcc). Linked before
# libtensorflow_framework, which exports CUDA runtime stubs of its own, and kept private
# (--exclude-libs), so the kernels bind to the runtime of the nvcc that compiled them.
cc_library(
    name = "cudart_static",
    srcs = {cudart},
    linkopts = ["-Wl,--exclude-libs,libcudart_static.a", "-ldl", "-lrt", "-lpthread"],
)

exports_files(["tf_config.bzl", "pytest.sh"])
""".format(
        version = info["version"],
        python = info["python"],
        defines = repr(defines),
        lib_name = lib_name,
        cudart = repr(cudart),
    ))

    rctx.file("tf_config.bzl", """# Generated by //third_party/tf:tf_configure.bzl.
TF_VERSION = {version}
TF_CXX11_ABI_FLAG = {abi_flag}
TF_DEFINES = {defines}
TF_CUDA_VERSION = {cuda_version}
TF_INCLUDE_DIR = {include_dir}
PYTHON_BIN = {python}
NVCC = {nvcc}
NVCC_CUDA_VERSION = {nvcc_version}
CUDA_LIB_DIR = {cuda_lib_dir}
CUDA_ARCH_FLAGS = {arch_flags}
CUDA_VERSION_WARNING = {warning}
""".format(
        version = repr(info["version"]),
        abi_flag = info["abi_flag"],
        defines = repr(defines),
        cuda_version = repr(info["cuda_version"]),
        include_dir = repr(info["include_dir"]),
        python = repr(python),
        nvcc = repr(cuda["NVCC"]),
        nvcc_version = repr(cuda["NVCC_CUDA_VERSION"]),
        cuda_lib_dir = repr(cuda["CUDA_LIB_DIR"]),
        arch_flags = repr(cuda["CUDA_ARCH_FLAGS"]),
        warning = repr(cuda["CUDA_VERSION_WARNING"]),
    ))

    rctx.file("pytest.sh", """#!/bin/bash
# Generated by //third_party/tf:tf_configure.bzl. Runs pytest, from the Python that has
# TensorFlow installed, on the test files given, against the op libraries Bazel built: they are in
# this test's runfiles under custom_ops/<area>/, which TF_GBA_OPS_DIR points tf_gba's loader to.
set -euo pipefail
export TF_GBA_OPS_DIR="$PWD/custom_ops"
export TF_GBA_BAZEL_TEST=1
export PYTHONDONTWRITEBYTECODE=1
args=(-q -p no:cacheprovider)
if [[ -n "${{XML_OUTPUT_FILE:-}}" ]]; then
  args+=("--junitxml=$XML_OUTPUT_FILE")
fi
exec "{python}" -m pytest "${{args[@]}}" "$@"
""".format(python = python), executable = True)

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = ["PYTHON_BIN_PATH", "NVCC", "CUDA_HOME", "TF_GBA_CUDA_ARCHS"],
    configure = True,
    local = True,
)
