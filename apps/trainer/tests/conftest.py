from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[1]
DEBUG_TOML = TRAINER / "configs" / "debug_model.toml"


def run_cli(
    args: list[str], nproc: int = 1, timeout: float = 600, env_extra: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the trainer the way a user does: `python -m titan_trainer` or torchrun for several ranks."""
    return start_cli(args, nproc, env_extra).result(timeout)


class Started:
    """A trainer command running in the background (see `start_cli`). Its output goes to
    files, not pipes: a run that is not being read must never block on a full pipe while its
    other ranks wait for it in a collective."""

    def __init__(self, cmd: list[str], env: dict):
        self.cmd = cmd
        # Open until `result()` reads and closes them.
        self.out = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        # Its own session, so that a timeout (or pytest-timeout) stops torchrun and every
        # rank it started: a rank left behind would hold the CPU for the rest of the run.
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=self.err, text=True, env=env, start_new_session=True
        )

    def result(self, timeout: float = 600) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        except BaseException:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        outputs = []
        for f in (self.out, self.err):
            f.seek(0)
            outputs.append(f.read())
            f.close()
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, *outputs)


def start_cli(args: list[str], nproc: int = 1, env_extra: dict | None = None) -> Started:
    """`run_cli` without waiting: several runs can share the machine (much of a run is
    importing torch and waiting at rendezvous). Collect with `.result(timeout)`."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if nproc > 1 else "2"),
    }
    env.update(env_extra or {})
    if nproc == 1:
        cmd = [sys.executable, "-m", "titan_trainer", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "titan_trainer",
            *args,
        ]
    return Started(cmd, env)


def parse_losses(stdout: str) -> dict[int, float]:
    """step -> loss from the trainer's metric lines."""
    losses = {}
    for line in stdout.splitlines():
        if "| loss " in line and "step " in line:
            fields = [f.strip() for f in line.split("|")]
            step = int(fields[0].split("step")[-1])
            losses[step] = float(fields[1].split()[1])
    return losses


@pytest.fixture
def debug_args(tmp_path) -> list[str]:
    """The README's debug config, shortened for tests, writing into a temporary folder."""
    return [
        "--job.config_file",
        str(DEBUG_TOML),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        # Drawing the end-of-run curves costs seconds per run; the tests that look at them
        # turn them on.
        "--metrics.save_plots_folder",
        "",
    ]


STEPS = 4
# Every document is the same 127 bytes: with BOS and EOS it fills exactly one 129-token window
# (seq_len 128 + 1), so every sample on every rank is identical. Sharding the data across
# data-parallel ranks then cannot change a batch, and the runs can be compared step by step.
TEXT = (
    "The quick brown fox jumps over the lazy dog while seventeen wizards quietly boxed "
    "jackdaws; pack my box with five dozen jugs, now!"
)[:127]


@pytest.fixture(scope="module")
def same_doc_dataset(tmp_path_factory):
    import json

    assert len(TEXT.encode()) == 127
    path = tmp_path_factory.mktemp("data") / "same.jsonl"
    path.write_text("".join(json.dumps({"text": TEXT}) + "\n" for _ in range(256)))
    return str(path)


def fp32_args(debug_args, dataset):
    return [
        *debug_args,
        "--training.dataset",
        dataset,
        "--training.steps",
        str(STEPS),
        "--training.mixed_precision_param",
        "float32",
        "--training.local_batch_size",
        "4",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.peak_tflops",
        "1",
    ]


@pytest.fixture(scope="session")
def hf_tokenizer_folders(tmp_path_factory) -> dict[str, str]:
    """Hugging Face tokenizer folders, as the families ship them, around one byte-level BPE
    tokenizer.json trained once with `tokenizers` on the embedded corpus (1,000 merges and
    ranks, then the special tokens): `llama` (tokenizer_config.json names BOS, EOS and PAD, as
    Llama 3's and DeepSeek-V3's do) and `qwen` (no BOS, as Qwen3's)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from titan_data import pydocs_documents

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(pydocs_documents("train"), trainer)
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|endoftext|>"])
    configs = {
        "llama": {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "pad_token": "<|endoftext|>",
        },
        "qwen": {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    }
    root = tmp_path_factory.mktemp("hf_tokenizers")
    folders = {}
    for kind, config in configs.items():
        folder = root / kind
        folder.mkdir()
        tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        folders[kind] = str(folder)
    return folders


@pytest.fixture
def torchtitan_checkout(tmp_path, monkeypatch, hf_tokenizer_folders):
    """A working directory laid out as torchtitan's: `c4_test` is its tests/assets/c4_test
    (a few documents of our own here), tests/assets/tokenizer its test tokenizer (a Hugging
    Face tokenizer.json with its tokenizer_config.json; ours is trained on the embedded
    corpus)."""
    import json
    import shutil

    shutil.copytree(hf_tokenizer_folders["llama"], tmp_path / "tests/assets/tokenizer")
    sample = tmp_path / "tests/assets/c4_test"
    sample.mkdir(parents=True)
    rows = [{"text": f"Sample document {i}. " * 40, "url": "local"} for i in range(30)]
    (sample / "data.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    return tmp_path
