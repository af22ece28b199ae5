"""The [checkpoint] config section (torchtitan's key names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the newest complete one in `folder`."""
    folder: str = "checkpoint"
    """Where checkpoints go (one `step-<N>` folder per save): relative to [job] dump_folder, an
    absolute path, or a URL of remote storage: `s3://bucket/run/checkpoint`, or any fsspec URL
    (S3 needs `pip install 'titan-llm-ckpt[s3]'`; an S3-compatible server is named by the
    AWS_ENDPOINT_URL environment variable, credentials as for any AWS tool)."""
    interval: int = 500
    """Save every this many steps (and always at the last step)."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """How saving overlaps training: `disabled` blocks until written; `async` blocks only while the
    state is copied to CPU memory and writes in the background; `async_with_pinned_mem` (CUDA only)
    also copies into reused pinned buffers in the background, waiting before the next optimizer step."""
    async_executor: Literal["thread", "process"] = "thread"
    """Where an async save writes: a background thread, or a background process (torch's
    AsyncCheckpointerType.PROCESS; keeps file I/O off the trainer's GIL, costs a process start)."""
    keep_latest_k: int = 10
    """Keep only the newest this many complete checkpoints (0 keeps all). 1 is allowed, also with
    async saves: old checkpoints are pruned only after the new one is committed."""
    load_step: int = -1
    """Step to resume from; -1 picks the newest complete checkpoint."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """States not restored on resume, by name (model, optimizer, lr_scheduler, dataloader,
    train_state, rng)."""
    last_save_model_only: bool = False
    """At the last step, save only the model weights (in `export_dtype`): the final checkpoint is
    for evaluation or export, not for resuming. (torchtitan defaults to true; Titan defaults to false
    so that a run stopped early, or extended later, resumes from its last save.)"""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of model-only final saves and of Hugging Face exports."""
    last_save_in_hf: bool = False
    """At the last step, also write Hugging Face safetensors + config.json into `step-<N>/hf`
    (needs a model with an HF adapter); each rank writes its own shards, none gathers the model."""
    hf_interval: int = 0
    """Every this many steps (and at the last step), write a Hugging Face snapshot (0: none):
    safetensors in `export_dtype` (each rank writes its own shards), config.json and the
    tokenizer's files, into `<folder>/hf/step-<N>`, a folder that appears only once complete
    (needs a model with an HF adapter). With an async `async_mode` the weights are copied to
    CPU memory and written in the background (the training waits for the copy only); otherwise,
    and for `hf_save_optimizer`'s state, the training waits for the write."""
    hf_keep_latest_k: int = 0
    """Keep only the newest this many Hugging Face snapshots (`hf_interval`; 0 keeps all)."""
    hf_save_optimizer: bool = False
    """With each Hugging Face snapshot, also save the rest of the training state (optimizer, LR
    schedule, data position, train state, RNG) in its `titan_state/` folder (a DCP checkpoint),
    so that a run resumes from the snapshot: `initial_load_path` = the snapshot,
    `initial_load_in_hf` = true, `initial_load_model_only` = false."""
    initial_load_path: str | None = None
    """A checkpoint to start from when `folder` holds none (a `step-<N>` folder, or a Hugging Face
    folder with `initial_load_in_hf`)."""
    initial_load_model_only: bool = True
    """Take only the model weights from `initial_load_path` (fine-tuning from a pretrained model).
    false takes the whole training state; with `initial_load_in_hf`, that needs a snapshot
    saved with `hf_save_optimizer`."""
    initial_load_in_hf: bool = False
    """`initial_load_path` holds Hugging Face safetensors (needs a model with an HF adapter); each
    rank reads only the parts of the files its own shards need."""
    create_seed_checkpoint: bool = False
    """Write a model-only `step-0` checkpoint (usually from one process) and stop; later runs in any
    parallel layout start from these exact weights."""
    checkpointer: str = "dcp"
    """Which checkpoint package the trainer uses: a name registered under the
    `titan.checkpointers` entry-point group, or `module:attr` of a build function."""

    def validate(self) -> list[str]:
        problems = []
        if self.interval < 1:
            problems.append(
                f"[checkpoint] interval = {self.interval} is not valid\nuse a positive number of steps"
            )
        if self.keep_latest_k < 0:
            problems.append(
                f"[checkpoint] keep_latest_k = {self.keep_latest_k} is not valid\nuse 0 to keep all, or a positive count"
            )
        if self.async_mode == "async_with_pinned_mem" and not _cuda_available():
            problems.append(
                '[checkpoint] async_mode = "async_with_pinned_mem" needs CUDA, and no GPU is visible\n'
                'use "async" on CPU'
            )
        if self.load_step < -1:
            problems.append(
                f"[checkpoint] load_step = {self.load_step} is not valid\nuse -1 for the newest, or a saved step"
            )
        known = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
        for name in self.exclude_from_loading:
            if name not in known:
                problems.append(
                    f"[checkpoint] exclude_from_loading names unknown state {name!r}\n"
                    f"allowed: {', '.join(sorted(known))}"
                )
        for key in ("folder", "initial_load_path"):
            problem = _storage_problem(key, getattr(self, key))
            if problem:
                problems.append(problem)
        if self.initial_load_in_hf and not self.initial_load_path:
            problems.append(
                "[checkpoint] initial_load_in_hf = true needs initial_load_path\nname the HF folder"
            )
        for key in ("hf_interval", "hf_keep_latest_k"):
            if getattr(self, key) < 0:
                problems.append(
                    f"[checkpoint] {key} = {getattr(self, key)} is not valid\n"
                    + (
                        "use 0 for no snapshots, or a positive number of steps"
                        if key == "hf_interval"
                        else "use 0 to keep all, or a positive count"
                    )  # fmt: skip
                )
        if self.hf_save_optimizer and self.hf_interval <= 0:
            problems.append(
                "[checkpoint] hf_save_optimizer = true saves beside Hugging Face snapshots, and"
                " hf_interval = 0 writes none\nset hf_interval to a positive number of steps, or"
                " leave hf_save_optimizer off"
            )
        if self.hf_interval > 0 and not self.enable:
            problems.append(
                "[checkpoint] hf_interval writes into the checkpoint folder, and enable = false"
                " saves nothing\nset [checkpoint] enable = true, or hf_interval = 0"
            )
        return problems


def _cuda_available() -> bool:
    # Imported here: the config is read and checked before torch's seconds of import, and only
    # this setting asks about the device.
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def _storage_problem(key: str, value: str | None) -> str | None:
    """A URL whose storage is not installed here, named before anything starts."""
    from titan_ckpt.storage import StorageUnavailableError, filesystem, is_url  # noqa: PLC0415

    if not value or not is_url(value):
        return None
    try:
        filesystem(value)
    except StorageUnavailableError as e:
        return f"[checkpoint] {key} = {value!r}: {e}"
    return None
