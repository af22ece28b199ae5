"""The README's example runs as written (one process; the torchrun layouts are the parity tests)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_trains_three_steps(capsys) -> None:
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(code, str(README), "exec"), {"__name__": "__main__"})
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 0", "step 1", "step 2"]
    losses = [float(line.split("loss ")[1].split(" |")[0]) for line in lines]
    assert losses[-1] < losses[0]  # AdamW on a fixed-size random task still lowers the loss
