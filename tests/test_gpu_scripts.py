"""The device-call helper scripts, run here on fake outputs (they run on the GPU machine once a
session, where a mistake costs device time): scripts/gpu_pack.sh keeps what a call must bring
back within the 8-file limit, scripts/gpu_bisect.sh writes its table even when nothing ran."""

import os
import subprocess
import tarfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run(script, *args, out, **env):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", script), *args],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "OUT": str(out), **env}, cwd=ROOT)


def test_gpu_pack_keeps_the_named_files_and_packs_the_rest(tmp_path):
    names = ["summary.txt", "layer_n8.json", "layer_n8.md", "gemm.json", "final_logs.tgz",
             "knob/layer_n8.json", "knob/layer_n8.md", "knob/deep/x.txt"]
    for n in names:
        (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / n).write_text(n)
    r = run("gpu_pack.sh", "summary.txt", "layer_n8.*", "knob/layer_n8.md", out=tmp_path)
    assert r.returncode == 0, r.stderr
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["knob/layer_n8.md", "layer_n8.json", "layer_n8.md", "rest.tgz",
                    "summary.txt"]
    with tarfile.open(tmp_path / "rest.tgz") as t:
        assert sorted(t.getnames()) == ["final_logs.tgz", "gemm.json", "knob/deep/x.txt",
                                        "knob/layer_n8.json"]
    assert "5 files" in r.stdout and "more than 8" not in r.stderr


def test_gpu_pack_warns_when_too_many_are_kept(tmp_path):
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_text("x")
    r = run("gpu_pack.sh", "*.txt", out=tmp_path)
    assert r.returncode == 0 and "more than 8 files" in r.stderr
    assert not (tmp_path / "rest.tgz").exists()


def test_gpu_bisect_writes_its_table_when_no_commit_ran(tmp_path):
    r = run("gpu_bisect.sh", out=tmp_path, COMMITS="0000000", PYTHON="python3")
    assert r.returncode == 0, r.stderr
    assert "-- 0000000: no .old/0000000" in r.stdout
    assert (tmp_path / "bisect.md").read_text().startswith("| config | tokens |")
