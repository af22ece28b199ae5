"""`python bench/vs_torchtitan.py --check`: what a CPU can check of the side-by-side runs, with
torchtitan 0.2.2 importable (tools/gpu_bundle.py --with-torchtitan installs it).

- the tokenizer.json the bench writes has exactly the model's vocabulary for torchtitan's
  tokenizer and Titan's, and every id of the corpus it encodes is below it;
- torchtitan's dataset (`c4_test` from the bench's folder) yields full samples of seq_len + 1
  tokens, every id below the vocabulary;
- torchtitan's own config manager accepts each row's command line as the bench builds it, and
  Titan's config loader the Titan one, and both read the row's settings from the shared TOML;
- torchtitan's cut flavors (registered by torchtitan_cut_llama3) and Titan's
  (titan_cut_llama3) build models with the same parameter count and the same parameter shapes
  (on the meta device: nothing allocated);
- the bench reads back the metrics line torchtitan's own `MetricsProcessor.log` writes, with
  and without colors (the CUDA memory monitor it reads from is replaced by its answer: the one
  part of that method a CPU cannot run).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch


class CheckFailed(Exception):
    pass


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailed(what)


def check_tokenizers(bench: ModuleType, assets: Path) -> str:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from titan_core import plugins, resolve
    from titan_data import pydocs_documents

    theirs = HuggingFaceTokenizer(str(assets / "tokenizer"))
    ours = resolve(plugins.DATA, "titan").build_tokenizer(str(assets / "tokenizer"))
    expect(theirs.get_vocab_size() == bench.VOCAB, f"torchtitan's vocabulary {theirs.get_vocab_size()}")  # fmt: skip
    expect(ours.vocab_size == bench.VOCAB, f"Titan's vocabulary {ours.vocab_size}")
    ids = [i for doc in pydocs_documents("train") for i in theirs.encode(doc, add_bos=True, add_eos=True)]  # fmt: skip
    expect(min(ids) >= 0 and max(ids) < bench.VOCAB, f"ids {min(ids)}..{max(ids)}")
    expect(ids[0] == theirs.bos_id and theirs.eos_id in ids, "BOS/EOS not added")
    return f"tokenizer: {bench.VOCAB} ids for both; the corpus is {len(ids):,} tokens, ids 0..{max(ids)}"  # fmt: skip


def check_dataset(bench: ModuleType, assets: Path) -> str:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    tokenizer = HuggingFaceTokenizer(str(assets / "tokenizer"))
    data = HuggingFaceTextDataset("c4_test", str(assets / "c4_test"), tokenizer, seq_len=8192)
    samples = [sample for _, sample in zip(range(3), data, strict=False)]
    for inputs, labels in samples:
        expect(inputs["input"].shape == labels.shape == (8192,), f"sample of {labels.shape}")
        expect(int(inputs["input"].max()) < bench.VOCAB, "an id past the vocabulary")
    expect(len(samples) == 3, f"{len(samples)} samples")
    return "torchtitan's c4_test loader: 3 full samples of 8192 tokens"


def check_configs(bench: ModuleType, work: Path, rows: list[str]) -> str:
    from torchtitan.config import ConfigManager

    from titan_core import load_config
    from titan_trainer.config import JobConfig

    for row in rows:
        flavor, ac, compiled, float8 = bench.ROWS[row]
        path = work / f"{row}.toml"
        path.write_text(bench.row_toml(row, work, 20, smoke=False))
        theirs_cmd = bench.command("torchtitan", row, path, smoke=False)
        theirs = ConfigManager().parse_args(theirs_cmd[theirs_cmd.index("torchtitan.train") + 1 :])
        ours_cmd = bench.command("titan", row, path, smoke=False)
        ours = load_config(JobConfig, ours_cmd[ours_cmd.index("titan_trainer") + 1 :])
        expect(theirs.experimental.custom_import == "torchtitan_cut_llama3", "custom import")
        for name, config in (("torchtitan", theirs), ("Titan", ours)):
            got = (config.model.flavor, config.training.seq_len, config.training.local_batch_size,
                   config.training.steps, config.activation_checkpoint.mode, config.compile.enable,
                   list(config.model.converters))  # fmt: skip
            want = (flavor, 8192, 1, 20, ac, compiled, ["quantize.linear.float8"] if float8 else [])
            expect(got == want, f"{row}: {name} read {got}, the row is {want}")
            f8 = config.quantize.linear.float8
            expect((f8.recipe_name, list(f8.filter_fqns)) == ("tensorwise", ["output"]), f"{row}: {name} Float8 {f8}")  # fmt: skip
            expect(config.activation_checkpoint.selective_ac_option == "op", f"{row}: {name} AC option")  # fmt: skip
    return f"configs: torchtitan's ConfigManager and Titan's loader read the rows {', '.join(rows)} alike"  # fmt: skip


def check_models(bench: ModuleType) -> str:
    import titan_cut_llama3
    import torchtitan_cut_llama3  # noqa: F401 (registers the flavors, as torchtitan imports it)
    from torchtitan.models.llama3 import Transformer, llama3_args

    from titan_core import load_config
    from titan_trainer.config import JobConfig
    from titan_trainer.model import model_args_for

    said = []
    for flavor in ("8B-4", "8B-8", "smoke"):
        vocab = bench.SMOKE_VOCAB if flavor == "smoke" else bench.VOCAB
        config = load_config(JobConfig, ["--model.flavor", flavor, "--training.seq_len", "8192"])
        spec = titan_cut_llama3.spec
        with torch.device("meta"):
            theirs = Transformer(llama3_args[flavor])
            ours = spec.build(model_args_for(spec, config, vocab))
        shapes = [Counter(tuple(p.shape) for p in m.parameters()) for m in (theirs, ours)]
        counts = [sum(p.numel() for p in m.parameters()) for m in (theirs, ours)]
        expect(shapes[0] == shapes[1], f"{flavor}: parameter shapes differ: {shapes}")
        expect(counts[0] == counts[1], f"{flavor}: {counts[0]:,} parameters against {counts[1]:,}")
        said.append(f"{flavor} {counts[0]:,}")
    return f"models: the same parameter shapes and counts ({'; '.join(said)})"


class _PeakMemory:
    """What torchtitan's DeviceMemoryMonitor answers (it reads torch.cuda.memory_stats)."""

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(40.0, 50.0, 43.71, 55.2, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def check_metrics_line(bench: ModuleType) -> str:
    from torchtitan.components.metrics import BaseLogger, MetricsProcessor
    from torchtitan.tools.utils import Color, NoColor

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    root = logging.getLogger()  # torchtitan's logger
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    flops_per_token = 6 * 1_923_125_248
    try:
        for color in (NoColor(), Color()):
            metrics = object.__new__(MetricsProcessor)  # its __init__ asks CUDA for the device
            metrics.logger, metrics.color = BaseLogger(), color
            metrics.parallel_dims = SimpleNamespace(non_data_parallel_size=1)
            metrics.job_config = SimpleNamespace(metrics=SimpleNamespace(log_freq=1))
            metrics.device_memory_monitor = _PeakMemory()
            metrics.gpu_peak_flops, metrics.num_flops_per_token = 989e12, flops_per_token
            metrics.ntokens_since_last_log, metrics.data_loading_times = 8192, [0.001]
            metrics.time_last_log = time.perf_counter() - 0.16
            metrics.log(7, 3.25, 3.25, 0.9)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    steps = bench.parse_steps("torchtitan", "\n".join(said))
    expect(len(steps) == 2, f"read {steps} from {said}")
    for step in steps:
        mfu = 100 * flops_per_token * step.tokens_per_s / 989e12
        expect(step.step == 7 and step.memory_gib == 43.71, f"read {step} from {said}")
        # tps is printed rounded to a token, MFU to 0.01%.
        expect(abs(step.mfu_pct - mfu) < 0.01, f"MFU {step.mfu_pct} against {mfu:.3f}")
    return f"metrics line: torchtitan's own, read back ({said[0]!r})"


def run_checks(args, say, bench: ModuleType) -> int:
    """Each check in turn, said as it passes or fails; 1 when any failed."""
    rows = args.rows.split(",")
    with tempfile.TemporaryDirectory(prefix="vs_torchtitan_check_") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        bench.write_assets(work / "assets", bench.VOCAB)
        checks = [
            lambda: check_tokenizers(bench, work / "assets"),
            lambda: check_dataset(bench, work / "assets"),
            lambda: check_configs(bench, work, rows),
            lambda: check_models(bench),
            lambda: check_metrics_line(bench),
        ]
        failed = 0
        for check in checks:
            try:
                say(f"ok: {check()}")
            except CheckFailed as e:
                failed += 1
                say(f"FAILED: {e}")
    return 1 if failed else 0
