"""`titan-ckpt`: inspect and verify checkpoint folders, and convert between DCP, Hugging Face
safetensors and single torch files.

    titan-ckpt list OUTPUTS/checkpoint
    titan-ckpt verify OUTPUTS/checkpoint [--values]
    titan-ckpt convert dcp-to-hf   OUTPUTS/checkpoint/step-1000 hf_out --model llama3 --flavor 8B
    titan-ckpt convert hf-to-dcp   hf_in  step-0 --model llama3 --flavor 8B
    titan-ckpt convert dcp-to-torch OUTPUTS/checkpoint/step-1000 model.pt --model-only

`dcp-to-hf` and `hf-to-dcp` also run on several processes, each holding 1/N of every tensor
and reading and writing only those parts of the files:

    torchrun --nproc-per-node 8 --no-python titan-ckpt convert dcp-to-hf step-1000 hf_out

A checkpoint or folder may be a URL (s3://bucket/run/checkpoint, any fsspec storage; for S3,
`pip install 'titan-llm-ckpt[s3]'`, and AWS_ENDPOINT_URL for an S3-compatible server).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_ckpt import layout
from titan_ckpt.convert import dcp_to_hf, hf_to_dcp
from titan_ckpt.dcp_io import (
    checkpoint_keys,
    checkpoint_problems,
    dcp_to_torch_file,
    value_problems,
)
from titan_ckpt.hf import DTYPES
from titan_ckpt.hf_check import check_safetensors_folder
from titan_ckpt.integrity import LEGACY_ALGORITHM
from titan_ckpt.safe_read import UnsafeCheckpointError
from titan_ckpt.storage import StorageUnavailableError, as_path, is_store_error
from titan_core.messages import first_line
from titan_core.plugins import DATA, MODELS, PluginError, resolve
from titan_core.protocols import HFAdapter, ModelSpec, build_hf_adapter
from titan_core.versions import add_version_flag


class CliError(Exception):
    pass


def build_adapter(model: str, flavor: str | None, overrides: Sequence[str] = ()) -> HFAdapter:
    """The HF adapter of a registered model family (name or `module:attr`) for one flavor, with
    `key=value` overrides of the flavor's arguments (e.g. `vocab_size=128256`)."""
    spec, args = _flavor_args(model, flavor, overrides)
    return spec.hf_adapter(args)


def _flavor_args(model: str, flavor: str | None, overrides: Sequence[str]) -> tuple[ModelSpec, Any]:
    try:
        spec = resolve(MODELS, model)
    except PluginError as e:
        raise CliError(str(e)) from None
    if spec.hf_adapter is None:
        raise CliError(f"model {spec.name!r} has no Hugging Face adapter")
    flavors = dict(spec.flavors)
    if flavor is None:
        raise CliError(f"name a flavor with --flavor; {spec.name} has: {', '.join(flavors)}")
    if flavor not in flavors:
        raise CliError(
            f"model {spec.name!r} has no flavor {flavor!r}; it has: {', '.join(flavors)}"
        )
    args = flavors[flavor]
    if overrides:
        args = dataclasses.replace(args, **dict(_parse_override(o) for o in overrides))
    return spec, args


def _checkpoint_args(spec: ModelSpec, args: Any, ckpt: Path, given: set[str]) -> Any:
    """The flavor's arguments as the checkpoint's model was built: the vocabulary size of its
    tensors (a trainer pads the tokenizer's vocabulary, so it is not the flavor's), unless
    given with --set. The context length (`max_position_embeddings`) stays the flavor's own,
    or the run's sequence length where that is longer: a run trained on short samples does
    not shorten the model's positions."""
    fields = {f.name for f in dataclasses.fields(args)}
    changes: dict[str, Any] = {}
    seq_len = _saved_config(ckpt).get("training", {}).get("seq_len")
    if "max_seq_len" in fields and "max_seq_len" not in given and isinstance(seq_len, int):
        changes["max_seq_len"] = max(seq_len, args.max_seq_len)
    if "vocab_size" in fields and "vocab_size" not in given:
        vocab = _vocab_of_tensors(spec, args, checkpoint_keys(ckpt))
        if vocab is not None:
            changes["vocab_size"] = vocab
    return dataclasses.replace(args, **changes) if changes else args


def _vocab_of_tensors(spec: ModelSpec, args: Any, keys: Mapping[str, Any]) -> int | None:
    """The vocabulary size the saved tensors have: build the flavor on the meta device and
    find the dimensions that are the flavor's vocab_size there and differ in the checkpoint."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in spec.build(args).state_dict().items()}
    found = set()
    for name, shape in shapes.items():
        meta = keys.get(f"model.{name}")
        saved = tuple(meta.size) if meta is not None and hasattr(meta, "size") else None
        if saved is None or len(saved) != len(shape):
            continue
        found |= {s for f, s in zip(shape, saved) if f == args.vocab_size and s != f}
    if len(found) > 1:
        raise CliError(
            f"the checkpoint's tensors disagree on the vocabulary size ({sorted(found)}); "
            "pass --set vocab_size=N"
        )
    return found.pop() if found else None


def _parse_override(text: str) -> tuple[str, Any]:
    key, eq, value = text.partition("=")
    if not eq:
        raise CliError(f"--set {text!r}: write key=value, e.g. --set vocab_size=2048")
    try:
        return key.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return key.strip(), value.strip()


def _saved_config(ckpt: Path) -> dict[str, Any]:
    """The resolved config saved in the checkpoint ({} if it has none)."""
    path = ckpt / layout.CONFIG_FILE
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def _token_ids(ckpt: Path) -> tuple[int | None, int | None]:
    """BOS and EOS ids of the tokenizer the run trained with, for config.json: its saved config
    names the tokenizer and the data plugin that builds it (found by name, as the trainer
    finds it). (None, None), with a note, when it cannot be built here."""
    saved = _saved_config(ckpt)
    if not saved:
        return None, None
    model = saved.get("model", {})
    # The trainer's rule: tokenizer_path unless it is left at `byte` and hf_assets_path is set.
    name = model.get("tokenizer_path", "byte")
    if name == "byte" and model.get("hf_assets_path"):
        name = model["hf_assets_path"]
    plugin = saved.get("training", {}).get("data_plugin", "titan")
    try:
        tokenizer = resolve(DATA, plugin).build_tokenizer(name)
    except Exception as e:  # noqa: BLE001 - a tokenizer file not on this machine: say so
        print(
            f"titan-ckpt: note: the run's tokenizer {name!r} cannot be loaded here"
            f" ({first_line(e)}); config.json gets"
            " no bos_token_id/eos_token_id",
            file=sys.stderr,
        )
        return None, None
    return tokenizer.bos_id, tokenizer.eos_id


def _model_from_config(ckpt: Path) -> tuple[str | None, str | None]:
    """[model] name and flavor from the resolved config saved in the checkpoint, if any."""
    model = _saved_config(ckpt).get("model", {})
    return model.get("name"), model.get("flavor")


def _dcp_to_hf(a: argparse.Namespace) -> None:
    ckpt = as_path(a.checkpoint)
    _require_checkpoint(ckpt)
    saved_name, saved_flavor = _model_from_config(ckpt)
    name = a.model or saved_name
    if name is None:
        raise CliError(
            f"{ckpt} has no config.toml naming the model; pass --model NAME --flavor FLAVOR"
        )
    spec, args = _flavor_args(name, a.flavor or saved_flavor, a.set)
    given = {_parse_override(o)[0] for o in a.set}
    bos, eos = _token_ids(ckpt)
    adapter = build_hf_adapter(
        spec, _checkpoint_args(spec, args, ckpt, given), bos_token_id=bos, eos_token_id=eos
    )
    files = dcp_to_hf(
        ckpt,
        a.out,
        adapter,
        dtype=a.dtype,
        max_shard_bytes=int(a.max_shard_gb * 2**30),
        progress=_rank() == 0,
    )
    _say(f"wrote {len(files)} files to {a.out}")


def _hf_to_dcp(a: argparse.Namespace) -> None:
    adapter = build_adapter(a.model, a.flavor, a.set)
    out = hf_to_dcp(a.hf_folder, a.out, adapter, dtype=a.dtype, step=a.step, progress=_rank() == 0)
    _say(
        f"wrote model-only checkpoint {out} (use it as [checkpoint] initial_load_path, or as step-{a.step} of a run)"
    )


def _dcp_to_torch(a: argparse.Namespace) -> None:
    ckpt = as_path(a.checkpoint)
    _require_checkpoint(ckpt)
    dcp_to_torch_file(ckpt, a.out, model_only=a.model_only)
    print(f"wrote {a.out} (load with torch.load(path, weights_only=True))")


def _list(a: argparse.Namespace) -> None:
    found = layout.committed(a.folder)
    unmarked = layout.unmarked(a.folder)
    if not found and not unmarked:
        print(f"no complete checkpoints in {a.folder}")
    for step, path in sorted(found + unmarked):
        if (step, path) in unmarked:
            print(
                f"step {step:>8}  {'no marker':<10}  {'':>10}  {path}: not a checkpoint ({layout.COMMIT_FILE} is missing)"
            )
            continue
        try:
            record = layout.read_commit(path)
        except (OSError, ValueError) as e:
            print(f"step {step:>8}  {'unreadable':<10}  {'':>10}  {path}: {e}")
            continue
        kind = "model only" if record.get("model_only") else "full"
        print(f"step {step:>8}  {kind:<10}  world {record.get('world_size', '?'):>4}  {path}")


def _verify(a: argparse.Namespace) -> int:
    """Check checkpoints offline, as a resume does, every byte: exit 1 if any fails."""
    target = as_path(a.path)
    unmarked: list[Path] = []
    if (target / layout.COMMIT_FILE).exists():
        paths = [target]
    elif (target / ".metadata").exists():
        paths, unmarked = [], [target]
    else:
        paths = [p for _, p in layout.committed(target)]
        unmarked = [p for _, p in layout.unmarked(target)]
    if not paths and not unmarked:
        raise CliError(f"{target} is neither a checkpoint nor a folder of checkpoints")
    failed = 0
    for path in sorted(paths + unmarked, key=_step_order):
        if path in unmarked:
            problems = [layout.UNMARKED.format(marker=layout.COMMIT_FILE)]
        else:
            problems = checkpoint_problems(path)
        if not problems and a.values:
            problems = value_problems(path, progress=False)
        if problems:
            failed += 1
            print(f"{path}: FAILED: " + "; ".join(problems))
            continue
        files = layout.read_commit(path).get("files")
        if files is None:
            print(
                f"{path}: not verified: it records no checksums (saved by titan-ckpt 0.1.0 or another tool)"
                + ("; values plausible" if a.values else "")
            )
            continue
        size = sum(int(entry["bytes"]) for entry in files.values())
        algorithms = sorted({entry.get("algorithm", LEGACY_ALGORITHM) for entry in files.values()})
        checked = " and values plausible" if a.values else ""
        print(
            f"{path}: OK ({len(files)} files, {size / 2**20:,.1f} MiB,"
            f" {'/'.join(algorithms)} checksums{checked})"
        )
    if failed:
        total = len(paths) + len(unmarked)
        print(f"{failed} of {total} checkpoints failed verification", file=sys.stderr)
    return 1 if failed else 0


def _step_order(path: Path) -> tuple[int, str]:
    name = path.name
    return (int(name[5:]), name) if name.startswith("step-") and name[5:].isdigit() else (-1, name)


def _require_checkpoint(path: Path) -> None:
    """A complete checkpoint whose files pass their checksums (see `verify`); under torchrun
    each rank checks its share of the files."""
    if not layout.is_complete(path):
        raise CliError(
            f"{path} is not a complete checkpoint folder (no {layout.COMMIT_FILE} or .metadata)"
        )
    problems = checkpoint_problems(path, _rank(), _world())
    if _world() > 1:
        parts: list[list[str] | None] = [None] * _world()
        dist.all_gather_object(parts, problems)
        problems = [p for part in parts for p in part or []]
    if problems:
        raise CliError(f"{path} failed verification: " + "; ".join(problems))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titan-ckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_version_flag(parser, "titan-ckpt", "titan-llm-ckpt")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="list the complete checkpoints in a folder")
    ls.add_argument("folder")
    ls.set_defaults(func=_list)
    verify = sub.add_parser(
        "verify",
        help="check checkpoints against the checksums in their commit markers, as a resume does",
    )
    verify.add_argument("path", help="a checkpoint (step-N) or a folder of checkpoints")
    verify.add_argument(
        "--values",
        action="store_true",
        help="also read every model and optimizer tensor: none may hold NaN or inf, no second"
        " moment (exp_avg_sq, ...) may be negative, and optimizer step counts must be whole"
        " numbers up to the checkpoint's step",
    )
    verify.set_defaults(func=_verify)
    convert = sub.add_parser("convert", help="convert between formats").add_subparsers(
        dest="kind", required=True
    )

    def model_args(p: argparse.ArgumentParser, required: bool) -> None:
        p.add_argument(
            "--model",
            required=required,
            help="titan.models name or module:attr (default: from config.toml)",
        )
        p.add_argument(
            "--flavor", help="model flavor, e.g. debugmodel or 8B (default: from config.toml)"
        )
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a flavor argument",
        )

    to_hf = convert.add_parser("dcp-to-hf", help="DCP checkpoint -> HF safetensors + config.json")
    to_hf.add_argument("checkpoint")
    to_hf.add_argument("out")
    model_args(to_hf, required=False)
    to_hf.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast floating weights (default: as saved)",
    )
    to_hf.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="split safetensors files above this size"
    )
    to_hf.set_defaults(func=_dcp_to_hf)

    from_hf = convert.add_parser("hf-to-dcp", help="HF safetensors -> model-only DCP checkpoint")
    from_hf.add_argument("hf_folder")
    from_hf.add_argument("out")
    model_args(from_hf, required=True)
    from_hf.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast floating weights"
    )
    from_hf.add_argument("--step", type=int, default=0, help="step recorded in the checkpoint")
    from_hf.set_defaults(func=_hf_to_dcp)

    to_torch = convert.add_parser("dcp-to-torch", help="DCP checkpoint -> one torch.save file")
    to_torch.add_argument("checkpoint")
    to_torch.add_argument("out")
    to_torch.add_argument("--model-only", action="store_true", help="only the model weights")
    to_torch.set_defaults(func=_dcp_to_torch)
    return parser


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if _world() > 1 else 0


def _say(text: str) -> None:
    if _rank() == 0:
        print(text)


def _process_group(args: argparse.Namespace) -> bool:
    """Under torchrun (WORLD_SIZE > 1) the conversions to and from Hugging Face run on every
    rank, over gloo: start its process group. Other commands are one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    if getattr(args, "kind", None) not in ("dcp-to-hf", "hf-to-dcp"):
        raise CliError(
            f"titan-ckpt {args.command} {getattr(args, 'kind', '') or ''}".rstrip()
            + " runs in one process; run it without torchrun (only convert dcp-to-hf and"
            " hf-to-dcp run on several ranks)"
        )
    dist.init_process_group("gloo")
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = False
    try:
        if getattr(args, "kind", None) == "hf-to-dcp":  # before any rank starts a group
            check_safetensors_folder(args.hf_folder)
        started = _process_group(args)
        code = args.func(args)
    except (
        CliError,
        FileNotFoundError,
        ValueError,
        UnsafeCheckpointError,
        StorageUnavailableError,
    ) as e:
        if int(os.environ.get("RANK", "0")) == 0:  # one message under torchrun, not one a rank
            print(f"titan-ckpt: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not is_store_error(e):
            raise
        print(
            f"titan-ckpt: error: the storage refused: {type(e).__name__}: {e}\ncheck the URL,"
            " the credentials and the endpoint (AWS_ENDPOINT_URL for an S3-compatible server)",
            file=sys.stderr,
        )
        return 2
    finally:
        if started:
            dist.destroy_process_group()
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
