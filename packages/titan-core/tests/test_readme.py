"""The README's example runs as written, in a fresh process (it makes a process group)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def test_readme_example_runs(tmp_path):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    env = {**os.environ, "TITAN_CACHE_DIR": str(tmp_path / "cache")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    # Installed alone (nox's isolated session), the package brings numpy, which torch imports.
    assert "Failed to initialize NumPy" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert "did you mean steps?" in done.stdout
    assert lines[-2] == "None"  # no fsdp mesh with one process
    assert re.fullmatch(r"\d[\d.]* TFLOP/s \((measured|datasheet): .*\)", lines[-1]), lines[-1]
