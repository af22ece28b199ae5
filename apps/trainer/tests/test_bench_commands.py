"""The benchmark commands users run: `uv run nox -s bench-gpu` refuses clearly on a machine
without a GPU, and its parts (throughput with the step breakdown, Float8, checkpoints) run end
to end at toy sizes (`--smoke`), each appended to the JSON-lines file as it ends, and a part
the dry run says does not fit is not run; `uv run nox -s bench` reaches every CPU script, and
each script answers `--help` and a bad flag before it imports torch; bench/README.md's
throughput commands run as shown, with toy sizes appended (argparse keeps the last value of a
flag)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from titan_trainer.precision import compute_dtype

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has a CUDA GPU: bench-gpu measures here"
)
def test_bench_gpu_without_a_gpu_says_so_and_fails_without_writing_a_file(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(REPO / "noxfile.py"), "-s", "bench-gpu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = done.stdout + done.stderr  # nox passes the command's stderr on to its stdout
    assert done.returncode != 0
    assert "no CUDA GPU on this machine" in said, said[-2000:]
    assert "nothing was measured and no file was written" in said
    assert "uv run nox -s bench`" in said  # what to run instead
    assert not list(tmp_path.glob("*.json"))


class _AnyNumber:
    """Equal to any positive number (a prediction whose value is not the point)."""

    def __eq__(self, other):
        return isinstance(other, int | float) and other > 0


ANY_NUMBER = _AnyNumber()


def _bench_gpu(out: Path, *flags: str) -> subprocess.Popen:
    command = [sys.executable, str(REPO / "bench" / "gpu.py"), "--smoke", "--out", str(out)]
    return subprocess.Popen(
        [*command, *flags], stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_bench_gpu_appends_each_part_as_it_ends_and_runs_every_part(tmp_path):
    """Read as soon as its first part (throughput, eager) has ended, while the others still
    run, the file holds the machine, the dry run's sizing and that part's records (on disk:
    a run stopped then keeps them); at the end every part and the targets follow. One run
    serves both checks: each run pays for its own dry run and imports."""
    out = tmp_path / "bench.jsonl"
    run = _bench_gpu(out)
    try:
        deadline = time.monotonic() + 600
        while not any(line.get("kind") == "part" for line in _lines(out)):
            assert run.poll() is None, run.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        first = _lines(out)
        assert run.wait(timeout=900) == 0, run.stderr.read()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    machine, part = first  # and nothing after: the other parts had not ended
    assert machine["kind"] == "machine" and machine["smoke"] is True
    assert part["part"] == "throughput_eager" and part["returncode"] == 0
    assert part["sizing"] == [{"batch": 2, "predicted_peak_gib": ANY_NUMBER, "fits": True}]
    (record,) = part["records"]
    assert record["variant"] == "eager" and record["batch_size"] == 2
    # The breakdown covers the whole step: its parts add up to about the median step.
    assert set(record["breakdown_s"]) == {"data", "forward", "backward", "optimizer", "logging"}
    assert record["mfu_pct"] > 0 and record["peak_tflops"] > 0 and record["drift"] > 0

    again, *parts, end = _lines(out)
    assert [again, parts[0]] == first  # the lines written first are kept as they were
    assert [p["part"] for p in parts] == [
        "throughput_eager",
        "throughput_eager_attention_auto",
        "throughput_compiled",
        "float8",
        "ckpt",
    ]
    assert all(p["returncode"] == 0 and not p["timed_out"] for p in parts)
    auto, compiled, float8, ckpt = (p["records"] for p in parts[1:])
    assert auto[0]["attention"] != "default" and record["attention"] == "default"
    assert [r["variant"] for r in compiled] == ["compiled"]
    assert "--compile.enable" in parts[2]["command"]
    assert {"sync_save_s", "async_blocking_s", "load_s"} <= {r["metric"] for r in ckpt}
    assert float8[0].get("skipped") is (not torch.cuda.is_available())
    assert end["kind"] == "targets" and end["targets"][0]["target"] == "1B bf16 compiled MFU >= 50%"


def test_bench_gpu_refuses_a_part_the_dry_run_says_does_not_fit(tmp_path):
    out = tmp_path / "bench.jsonl"
    run = _bench_gpu(out, "--memory-gib", "0.001", "--only", "throughput_eager")
    assert run.wait(timeout=600) == 1
    said = run.stderr.read()
    assert "the dry run predicts" in said and "budget 0.00085 GiB: does not fit" in said, said
    assert "the throughput parts fit at no batch under 0.00085 GiB: not run" in said
    _, refused, end = _lines(out)
    assert refused["not_run"] == "does not fit" and not refused["sizing"][0]["fits"]
    assert end == {"kind": "targets", "targets": []}


BENCH_SCRIPTS = sorted((REPO / "bench").glob("*.py"))
# A line of `python -X importtime` (PYTHONPROFILEIMPORTTIME) for the import of torch itself.
TORCH_IMPORT = re.compile(r"^import time:.*\|\s+torch$", re.M)


def test_nox_bench_runs_every_cpu_script(tmp_path):
    # `--` passes `--help` on to each script: every one is reached and parses its flags, without
    # the minutes the measurements themselves take, and answers before it imports torch.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nox",
            "-f",
            str(REPO / "noxfile.py"),
            "-s",
            "bench",
            "--",
            "--help",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    scripts = [p.name for p in BENCH_SCRIPTS if p.name not in ("gpu.py", "vs_torchtitan.py")]
    usages = re.findall(r"usage: (\S+\.py)", said)
    assert sorted(usages) == scripts, usages
    assert not TORCH_IMPORT.search(said), "a script imported torch before answering --help"


def test_every_bench_script_refuses_a_bad_flag_before_importing_torch():
    for script in BENCH_SCRIPTS:
        done = subprocess.run(
            [sys.executable, "-X", "importtime", str(script), "--no-such-flag"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (script.name, done.stderr[-2000:])
        assert "error: unrecognized arguments: --no-such-flag" in done.stderr, done.stderr[-2000:]
        assert not TORCH_IMPORT.search(done.stderr), f"{script.name} imported torch first"


# Two timed steps (a median and a drift), no untimed ones: at toy sizes nothing needs warming up.
TOY = ["--seq-len", "16", "--batch-size", "2", "--steps", "2", "--warmup", "0"]


def _bench_readme_commands(script: str) -> list[str]:
    text = (REPO / "bench" / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.startswith(f"uv run python bench/{script}")
    ]


def _run_in_repo(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def _run_bench_readme_command(script: str, extra: list[str] | None = None) -> list[dict]:
    """Runs the bench README's one command for `script` as shown (with `extra` flags after it,
    in this interpreter for `uv run python`) and returns the JSON lines it printed."""
    (command,) = _bench_readme_commands(script)
    argv = shlex.split(command)
    assert argv[:3] == ["uv", "run", "python"], argv
    done = _run_in_repo([sys.executable, *argv[3:], *(extra or [])])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_bench_readme_throughput_commands_run_at_toy_sizes():
    commands = _bench_readme_commands("throughput.py")
    assert len(commands) == 4, commands
    runs = []
    for command in commands:
        argv = shlex.split(command)
        assert argv[:3] == ["uv", "run", "python"]
        # The first compiled command compiles as shown (Inductor's C++ code for this CPU); the
        # others take the same compile path without the C++ compiler's half a minute, the way
        # the trainer's other compiled tests do.
        compiled = "--compile.enable" in command
        backend = (
            ["--", "--compile.backend", "aot_eager"]
            if compiled and any("--compile.enable" in c for c, _ in runs)
            else []
        )
        runs.append((command, [sys.executable, *argv[3:], *TOY, *backend]))
    # Side by side: each is one process on one thread, and the machine has more cores.
    with ThreadPoolExecutor(len(runs)) as pool:
        done_all = list(pool.map(_run_in_repo, [cmd for _, cmd in runs]))
    compiled_commands = 0
    for (command, _), done in zip(runs, done_all, strict=True):
        argv = shlex.split(command)
        compiled_commands += "--compile.enable" in command
        assert done.returncode == 0, command + "\n" + done.stderr[-3000:]
        records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        flags = dict(zip(argv[3::1], argv[4::1]))
        variants = flags.get("--variants", "default").split(";")
        assert [r["variant"] for r in records] == variants, command
        # What the trainer computes in here: bfloat16 only on a CPU with native bf16 (AVX-512
        # BF16 or AMX); an AVX2-only CPU trains a bfloat16 request in float32.
        computed = str(compute_dtype(flags["--dtype"], torch.device("cpu"))).removeprefix("torch.")
        for record in records:
            assert record["flavor"] == flags["--flavors"]
            assert record["dtype"] == computed
            assert (record["seq_len"], record["batch_size"], record["steps_timed"]) == (16, 2, 2)
            assert record["mfu_pct"] > 0 and record["tokens_per_s"] > 0
            assert set(record["breakdown_s"]) == {
                "data",
                "forward",
                "backward",
                "optimizer",
                "logging",
            }
        # Never silent for long: each variant built and each step of them all, with the time
        # left, on stderr (2 timed steps, no warm-up: TOY).
        rounds = len(variants) + 2
        flavor = flags["--flavors"]
        assert "warmup_steps" not in done.stderr  # the schedule does not matter to the times
        assert f"throughput {flavor}: variant {variants[0]} built (1 of {rounds} done in" in (
            done.stderr
        ), done.stderr[-3000:]
        assert re.search(
            rf"throughput {flavor}: step 1 of 2 \(timed\) of every variant \({rounds - 1} of"
            rf" {rounds} done in [\w ]+; about [\w ]+ left\)",
            done.stderr,
        ), done.stderr[-3000:]
        if "--model.attention_backend" in command:  # the kernel each variant ran
            assert [r["attention"] for r in records] == ["default", records[1]["attention"], "math"]
            assert records[1]["attention"] in ("flash", "math")  # auto: a CPU kernel
        if len(records) == 2:  # side by side: the second carries its ratio to the first
            assert records[1]["step_time_over_first_variant"] > 0
            # ... and MFU against the same peak, measured once per dtype.
            assert records[0]["peak_tflops"] == records[1]["peak_tflops"]
    assert compiled_commands == 2  # one compiled with Inductor, one with aot_eager


def test_bench_readme_ckpt_command_runs_at_toy_sizes():
    (command,) = _bench_readme_commands("ckpt.py")
    argv = shlex.split(command)
    assert argv[:3] == ["uv", "run", "python"] and "--only" in argv
    done = subprocess.run(
        [sys.executable, *argv[3:], "--mb", "16,32", "--saves", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted({r["checkpoint_mb"] for r in rows}) == [48.0, 96.0]  # each size in turn
    targets = {(r["checkpoint_mb"], r["metric"]): r for r in rows if "target" in r}
    assert {metric for _, metric in targets} == {
        "checksummed_save_over_plain_save",
        "checksummed_read_over_plain_read",
        "verified_load_over_plain_load",
    }
    # Toy sizes on a shared machine: the ratios are reported, not judged, here.
    assert all(r["value"] > 0 and isinstance(r["met"], bool) for r in targets.values())


def test_bench_readme_long_context_command_runs_at_toy_sizes():
    toy = ["--seqs", "2048", "--cps", "2", "--steps", "1", "--median", "48", "--heads", "4"]
    rows = _run_bench_readme_command("long_context.py", toy)
    assert [r["layout"] for r in rows] == ["one process", "CP 2 ring", "CP 2 all-to-all"]
    assert all(r["seq"] == 2048 and r["s_per_step"] > 0 for r in rows)
    ring = rows[1]
    # Documents of ~48 tokens in 8 chunks of 256: most chunk pairs share no document.
    assert ring["chunks_per_rank"] == 4
    assert ring["skipped_block_share"] > 0.4
    assert 1.0 <= ring["imbalance"] <= ring["head_tail_imbalance"]


def test_bench_readme_step_time_command_prices_the_recorded_runs():
    rows = _run_bench_readme_command("step_time_published.py")
    *each, summary = rows
    assert summary["summary"] and summary["rows"] == len(each) >= 10, summary
    assert {r["source"] for r in each} >= {"torchtitan-benchmarks", "llama3-paper"}
    for r in each:
        assert r["error_pct"] == pytest.approx(
            100 * (r["predicted"] - r["published"]) / r["published"], abs=0.1
        ), r


def test_bench_readme_step_time_cpu_command_measures_and_predicts():
    rows = _run_bench_readme_command("step_time_cpu.py")
    layouts = [r for r in rows if "layout" in r]
    assert [r["layout"] for r in layouts] == ["1 process", "PP 2 (1F1B)"], rows
    for r in layouts:  # both measured and predicted; how close is the recorded run's test
        assert r["measured_s"] > 0 and r["predicted_s"] > 0, r
        assert r["error_pct"] == pytest.approx(
            100 * (r["predicted_s"] - r["measured_s"]) / r["measured_s"], abs=0.1
        ), r
    (summary,) = [r for r in rows if "summary" in r]
    assert summary["layouts"] == 2 and "kendall_tau" in summary, summary
