"""nvcc with relocatable device code and one device link, as CMakeLists.txt builds the kernels.

CMake's CUDA_SEPARABLE_COMPILATION + CUDA_RESOLVE_DEVICE_SYMBOLS: every .cu is compiled with
-rdc=true, then `nvcc -dlink` joins their device code with NVSHMEM's device archive into one
more object. All of these objects go into the one shared library (cc_binary srcs), so there is
a single copy of NVSHMEM's device state.
"""

# Bazel 4's built-in provider; @rules_cc's cc_info.bzl cannot be had offline for Bazel 4.
# buildifier: disable=native-cc-info
_CcInfo = CcInfo

CudaArchsInfo = provider(
    doc = "SASS targets, e.g. [\"90\", \"100\"]; PTX of the last one is embedded too.",
    fields = ["archs"],
)

def _cuda_archs_impl(ctx):
    archs = ctx.build_setting_value
    if not archs:
        fail("{}: give at least one architecture, e.g. 90".format(ctx.label))
    return CudaArchsInfo(archs = archs)

cuda_archs = rule(
    implementation = _cuda_archs_impl,
    build_setting = config.string_list(flag = True),
    doc = "A command-line flag: --//bazel:cuda_archs=90,100",
)

def _gencode_flags(archs):
    flags = ["--generate-code=arch=compute_{0},code=[sm_{0}]".format(a) for a in archs]
    flags.append("--generate-code=arch=compute_{0},code=[compute_{0}]".format(archs[-1]))
    return flags

def _join(*parts):
    return "/".join([p for p in parts if p])

def _cuda_rdc_objects_impl(ctx):
    gencode = _gencode_flags(ctx.attr.archs[CudaArchsInfo].archs)
    contexts = [dep[_CcInfo].compilation_context for dep in ctx.attr.deps]
    inputs = depset(ctx.files.hdrs, transitive = [c.headers for c in contexts])

    flags = ["-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-fPIC"] + gencode + ctx.attr.copts
    package_dir = _join(ctx.label.workspace_root, ctx.label.package)
    for inc in ctx.attr.includes:
        flags.append("-I" + _join(package_dir, inc))
    for c in contexts:
        flags += ["-D" + d for d in c.defines.to_list()]
        flags += ["-I" + d for d in c.quote_includes.to_list() + c.includes.to_list()]
        for d in c.system_includes.to_list():
            flags += ["-isystem", d]

    objects = []
    for src in ctx.files.srcs:
        stem = src.short_path[len(ctx.label.package) + 1:] if ctx.label.package else src.short_path
        obj = ctx.actions.declare_file("_objs/{}/{}.o".format(ctx.label.name, stem.rsplit(".", 1)[0]))
        args = ctx.actions.args()
        args.add_all(flags)

        # Intermediates beside the object, not in /tmp: Bazel 4's linux-sandbox shares /tmp and
        # gives each action its own PID namespace, so parallel nvccs (each pid 2) wrote the same
        # /tmp/tmpxft_00000002_* files ("cannot open source file ...cpp4.ii", CI 2026-12-05).
        args.add_all([
            "-x",
            "cu",
            "-rdc=true",
            "--objdir-as-tempdir",
            "-c",
            src.path,
            "-o",
            obj.path,
        ])
        ctx.actions.run(
            executable = ctx.executable.nvcc,
            arguments = [args],
            inputs = depset([src], transitive = [inputs]),
            outputs = [obj],
            mnemonic = "NvccCompile",
            progress_message = "nvcc -rdc {}".format(src.short_path),
            use_default_shell_env = True,  # nvcc runs the host compiler found on PATH
        )
        objects.append(obj)

    dlink = ctx.actions.declare_file("_objs/{}/device_link.o".format(ctx.label.name))
    args = ctx.actions.args()
    args.add_all(gencode + ["-Xcompiler=-fPIC", "-dlink", "-o", dlink.path])
    args.add_all(objects)
    args.add_all(ctx.files.device_libs)
    ctx.actions.run(
        executable = ctx.executable.nvcc,
        arguments = [args],
        inputs = objects + ctx.files.device_libs,
        outputs = [dlink],
        mnemonic = "NvccDeviceLink",
        progress_message = "nvcc -dlink {}".format(ctx.label),
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset(objects + [dlink]))]

cuda_rdc_objects = rule(
    implementation = _cuda_rdc_objects_impl,
    doc = "Objects of .cu sources compiled with -rdc=true, plus their device-link object.",
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"], doc = "The .cu files"),
        "hdrs": attr.label_list(allow_files = True, doc = "Headers they include"),
        "includes": attr.string_list(doc = "Include dirs, relative to this package"),
        "copts": attr.string_list(doc = "More nvcc flags"),
        "deps": attr.label_list(providers = [_CcInfo], doc = "cc_library targets for headers"),
        "device_libs": attr.label_list(
            allow_files = [".a"],
            doc = "Static archives with device code, for the device link",
        ),
        "archs": attr.label(
            default = "//bazel:cuda_archs",
            providers = [CudaArchsInfo],
            doc = "A cuda_archs flag",
        ),
        "nvcc": attr.label(
            default = "@jmc_deps//:nvcc",
            executable = True,
            allow_single_file = True,
            cfg = "exec",
        ),
    },
)
