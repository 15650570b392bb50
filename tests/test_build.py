"""Packaging: the wheel setup.sh built (and installed) works in a fresh venv; with nvcc present
a build makes the CUDA module or fails saying why, never a quiet reference-only package."""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

from jax_moe_comm import native

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
REQUIRE = os.environ.get("JMC_REQUIRE_NATIVE") == "1"
WHEEL = os.environ.get("JMC_WHEEL")  # exported by scripts/setup.sh
NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None)


def _backend():
    spec = importlib.util.spec_from_file_location(
        "jmc_build", os.path.join(ROOT, "build_backend", "jmc_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_isolated_build_gets_nvshmem_and_jax_when_nvcc_is_present(monkeypatch, tmp_path):
    b = _backend()
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.delenv("JMC_CUDA", raising=False)
    monkeypatch.setattr(b.shutil, "which", lambda name: str(fake) if name == "nvcc" else None)
    assert b.builds_cuda(None)
    assert "nvidia-nvshmem-cu13==3.4.5" in b._with_cuda([], None)
    assert not b.builds_cuda({"cmake.define.JMC_CUDA": "OFF"})  # asked for reference-only
    monkeypatch.setattr(b.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    monkeypatch.setattr(b.os, "access", lambda p, m: False)
    assert not b.builds_cuda(None) and b._with_cuda([], None) == []
    monkeypatch.setenv("JMC_CUDA", "ON")  # forced: CMake then fails if nvcc is missing
    assert b.builds_cuda(None)


@pytest.mark.skipif(NVCC is None or shutil.which("cmake") is None,
                    reason="needs nvcc and cmake")
def test_cmake_with_nvcc_stops_with_the_reason_when_nvshmem_is_missing(tmp_path):
    hide = tmp_path / "hide" / "nvidia"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "hide"), CUDACXX=NVCC)
    env.pop("JMC_CUDA", None)
    r = subprocess.run([shutil.which("cmake"), "-S", ROOT, "-B", str(tmp_path / "build"),
                        f"-DPython_EXECUTABLE={sys.executable}"],  # JMC_CUDA: AUTO
                       capture_output=True, text=True, env=env, timeout=300)
    out = " ".join((r.stdout + r.stderr).split())  # CMake wraps its messages
    assert r.returncode != 0, out
    assert "so the CUDA module is built, but" in out and "cannot find NVSHMEM" in out, out
    assert "JMC_CUDA=OFF" in out


def test_the_wheel_installs_into_a_fresh_venv_and_its_module_loads(tmp_path):
    if not WHEEL:
        if REQUIRE:
            pytest.fail("JMC_WHEEL is not set: scripts/setup.sh builds the wheel and sets it")
        pytest.skip("no wheel to test: scripts/setup.sh builds one and exports JMC_WHEEL")
    names = zipfile.ZipFile(WHEEL).namelist()
    assert "jax_moe_comm/py.typed" in names
    modules = [n for n in names if n.startswith("jax_moe_comm/_native.") and n.endswith(".so")]
    if not native.built():
        assert not modules, "a reference-only install from a wheel with the CUDA module"
        pytest.skip("reference-only wheel (no nvcc at setup)")
    assert modules and "jax_moe_comm/_native_build.py" in names
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-deps", WHEEL, "nvidia-nvshmem-cu13==3.4.5"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # Load the module alone (jax is not in this venv): NVSHMEM must come from this venv's
    # nvidia-nvshmem-cu13 through the module's relative rpath, and no GPU is needed.
    code = ("import glob, importlib.util, site\n"
            "path = glob.glob(site.getsitepackages()[0] + '/jax_moe_comm/_native.*.so')[0]\n"
            "spec = importlib.util.spec_from_file_location('_native', path)\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "maps = open('/proc/self/maps').read().split()\n"
            "print('nvshmem', m.built_nvshmem_version(), m.runtime_nvshmem_version())\n"
            "print('lib', [p for p in maps if 'libnvshmem_host' in p][0])\n")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nvshmem (3, 4, 5) (3, 4, 5)" in r.stdout, r.stdout
    assert f"lib {env_dir}" in r.stdout, r.stdout  # not the build machine's copy
    assert glob.glob(str(env_dir / "lib" / "python*" / "site-packages" / "jax_moe_comm"))
