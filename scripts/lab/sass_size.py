"""Machine-code size of each kernel of a .cu file: SASS instructions per function, from the
.text sections of the cubin nvcc makes (no cuobjdump needed).

    .venv/bin/python scripts/lab/sass_size.py csrc/kernels/fused.cu            # sm_90
    .venv/bin/python scripts/lab/sass_size.py --arch 100 csrc/kernels/fused.cu

Why (issue 23, 2026-12-06 evening): at decode sizes a kernel's code size is on the critical
path. Every launch of a one-block kernel lands on an SM whose instruction caches hold other
code, and cold code between the hot paths costs fetches: moving the error paths out of line
(fused dispatch 4,304 -> 3,296 instructions; with a clock-read change worth 0.2-0.5 µs) made
every 1-16 token cycle 2.0-4.6 µs faster. Check a kernel change here before timing it. Needs
nvcc (/usr/local/cuda or CUDA_HOME), jax and the NVSHMEM wheel in this interpreter
(scripts/setup.sh's .venv has both). A tree under .old/ compiles against its own headers.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

def text_sizes(cubin: bytes) -> dict[str, int]:
    """{function: SASS instructions} from an ELF64 cubin's .text.<function> sections (16 bytes
    an instruction on sm_70 and newer)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names = headers[names_at][4]  # sh_offset of the section-name table
    sizes = {}
    for h in headers:
        start = names + h[0]
        name = cubin[start:cubin.index(b"\0", start)].decode()
        if name.startswith(".text."):
            sizes[name[len(".text."):]] = h[5] // 16  # sh_size
    return sizes


def short(mangled: str) -> str:
    """The kernel's name and template arguments, without the file-static prefixes."""
    m = re.search(r"(\d+)([a-z_]+_kernel)(I.*?E)?E?v", mangled)
    return (m.group(2) + (m.group(3) or "")) if m else mangled


def csrc_of(source: str) -> str:
    """The csrc/ folder the source file lives in (its includes are relative to it), so a tree
    under .old/ compiles against its own headers."""
    path = os.path.dirname(os.path.abspath(source))
    while os.path.basename(path) != "csrc":
        parent = os.path.dirname(path)
        if parent == path:
            sys.exit(f"sass_size: {source} is not under a csrc/ folder")
        path = parent
    return path


CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")


def nvcc() -> str:
    """The nvcc on PATH, else CUDA_HOME's (which may not exist)."""
    return shutil.which("nvcc") or os.path.join(CUDA_HOME, "bin", "nvcc")


def nvcc_release() -> str | None:
    """nvcc's release ("13.0"), or None without nvcc."""
    if not os.path.exists(nvcc()):
        return None
    out = subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def compile_cubin(source: str, arch: str) -> bytes:
    import jax.ffi
    import nvidia.nvshmem

    nvshmem = os.path.join(list(nvidia.nvshmem.__path__)[0], "include")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "k.cubin")
        subprocess.run([nvcc(), "-std=c++17", "-rdc=true", f"-arch=sm_{arch}", "-O3", "-cubin",
                        f"-I{csrc_of(source)}", f"-I{jax.ffi.include_dir()}",
                        f"-I{nvshmem}", f"-I{os.path.join(CUDA_HOME, 'include', 'cccl')}",
                        "-c", source, "-o", out], check=True)
        return open(out, "rb").read()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="a .cu file of csrc/kernels")
    p.add_argument("--arch", default="90")
    args = p.parse_args()
    sizes = text_sizes(compile_cubin(args.source, args.arch))
    for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]):
        print(f"{n:7d}  {short(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
