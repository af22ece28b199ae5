"""AdamW, Muon and MuonClip (Muon with QK-Clip) at the same token budget: each step's training
loss and largest attention logit, as JSON lines, a Markdown table and a plot (loss and largest
logit against step), all written beside the optimizer docs as `muon_clip_<name>.*`.

    uv run python bench/muon_clip.py [--config kimi_k2_debug] [--flavor F] [--name debug]
        [--steps 60] [--tau 3] [--out apps/trainer/docs]

Each variant is one run of the trainer itself (`titan_trainer.train`), in this process, from the
same seed on the same data. Every variant records its logits the same way ([metrics]
max_attention_logit: each head's largest q . k x scale in the step, before any clip); only
MuonClip scales the projections afterwards. Small models' logits stay small in a short run, so
the default tau is low enough to bite; the paper's 100 is for models whose logits grow to
thousands.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import tempfile
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="kimi_k2_debug", help="a shipped config")
    ap.add_argument("--flavor", default=None, help="the model flavor (default: the config's)")
    ap.add_argument("--name", default="debug", help="output files: muon_clip_<name>.*")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tau", type=float, default=3.0, help="MuonClip's bound on the logits")
    ap.add_argument("--out", default="apps/trainer/docs")
    ap.add_argument(
        "--replot", action="store_true", help="redraw the plot from the JSON lines in --out"
    )
    return ap.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch loads: --help answers at once

from titan_core import init_logging, load_config
from titan_trainer.config import JobConfig
from titan_trainer.shipped import find_config_file
from titan_trainer.train import train

LINE = re.compile(r"step\s+(\d+) \| loss ([\d.]+) ")
LOGIT = re.compile(r"\| maxlogit ([-+\w.]+)")


class _MetricLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        m = LINE.search(message)
        if m:
            row = {"loss": float(m[2])}
            if logit := LOGIT.search(message):
                row["max_logit"] = float(logit[1])
            self.rows[int(m[1])] = row


def variants(tau: float) -> dict[str, list[str]]:
    muon = ["--optimizer.name", "Muon", "--optimizer.muon.ns_dtype", "float32"]
    return {
        "AdamW": ["--optimizer.name", "AdamW", "--optimizer.muon.qk_clip_tau", "0"],
        "Muon": [*muon, "--optimizer.muon.qk_clip_tau", "0"],
        f"MuonClip, tau {tau:g}": [*muon, "--optimizer.muon.qk_clip_tau", str(tau)],
    }


def main(a: argparse.Namespace) -> None:
    if a.replot:
        lines = (Path(a.out) / f"muon_clip_{a.name}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        results = {r["optimizer"]: {int(s): v for s, v in r["steps"].items()} for r in rows}
        write_plot(results, a, Path(a.out))
        return
    init_logging()
    handler = _MetricLines()
    logging.getLogger("titan.metrics").addHandler(handler)
    results = {}
    for name, extra in variants(a.tau).items():
        handler.rows = {}
        with tempfile.TemporaryDirectory() as tmp:
            args = [
                "--job.config_file", a.config,
                *(["--model.flavor", a.flavor] if a.flavor else []),
                "--metrics.max_attention_logit", "true",
                "--job.dump_folder", tmp,
                "--training.steps", str(a.steps),
                "--training.seq_len", str(a.seq_len),
                "--training.local_batch_size", str(a.batch),
                "--training.seed", "0",
                "--training.mixed_precision_param", "float32",
                "--optimizer.lr", str(a.lr),
                "--lr_scheduler.warmup_steps", str(max(1, a.steps // 10)),
                "--metrics.enable_tensorboard", "false",
                "--metrics.save_plots_folder", "",
                "--metrics.log_freq", "1",
                "--metrics.peak_tflops", "1",
                *extra,
            ]  # fmt: skip
            train(load_config(JobConfig, args, find_config_file=find_config_file))
        results[name] = dict(sorted(handler.rows.items()))
        print(json.dumps({"bench": "muon_clip", "optimizer": name, "steps": results[name]}))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"muon_clip_{a.name}.jsonl").write_text(
        "".join(
            json.dumps({"bench": "muon_clip", "optimizer": name, "steps": rows}) + "\n"
            for name, rows in results.items()
        )
    )
    write_table(results, a, out)
    write_plot(results, a, out)


def write_table(results: dict, a, out: Path) -> None:
    every = max(1, a.steps // 6)
    steps = [s for s in range(every, a.steps + 1, every)]
    head = "| optimizer | " + " | ".join(f"step {s}" for s in steps) + " |"
    lines = [head, "|---|" + "---|" * len(steps)]
    for name, rows in results.items():
        cells = []
        for s in steps:
            row = rows.get(s, {})
            logit = f" / {row['max_logit']:.3g}" if "max_logit" in row else ""
            cells.append(f"{row.get('loss', float('nan')):.3f}{logit}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"muon_clip_{a.name}.md").write_text(
        f"<!-- written by bench/muon_clip.py {command(a)} -->\ntraining loss / largest attention logit"
        " (before the step's clip)\n\n" + "\n".join(lines) + "\n"
    )


def command(a) -> str:
    flavor = f" --flavor {a.flavor}" if a.flavor else ""
    return (
        f"--config {a.config}{flavor} --name {a.name} --steps {a.steps} --seq-len {a.seq_len}"
        f" --batch {a.batch} --lr {a.lr} --tau {a.tau}"
    )


def write_plot(results: dict, a, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (loss_ax, logit_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        steps = sorted(rows)
        loss_ax.plot(steps, [rows[s]["loss"] for s in steps], label=name)
        logged = [s for s in steps if "max_logit" in rows[s]]
        logit_ax.plot(logged, [rows[s]["max_logit"] for s in logged], label=name)
    logit_ax.axhline(a.tau, color="grey", linestyle=":", label=f"tau {a.tau:g}")
    loss_ax.set(xlabel="step", ylabel="training loss", title="loss")
    logit_ax.set(xlabel="step", ylabel="largest attention logit", title="largest logit")
    logit_ax.set_yscale("log")  # AdamW's run away by tens of times the others' (and tau's)
    for ax in (loss_ax, logit_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    tokens = a.steps * a.batch * a.seq_len
    fig.suptitle(f"{a.config} {a.flavor or ''}: {a.steps} steps, {tokens:,} tokens")
    fig.tight_layout()
    fig.savefig(out / f"muon_clip_{a.name}.png", dpi=100)


if __name__ == "__main__":
    main(ARGS)
