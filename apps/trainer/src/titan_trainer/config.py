"""The trainer's config: its own sections plus the sections each package owns.

Section and key names follow torchtitan's TOML configs, so a torchtitan user's file loads here
unchanged. Run `titan-train --help` for every option with its default.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Literal

from titan_ckpt import Checkpoint
from titan_core import Comm, Job
from titan_core.config import ConfigCompat
from titan_float8 import Float8
from titan_models.options import ModelOptions
from titan_parallel import (
    ActivationCheckpoint,
    Compile,
    FaultToleranceConfig,
    MuonOptions,
    Parallelism,
    Ranger21Options,
)
from titan_trainer import torchtitan_keys
from titan_trainer.logs import parse_ranks, ranks_text
from titan_trainer.param_groups import ParamGroup, optimizer_group_problems

Dtype = Literal["auto", "bfloat16", "float32"]


@dataclass
class ModelChoice:
    """The trainer's own `[model]` keys: which family and flavor it trains, its tokenizer and
    its converters."""

    name: str = "llama3"
    """Model family: an entry point in `titan.models` (see `titan-train --list-plugins`) or `module:attr`."""
    flavor: str = "debugmodel"
    """Size preset of the family, e.g. debugmodel, 8B, 70B, 405B."""
    tokenizer_path: str = "byte"
    """`byte` (no asset needed), `llama3` (from the llama-models package), a path to a Hugging
    Face tokenizer.json (special tokens from the tokenizer_config.json beside it) or a tiktoken
    tokenizer.model, or a folder holding one (a model's Hugging Face download). Its vocabulary
    sets the model's. Set to anything but `byte`, it wins over hf_assets_path (as in torchtitan)."""
    hf_assets_path: str | None = None
    """Folder of Hugging Face assets (torchtitan's newer key); the tokenizer is read from it
    unless tokenizer_path names another one."""
    converters: list[str] = field(default_factory=list)
    """Model converters applied before parallelism, e.g. ["quantize.linear.float8"]."""
    print_after_conversion: bool = False
    """Log the model after converters ran."""

    def tokenizer_source(self) -> tuple[str, str | None]:
        """(what the tokenizer is loaded from, a note when two keys name one). tokenizer_path
        when it is set to anything but `byte`, else hf_assets_path, else `byte`: torchtitan's
        rule (its tokenizer_path, when set, replaces hf_assets_path)."""
        if self.hf_assets_path is None:
            return self.tokenizer_path, None
        if self.tokenizer_path == "byte":
            return self.hf_assets_path, None
        return self.tokenizer_path, (
            f"[model] tokenizer_path = {self.tokenizer_path!r} and hf_assets_path ="
            f" {self.hf_assets_path!r} are both set: the tokenizer comes from tokenizer_path"
        )


@dataclass
class Model(ModelOptions, ModelChoice):
    """`[model]`: the trainer's keys (`ModelChoice`), then the settings the model family reads
    (titan-models' `ModelOptions`: experts' balancing, attention, multi-token prediction),
    which reach the model's arguments through its `ModelSpec.configure`."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """`AdamW` or `Adam` (built in), `Ranger21` or `Muon` (titan-parallel), another entry point
    in `titan.optimizers` (see `titan-train --list-plugins`), or `module:attr`."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.95
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """Kernel choice for AdamW and Adam: fused (one kernel per step; falls back to foreach where
    unsupported), foreach, for-loop."""
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the optimizer's moments, for AdamW and Ranger21. bfloat16 halves their memory;
    they are updated in float32 and stored with stochastic rounding (AdamW then runs on
    titan-parallel's foreach AdamW, whatever `implementation` says)."""
    param_groups: list[ParamGroup] = field(default_factory=list)
    """Groups of parameters with their own lr, weight_decay, beta1, beta2, eps (and Muon's
    `muon` switch), chosen by a regex over parameter names; the first match wins, the rest
    take the values above. TOML `[[optimizer.param_groups]]` tables (or a JSON list here)."""
    ranger21: Ranger21Options = field(default_factory=Ranger21Options)
    muon: MuonOptions = field(default_factory=MuonOptions)

    def validate(self) -> list[str]:
        problems = optimizer_group_problems(self)
        if self.state_dtype != "float32" and self.name == "Adam":
            problems.append(
                f"[optimizer] state_dtype = {self.state_dtype!r} is not available for Adam\n"
                "use AdamW or Ranger21, or state_dtype = 'float32'"
            )
        if self.lr <= 0:
            problems.append(
                f"[optimizer] lr = {self.lr} is not valid\nuse a positive learning rate"
            )
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                problems.append(
                    f"[optimizer] {key} = {getattr(self, key)} is not valid\nuse a value in [0, 1)"
                )
        return problems


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warm-up from near zero to the peak learning rate."""
    decay_ratio: float | None = None
    """Share of the steps spent decaying at the end (warmup-stable-decay); none decays over
    every step after warm-up."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""
    min_lr_factor: float = 0.0
    """The learning rate decays to this fraction of the peak."""

    def validate(self) -> list[str]:
        problems = []
        if self.warmup_steps < 0:
            problems.append(
                f"[lr_scheduler] warmup_steps = {self.warmup_steps} is not valid\nuse 0 or more"
            )
        if self.decay_ratio is not None and not 0 <= self.decay_ratio <= 1:
            problems.append(
                f"[lr_scheduler] decay_ratio = {self.decay_ratio} is not valid\nuse a value in [0, 1]"
            )
        if not 0 <= self.min_lr_factor <= 1:
            problems.append(
                f"[lr_scheduler] min_lr_factor = {self.min_lr_factor} is not valid\nuse a value in [0, 1]"
            )
        return problems


@dataclass
class DataLoaderOptions:
    num_workers: int = 1
    """Processes per rank that read, tokenize and pack the batches ahead of training (0: the
    training process itself). Any count gives the same batches, and a checkpoint resumes on
    any other count."""
    prefetch_factor: int = 2
    """Microbatches each worker keeps ready."""
    pin_memory: bool = True
    """Put batches in pinned memory, for faster copies to the GPU (CUDA only)."""

    def validate(self) -> list[str]:
        problems = []
        if self.num_workers < 0:
            problems.append(
                f"[training.dataloader] num_workers = {self.num_workers} is not valid\n"
                "use 0 (load in the training process) or more"
            )
        if self.prefetch_factor < 1:
            problems.append(
                f"[training.dataloader] prefetch_factor = {self.prefetch_factor} is not valid\n"
                "use 1 or more"
            )
        return problems


@dataclass
class Training:
    dataset: str = "pydocs"
    """Dataset: `pydocs` (embedded, offline), `c4`, a Hugging Face hub name, a local
    file/folder/glob, a folder written by `titan-data tokenize`, or a weighted mixture of
    them: `c4:0.7,pydocs:0.3` (entries DATASET[=PATH][:WEIGHT])."""
    dataset_path: str | None = None
    """Local copy of the dataset (for `c4` and other hub datasets; a mixture gives each entry
    its own as DATASET=PATH)."""
    dataset_text_field: str = "text"
    """The field that holds the text in the rows of jsonl, json and parquet files and of hub
    datasets named `org/name` (every dataset of a mixture); `c4` and `pydocs` know their own."""
    data_plugin: str = "titan"
    """Package that builds tokenizers and loaders: an entry point in `titan.data` or `module:attr`."""
    bad_rows: Literal["error", "skip"] = "error"
    """A row that is not a text document (malformed JSON, invalid UTF-8, a missing or non-string
    text field): `error` stops before training, naming file and line (every row of local files is
    checked at start-up); `skip` skips it and counts it (`skipped rows` in the metrics line)."""
    local_batch_size: int = 8
    """Samples per data-parallel rank per microbatch."""
    global_batch_size: int = -1
    """Samples per optimizer step over all ranks; above local x dp it accumulates gradients. -1: local x dp."""
    seq_len: int = 2048
    """Tokens per sample."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this (0 turns clipping off)."""
    max_nonfinite_in_a_row: int = 0
    """A step whose loss or gradient norm is NaN or inf is never applied. 0: the run stops at the
    next metrics line (at once for an optimizer that cannot skip on the device); N > 0: up to N
    such steps in a row are skipped and counted (`skipped_steps` in the metrics) and training
    goes on; one more stops the run."""
    steps: int = 10000
    """Optimizer steps to train for."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the parameters, their gradients and the optimizer's state are kept in. float32:
    a float32 master copy, computed in mixed_precision_param (mixed precision). bfloat16: all
    of them in bfloat16 with no float32 copy: half their memory, but every update is rounded
    to bfloat16 (the loss gap measured: see the trainer README). Computes in bfloat16 even on
    a CPU without bf16 instructions (slowly). Ranger21 and titan's AdamW keep their moments
    in [optimizer] state_dtype (set bfloat16 for no float32 state at all)."""
    mixed_precision_param: Dtype = "bfloat16"
    """Compute dtype of parameters. On a CPU without bf16 instructions bfloat16 falls back to
    float32 with a warning; auto picks bfloat16 where it is native."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reductions across data-parallel ranks."""
    enable_cpu_offload: bool = False
    """Keep FSDP parameters, gradients and optimizer state in CPU memory."""
    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic collection is turned off)."""
    seed: int | None = None
    """Seed for initialisation and data order; none picks 0."""
    deterministic: bool = False
    """Use deterministic kernels (slower)."""
    mtp_loss_weight: float = 0.3
    """Weight of the multi-token-prediction loss (for a model with `[model] n_mtp_layers`):
    loss = next-token loss + mtp_loss_weight x the mean of the D depths' losses. DeepSeek-V3
    used 0.3 for its first 10T tokens, then 0.1. The logged loss is this sum."""
    loss_chunk_tokens: int = 0
    """Compute the output projection and the cross-entropy this many tokens at a time, with
    each chunk's gradients in the same pass, so the float32 logits of the whole microbatch
    (tokens x vocab x 4 bytes) never exist; holds a float32 buffer the size of the output weight
    until backward instead. For an eager loss (a compiled one never writes them either).
    0: off (the whole microbatch at once). Not with tensor or pipeline parallel, multi-token
    prediction or "loss" in [compile] components."""
    dataloader: DataLoaderOptions = field(default_factory=DataLoaderOptions)

    def validate(self) -> list[str]:
        problems = []
        for key in ("local_batch_size", "seq_len", "steps", "gc_freq"):
            if getattr(self, key) < 1:
                problems.append(
                    f"[training] {key} = {getattr(self, key)} is not valid\nuse 1 or more"
                )
        if self.global_batch_size == 0 or self.global_batch_size < -1:
            problems.append(
                f"[training] global_batch_size = {self.global_batch_size} is not valid\n"
                "use a positive number of samples, or -1 for local_batch_size x data-parallel degree"
            )
        if self.max_nonfinite_in_a_row < 0:
            problems.append(
                f"[training] max_nonfinite_in_a_row = {self.max_nonfinite_in_a_row} is not valid\n"
                "use 0 (stop at the first) or the number of bad steps in a row to skip"
            )
        if self.loss_chunk_tokens < 0:
            problems.append(
                f"[training] loss_chunk_tokens = {self.loss_chunk_tokens} is not valid\n"
                "use 0 (off) or a positive number of tokens (e.g. 1024)"
            )
        if self.dtype == "bfloat16" and self.mixed_precision_param == "float32":
            problems.append(
                '[training] dtype = "bfloat16" keeps the parameters in bfloat16, so they compute'
                ' in it too, but mixed_precision_param = "float32"\n'
                'set mixed_precision_param = "bfloat16" (or "auto"), or dtype = "float32"'
            )
        if self.mtp_loss_weight < 0:
            problems.append(
                f"[training] mtp_loss_weight = {self.mtp_loss_weight} is not valid\n"
                "use 0 or more (DeepSeek-V3: 0.3, then 0.1)"
            )
        if self.max_norm < 0:
            problems.append(
                f"[training] max_norm = {self.max_norm} is not valid\nuse 0 (off) or a positive norm"
            )
        return problems


WANDB_MISSING = (
    "[metrics] enable_wandb = true, but wandb is not installed\n"
    "pip install 'titan-llm-trainer[wandb]' (or in the workspace: uv sync --all-packages --inexact"
    " --extra wandb), or turn it off"
)


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps (and at the first and last step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard events under job.dump_folder/save_tb_folder."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    peak_tflops: float | None = None
    """Peak TFLOP/s for MFU. None: the datasheet value for known GPUs, else measured at start-up."""
    save_plots_folder: str = "plots"
    """At the end of the run, loss, throughput and memory curves as PNG go here (relative to
    job.dump_folder; rank 0), and one per [eval] task; empty turns them off. Needs matplotlib (titan-llm-trainer[plots])."""
    enable_wandb: bool = False
    """Log the same scalars to Weights & Biases (pip install 'titan-llm-trainer[wandb]'); project, entity, name and online/offline from WANDB_PROJECT (default titan), WANDB_ENTITY, WANDB_NAME (default job.description), WANDB_MODE."""
    max_attention_logit: bool = False
    """Record every attention head's largest logit (q . k x softmax scale) in each step and log
    the step's largest (`maxlogit` on the metric line, in TensorBoard), with any optimizer: the
    logit growth that precedes loss spikes. Always on with [optimizer.muon] qk_clip_tau. Costs
    one more q . k product per attention layer (no gradient); not with context parallel."""
    sinks: list[str] = field(default_factory=list)
    """More metric sinks for the same scalars, by name: entry points in `titan.metric_sinks`
    (see `titan-train --list-plugins`) or `module:attr`. TensorBoard and W&B are two such
    sinks, switched by enable_tensorboard and enable_wandb."""

    def validate(self) -> list[str]:
        problems = []
        if self.log_freq < 1:
            problems.append(f"[metrics] log_freq = {self.log_freq} is not valid\nuse 1 or more")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            problems.append(
                f"[metrics] peak_tflops = {self.peak_tflops} is not valid\nuse a positive number"
            )
        if self.enable_wandb and importlib.util.find_spec("wandb") is None:
            problems.append(WANDB_MISSING)
        return problems


@dataclass
class Logging:
    ranks: str | None = None
    """Ranks whose INFO lines reach the console: `0`, `0,3`, `0-3` or `all` (every rank shows
    its warnings and errors). None: the LOG_RANK environment variable, else 0."""
    folder: str = "logs"
    """Each rank appends everything it logs to `<job.dump_folder>/<folder>/rank_<n>.log`;
    empty turns the files off."""

    def validate(self) -> list[str]:
        try:
            parse_ranks(ranks_text(self))
        except ValueError as e:
            where = "[logging] ranks" if self.ranks is not None else "LOG_RANK"
            return [f"{where} = {ranks_text(self)!r}: {e}\nuse ranks such as 0, 0,3, 0-3 or all"]
        return []


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""
    profile_freq: int = 10
    """Profile one step in every this many."""
    enable_memory_snapshot: bool = False
    """Dump CUDA memory snapshots (CUDA only)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on held-out data during training."""
    dataset: str = "pydocs_validation"
    """Dataset to evaluate on (same forms as training.dataset). The default is the held-out
    split of the embedded corpus, which training on `pydocs` never reads; name your own
    held-out data when training on anything else."""
    dataset_path: str | None = None
    """Local copy of the validation dataset."""
    dataset_text_field: str = "text"
    """The field that holds the text in the validation dataset's rows (as
    training.dataset_text_field)."""
    local_batch_size: int = 8
    """Samples per data-parallel rank per validation step."""
    seq_len: int = -1
    """Tokens per validation sample; -1 uses training.seq_len. At most training.seq_len (the
    model's positional table is that long), and equal to it under context parallel."""
    freq: int = 500
    """Validate every this many steps."""
    steps: int = 10
    """Batches per validation; -1 runs the whole dataset once."""


@dataclass
class Eval:
    tasks: list[str] = field(default_factory=list)
    """Downstream tasks to score during training: paths of task specs (.toml beside a .jsonl or
    .parquet file of items; multiple choice, last word, perplexity), scored as
    lm-evaluation-harness scores them. Empty: no evaluation. See apps/trainer/docs/eval.md."""
    freq: int = 1000
    """Evaluate every this many steps."""
    at_end: bool = True
    """Also evaluate after the last step."""
    max_examples: int = -1
    """Score only the first this many items of each task; -1 scores them all."""
    local_batch_size: int = 8
    """Requests (a context and one continuation) per forward on each data-parallel rank; each is
    padded to the longest of its forward (to training.seq_len under pipeline or context
    parallel, or compile, whose shapes are fixed)."""
    add_bos: bool = True
    """Encode each text with BOS first where the tokenizer starts documents with one (as training
    did, and as lm-eval's hf model does by default); false encodes without (lm-eval's
    add_bos_token=False)."""
    log_samples: bool = False
    """Also write each item's log-likelihoods and prediction to
    eval_samples/step-<N>/<task>.jsonl in the dump folder (lm-eval's log_samples)."""

    def validate(self) -> list[str]:
        problems = []
        if self.freq < 1:
            problems.append(
                f"[eval] freq = {self.freq} is not valid\nuse a positive number of steps"
            )
        if self.local_batch_size < 1:
            problems.append(
                f"[eval] local_batch_size = {self.local_batch_size} is not valid\nuse 1 or more requests per forward"
            )
        if self.max_examples == 0 or self.max_examples < -1:
            problems.append(
                f"[eval] max_examples = {self.max_examples} is not valid\nuse -1 for every item, or a positive count"
            )
        missing = [t for t in self.tasks if not os.path.isfile(t)]
        if missing:
            problems.append(
                f"[eval] tasks: no task spec at {', '.join(missing)}\ngive the paths of task .toml files"
                " (apps/trainer/tasks/ has examples)"
            )
        return problems


@dataclass
class DryRun:
    world_size: int | None = None
    """Ranks to simulate with `--dry-run`; none takes the product of the parallelism degrees,
    else the NGPU environment variable, else (data_parallel_shard_degree = -1, as in
    torchtitan's TOML files) one node of 8, rounded up to a multiple of the other degrees,
    which the dry run says."""
    device: str = "H100"
    """The GPU the job will run on, for its memory (H100, H200, A100, A100-40GB, B200, MI300X, ...)."""
    device_memory_gib: float | None = None
    """Memory per device in GiB; overrides `device`."""
    headroom_gib: float = 4.0
    """Memory tensors do not show (CUDA context, NCCL buffers, allocator fragmentation); a job
    fits when its peak plus this is within the device memory."""
    all_ranks: bool = False
    """Simulate every pipeline rank instead of the first and the last."""
    suggest: bool = True
    """When the job does not fit, simulate the cheapest changes that would make it fit."""
    system: str = "auto"
    """The system the predicted step time is priced on: a shipped one (h100_sxm,
    h100_torchtitan, h200, a100_sxm), a path to a TOML file describing yours, cpu (this
    machine, measured), or auto (the shipped system of `device`; none: no step time)."""
    search: bool = False
    """Rank the layouts that fit this world size by predicted tokens/s: degrees, pipeline
    schedule and microbatches, activation checkpointing, Float8; each one simulated."""

    def validate(self) -> list[str]:
        problems = []
        if self.world_size is not None and self.world_size < 1:
            problems.append(f"[dry_run] world_size = {self.world_size} is not valid\nuse 1 or more")
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            problems.append(
                f"[dry_run] device_memory_gib = {self.device_memory_gib} is not valid\nuse a positive size"
            )
        if self.headroom_gib < 0:
            problems.append(
                f"[dry_run] headroom_gib = {self.headroom_gib} is not valid\nuse 0 or more"
            )
        return problems


@dataclass
class QuantizeLinear:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


@dataclass
class JobConfig:
    # torchtitan's TOML files load unchanged: its other names for our keys, the keys it has
    # that Titan does not implement (one warning), and the names it used to have (an error).
    __config_compat__ = ConfigCompat(
        aliases=torchtitan_keys.ALIASES,
        unimplemented=torchtitan_keys.UNIMPLEMENTED,
        renamed=torchtitan_keys.RENAMED,
        values=torchtitan_keys.VALUES,
    )

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    metrics: Metrics = field(default_factory=Metrics)
    logging: Logging = field(default_factory=Logging)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    dry_run: DryRun = field(default_factory=DryRun)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
