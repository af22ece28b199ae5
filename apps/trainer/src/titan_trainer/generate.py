"""`titan-generate`: text from a trained model, with a KV cache.

    titan-generate outputs/debug --prompt "The list type" --max-new-tokens 120
    titan-generate hf_out --tokenizer byte --prompt "def " --temperature 0.8 --top-p 0.9
    torchrun --nproc_per_node 2 -m titan_trainer.generate outputs/debug --prompt "The"

The weights come from a DCP checkpoint in any layout (a `step-N` folder, a checkpoint folder
or a run's dump folder: the newest complete checkpoint), read through titan-ckpt, with the
model, flavor, sequence length and tokenizer of the run's config saved beside it; or from a
Hugging Face folder (`config.json` + safetensors; the flavor whose shapes match is found). The
tokens are the run's tokenizer's (`--tokenizer` for a Hugging Face folder without one).

Under torchrun the model is split with tensor parallel over every process (no sequence
parallel: one new token at a time); each rank reads the full weights and keeps its shard, and
every rank draws the same tokens (the same seed); rank 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_trainer.tools import run_tool, tool_parser

STRUCTURE = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "rope_theta",
    "tie_word_embeddings",
)
"""The keys of a Hugging Face config.json that pick the flavor."""


class GenerateError(Exception):
    pass


@dataclasses.dataclass
class Source:
    """What to build and load: the model family and its arguments, the weights' reader, the
    tokenizer's name or path and the data plugin that builds it."""

    spec: Any
    args: Any
    read_weights: Any
    tokenizer: str
    data_plugin: str
    where: str


def find_checkpoint(path: Path) -> Path | None:
    """A complete DCP checkpoint whose files pass their checks (every byte against its
    checksum, as `titan-ckpt verify`): `path` itself, or the newest usable one in it or in its
    checkpoint/ (a dump folder), each damaged newer one said on stderr and passed over; None
    when there is none. GenerateError when the one named, or every one, is damaged."""
    from titan_ckpt import checkpoint_problems, list_checkpoints

    if (path / ".metadata").is_file():
        problems = checkpoint_problems(path)
        if problems:
            raise GenerateError(
                f"{path} is damaged: {'; '.join(problems)}\nname another checkpoint (`titan-ckpt"
                f" list {path.parent}`), or the run's folder for its newest usable one"
            )
        return path
    for folder in (path, path / "checkpoint"):
        found = list_checkpoints(folder) if folder.is_dir() else []
        damaged = []
        for _, step in reversed(found):
            problems = checkpoint_problems(step)
            if not problems:
                for name, why in damaged:
                    _say(f"titan-generate: {name} is damaged ({why}); using {step.name}")
                return step
            damaged.append((step.name, "; ".join(problems)))
        if damaged:
            raise GenerateError(
                f"every checkpoint in {folder} is damaged:\n  "
                + "\n  ".join(f"{name}: {why}" for name, why in damaged)
                + f"\n`titan-ckpt verify {folder}` checks them again; generate from another run,"
                " or from a Hugging Face export"
            )
    return None


def _say(text: str) -> None:
    """A note on stderr, from the first rank only under torchrun."""
    if os.environ.get("RANK", "0") == "0":
        print(text, file=sys.stderr)


def dcp_source(step: Path, tokenizer: str | None) -> Source:
    from titan_ckpt import load_consolidated
    from titan_core import load_config, plugins, resolve
    from titan_trainer.config import JobConfig
    from titan_trainer.model import model_args_for

    saved = step / "config.toml"
    if not saved.is_file():
        raise GenerateError(
            f"{step} has no config.toml (the run's config, which names the model and its "
            "tokenizer); convert it to a Hugging Face folder with titan-ckpt and pass that"
        )
    config = load_config(JobConfig, ["--job.config_file", str(saved)])
    spec = resolve(plugins.MODELS, config.model.name)
    data = resolve(plugins.DATA, config.training.data_plugin)
    name = tokenizer or config.model.tokenizer_source()[0]
    vocab = data.build_tokenizer(name).vocab_size
    return Source(
        spec=spec,
        args=model_args_for(spec, config, vocab),
        read_weights=lambda: load_consolidated(step, "model.", progress=False),
        tokenizer=name,
        data_plugin=config.training.data_plugin,
        where=str(step),
    )


def hf_source(folder: Path, model: str, flavor: str | None, tokenizer: str | None) -> Source:
    from titan_ckpt import import_hf
    from titan_core import plugins, resolve

    spec = resolve(plugins.MODELS, model)
    hf = json.loads((folder / "config.json").read_text())
    candidates = [flavor] if flavor else list(spec.flavors)
    for name in candidates:
        if name not in spec.flavors:
            raise GenerateError(
                f"{spec.name} has no flavor {name!r}; it has {', '.join(spec.flavors)}"
            )
        args = spec.flavors[name]
        fields = {f.name for f in dataclasses.fields(args)}
        changes = {
            key: hf[hf_key]
            for key, hf_key in (
                ("vocab_size", "vocab_size"),
                ("max_seq_len", "max_position_embeddings"),
            )
            if key in fields and hf_key in hf
        }
        args = dataclasses.replace(args, **changes)
        built = spec.hf_adapter(args).hf_config()
        if all(built.get(k) == hf.get(k) for k in STRUCTURE if k in hf):
            break
    else:
        shape = ", ".join(f"{k} {hf.get(k)}" for k in STRUCTURE if k in hf)
        raise GenerateError(
            f"{folder}/config.json ({shape}) matches no flavor of {spec.name}"
            + (f" ({flavor} differs)" if flavor else "")
            + "\nname the model family with --model, or the flavor with --flavor"
        )
    if tokenizer is None:
        tokenizer = str(folder)  # a folder holding tokenizer.model
    return Source(
        spec=spec,
        args=args,
        read_weights=lambda: import_hf(folder, spec.hf_adapter(args), progress=False),
        tokenizer=tokenizer,
        data_plugin="titan",
        where=str(folder),
    )


def find_source(a: argparse.Namespace) -> Source:
    path = Path(a.source)
    if not path.exists():
        raise GenerateError(f"{path} does not exist")
    step = find_checkpoint(path)
    if step is not None:
        return dcp_source(step, a.tokenizer)
    if (path / "config.json").is_file():
        return hf_source(path, a.model, a.flavor, a.tokenizer)
    raise GenerateError(
        f"{path} is neither a DCP checkpoint (a step-N folder, a folder of them, or a run's dump "
        "folder) nor a Hugging Face folder (config.json and safetensors)"
    )


def build_generator_model(source: Source, device, dtype, tp_mesh=None):
    """The model on `device` in `dtype` with the source's weights, split over `tp_mesh` when
    it has more than one rank."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.device("meta"):
        model = source.spec.build(source.args)
    if tp_mesh is not None and tp_mesh.size() > 1:
        from titan_parallel import apply_tp

        apply_tp(model, tp_mesh, model.tp_plan(), sequence_parallel=False, loss_parallel=False)
    model.to_empty(device=device)
    weights = source.read_weights()
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise GenerateError(f"{source.where} lacks weights for {', '.join(missing[:5])}")
    with torch.no_grad():
        for name, param in expected.items():
            full = weights[name].to(device=device, dtype=param.dtype)
            if isinstance(param, DTensor):
                # Every rank holds the full tensor: take this rank's shard without sending it.
                full = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
            param.copy_(full)
    model.to(dtype)
    model.init_buffers(device)  # the rotary table stays float32
    return model.eval()


def run(a: argparse.Namespace) -> int:
    import torch

    from titan_core import init_distributed, plugins, resolve, resolve_device_type
    from titan_core.distributed import destroy_distributed
    from titan_models import Sampling, generate

    sampling = Sampling(a.temperature, a.top_k, a.top_p)
    try:
        sampling.validate()
    except ValueError as e:
        raise GenerateError(str(e)) from None
    source = find_source(a)
    tokenizer = resolve(plugins.DATA, source.data_plugin).build_tokenizer(source.tokenizer)
    prompt = tokenizer.encode(a.prompt, bos=True, eos=False)
    limit = getattr(source.args, "max_seq_len", None)
    if limit is not None and len(prompt) + a.max_new_tokens > limit:
        raise GenerateError(
            f"the prompt ({len(prompt)} tokens) and --max-new-tokens {a.max_new_tokens} need "
            f"{len(prompt) + a.max_new_tokens} positions, but the model has {limit}\n"
            f"use --max-new-tokens {max(limit - len(prompt), 0)} or less"
        )
    info = init_distributed(resolve_device_type(a.device))
    try:
        mesh = None
        if info.world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("tp",))
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
        model = build_generator_model(source, info.device, dtype, mesh)
        generator = torch.Generator(device=info.device).manual_seed(a.seed)
        new = generate(
            model,
            torch.tensor([prompt] * a.samples, device=info.device),
            a.max_new_tokens,
            sampling,
            stop_tokens={tokenizer.eos_id} if a.stop_at_eos else frozenset(),
            vocab_limit=tokenizer.vocab_size,
            generator=generator,
        )
        if info.rank == 0:
            for row in new.tolist():
                if a.stop_at_eos and tokenizer.eos_id in row:
                    row = row[: row.index(tokenizer.eos_id)]
                print(a.prompt + tokenizer.decode(row))
                if a.samples > 1:
                    print("-" * 40)
    finally:
        destroy_distributed()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("titan-generate", __doc__)
    parser.add_argument(
        "source",
        help="a DCP checkpoint, checkpoint folder or dump folder; or a Hugging Face folder",
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: from the start)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=100, help="tokens to generate at most"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sample"
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely tokens"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample among the most likely tokens that make up p",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument(
        "--samples", type=int, default=1, help="continuations to generate (a batch)"
    )
    parser.add_argument(
        "--no-stop",
        dest="stop_at_eos",
        action="store_false",
        help="do not stop at the end-of-text token",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer name or path (default: the run's; for a Hugging Face folder, the folder)",
    )
    parser.add_argument(
        "--model",
        default="llama3",
        help="model family of a Hugging Face folder (titan.models name)",
    )
    parser.add_argument(
        "--flavor",
        default=None,
        help="flavor of a Hugging Face folder (default: the one whose shapes match)",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype"
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to compute"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.max_new_tokens < 1 or a.samples < 1:
        print(
            "titan-generate: error: --max-new-tokens and --samples take 1 or more", file=sys.stderr
        )
        return 2
    errors = (GenerateError, FileNotFoundError, ValueError, tomllib.TOMLDecodeError)
    return run_tool("titan-generate", run, a, errors, 2)


if __name__ == "__main__":
    sys.exit(main())
