"""Repository rule: the native module's inputs, found on this machine as CMakeLists.txt finds them.

Nothing is downloaded. A Python interpreter (JMC_PYTHON, else python3 on PATH) that has jax,
nanobind and nvidia-nvshmem-cu13==3.4.5 installed says where the XLA FFI headers, nanobind's
sources, the NVSHMEM wheel and its own C headers are; the CUDA toolkit is CUDA_PATH, else
CUDA_HOME, else /usr/local/cuda. Those directories are linked into the generated repository,
whose BUILD file declares them as cc_library targets, plus:
  :nvcc              a wrapper that runs the toolkit's nvcc by its absolute path (nvcc finds its
                     own installation from the path it was called by, so a link to it fails)
  :python_toolchain  the interpreter above as Bazel's Python toolchain, so py_test sees jax
"""

_FIND_PACKAGES = """
import json, os, sys, sysconfig
found = {"python": sys.executable, "python_include": sysconfig.get_paths()["include"]}
try:
    import jax.ffi
    found["xla_ffi_include"] = jax.ffi.include_dir()
    import nanobind
    found["nanobind"] = os.path.dirname(nanobind.__file__)
    import nvidia.nvshmem as m
    found["nvshmem"] = list(m.__path__)[0]
except ImportError as e:
    found["error"] = str(e)
print(json.dumps(found))
"""

_BUILD = """\
package(default_visibility = ["//visibility:public"])

load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

exports_files(["nvcc"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["cuda/include/**"]),
    # nvshmem.h pulls in libcu++ (cuda/std/...), which CUDA 13 keeps under include/cccl.
    includes = ["cuda/include", "cuda/include/cccl"],
)

cc_library(
    name = "cudart_static",
    srcs = ["cuda/lib64/libcudart_static.a"],
    linkopts = ["-ldl", "-lrt", "-lpthread"],
)

cc_library(
    name = "xla_ffi_headers",
    hdrs = glob(["xla_ffi_include/**/*.h"]),
    includes = ["xla_ffi_include"],
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

cc_library(
    name = "nvshmem_headers",
    hdrs = glob(["nvshmem/include/**"]),
    includes = ["nvshmem/include"],
)

# Device code for nvcc's device link, and its host part for the final link.
filegroup(
    name = "nvshmem_device_archive",
    srcs = ["nvshmem/lib/libnvshmem_device.a"],
)

cc_library(
    name = "nvshmem_device",
    srcs = ["nvshmem/lib/libnvshmem_device.a"],
)

# The wheel ships only the versioned soname. The rpath finds it where the wheel is installed.
cc_library(
    name = "nvshmem_host",
    srcs = ["nvshmem/lib/libnvshmem_host.so.3"],
    linkopts = ["-Wl,-rpath,{nvshmem}/lib"],
)

# nanobind's own sources, built static as nanobind_add_module(NB_STATIC) builds them
# (nb_combined.cpp includes the others; nb_backend.cpp and nb_ft.cpp are for other modes).
cc_library(
    name = "nanobind",
    srcs = glob(
        ["nanobind/src/*.cpp"],
        exclude = [
            "nanobind/src/nb_backend.cpp",
            "nanobind/src/nb_combined.cpp",
            "nanobind/src/nb_ft.cpp",
        ],
    ) + glob(["nanobind/src/*.h"]),
    hdrs = glob(["nanobind/include/**/*.h", "nanobind/ext/robin_map/include/**/*.h"]),
    copts = [
        "-std=c++17",  # Bazel 4's default toolchain says -std=c++0x
        "-O3",
        "-fvisibility=hidden",
        "-fno-strict-aliasing",
        "-mtls-dialect=gnu2",
        "-fno-stack-protector",
    ],
    includes = ["nanobind/include", "nanobind/ext/robin_map/include"],
    linkstatic = True,
    local_defines = ["NB_BUILD", "NB_COMPACT_ASSERTIONS"],
    deps = [":python_headers"],
)

py_runtime(
    name = "python3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
    # The test stub runs under this interpreter too, not under `python` on PATH (Debian has
    # only python3 there, so a user without pyenv got "/usr/bin/env: 'python': No such file").
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "python_runtimes",
    py3_runtime = ":python3_runtime",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":python_runtimes",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _fail(what, fix):
    fail("jax_moe_comm: cannot find {}. {}".format(what, fix))

def _jmc_local_deps_impl(rctx):
    python = rctx.os.environ.get("JMC_PYTHON") or rctx.which("python3")
    if not python:
        _fail("a Python interpreter", "Set JMC_PYTHON to one that has jax installed.")
    res = rctx.execute([str(python), "-c", _FIND_PACKAGES], timeout = 120)
    if res.return_code != 0:
        _fail("the Python packages with {}".format(python), res.stderr)
    found = json.decode(res.stdout.strip())
    if "error" in found:
        _fail(
            "a package with {} ({})".format(found["python"], found["error"]),
            "pip install 'jax>=0.10.0,<0.12' 'nanobind>=2.0' nvidia-nvshmem-cu13==3.4.5, or set JMC_PYTHON.",
        )

    cuda = rctx.os.environ.get("CUDA_PATH") or rctx.os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    if not rctx.path(cuda + "/bin/nvcc").exists:
        _fail("nvcc under " + cuda, "Set CUDA_PATH to the CUDA toolkit's root.")

    links = {
        "cuda": cuda,
        "nanobind": found["nanobind"],
        "nvshmem": found["nvshmem"],
        "python_include": found["python_include"],
        "xla_ffi_include": found["xla_ffi_include"],
    }
    for name, target in links.items():
        rctx.symlink(target, name)
    for f in [
        "nvshmem/include/nvshmem.h",
        "nvshmem/lib/libnvshmem_device.a",
        "nvshmem/lib/libnvshmem_host.so.3",
        "cuda/lib64/libcudart_static.a",
        "python_include/Python.h",
        "xla_ffi_include/xla/ffi/api/ffi.h",
        "nanobind/src/nb_internals.cpp",
    ]:
        if not rctx.path(f).exists:
            _fail(f + " in the linked directories " + str(links), "Reinstall that package.")

    # Each nvcc gets its own TMPDIR: Bazel 4's sandboxes share /tmp and give every action its
    # own PID namespace, and nvcc names its host-compiler probe files after its pid, so two
    # parallel actions (both pid 1 or 2) could truncate each other's (--objdir-as-tempdir in
    # cuda.bzl keeps the compile's own intermediates beside the object; these it does not).
    rctx.file("nvcc", (
        "#!/bin/sh\n" +
        "d=$(mktemp -d) || exit 1\n" +
        "TMPDIR=$d '{}/bin/nvcc' \"$@\"\n" +
        "rc=$?\n" +
        "rm -rf \"$d\"\n" +
        "exit $rc\n"
    ).format(cuda), executable = True)
    rctx.file("WORKSPACE", "workspace(name = \"{}\")\n".format(rctx.name))
    rctx.file("BUILD.bazel", _BUILD.replace("{nvshmem}", found["nvshmem"]).replace(
        "{python}",
        found["python"],
    ))

jmc_local_deps = repository_rule(
    implementation = _jmc_local_deps_impl,
    environ = ["JMC_PYTHON", "CUDA_PATH", "CUDA_HOME"],
    local = True,
    doc = "The CUDA toolkit, NVSHMEM wheel, XLA FFI headers, nanobind and Python of this machine.",
)
