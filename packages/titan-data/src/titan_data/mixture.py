"""Several datasets with weights in one `dataset` string.

torchtitan names one dataset in `training.dataset` and has no mixtures, so the same key takes
a comma-separated list here, each entry `DATASET[=PATH][:WEIGHT]`:

    c4:0.7,pydocs:0.3
    c4=/data/c4:3,/data/code/*.jsonl:1,tokens/wiki:1

`DATASET` is any form one dataset takes (a name, an `owner/name`, a file, folder or glob, a
folder of tokens); `=PATH` is that entry's `dataset_path` (a hub dataset's local copy);
`WEIGHT` is a positive number, 1 when left out. Weights are shares of samples (each sample is
`seq_len` tokens, so also shares of tokens). One string keeps a mixture inside the existing key,
on the command line as in TOML, and a single dataset reads as before.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    dataset: str
    dataset_path: str | None
    weight: float
    label: str
    """Short name for the metrics (`tokens/<label>`): the dataset name, or a path's last plain
    component."""


def parse_datasets(dataset: str, dataset_path: str | None = None) -> list[Entry]:
    """The entries of `dataset` (see the module docstring); raises ValueError naming a bad one."""
    parts = [p.strip() for p in dataset.split(",")]
    if len(parts) == 1 and _split_weight(parts[0])[1] is None:
        return [Entry(dataset, dataset_path, 1.0, _label(dataset))]
    if dataset_path is not None:
        raise ValueError(
            f"dataset_path ({dataset_path}) cannot go with a mixture of datasets ({dataset}); "
            "give each entry its own path as DATASET=PATH"
        )
    entries = []
    for part in parts:
        if not part:
            raise ValueError(
                f"dataset {dataset!r} has an empty entry; use DATASET[=PATH][:WEIGHT],..."
            )
        text, weight = _split_weight(part)
        name, _, path = text.partition("=")
        if weight is not None and weight <= 0:
            raise ValueError(
                f"dataset entry {part!r}: weight {weight:g} is not valid; use a positive weight"
            )
        entries.append(Entry(name, path or None, 1.0 if weight is None else weight, _label(name)))
    labels = [e.label for e in entries]
    return [
        e
        if labels.count(e.label) == 1
        else Entry(e.dataset, e.dataset_path, e.weight, f"{e.label}#{i}")
        for i, e in enumerate(entries)
    ]


def _split_weight(entry: str) -> tuple[str, float | None]:
    head, sep, tail = entry.rpartition(":")
    if not sep:
        return entry, None
    try:
        return head, float(tail)
    except ValueError:
        return entry, None  # a ':' that is part of the name


def _label(dataset: str) -> str:
    path = os.path.expanduser(dataset)
    if not (path.startswith(("/", ".", "~")) or glob.has_magic(path) or os.path.exists(path)):
        return dataset
    plain = [p for p in path.rstrip("/").split("/") if p and not glob.has_magic(p) and p != "."]
    if not plain:
        return dataset
    return plain[-1].split(".")[0] or plain[-1]
