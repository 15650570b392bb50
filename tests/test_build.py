"""Packaging: the wheel setup.sh built (and installed) works in a fresh venv; with nvcc present
a build makes the CUDA module or fails saying why, never a quiet reference-only package."""

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


def _fake_wheel(path, cuda_version=None):
    """A minimal wheel: METADATA, RECORD, and the CUDA module when cuda_version is given."""
    files = {"jax_moe_comm/__init__.py": b"",
             "jax_moe_comm-0.2.0.dist-info/METADATA":
                 b"Metadata-Version: 2.2\nName: jax_moe_comm\nVersion: 0.2.0\n"
                 b"Requires-Dist: numpy\n\n# jax_moe_comm\n\nRequires-Dist: in the text\n"}
    if cuda_version:
        files["jax_moe_comm/_native.cpython-311-x86_64-linux-gnu.so"] = b"\x7fELF"
        files["jax_moe_comm/_native_build.py"] = f'CUDA_VERSION = "{cuda_version}"\n'.encode()
    record = "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items())
    files["jax_moe_comm-0.2.0.dist-info/RECORD"] = (
        record + "jax_moe_comm-0.2.0.dist-info/RECORD,,\n").encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def _metadata(path) -> str:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def _requires(metadata: str) -> list[str]:
    """Requires-Dist of the header (not the description), without extras' markers."""
    head = metadata.partition("\n\n")[0]
    return [line.split(": ", 1)[1] for line in head.splitlines()
            if line.startswith("Requires-Dist: ") and ";" not in line]


@pytest.mark.parametrize("cuda_version,expected", [("13.0", "nvidia-nvshmem-cu13==3.4.5"),
                                                   ("12.9", "nvidia-nvshmem-cu12==3.4.5"),
                                                   (None, None)])
def test_a_wheel_with_the_cuda_module_requires_its_nvshmem(tmp_path, cuda_version, expected):
    b = _backend()
    wheel = str(tmp_path / "jax_moe_comm-0.2.0-cp311-cp311-linux_x86_64.whl")
    _fake_wheel(wheel, cuda_version)
    assert b.require_nvshmem_in_wheel(wheel) == expected
    meta = _metadata(wheel)
    assert _requires(meta) == ["numpy"] + ([expected] if expected else [])
    assert meta.endswith("# jax_moe_comm\n\nRequires-Dist: in the text\n")  # text untouched
    if expected:
        with zipfile.ZipFile(wheel) as z:
            record = z.read("jax_moe_comm-0.2.0.dist-info/RECORD").decode()
            data = z.read("jax_moe_comm-0.2.0.dist-info/METADATA")
        assert f"jax_moe_comm-0.2.0.dist-info/METADATA,{b._record_hash(data)},{len(data)}" \
            in record.splitlines()
        b.require_nvshmem_in_wheel(wheel)  # once only
        assert _requires(_metadata(wheel)).count(expected) == 1


def test_metadata_prepared_before_the_build_predicts_the_nvshmem_requirement(monkeypatch):
    b = _backend()
    monkeypatch.setattr(b, "nvcc_major", lambda nvcc: 12)
    monkeypatch.setattr(b, "find_nvcc", lambda: "/opt/cuda-12/bin/nvcc")
    monkeypatch.delenv("JMC_CUDA", raising=False)
    assert b.cuda_build_requires(None) == ["nvidia-nvshmem-cu12==3.4.5", b.JAX_BUILD_REQUIRES]
    assert b.cuda_build_requires({"cmake.define.JMC_CUDA": "OFF"}) == []


def test_prepared_metadata_requires_nvshmem_exactly_when_the_module_is_built(tmp_path,
                                                                          monkeypatch):
    """pip resolves from prepare_metadata_for_build_wheel before building: `pip install .`
    with nvcc must already ask for NVSHMEM there."""
    b = _backend()
    meta = tmp_path / "METADATA"
    monkeypatch.setattr(b, "nvcc_major", lambda nvcc: 13)
    for cuda, expected in ((True, ["numpy", "nvidia-nvshmem-cu13==3.4.5"]), (False, ["numpy"])):
        meta.write_text("Metadata-Version: 2.2\nName: jax_moe_comm\nRequires-Dist: numpy\n\nText\n")
        monkeypatch.setattr(b, "builds_cuda", lambda settings, cuda=cuda: cuda)
        b._predict_nvshmem(str(meta), None)
        assert _requires(meta.read_text()) == expected


def _wheel_or_skip():
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
    return names


def test_the_built_wheel_is_manylinux_and_requires_the_nvshmem_it_links():
    _wheel_or_skip()
    assert "-manylinux_" in os.path.basename(WHEEL), WHEEL  # auditwheel repair (setup.sh)
    assert native.nvshmem_requirement() in _requires(_metadata(WHEEL))
    assert native.nvshmem_requirement() == "nvidia-nvshmem-cu13==3.4.5"  # nvcc 13 here
    names = zipfile.ZipFile(WHEEL).namelist()
    # NVSHMEM and the driver come from their own packages at run time, never from the wheel.
    assert not [n for n in names if "libnvshmem" in n or "libcuda" in n], names


def test_the_wheel_installs_into_a_fresh_venv_and_its_module_loads(tmp_path):
    _wheel_or_skip()
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    site = subprocess.run([py, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # jax and numpy from this interpreter, after the fresh venv's own packages: the package and
    # NVSHMEM must come from the fresh venv.
    outer = [p for p in sys.path if p.endswith("site-packages")]
    with open(os.path.join(site, "outer.pth"), "w") as f:
        f.write("\n".join(outer) + "\n")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
           "--ignore-installed"]  # what the .pth shows is not installed here
    r = subprocess.run(pip + [WHEEL], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    reason = ("import jax_moe_comm, jax_moe_comm.native as n\n"
              "print('from', jax_moe_comm.__file__)\n"
              "print('reason', n.unavailable_reason())\n")
    # Without NVSHMEM (as after --no-deps) the reason names the command that fixes it.
    r = subprocess.run([py, "-c", reason], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"from {site}" in r.stdout, r.stdout
    assert "libnvshmem_host.so.3" in r.stdout, r.stdout
    assert "pip install nvidia-nvshmem-cu13==3.4.5" in r.stdout, r.stdout
    # The NVSHMEM the wheel's metadata requires: then the module loads, with no GPU.
    requirement = [q for q in _requires(_metadata(WHEEL)) if q.startswith("nvidia-nvshmem")]
    r = subprocess.run(pip + requirement, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    code = ("import jax_moe_comm._native as m, jax_moe_comm.native as n\n"
            "maps = open('/proc/self/maps').read().split()\n"
            "print('nvshmem', m.built_nvshmem_version(), m.runtime_nvshmem_version())\n"
            "print('lib', [p for p in maps if 'libnvshmem_host' in p][0])\n"
            "print('reason', n.unavailable_reason())\n")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nvshmem (3, 4, 5) (3, 4, 5)" in r.stdout, r.stdout
    assert f"lib {site}" in r.stdout, r.stdout  # the fresh venv's copy, not the build's
    assert "reason no NVIDIA GPU here" in r.stdout or "reason no usable CUDA device" in r.stdout, \
        r.stdout  # loaded; no GPU here


def test_the_build_key_changes_with_the_sources_and_not_with_caches(tmp_path, monkeypatch):
    """scripts/setup.sh reuses the installed build while this key is unchanged."""
    spec = importlib.util.spec_from_file_location(
        "build_key", os.path.join(ROOT, "scripts", "build_key.py"))
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)
    monkeypatch.setattr(bk, "nvcc_identity", lambda: "nvcc 13.0")
    for rel in ("csrc/kernels/k.cu", "jax_moe_comm/api.py", "build_backend/jmc_build.py",
                "CMakeLists.txt", "pyproject.toml", "README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    key = bk.build_key(str(tmp_path))
    (tmp_path / "jax_moe_comm" / "__pycache__").mkdir()
    (tmp_path / "jax_moe_comm" / "__pycache__" / "api.cpython-311.pyc").write_text("x")
    (tmp_path / "jax_moe_comm" / "_native.cpython-311-x86_64-linux-gnu.so").write_text("x")
    (tmp_path / "README.md").write_text("not built from")
    assert bk.build_key(str(tmp_path)) == key
    (tmp_path / "csrc" / "kernels" / "k.cu").write_text("changed")
    changed = bk.build_key(str(tmp_path))
    assert changed != key
    monkeypatch.setenv("JMC_CUDA_ARCHS", "90")
    assert bk.build_key(str(tmp_path)) != changed
    monkeypatch.delenv("JMC_CUDA_ARCHS")
    monkeypatch.setattr(bk, "nvcc_identity", lambda: "nvcc 12.9")
    assert bk.build_key(str(tmp_path)) != changed


def test_one_version_everywhere():
    import re

    import jax_moe_comm

    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert jax_moe_comm.__version__ == version
    changelog = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    assert f"\n## {version} (" in changelog, f"CHANGELOG.md has no section for {version}"


# -- the CUDA 12 build (scripts/build_cuda12.sh; the build itself is opt-in in CI: JMC_CI_CUDA12=1)
def _script(name, env, timeout=60):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", name)], capture_output=True,
                          text=True, env=env, timeout=timeout)


def _fake_cuda(root, release):
    """A toolkit folder whose nvcc reports `release` and does nothing else."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "Cuda compilation tools, release {release}, V{release}.1"\n')
    nvcc.chmod(0o755)
    return root


@pytest.mark.parametrize("release,archs,expected", [("12.4", None, "80;90"),
                                                    ("12.8", None, "80;90;100"),
                                                    ("12.9", "90", "90")])
def test_build_cuda12_builds_for_the_architectures_its_nvcc_has(tmp_path, release, archs,
                                                                 expected):
    """sm_100 needs CUDA 12.8; the Debian toolkit the script assembles is 12.4."""
    env = dict(os.environ, CUDA12_HOME=str(_fake_cuda(tmp_path / "cuda", release)),
               JMC_CU12_PLAN="1")
    env.pop("JMC_CUDA_ARCHS", None)
    if archs:
        env["JMC_CUDA_ARCHS"] = archs
    r = _script("build_cuda12.sh", env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"(CUDA {release}), JMC_CUDA_ARCHS={expected}, nvidia-nvshmem-cu12==" in r.stdout


def test_build_cuda12_refuses_a_toolkit_that_is_not_cuda_12(tmp_path):
    env = dict(os.environ, CUDA12_HOME=str(_fake_cuda(tmp_path / "cuda", "13.0")),
               JMC_CU12_PLAN="1")
    r = _script("build_cuda12.sh", env)
    assert r.returncode == 2 and "is CUDA 13.0, not 12" in r.stdout, r.stdout + r.stderr
    env["CUDA12_HOME"] = str(tmp_path / "none")
    r = _script("build_cuda12.sh", env)
    assert r.returncode == 2 and "must be a CUDA 12 toolkit" in r.stdout, r.stdout + r.stderr


def test_the_cuda12_build_pins_what_the_backend_and_the_extras_pin():
    import tomllib

    b = _backend()
    script = open(os.path.join(ROOT, "scripts", "build_cuda12.sh")).read()
    assert f'NVSHMEM_REQ="{b.nvshmem_requirement(12)}"' in script
    assert f'JAX_REQ="{b.JAX_BUILD_REQUIRES}"' in script
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert b.nvshmem_requirement(12) in extras["cuda12"]
    assert b.nvshmem_requirement(13) in extras["cuda13"] and extras["cuda"] == extras["cuda13"]


def test_cuda12_toolkit_reuses_what_it_assembled_without_the_network(tmp_path):
    import re

    script = open(os.path.join(ROOT, "scripts", "cuda12_toolkit.sh")).read()
    packages = re.search(r"^PACKAGES=\((.*?)\)", script, re.S | re.M).group(1).split()
    assert all(p.startswith(("nvidia-cuda-", "libcudart12=")) and "~12.4.1-" in p
               or p.startswith("libcu++-dev=2.3.2") for p in packages), packages  # CUDA 12.4.1
    home = _fake_cuda(tmp_path / "tk" / "cuda-12.4", "12.4")
    (home / "assembled-from").write_text("trixie " + " ".join(packages) + "\n")
    env = dict(os.environ, CUDA12_TOOLKIT_DIR=str(tmp_path / "tk"), PATH="/nonexistent:/bin",
               DEBIAN_MIRROR="http://unused.invalid/debian")  # any download would fail
    r = _script("cuda12_toolkit.sh", env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(home)
    assert "reusing" in r.stderr
