"""Where documents come from: a dataset name and an optional local path, turned into a `Source`
whose readers give the documents of one packing stream (see `titan_data.readers`), or into the
`TokenShards` of a folder that `titan-data tokenize` wrote.

Forms of `dataset` (with `dataset_path`):
- `pydocs`: the embedded corpus's training split (see `titan_data.pydocs`); no path.
- `pydocs_validation`: its held-out split, disjoint from `pydocs`; no path.
- `c4`: `allenai/c4`, config `en`, split `train`, streamed from the hub; with `dataset_path`
  the local copy at that path is read instead (a clone of the hub repository or a folder of
  its json.gz files), through the same `load_dataset` call. `c4_validation`: its validation
  split (torchtitan's names).
- `c4_test`: torchtitan's sample of C4 in its repository, the folder `tests/assets/c4_test`
  relative to the working directory (or `dataset_path`), as torchtitan reads it.
- `owner/name`: any hub dataset, split `train`, streamed; `dataset_path` again points at a
  local copy.
- a local file, folder or glob of jsonl/json, parquet or plain-text files, or one of the
  format names `jsonl`, `json`, `parquet`, `text` with the files in `dataset_path`.
- a folder written by `titan-data tokenize` (it holds `titan-tokens.json`): token ids, read
  by memory map.

Local jsonl/json and text files are read line by line here rather than by pyarrow, so that a
row that is not a text document (malformed JSON, invalid UTF-8, a missing or non-string text
field) is a row of its own, named by file and line, which the loader can refuse or skip; and
so that all of them can be found before training (`scan_bad_rows`).
"""

from __future__ import annotations

import difflib
import functools
import glob
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_data.errors import DataError, MissingTextField
from titan_data.pydocs import pydocs_documents
from titan_data.readers import DatasetsReader, LineReader, ListReader, Reader, ReadError
from titan_data.token_shards import TokenShards, is_token_folder

if TYPE_CHECKING:
    import datasets


@dataclass(frozen=True)
class HubDataset:
    path: str
    config: str | None
    split: str
    text_field: str


HUB_DATASETS = {
    "c4": HubDataset("allenai/c4", "en", "train", "text"),
    "c4_validation": HubDataset("allenai/c4", "en", "validation", "text"),
}
"""Short names for hub datasets, as torchtitan users know them."""

TORCHTITAN_FOLDERS = {"c4_test": "tests/assets/c4_test"}
"""torchtitan's names for sample data inside its own repository: a folder relative to the
working directory (a torchtitan checkout), as torchtitan reads it; `dataset_path` points
elsewhere."""

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
    f"known names: {', '.join([*EMBEDDED, *HUB_DATASETS, *TORCHTITAN_FOLDERS])}; a hub"
    " dataset as owner/name; "
    "a local file, folder or glob of "
    f"{'/'.join(sorted({e.split('.')[1] for e in EXTENSIONS}))} files (optionally compressed); "
    f"a format name ({', '.join(FORMAT_NAMES)}) with the files in dataset_path; a folder"
    " written by `titan-data tokenize`; or a weighted mixture DATASET[=PATH][:WEIGHT],..."
)


@dataclass(frozen=True)
class Source:
    """A dataset of text documents, ready to read: `open(slot, slots)` returns a reader of the
    documents of packing stream `slot` of `slots` (see `titan_data.readers`; `open(0, 1)`
    reads every document once). `files` lists the local files read line by line (those
    `scan_bad_rows` checks); `build()`, for sources that Hugging Face `datasets` reads (hub
    datasets, parquet), returns a fresh, unsharded `IterableDataset`."""

    name: str
    description: str
    text_field: str
    open: Callable[[int, int], Reader]
    files: tuple[str, ...] = ()
    line_format: str | None = None
    """`json` or `text` for local files read line by line."""
    build: Callable[[], datasets.IterableDataset] | None = None
    hub_repo: str | None = None
    """The Hugging Face hub repository streamed (None for local data and local copies)."""


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
                f"{', '.join(EXTENSIONS)} (or tokens made by `titan-data tokenize`)"
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
    kind = {"json": "jsonl", "parquet": "parquet", "text": "text"}[fmt]
    plural = "s" if len(files) != 1 else ""
    description = f"{len(files)} {kind} file{plural} ({spec})"
    if fmt == "parquet":

        def build() -> datasets.IterableDataset:
            import datasets  # noqa: PLC0415 - see _hub_source

            return datasets.load_dataset(fmt, data_files=files, split="train", streaming=True)

        return _datasets_source(name, description, text_field, build)

    def open_lines(slot: int, slots: int) -> LineReader:
        return LineReader(files, fmt, text_field, slot, slots)

    return Source(name, description, text_field, open_lines, tuple(files), fmt)


def _datasets_source(
    name: str,
    description: str,
    text_field: str,
    build: Callable[[], datasets.IterableDataset],
    hub_repo: str | None = None,
) -> Source:
    def open_rows(slot: int, slots: int) -> DatasetsReader:
        return DatasetsReader(
            build, text_field, slot, slots, describe=lambda: f"dataset {name} ({description})"
        )

    return Source(name, description, text_field, open_rows, build=build, hub_repo=hub_repo)


def scan_bad_rows(source: Source) -> tuple[int, str | None]:
    """Read every row of `source`'s local files once: (rows read, the first bad row or None).
    Remembered per file version, so that loaders built again (validation) do not re-read."""
    if not source.files:
        return 0, None
    stamps = tuple((f, os.path.getsize(f), os.path.getmtime(f)) for f in source.files)
    return _scan(stamps, source.text_field, source.line_format)


@functools.lru_cache(maxsize=32)
def _scan(stamps: tuple, text_field: str, fmt: str) -> tuple[int, str | None]:
    rows = 0
    reader = LineReader([f for f, _, _ in stamps], fmt, text_field, 0, 1)
    while (row := reader.next()) is not None:
        rows += 1
        if row.bad:
            return rows, row.bad
    return rows, None


def _hub_source(name: str, hub: HubDataset, local_copy: str | None) -> Source:
    if local_copy is not None:
        local_copy = os.path.expanduser(local_copy)
        if not os.path.exists(local_copy):
            raise FileNotFoundError(
                f"dataset_path {local_copy} (local copy of {name}) does not exist"
            )
    location = local_copy or hub.path

    def build() -> datasets.IterableDataset:
        # Imported here: `datasets` takes seconds to import, and sources that do not use it
        # (the embedded corpus, local jsonl/text, tokens) start without it.
        import datasets  # noqa: PLC0415

        config = hub.config
        if local_copy is not None and config is not None:
            # A folder of bare data files has only the "default" config; a clone of the
            # hub repository declares the real ones in its README.
            names = datasets.get_dataset_config_names(local_copy)
            config = config if config in names else None
        return datasets.load_dataset(location, config, split=hub.split, streaming=True)

    what = f"{hub.path}" + (f" ({hub.config})" if hub.config else "") + f" split {hub.split}"
    where = f"local copy {local_copy}" if local_copy else "Hugging Face hub, streaming"
    repo = None if local_copy else hub.path
    return _datasets_source(name, f"{what} from {where}", hub.text_field, build, repo)


def _torchtitan_folder(name: str, dataset_path: str | None, text_field: str) -> Source:
    folder = dataset_path or TORCHTITAN_FOLDERS[name]
    if not os.path.exists(os.path.expanduser(folder)):
        where = (
            f"read from dataset_path = {folder}, which does not exist"
            if dataset_path
            else f"read from {folder} in a torchtitan checkout, and {os.getcwd()} has no such"
            " folder"
        )
        raise FileNotFoundError(
            f"dataset {name} (torchtitan's sample of C4, kept in its repository) is {where}\n"
            "run from a torchtitan checkout, set dataset_path to that folder, or train on"
            " pydocs (embedded) or c4 (the hub)"
        )
    return _local_source(name, folder, text_field)


def _pydocs_source(name: str) -> Source:
    split = EMBEDDED[name]

    def open_list(slot: int, slots: int) -> ListReader:
        return ListReader(pydocs_documents(split), slot, slots)

    return Source(name, f"embedded Python documentation, {split} split", "text", open_list)


def _looks_like_path(dataset: str) -> bool:
    return (
        dataset.startswith(("/", ".", "~"))
        or glob.has_magic(dataset)
        or _format_of(dataset) is not None
        or os.path.exists(os.path.expanduser(dataset))
    )


def load_source(
    dataset: str, dataset_path: str | None = None, text_field: str = "text"
) -> Source | TokenShards:
    """Resolve `dataset` (+ `dataset_path`) to a `Source`, or to `TokenShards` for a folder of
    tokens; the module docstring lists the forms. Raises ValueError or FileNotFoundError saying
    what was given and what is accepted."""
    if dataset_path is not None and is_token_folder(dataset_path):
        raise ValueError(
            f"dataset_path {dataset_path} is a folder of tokens; name it as the dataset itself"
            f" (dataset = {dataset_path!r}, no dataset_path)"
        )
    if is_token_folder(dataset):
        if dataset_path is not None:
            raise ValueError(
                f"dataset {dataset} is a folder of tokens, so dataset_path ({dataset_path})"
                " would be ignored; set only one of them"
            )
        return TokenShards(dataset)
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
    if dataset in TORCHTITAN_FOLDERS:
        return _torchtitan_folder(dataset, dataset_path, text_field)
    if _looks_like_path(dataset):
        if dataset_path is not None:
            raise ValueError(
                f"dataset {dataset} is a path, so dataset_path ({dataset_path}) would be ignored; "
                "set only one of them"
            )
        return _local_source(dataset, dataset, text_field)
    if dataset.count("/") == 1 and all(dataset.split("/")):
        return _hub_source(dataset, HubDataset(dataset, None, "train", text_field), dataset_path)
    close = difflib.get_close_matches(dataset, [*EMBEDDED, *HUB_DATASETS, *TORCHTITAN_FOLDERS], n=1)
    hint = f"did you mean {close[0]}?\n" if close else ""
    raise ValueError(f"unknown dataset {dataset!r}\n{hint}{ACCEPTED}")


def check_source(source: Source | TokenShards) -> None:
    """Read the first document (or a token folder's index), so that an empty dataset or a wrong
    text field fails when the loader is built rather than at the first training step."""
    if isinstance(source, TokenShards):
        source.check()
        return
    try:
        first = source.open(0, 1).next()
    except ReadError as e:
        raise DataError(str(e)) from e
    if first is None:
        raise DataError(f"dataset {source.name} ({source.description}) is empty")
    if first.bad and ": has no field " in first.bad:  # on the first row: most likely the field
        raise MissingTextField(f"dataset {source.name} ({source.description}): {first.bad}")
