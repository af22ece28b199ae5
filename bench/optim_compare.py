"""AdamW against Ranger21, and Ranger21 with each component off in turn, or against Muon, on
the debug model (or another flavor): the same data, steps and seed; validation loss at fixed
steps, as JSON lines, a Markdown table and a PNG plot written into the trainer's docs.

    uv run python bench/optim_compare.py [--steps 120] [--every 20] [--out apps/trainer/docs]
    uv run python bench/optim_compare.py --flavor 100M --variants AdamW Ranger21 ...
    uv run python bench/optim_compare.py --variants AdamW Muon --stem muon_comparison

Each variant is one training run of the trainer itself (`titan_trainer.train`), in this
process, on the embedded corpus, validated on its held-out split.
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
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default="apps/trainer/docs")
    ap.add_argument("--flavor", default="debugmodel", help="model flavor (debugmodel, 100M, ...)")
    ap.add_argument("--variants", nargs="*", help="names of the variants to run (default: all)")
    ap.add_argument("--stem", default="optimizer_comparison", help="file name of the table/plot")
    return ap.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

from titan_core import init_logging, load_config
from titan_parallel.ranger21 import COMPONENTS
from titan_trainer.config import JobConfig
from titan_trainer.train import train


class _ValidationLosses(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.losses: dict[int, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = re.search(r"step\s+(\d+) \| validation loss ([\d.]+)", record.getMessage())
        if m:
            self.losses[int(m.group(1))] = float(m.group(2))


def variants() -> dict[str, list[str]]:
    out = {"AdamW": ["--optimizer.name", "AdamW"], "Ranger21": ["--optimizer.name", "Ranger21"]}
    for c in COMPONENTS:
        out[f"Ranger21, {c} off"] = [
            "--optimizer.name",
            "Ranger21",
            f"--optimizer.ranger21.{c}",
            "false",
        ]
    out["Ranger21, MADGRAD core"] = [
        "--optimizer.name",
        "Ranger21",
        "--optimizer.ranger21.core",
        "madgrad",
    ]
    # Muon with Moonlight's scale takes AdamW's learning rate and weight decay; with Jordan's
    # original scale its matrices take their own rate (0.02, his default).
    out["Muon"] = ["--optimizer.name", "Muon"]
    out["Muon, original scale, lr 0.02"] = [
        *("--optimizer.name", "Muon", "--optimizer.muon.adjust_lr", "original"),
        *("--optimizer.muon.lr", "0.02"),
    ]
    return out


def main(a: argparse.Namespace) -> None:
    init_logging()
    handler = _ValidationLosses()
    logging.getLogger().addHandler(handler)
    for name in ("titan", "titan.train"):
        logging.getLogger(name).addHandler(handler)
    results = {}
    chosen = variants()
    unknown = set(a.variants or ()) - set(chosen)
    if unknown:
        # Checked here, not by the parser: the names come from titan_parallel (torch).
        raise SystemExit(
            f"optim_compare.py: error: unknown variants {sorted(unknown)}; choose from"
            f" {list(chosen)}"
        )
    for name, extra in chosen.items():
        if a.variants and name not in a.variants:
            continue
        handler.losses = {}
        with tempfile.TemporaryDirectory() as tmp:
            args = [
                "--job.config_file", "debug_model",
                "--job.dump_folder", tmp,
                "--model.flavor", a.flavor,
                "--training.steps", str(a.steps),
                "--training.seq_len", str(a.seq_len),
                "--training.local_batch_size", str(a.batch),
                "--training.seed", "0",
                "--training.mixed_precision_param", "float32",
                "--optimizer.lr", str(a.lr),
                "--lr_scheduler.warmup_steps", str(a.steps // 10),
                "--metrics.enable_tensorboard", "false",
                "--metrics.log_freq", str(a.every),
                "--metrics.peak_tflops", "1",
                "--validation.enable",
                "--validation.freq", str(a.every),
                "--validation.steps", "8",
                "--validation.local_batch_size", str(a.batch),
                *extra,
            ]  # fmt: skip
            from titan_trainer.shipped import find_config_file

            train(load_config(JobConfig, args, find_config_file=find_config_file))
        results[name] = dict(sorted(handler.losses.items()))
        print(
            json.dumps(
                {"bench": "optim_compare", "optimizer": name, "validation_loss": results[name]}
            ),
            flush=True,
        )
    write_docs(results, a, Path(a.out))


def write_docs(results: dict, a, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    steps = sorted({s for r in results.values() for s in r})
    lines = [
        "| optimizer | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|" + "---|" * len(steps),
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | " + " | ".join(f"{r.get(s, float('nan')):.3f}" for s in steps) + " |"
        )
    stem = a.stem + ("" if a.flavor == "debugmodel" else f"_{a.flavor}")
    (out / f"{stem}.md").write_text(
        f"<!-- written by bench/optim_compare.py --flavor {a.flavor} --steps {a.steps} "
        f"--every {a.every} --seq-len {a.seq_len} --batch {a.batch} --lr {a.lr}"
        f" --stem {a.stem} -->\n" + "\n".join(lines) + "\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20").colors  # 12 variants: no colour used twice
    for i, (name, r) in enumerate(results.items()):
        style = "-" if name in ("AdamW", "Ranger21", "Muon") else ":"
        ax.plot(list(r), list(r.values()), style, marker="o", markersize=3, label=name,
                color=colors[i % len(colors)])  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{a.flavor}, lr {a.lr}, seq {a.seq_len} x batch {a.batch}, seed 0")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    main(ARGS)
