"""scripts/lab/diag_trees.py's edits still apply to today's kernels: each variant's text is found
once, or the script stops (a tree whose code moved would time something else)."""

import importlib.util
import os
import shutil

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def load():
    spec = importlib.util.spec_from_file_location(
        "diag_trees", os.path.join(ROOT, "scripts", "lab", "diag_trees.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["diag-gpu", "diag-noack", "diag-nodack", "diag-nocack",
                                     "diag-notimer", "diag-all", "diag-ackload"])
def test_each_variant_applies_to_the_current_kernels(tmp_path, variant):
    diag = load()
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    for edit in diag.VARIANTS[variant]:
        edit(str(tmp_path))
    text = "".join(p.read_text() for p in (tmp_path / "csrc").rglob("*.cuh"))
    assert ("DIAG" in text) == (variant != "diag-gpu")
    halves = {"diag-nodack": ("dispatch", "combine"), "diag-nocack": ("combine", "dispatch")}
    if variant in halves:  # one half's acknowledgements only
        edited, kept = halves[variant]
        kernels = tmp_path / "csrc" / "kernels"
        for half, want in ((edited, True), (kept, False)):
            for part in ("send", "recv"):
                assert ("DIAG" in (kernels / f"{half}_{part}.cuh").read_text()) == want
    if "gpu_scope" in [e.__name__ for e in diag.VARIANTS[variant]]:
        memory = (tmp_path / "csrc" / "core" / "memory.cuh").read_text()
        assert ".sys.global" not in memory and memory.count(".gpu.global") == 4


def test_an_edit_that_no_longer_matches_stops_the_script(tmp_path):
    diag = load()
    (tmp_path / "csrc" / "core").mkdir(parents=True)
    (tmp_path / "csrc" / "core" / "memory.cuh").write_text("nothing to replace")
    with pytest.raises(SystemExit, match="expected 1"):
        diag.gpu_scope(str(tmp_path))
