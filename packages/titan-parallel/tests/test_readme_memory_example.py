"""The README's memory-estimate example, saved as `estimate.py` and run as shown
(`python estimate.py`): a 6.5B-parameter model's rank of a 64-rank job, on a laptop CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_memory_example_runs_and_reports_per_kind(tmp_path):
    text = README.read_text()
    assert "run `python estimate.py`" in " ".join(text.split())
    code = re.search(r"`estimate.py` and run.*?```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "estimate.py").write_text(code)
    result = subprocess.run(
        [sys.executable, "estimate.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    init = float(re.search(r"init peak ([\d.]+) GiB", result.stdout).group(1))
    kinds = dict(re.findall(r"(\w+) ([\d.]+) GiB", result.stdout.splitlines()[-1]))
    assert set(kinds) == {
        "parameters",
        "gradients",
        "optimizer",
        "activations",
        "temporaries",
        "communication",
        "total",
    }
    # 4.3B parameters (fp32) over 64 ranks is 0.25 GiB of shards. With an init_plan a rank
    # draws one block at a time (at most 64 MiB) beyond its shards, never the whole 16 GiB model.
    assert 0.2 < init < 0.25 + 0.15, result.stdout
    # AdamW's two moments per shard element; the step's peak covers more than the shards.
    assert float(kinds["optimizer"]) > float(kinds["parameters"]) > 0
    assert float(kinds["total"]) > float(kinds["optimizer"])
