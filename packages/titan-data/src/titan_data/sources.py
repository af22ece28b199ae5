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

Local jsonl/json and text files are read line by line here rather than by pyarrow, so that a
row that is not a text document (malformed JSON, invalid UTF-8, a missing or non-string text
field) is a row of its own, named by file and line (`BAD_ROW` says why), which the loader
can refuse or skip; and so that all of them can be found before training (`scan_bad_rows`).
"""

from __future__ import annotations

import bz2
import functools
import glob
import gzip
import io
import json
import lzma
import os
from collections.abc import Callable, Iterator
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


class DataError(ValueError):
    """The data cannot make batches: a bad row, too few tokens, or a source that fails to read."""


BAD_ROW = "titan_bad_row"
"""Column that the line readers set, instead of the text, on a row that is not a document:
`file:line: what is wrong`."""


@dataclass(frozen=True)
class Source:
    """A dataset ready to stream: `build()` returns a fresh, unsharded `IterableDataset`
    (a fresh one per epoch, so no iteration state leaks between epochs or loaders).
    `files` lists the local files it reads line by line (those `scan_bad_rows` checks)."""

    name: str
    description: str
    text_field: str
    build: Callable[[], datasets.IterableDataset]
    files: tuple[str, ...] = ()


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
    kind = {"json": "jsonl", "parquet": "parquet", "text": "text"}[fmt]
    plural = "s" if len(files) != 1 else ""
    description = f"{len(files)} {kind} file{plural} ({spec})"
    if fmt == "parquet":

        def build() -> datasets.IterableDataset:
            return datasets.load_dataset(fmt, data_files=files, split="train", streaming=True)

        return Source(name, description, text_field, build)
    # One shard per file, so that data-parallel ranks split them as before; rows carry "text".
    reader = _json_rows if fmt == "json" else _text_rows

    def build_lines() -> datasets.IterableDataset:
        return datasets.IterableDataset.from_generator(
            reader, gen_kwargs={"files": files, "text_field": text_field}
        )

    return Source(name, description, "text", build_lines, tuple(files))


def _open(path: str) -> io.BufferedIOBase:
    lower = path.lower()
    if lower.endswith(".gz"):
        return gzip.open(path, "rb")
    if lower.endswith(".bz2"):
        return bz2.open(path, "rb")
    if lower.endswith(".xz"):
        return lzma.open(path, "rb")
    if lower.endswith(".zst"):
        try:
            import zstandard  # noqa: PLC0415 - optional, only for .zst files
        except ImportError:
            raise ImportError(
                f"reading {path} needs the zstandard package: pip install zstandard"
            ) from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")


def _bad(path: str, line: int, why: str) -> dict:
    return {"text": None, BAD_ROW: f"{path}:{line}: {why}"}


def _document(path: str, line: int, row: object, text_field: str) -> dict:
    if not isinstance(row, dict):
        return _bad(
            path, line, f"a JSON {type(row).__name__}, not an object with a {text_field!r} field"
        )
    if text_field not in row:
        found = ", ".join(map(repr, row)) or "none"
        return _bad(path, line, f"has no field {text_field!r}; fields found: {found}")
    text = row[text_field]
    if text is not None and not isinstance(text, str):
        return _bad(path, line, f"field {text_field!r} holds {type(text).__name__}, not text")
    return {"text": text, BAD_ROW: None}


def _json_rows(files: list[str], text_field: str) -> Iterator[dict]:
    """Documents of JSON-lines files (or of `.json` files holding one list of objects), one
    row per line; a line that is not a document gives a `BAD_ROW` row naming file and line."""
    for path in files:
        with _open(path) as f:
            head = f.peek(64)[:64].lstrip() if hasattr(f, "peek") else b""
            if head.startswith(b"["):
                yield from _json_list_rows(path, f.read(), text_field)
                continue
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield _bad(path, number, f"invalid UTF-8 at byte {e.start + 1} of the line")
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    why = e.msg.removesuffix(" at")
                    yield _bad(path, number, f"malformed JSON ({why} at column {e.colno})")
                    continue
                yield _document(path, number, row, text_field)


def _json_list_rows(path: str, data: bytes, text_field: str) -> Iterator[dict]:
    try:
        rows = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        yield _bad(path, data.count(b"\n", 0, e.start) + 1, "invalid UTF-8")
        return
    except json.JSONDecodeError as e:
        yield _bad(
            path, e.lineno, f"malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
        )
        return
    for i, row in enumerate(rows, 1):
        yield _document(f"{path} element", i, row, text_field)


def _text_rows(files: list[str], text_field: str) -> Iterator[dict]:
    """One document per plain-text file."""
    for path in files:
        with _open(path) as f:
            data = f.read()
        try:
            yield {"text": data.decode("utf-8"), BAD_ROW: None}
        except UnicodeDecodeError as e:
            yield _bad(path, data.count(b"\n", 0, e.start) + 1, "invalid UTF-8")


def scan_bad_rows(source: Source) -> tuple[int, str | None]:
    """Read every row of `source`'s local files once: (rows read, the first bad row or None).
    Remembered per file version, so that loaders built again (validation) do not re-read."""
    if not source.files:
        return 0, None
    stamps = tuple((f, os.path.getsize(f), os.path.getmtime(f)) for f in source.files)
    return _scan(stamps, source.text_field, source.build)


@functools.lru_cache(maxsize=32)
def _scan(stamps: tuple, text_field: str, build: Callable) -> tuple[int, str | None]:
    rows = 0
    for row in build():
        rows += 1
        if row.get(BAD_ROW):
            return rows, row[BAD_ROW]
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
    except Exception as e:  # noqa: BLE001 - pyarrow and friends: say which dataset, in one line
        text = str(e).strip().splitlines()
        raise DataError(
            f"dataset {source.name} ({source.description}): reading its first rows failed:"
            f" {type(e).__name__}: {text[0] if text else ''}"
        ) from e
    if first is None:
        raise DataError(f"dataset {source.name} ({source.description}) is empty")
    if source.text_field not in first:
        raise DataError(missing_field_message(source, first))
    bad = first.get(BAD_ROW)
    if bad and ": has no field " in bad:  # on the first row: most likely the wrong text_field
        raise DataError(
            f"dataset {source.name} ({source.description}): {bad}; "
            "set text_field to the field that holds the text"
        )
