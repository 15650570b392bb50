"""The device-call helper scripts, run here on fake outputs (they run on the GPU machine once a
session, where a mistake costs device time): scripts/lab/gpu_pack.sh keeps what a call must bring
back within the 8-file limit, scripts/lab/gpu_bisect.sh writes its table even when nothing ran."""

import os
import shutil
import subprocess
import tarfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run(script, *args, out, **env):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "lab", script), *args],
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


FAKE_PYTHON = r"""#!/usr/bin/env bash
# python3 for gpu_bisect.sh without a GPU: pip installs nothing, the launcher writes one
# bench_loop row whose figure says which environment it ran with, anything else is python3.
if [ "$1 $2" = "-m pip" ]; then echo pip >> "$FAKE_LOG"; exit 0; fi
if [ "$1 $2" = "-m jax_moe_comm.launch" ]; then
  while [ $# -gt 0 ] && [ "$1" != "--out" ]; do shift; done
  us=${FAKE_US_DEFAULT}; [ "${JMC_FUSED:-}" = always ] && us=${FAKE_US_FUSED}
  printf '{"rows": [{"variant": "graph", "config": "V2Lite", "tokens_per_rank": 1, "fit_event_b_us": %s}]}' "$us" > "$2"
  echo "us/cycle"; exit 0
fi
exec python3 "$@"
"""


def test_gpu_bisect_times_one_tree_again_with_an_entrys_environment(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    tree = os.path.join(ROOT, ".old", "test-bisect-env")
    os.makedirs(os.path.join(tree, "benchmarks"), exist_ok=True)
    try:
        r = run("gpu_bisect.sh", out=tmp_path / "out", PYTHON=str(fake),
                COMMITS="test-bisect-env test-bisect-env+JMC_FUSED=always",
                FAKE_US_DEFAULT="35.0", FAKE_US_FUSED="47.5", FAKE_LOG=str(tmp_path / "pip.log"))
    finally:
        shutil.rmtree(tree)
        shutil.rmtree("/tmp/site_test-bisect-env", ignore_errors=True)
    assert r.returncode == 0, r.stderr
    assert "-- test-bisect-env+JMC_FUSED=always rc=0 1 rows" in r.stdout, r.stdout
    table = (tmp_path / "out" / "bisect.md").read_text()
    assert "| test-bisect-env | test-bisect-env+JMC_FUSED=always |" in table, table
    assert "| V2Lite | 1 | 35.0 | 47.5 |" in table, table
    assert (tmp_path / "pip.log").read_text() == "pip\n"  # one build for both entries
