"""Where documents come from: a dataset name and an optional local path, turned into a
Hugging Face `IterableDataset` with a text column.

Forms of `dataset` (with `dataset_path`):
- `pydocs`: the embedded corpus's training split (see `titan_data.pydocs`); no path.
- `pydocs_validation`: its held-out split, disjoint from `pydocs`; no path.
- `c4`: `allenai/c4`, config `en`, split `train`, streamed from the hub; with `dataset_path`
  the local copy at that path is read instead (a clone of the hub repository or a folder of
  its json.gz files), through the same `load_dataset` call.
- `owner/name`: any hub dataset, split `train`, streamed; `dataset_path` again points at a
  local copy.
- a local file, folder or glob of jsonl/json, parquet or plain-text files, or one of the
  format names `jsonl`, `json`, `parquet`, `text` with the files in `dataset_path`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

import datasets

from titan_data.pydocs import pydocs_documents


@dataclass(frozen=True)
class HubDataset:
    path: str
    config: str | None
    split: str
    text_field: str


HUB_DATASETS = {"c4": HubDataset("allenai/c4", "en", "train", "text")}
"""Short names for hub datasets, as torchtitan users know them."""

EMBEDDED = {"pydocs": "train", "pydocs_validation": "validation"}
"""Embedded dataset names and the split of the pydocs corpus each reads."""
FORMAT_NAMES = {"jsonl": "json", "json": "json", "parquet": "parquet", "text": "text"}
_COMPRESSIONS = ("", ".gz", ".bz2", ".xz", ".zst")
EXTENSIONS = {
    **{f"{ext}{c}": "json" for ext in (".jsonl", ".json", ".ndjson") for c in _COMPRESSIONS},
    ".parquet": "parquet",
    **{f"{ext}{c}": "text" for ext in (".txt", ".text") for c in _COMPRESSIONS},
}
ACCEPTED = (
    f"known names: {', '.join([*EMBEDDED, *HUB_DATASETS])}; a hub dataset as owner/name; "
    "a local file, folder or glob of "
    f"{'/'.join(sorted({e.split('.')[1] for e in EXTENSIONS}))} files (optionally compressed); "
    f"or a format name ({', '.join(FORMAT_NAMES)}) with the files in dataset_path"
)


@dataclass(frozen=True)
class Source:
    """A dataset ready to stream: `build()` returns a fresh, unsharded `IterableDataset`
    (a fresh one per epoch, so no iteration state leaks between epochs or loaders)."""

    name: str
    description: str
    text_field: str
    build: Callable[[], datasets.IterableDataset]


def _format_of(path: str) -> str | None:
    lower = path.lower()
    for ext, fmt in EXTENSIONS.items():
        if lower.endswith(ext):
            return fmt
    return None


def _local_files(spec: str) -> list[str]:
    """The data files named by a file, a folder (searched recursively) or a glob, sorted."""
    spec = os.path.expanduser(spec)
    if os.path.isfile(spec):
        return [spec]
    if os.path.isdir(spec):
        found = sorted(
            os.path.join(root, f)
            for root, dirs, files in os.walk(spec)
            for f in files
            if _format_of(f) and not f.startswith(".")
        )
        if not found:
            raise FileNotFoundError(
                f"dataset folder {spec} holds no data files; accepted extensions: "
                f"{', '.join(EXTENSIONS)}"
            )
        return found
    if glob.has_magic(spec):
        found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not found:
            raise FileNotFoundError(f"dataset glob {spec!r} matches no files")
        return found
    raise FileNotFoundError(f"dataset path {spec} does not exist")


def _local_source(name: str, spec: str, text_field: str, fmt: str | None = None) -> Source:
    files = _local_files(spec)
    formats = {_format_of(f) for f in files}
    if fmt is None:
        if None in formats:
            unknown = [f for f in files if _format_of(f) is None][:3]
            raise ValueError(
                f"dataset {name}: cannot tell the format of {', '.join(unknown)}; accepted "
                f"extensions: {', '.join(EXTENSIONS)} (or name the format: "
                f"--training.dataset jsonl --training.dataset_path {spec})"
            )
        if len(formats) > 1:
            raise ValueError(
                f"dataset {name}: mixes {' and '.join(sorted(formats))} files; "
                "point it at files of one format"
            )
        (fmt,) = formats
    kwargs = {"sample_by": "document"} if fmt == "text" else {}
    # A plain-text file is one document; its text lands in the column "text".
    field = "text" if fmt == "text" else text_field

    def build() -> datasets.IterableDataset:
        return datasets.load_dataset(fmt, data_files=files, split="train", streaming=True, **kwargs)

    kind = {"json": "jsonl", "parquet": "parquet", "text": "text"}[fmt]
    plural = "s" if len(files) != 1 else ""
    return Source(name, f"{len(files)} {kind} file{plural} ({spec})", field, build)


def _hub_source(name: str, hub: HubDataset, local_copy: str | None) -> Source:
    if local_copy is not None:
        local_copy = os.path.expanduser(local_copy)
        if not os.path.exists(local_copy):
            raise FileNotFoundError(
                f"dataset_path {local_copy} (local copy of {name}) does not exist"
            )
    location = local_copy or hub.path

    def build() -> datasets.IterableDataset:
        config = hub.config
        if local_copy is not None and config is not None:
            # A folder of bare data files has only the "default" config; a clone of the
            # hub repository declares the real ones in its README.
            names = datasets.get_dataset_config_names(local_copy)
            config = config if config in names else None
        return datasets.load_dataset(location, config, split=hub.split, streaming=True)

    what = f"{hub.path}" + (f" ({hub.config})" if hub.config else "") + f" split {hub.split}"
    where = f"local copy {local_copy}" if local_copy else "Hugging Face hub, streaming"
    return Source(name, f"{what} from {where}", hub.text_field, build)


def _pydocs_source(name: str) -> Source:
    split = EMBEDDED[name]

    def build() -> datasets.IterableDataset:
        table = datasets.Dataset.from_dict({"text": list(pydocs_documents(split))})
        return table.to_iterable_dataset(num_shards=1)

    return Source(name, f"embedded Python documentation, {split} split", "text", build)


def _looks_like_path(dataset: str) -> bool:
    return (
        dataset.startswith(("/", ".", "~"))
        or glob.has_magic(dataset)
        or _format_of(dataset) is not None
        or os.path.exists(os.path.expanduser(dataset))
    )


def load_source(dataset: str, dataset_path: str | None = None, text_field: str = "text") -> Source:
    """Resolve `dataset` (+ `dataset_path`) to a `Source`; the module docstring lists the
    forms. Raises ValueError or FileNotFoundError saying what was given and what is accepted."""
    if dataset in EMBEDDED:
        if dataset_path is not None:
            raise ValueError(
                f"dataset {dataset} is embedded and takes no dataset_path (got {dataset_path}); "
                "to read local files, set dataset to their path or format"
            )
        return _pydocs_source(dataset)
    if dataset in FORMAT_NAMES:
        if dataset_path is None:
            raise ValueError(
                f"dataset {dataset} names a file format; set dataset_path to a file, folder or "
                "glob of such files"
            )
        return _local_source(dataset, dataset_path, text_field, FORMAT_NAMES[dataset])
    if dataset in HUB_DATASETS:
        return _hub_source(dataset, HUB_DATASETS[dataset], dataset_path)
    if _looks_like_path(dataset):
        if dataset_path is not None:
            raise ValueError(
                f"dataset {dataset} is a path, so dataset_path ({dataset_path}) would be ignored; "
                "set only one of them"
            )
        return _local_source(dataset, dataset, text_field)
    if dataset.count("/") == 1 and all(dataset.split("/")):
        return _hub_source(dataset, HubDataset(dataset, None, "train", text_field), dataset_path)
    raise ValueError(f"unknown dataset {dataset!r}; {ACCEPTED}")


def missing_field_message(source: Source, row: dict) -> str:
    found = ", ".join(map(repr, row)) or "none"
    return (
        f"dataset {source.name} ({source.description}) has no field {source.text_field!r}; "
        f"fields found: {found}; set text_field to the field that holds the text"
    )


def check_source(source: Source) -> None:
    """Read the first document, so that an empty dataset or a wrong text field fails when the
    loader is built rather than at the first training step."""
    try:
        first = next(iter(source.build()), None)
    except StopIteration:  # `datasets` lets this escape when a json file is empty
        first = None
    if first is None:
        raise ValueError(f"dataset {source.name} ({source.description}) is empty")
    if source.text_field not in first:
        raise ValueError(missing_field_message(source, first))
