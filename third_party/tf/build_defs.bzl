"""Macros that build tf_gba's TensorFlow op libraries and run its Python tests with Bazel.

Everything comes from @local_config_tf (//third_party/tf:tf_configure.bzl): TensorFlow's headers,
its framework library and defines (the C++11 ABI flag among them), the Python that has it
installed, and nvcc for the CUDA kernels. See docs/building.md.
"""

load(
    "@local_config_tf//:tf_config.bzl",
    "CUDA_ARCH_FLAGS",
    "CUDA_LIB_DIR",
    "CUDA_VERSION_WARNING",
    "NVCC",
    "TF_DEFINES",
    "TF_INCLUDE_DIR",
)

# Like setup.py: the C++ standard TensorFlow's headers need, and its warnings that are not ours.
TF_OP_COPTS = [
    "-std=c++17",
    "-O3",
    "-Wno-sign-compare",
    "-Wno-deprecated-declarations",
    "-Wno-interference-size",
    "-Wno-maybe-uninitialized",  # false positives behind OP_REQUIRES_OK early returns
]

def _nvcc_object(name, src, hdrs):
    """A genrule compiling one *.cu.cc with nvcc into a position-independent object."""
    out = src[:-len(".cu.cc")] + ".cu.pic.o"
    defines = " ".join(["-D" + d for d in TF_DEFINES])
    warning = ""
    if CUDA_VERSION_WARNING:
        warning = "echo '%s' >&2; " % CUDA_VERSION_WARNING.replace("'", "")
    if NVCC and CUDA_LIB_DIR:
        cmd = (warning +
               "'%s' -c -x cu -std=c++17 -O3 -DNDEBUG -DGOOGLE_CUDA=1 %s " % (NVCC, defines) +
               "--expt-relaxed-constexpr -fmad=false -Xcompiler -fPIC " +
               "-Xcompiler -Wno-deprecated-declarations " +
               "-I. -isystem '%s' %s $(location %s) -o $@" % (TF_INCLUDE_DIR, " ".join(CUDA_ARCH_FLAGS), src))
    else:
        cmd = ("echo 'The CUDA build (--config=cuda) needs nvcc and libcudart_static.a: set NVCC " +
               "or CUDA_HOME (docs/building.md), then run bazel sync --configure.' >&2; exit 1")
    native.genrule(
        name = name,
        srcs = [src] + hdrs,
        outs = [out],
        cmd = cmd,
        message = "nvcc " + src,
        tags = ["manual"],  # built only through --config=cuda
    )
    return out

def tf_op_library(name, srcs, hdrs = [], gpu_srcs = [], deps = []):
    """A TensorFlow custom-op shared library `name` (e.g. "_gba_ops.so").

    Args:
      name: the file name of the library, which lands in bazel-bin/<package>/.
      srcs: C++ sources (op registrations and CPU kernels).
      hdrs: headers the sources (and the CUDA sources) include.
      gpu_srcs: *.cu.cc files: compiled with nvcc and linked in only with --config=cuda, which
        also compiles `srcs` with GOOGLE_CUDA=1 (their GPU kernel registrations).
      deps: further cc_library dependencies.
    """
    gpu_objs = [
        _nvcc_object(name.replace(".", "_") + "_" + src.split("/")[-1].replace(".", "_"), src, hdrs)
        for src in gpu_srcs
    ]
    native.cc_binary(
        name = name,
        srcs = srcs + hdrs + select({
            "//:cuda": gpu_objs,
            "//conditions:default": [],
        }),
        copts = TF_OP_COPTS + select({
            "//:cuda": ["-DGOOGLE_CUDA=1"],
            "//conditions:default": [],
        }),
        linkshared = 1,
        # The CUDA runtime first: see @local_config_tf//:cudart_static.
        deps = deps + select({
            "//:cuda": ["@local_config_tf//:cudart_static"],
            "//conditions:default": [],
        }) + [
            "@local_config_tf//:tf_header_lib",
            "@local_config_tf//:libtensorflow_framework",
        ],
    )

def tf_gba_py_test(name, src, data = [], size = "medium", tags = []):
    """Runs the pytest file `src` with the Python that has TensorFlow installed.

    The tests import tf_gba from the runfiles and load the op libraries Bazel built (pytest.sh
    points TF_GBA_OPS_DIR at them; tests/test_bazel_build.py checks it).
    """
    native.sh_test(
        name = name,
        srcs = ["@local_config_tf//:pytest.sh"],
        args = ["$(location %s)" % src],
        data = [src] + data,
        size = size,
        # The venv lives outside Bazel's view: run where it is visible.
        tags = tags + ["local"],
    )

def tf_op_area_library(name):
    """The op library `name` of one area, custom_ops/<area>/, called from its BUILD file.

    Every cc/ops/*.cc and cc/kernels/*.cc (so new kernels are picked up), their headers and the
    shared ones of custom_ops/common, and the cc/kernels/*.cu.cc CUDA kernels.
    """
    tf_op_library(
        name = name,
        srcs = native.glob(["cc/ops/*.cc", "cc/kernels/*.cc"], exclude = ["**/*.cu.cc"]),
        hdrs = native.glob(["cc/kernels/*.h"]) + ["//custom_ops/common:headers"],
        gpu_srcs = native.glob(["cc/kernels/*.cu.cc"]),
    )
