"""The README's usage example, copied out of README.md and run as written (8 CPU devices)."""

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def usage_example() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    usage = text[text.index("\n## Usage\n"):]
    return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


def test_readme_usage_example_runs_as_written(tmp_path):
    script = tmp_path / "readme_example.py"
    script.write_text(usage_example())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "y (128, 256) over 8 ranks, backend reference" in r.stdout, r.stdout
