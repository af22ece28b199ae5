"""Every command the README and the pipeline/context-parallel guide show, run exactly as shown
(torchrun ones included, on CPU with gloo), in a folder holding that page's example saved as
`example.py`, the way a user runs them. A rank that waits forever in a collective shows up
here as a timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1]
README = PACKAGE / "README.md"
GUIDE = PACKAGE / "docs" / "pipeline_and_context_parallel.md"
TIMEOUT_S = 300  # 4 ranks importing torch on a busy 2-core machine take ~40 s; a hang never ends


def shown_commands(page: Path) -> list[str]:
    """The commands a page shows inline: `python example.py`, `[VAR=x ]torchrun ...`, and the
    same for the other examples a page saves (`moe_example.py`)."""
    text = " ".join(page.read_text().split())  # commands may wrap across lines
    return re.findall(r"`((?:[A-Z_]+=\S+ )*(?:python|torchrun) [^`]*example\.py[^`]*)`", text)


def example_code(page: Path, script: str = "example.py") -> str:
    """The code the page asks to save as `script`: the first Python block after the script's
    name first appears (`example.py`: the page's first block)."""
    text = page.read_text()
    start = 0 if script == "example.py" else text.index(f"`{script}`")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


class Shown:
    """One shown command, started in its own folder holding the page's example."""

    def __init__(self, command: str, page: Path, folder: Path):
        self.command = command
        script = re.search(r"(\w*example\.py)", command).group(1)
        (folder / script).write_text(example_code(page, script))
        # `python` and `torchrun` are the ones of the environment the tests run in.
        bin_dir = str(Path(sys.executable).parent)
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # so that a timeout stops torchrun and every rank it started
        )

    def output(self) -> str:
        try:
            out, err = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
            pytest.fail(
                f"`{self.command}` did not finish in {TIMEOUT_S} s (a rank waiting in a"
                f" collective the others never join?)\n{out}\n{err[-3000:]}"
            )
        assert self.proc.returncode == 0, f"`{self.command}` failed\n{out}\n{err[-3000:]}"
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


@pytest.fixture(scope="module")
def shown(tmp_path_factory):
    """Every command, started at once: much of each run is waiting (imports, rendezvous),
    which the others fill."""
    runs = {}
    for page in (README, GUIDE):
        for i, command in enumerate(shown_commands(page)):
            runs[command] = Shown(command, page, tmp_path_factory.mktemp(f"{page.stem}{i}"))
    yield runs
    for run in runs.values():
        run.stop()


def test_the_pages_show_the_commands_tested_here() -> None:
    assert shown_commands(README) == [
        "python example.py",
        "torchrun --standalone --nproc-per-node 2 example.py",
        "TP=2 torchrun --standalone --nproc-per-node 4 example.py",
        "OPTIMIZER=muon torchrun --standalone --nproc-per-node 2 example.py",
        "python moe_example.py",
        "torchrun --standalone --nproc-per-node 2 moe_example.py",
    ]
    assert shown_commands(GUIDE) == [
        "torchrun --standalone --nproc-per-node 2 example.py pp",
        "torchrun --standalone --nproc-per-node 2 example.py cp",
    ]


MOE = [c for c in shown_commands(README) if "moe_example.py" in c]


@pytest.mark.parametrize("command", [c for c in shown_commands(README) if c not in MOE])
def test_readme_command_trains_three_steps(command: str, shown: dict) -> None:
    lines = shown[command].output().strip().splitlines()
    # Rank 0 prints one line per step; every rank took part in the loss reduction.
    assert [line.split(" |")[0] for line in lines] == ["step 0", "step 1", "step 2"], lines
    losses = [float(line.split("loss ")[1].split(" |")[0]) for line in lines]
    assert losses[-1] < losses[0]  # AdamW (or Muon) on a fixed random task lowers the loss


@pytest.mark.parametrize("command", shown_commands(GUIDE))
def test_guide_command_trains(command: str, shown: dict) -> None:
    lines = shown[command].output().strip().splitlines()
    assert len(lines) == 1, lines  # rank 0 prints the five step losses on one line
    losses = [float(x) for x in lines[0].split()]
    assert len(losses) == 5
    assert losses[-1] < losses[0] - 0.1, losses  # five steps on one batch learn something


def test_readme_moe_example_prints_the_same_losses_with_experts_split_over_2_processes(
    shown: dict,
) -> None:
    one, two = (shown[c].output().strip().splitlines() for c in MOE)
    assert [line.split(" |")[0] for line in two] == ["step 0", "step 1", "step 2"], two
    losses = [[float(line.split("loss ")[1].split(" |")[0]) for line in out] for out in (one, two)]
    # Printed to 4 decimals; EP over gloo sums in another order (~1e-7 relative).
    assert losses[0] == pytest.approx(losses[1], abs=2e-4), losses
    assert losses[1][-1] < losses[1][0]
