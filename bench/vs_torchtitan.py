"""Titan against torchtitan 0.2.2, side by side on one GPU: issue 31's four rows, each run by
both frameworks one after the other, each run in a process of its own, as JSON lines.

    python bench/vs_torchtitan.py                      # the four rows, on a machine with a CUDA GPU
    python bench/vs_torchtitan.py --rows 4l_eager --steps 12
    bash gpu-bundle/run_vs_torchtitan.sh               # on a GPU machine without network
                                                       # (tools/gpu_bundle.py --with-torchtitan)

The rows (Llama 3.1 8B's widths: dim 4096, 32 heads, 8 KV heads, vocabulary 128256, FFN 14336,
cut to 4 or 8 blocks; seq 8192, batch 1, bf16 autocast over float32 parameters, AdamW, one GPU):

    4l_compiled         4 blocks, no AC, compiled
    8l_sac_compiled     8 blocks, selective AC (op), compiled
    8l_sac_float8       8 blocks, selective AC (op), compiled, Float8 tensorwise (output in bf16)
    4l_eager            4 blocks, no AC, eager

Both frameworks read the same TOML file per row, written in torchtitan's keys (Titan reads
torchtitan's files unchanged); only the model's name differs on the command line:

- torchtitan as its own CLI runs it: `python -m torch.distributed.run --standalone
  --nproc-per-node 1 -m torchtitan.train --job.config_file ROW.toml --experimental.custom_import
  torchtitan_cut_llama3 --model.name llama3 --model.flavor 8B-4`; the custom import
  (bench/vs_torchtitan_modules/) adds the cut flavors to torchtitan's llama3 train spec;
- Titan: `python -m titan_trainer --job.config_file ROW.toml --model.name titan_cut_llama3:spec
  --model.flavor 8B-4` (the same as `titan-train`).

Data and tokenizer, written into the work folder first, no network: the standard library's
documentation (titan-data's embedded corpus) as `c4_test` (torchtitan's sample-data layout,
one JSON line per document), and a byte-level BPE tokenizer.json trained on it with
`tokenizers` whose vocabulary is exactly the model's (128256: torchtitan keeps its flavor's
vocabulary, Titan sizes the model by the tokenizer's), so every id is a row of the embedding.

Each framework prints a metrics line per step (`--metrics.log_freq 1`); the bench reads them
(torchtitan 0.2.2: `step: N  loss: ...  memory: X.XXGiB(P%)  tps: N  tflops: T  mfu: M%` from
`torchtitan.components.metrics.MetricsProcessor.log`; Titan: `step N | ... | N tok/s | T
TFLOP/s | MFU M% | mem X GiB | ...` from `titan_trainer.metrics.format_line`) and records the
median tokens/s and MFU over steps `--median-from` to `--steps` and the largest memory figure
printed over them. The memory figures are each framework's own and are not the same measure:
torchtitan prints the peak memory *reserved* by the CUDA caching allocator, Titan
`torch.cuda.max_memory_allocated`. MFU is each framework's own FLOP count per token and peak
(an H100 SXM's dense bf16: 989 TFLOP/s in torchtitan, 989.4 in Titan); the ratio the target
judges is of tokens/s, which both measure alike (tokens of the step over its wall time).

The file (`--out`) starts with the machine; one line per run as it ends (command, exit status,
seconds, the steps read, the medians, the output's tail when it failed; the whole output is in
`--logs`, by default the folder beside the file, `OUT-logs/ROW.FRAMEWORK.log`); one line per row when both
of its runs have ended, with Titan / torchtitan tokens/s and whether it is >= 1.15 (issue 31's
target).

Time: on one H100 the eight runs take about 9 minutes by issue 31's figures (steps of 0.16-0.28 s,
about 25 s of start-up per process, 45-90 s of compilation per compiled run); `--total-seconds`
(540) stops the bench from starting a run that could not end before it, and `--run-seconds`
limits each run (a run past it is stopped and recorded as timed out).

Without a CUDA GPU nothing is measured: it says so and exits with status 2. `--check` runs the
checks a CPU can make (needs torchtitan importable): torchtitan's config manager accepts each
row's command line, both models have the same parameter shapes on the meta device, both
tokenizers read the tokenizer.json with every id below the vocabulary, torchtitan's dataset
yields full samples. `--smoke` runs both frameworks on a toy flavor on whatever device is here,
to check the commands. torchtitan 0.2.2 cannot train on a CPU: `torchtitan.tools.utils` takes
the device type from `torch._utils._get_available_device_type()`, falling back to "cuda" when
no accelerator is present, and `Trainer.__init__` calls `torch.cuda.set_device("cuda:0")` right
after importing the custom module, which fails without a CUDA device; so on a CPU `--smoke`
trains Titan and shows that torchtitan got as far as that call (its config and the custom
import accepted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Row name -> (flavor, activation checkpointing, compiled, Float8), and the wording.
ROWS = {
    "4l_compiled": ("8B-4", "none", True, False),
    "8l_sac_compiled": ("8B-8", "selective", True, False),
    "8l_sac_float8": ("8B-8", "selective", True, True),
    "4l_eager": ("8B-4", "none", False, False),
}
LABELS = {
    "4l_compiled": "4 layers, no AC, compiled",
    "8l_sac_compiled": "8 layers, selective AC, compiled",
    "8l_sac_float8": "8 layers, selective AC, compiled, Float8 tensorwise (output in bf16)",
    "4l_eager": "4 layers, no AC, eager",
}
FRAMEWORKS = ("torchtitan", "titan")
TARGET_RATIO = 1.15
VOCAB = 128256
SMOKE_VOCAB = 2048  # bench/vs_torchtitan_modules/cut_llama3_shapes.py's "smoke"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="vs-torchtitan.jsonl", help="the JSON-lines file to write")
    parser.add_argument("--rows", default=",".join(ROWS), help="rows to run (comma-separated)")
    parser.add_argument(
        "--frameworks", default=",".join(FRAMEWORKS), help="torchtitan, titan or both, in order"
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument(
        "--median-from", type=int, default=5, help="first step of the medians (to --steps)"
    )
    parser.add_argument("--run-seconds", type=float, default=150, help="time limit of one run")
    parser.add_argument(
        "--total-seconds", type=float, default=540, help="no run starts that could end past this"
    )
    parser.add_argument("--work", default=None, help="folder for data, configs, outputs (a temp)")
    parser.add_argument(
        "--logs", default=None, help="folder for each run's whole output (default: OUT-logs)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="a toy flavor on any device")
    mode.add_argument("--check", action="store_true", help="the CPU checks (needs torchtitan)")
    args = parser.parse_args(argv)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    unknown += [f for f in args.frameworks.split(",") if f not in FRAMEWORKS]
    if unknown:
        parser.error(f"unknown row or framework {', '.join(unknown)}; rows: {', '.join(ROWS)}")
    if not 1 <= args.median_from <= args.steps:
        parser.error(f"--median-from {args.median_from} must be between 1 and --steps")
    return args


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import torch  # noqa: E402

BENCH = Path(__file__).resolve().parent
FLAVORS = BENCH / "vs_torchtitan_modules"
NO_GPU_EXIT = 2
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torchtitan 0.2.2, torchtitan/components/metrics.py, MetricsProcessor.log (colors stripped):
#   f"step: {step:2}  loss: {loss:8.5f}  grad_norm: {grad_norm:7.4f}  memory:
#   {max_reserved_gib:5.2f}GiB({max_reserved_pct:.2f}%)  tps: {round(tps):,}  tflops:
#   {tflops:,.2f}  mfu: {mfu:.2f}%"
TORCHTITAN_LINE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:.*?memory:\s*(?P<mem>[\d.]+)GiB\([\d.]+%\)\s+"
    r"tps:\s*(?P<tps>[\d,]+)\s+tflops:\s*[\d.,]+\s+mfu:\s*(?P<mfu>[\d.]+)%"
)
# Titan, titan_trainer/metrics.py, format_line:
#   step   40 | loss 3.412 | grad_norm 0.87 | lr 8.0e-04 | 4,812 tok/s | 0.31 TFLOP/s | MFU 44.1% | mem 1.2 GiB | ...
TITAN_LINE = re.compile(
    r"step\s+(?P<step>\d+) \| loss .*? \| (?P<tps>[\d,]+) tok/s \| [\d.]+ TFLOP/s \| "
    r"MFU (?P<mfu>[\d.]+)%.*? \| mem (?P<mem>[\d.]+) GiB"
)
MEMORY_MEANING = {
    "torchtitan": "peak reserved by the CUDA caching allocator (reserved_bytes.all.peak)",
    "titan": "torch.cuda.max_memory_allocated",
}


@dataclass(frozen=True)
class Step:
    step: int
    tokens_per_s: float
    mfu_pct: float
    memory_gib: float


def parse_steps(framework: str, output: str) -> list[Step]:
    """Each metrics line a framework printed, in order (colors and log prefixes ignored)."""
    pattern = TORCHTITAN_LINE if framework == "torchtitan" else TITAN_LINE
    steps = []
    for line in ANSI.sub("", output).splitlines():
        match = pattern.search(line)
        if match:
            steps.append(
                Step(
                    int(match["step"]),
                    float(match["tps"].replace(",", "")),
                    float(match["mfu"]),
                    float(match["mem"]),
                )
            )
    return steps


def summarize(steps: list[Step], first: int, last: int) -> dict:
    """Median tokens/s and MFU over steps first..last, and the largest memory figure there."""
    chosen = [s for s in steps if first <= s.step <= last]
    if not chosen:
        return {"steps_used": 0}
    return {
        "steps_used": len(chosen),
        "tokens_per_s": statistics.median(s.tokens_per_s for s in chosen),
        "mfu_pct": round(statistics.median(s.mfu_pct for s in chosen), 2),
        "peak_gib": max(s.memory_gib for s in chosen),
    }


def row_toml(row: str, work: Path, steps: int, smoke: bool) -> str:
    """The run's config in torchtitan's keys, read by both frameworks."""
    _, ac, compiled, float8 = ROWS[row]
    seq = 64 if smoke else 8192
    lines = [
        "[job]", f'dump_folder = "{work / "outputs" / row}"', f'description = "vs_torchtitan {row}"',
        "[metrics]", "log_freq = 1", "enable_tensorboard = false", "disable_color_printing = true",
        "[model]", f'hf_assets_path = "{work / "assets" / "tokenizer"}"',
        *(['converters = ["quantize.linear.float8"]'] if float8 else []),
        "[optimizer]", 'name = "AdamW"', "lr = 3e-4", "eps = 1e-8",
        "[lr_scheduler]", "warmup_steps = 2",
        "[training]", "local_batch_size = 1", f"seq_len = {seq}", f"steps = {steps}",
        "max_norm = 1.0", 'dataset = "c4_test"', f'dataset_path = "{work / "assets" / "c4_test"}"',
        'mixed_precision_param = "bfloat16"',
        "[parallelism]", "data_parallel_shard_degree = -1",
        "[checkpoint]", "enable = false",
        "[compile]", f"enable = {'true' if compiled else 'false'}",
        'components = ["model", "loss"]',
        # On a CPU (--smoke) the compile path without the minutes a C++ compiler takes.
        *(['backend = "aot_eager"'] if smoke else []),
        "[activation_checkpoint]", f'mode = "{ac}"', 'selective_ac_option = "op"',
        "[quantize.linear.float8]", 'recipe_name = "tensorwise"', 'filter_fqns = ["output"]',
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def command(framework: str, row: str, config: Path, smoke: bool) -> list[str]:
    flavor = "smoke" if smoke else ROWS[row][0]
    if framework == "torchtitan":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "1", "-m", "torchtitan.train",
                "--job.config_file", str(config),
                "--experimental.custom_import", "torchtitan_cut_llama3",
                "--model.name", "llama3", "--model.flavor", flavor]  # fmt: skip
    return [sys.executable, "-m", "titan_trainer", "--job.config_file", str(config),
            "--model.name", "titan_cut_llama3:spec", "--model.flavor", flavor]  # fmt: skip


def write_assets(folder: Path, vocab: int) -> None:
    """`c4_test/data.json` (one document a line) and `tokenizer/` (tokenizer.json with exactly
    `vocab` ids, tokenizer_config.json naming BOS and EOS as Llama 3's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from titan_data import pydocs_documents

    docs = pydocs_documents("train")
    data = folder / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    (data / "data.json").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(docs, trainer)
    # Ids no merge produces fill the vocabulary up to the model's, then the special tokens.
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    spec = json.loads(tokenizer.to_str())
    table = spec["model"]["vocab"]
    for i in range(len(table), vocab - len(specials)):
        table[f"<|unused_{i}|>"] = i
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.add_special_tokens(specials)
    assert tokenizer.get_vocab_size() == vocab, tokenizer.get_vocab_size()
    out = folder / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def run_one(cmd: list[str], seconds: float, env: dict) -> tuple[int | None, bool, float, str]:
    """Run in its own session (a timeout stops torchrun and its worker alike); stdout and
    stderr together, in order."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
    return proc.returncode, timed_out, round(time.perf_counter() - start, 1), output


def machine() -> dict:
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torchtitan": _version("torchtitan"),
        "titan": _version("titan-llm-trainer"),
    }


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def append(path: Path, line: dict) -> None:
    """One JSON line, on disk before the next run starts."""
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_env() -> dict:
    """The flavors' folder first on PYTHONPATH (both frameworks import their module from it)."""
    path = os.pathsep.join(p for p in (str(FLAVORS), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def measure(args: argparse.Namespace, work: Path, say) -> int:
    out = Path(args.out)
    out.write_text("")
    append(out, {"kind": "machine", "smoke": args.smoke, "when": time.strftime("%Y-%m-%d %H:%M:%S"), **machine()})  # fmt: skip
    write_assets(work / "assets", SMOKE_VOCAB if args.smoke else VOCAB)
    logs = Path(args.logs) if args.logs else out.with_name(out.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.total_seconds
    failed = False
    for row in args.rows.split(","):
        config = work / "configs" / f"{row}.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(row_toml(row, work, args.steps, args.smoke))
        results = {}
        for framework in args.frameworks.split(","):
            cmd = command(framework, row, config, args.smoke)
            line = {"kind": "run", "row": row, "label": LABELS[row], "framework": framework,
                    "command": cmd, "memory_is": MEMORY_MEANING[framework]}  # fmt: skip
            seconds = min(args.run_seconds, deadline - time.monotonic())
            if seconds < min(args.run_seconds, 60):
                say(f"{row} {framework}: not run, {seconds:.0f} s left of --total-seconds")
                append(out, {**line, "not_run": "out of time"})
                failed = True
                continue
            say(f"{row} {framework} ... (at most {seconds:.0f} s)")
            code, timed_out, took, output = run_one(cmd, seconds, run_env())
            log = logs / f"{row}.{framework}.log"
            log.write_text(output)
            steps = parse_steps(framework, output)
            line.update(returncode=code, timed_out=timed_out, seconds=took, log=str(log),
                        steps_read=[s.step for s in steps],
                        **summarize(steps, args.median_from, args.steps))  # fmt: skip
            if code != 0 or timed_out:
                line["output_tail"] = output[-4000:]
                failed = True
            append(out, line)
            results[framework] = line
            say(f"{row} {framework}: exit {code}{' (timed out)' if timed_out else ''} in {took} s,"
                f" {line.get('tokens_per_s', '-')} tok/s")  # fmt: skip
        append(out, compare_row(row, results))
    say(f"wrote {out}")
    return 1 if failed else 0


def compare_row(row: str, results: dict) -> dict:
    """Titan / torchtitan tokens/s of one row, when both runs gave a median."""
    line = {"kind": "row", "row": row, "label": LABELS[row]}
    for framework, result in results.items():
        line[framework] = {k: result.get(k) for k in ("tokens_per_s", "mfu_pct", "peak_gib")}
    titan = results.get("titan", {}).get("tokens_per_s")
    other = results.get("torchtitan", {}).get("tokens_per_s")
    if titan and other:
        line["titan_over_torchtitan"] = round(titan / other, 3)
        line["target"] = f"Titan / torchtitan tokens/s >= {TARGET_RATIO}"
        line["met"] = titan / other >= TARGET_RATIO
    return line


def main(args: argparse.Namespace) -> int:
    def say(text: str) -> None:
        print(f"vs_torchtitan: {text}", file=sys.stderr, flush=True)

    if args.check:
        sys.path.insert(0, str(FLAVORS))
        from vs_torchtitan_check import run_checks  # needs torchtitan

        return run_checks(args, say, sys.modules[__name__])
    if not torch.cuda.is_available() and not args.smoke:
        print(
            f"vs_torchtitan: no CUDA GPU on this machine (torch {torch.__version__} sees none),"
            " so nothing was measured and no file was written\n"
            "               run it on a machine with an NVIDIA GPU; `--check` runs the checks"
            " a CPU can make",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    with tempfile.TemporaryDirectory(prefix="vs_torchtitan_") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        return measure(args, work, say)


if __name__ == "__main__":
    sys.exit(main(ARGS))
