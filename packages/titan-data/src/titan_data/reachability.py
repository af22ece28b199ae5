"""Can this machine read a dataset? Asked once before a job starts (`check_dataset`), so that a
hub dataset out of reach stops the job with one message instead of a traceback per rank.

A hub dataset is first asked about with one short request (huggingface_hub's `dataset_info`,
no retries), which tells a missing network from a missing token or a missing repository in
a second; then the first document is read, as training will read it. With `HF_HUB_OFFLINE=1`
no request is made and the first read says whether the Hugging Face cache holds the dataset.
"""

from __future__ import annotations

import os

from titan_core.messages import first_line
from titan_data.errors import DataError
from titan_data.mixture import parse_datasets
from titan_data.sources import Source, check_source, load_source

HUB_TIMEOUT_S = 10.0
"""Seconds the one request to the hub may take before the hub counts as out of reach."""


def check_dataset(dataset: str, dataset_path: str | None = None) -> None:
    """Open every source of `dataset` and read its first document (a hub dataset's first
    shard). Raises DataError naming the dataset, why it cannot be read and the fixes."""
    for entry in parse_datasets(dataset, dataset_path):
        source = load_source(entry.dataset, entry.dataset_path)
        repo = source.hub_repo if isinstance(source, Source) else None
        if repo is not None:
            cause = hub_problem(repo)
            if cause is not None:
                raise DataError(_unreachable(entry.dataset, source, cause))
        try:
            check_source(source)
        except Exception as e:  # noqa: BLE001 - `datasets` raises what its clients raise
            if repo is None:
                raise
            offline = _offline()
            cause = (
                f"it is not in the Hugging Face cache (HF_HUB_OFFLINE=1): {first_line(e)}"
                if offline
                else first_line(e)
            )
            raise DataError(_unreachable(entry.dataset, source, cause)) from None


def hub_problem(repo: str) -> str | None:
    """Why the hub dataset `repo` cannot be read from here, or None when it can (or when
    HF_HUB_OFFLINE leaves the answer to the cache)."""
    if _offline():
        return None
    import huggingface_hub  # noqa: PLC0415 - only for hub datasets
    from huggingface_hub import errors  # noqa: PLC0415

    try:
        huggingface_hub.HfApi().dataset_info(repo, timeout=HUB_TIMEOUT_S)
    except errors.GatedRepoError:
        return (
            f"{repo} is gated on the Hugging Face hub and this machine has no token with access"
            " to it (accept its terms on its hub page, then set HF_TOKEN or run `hf auth login`)"
        )
    except errors.RepositoryNotFoundError:
        token = "" if _has_token() else ", or it is private and this machine has no token"
        return f"the Hugging Face hub has no dataset {repo}{token}"
    except errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return f"the Hugging Face hub refused the token for {repo} (HTTP {status})"
        return f"the Hugging Face hub answered with an error: {first_line(e)}"
    except Exception as e:  # noqa: BLE001 - DNS, refused, timeout: the network, by any client
        return (
            f"this machine cannot reach the Hugging Face hub{hub_endpoint()} (no network route:"
            f" {type(e).__name__}: {first_line(e)})"
        )
    return None


def hub_endpoint() -> str:
    """` at URL (HF_ENDPOINT)` when the environment names another hub than huggingface.co,
    else empty: a message about the hub says which one was asked."""
    endpoint = os.environ.get("HF_ENDPOINT", "").strip()
    return f" at {endpoint} (HF_ENDPOINT)" if endpoint else ""


def _unreachable(name: str, source: Source, cause: str) -> str:
    cache = (
        "or read it once where the hub can be reached, to put it in the Hugging Face cache"
        " (HF_HUB_OFFLINE=1 here reads only that cache)"
        if _offline()
        else "or, with the dataset in the Hugging Face cache, set HF_HUB_OFFLINE=1"
    )
    return (
        f"dataset {name} ({source.description}) cannot be read: {cause}\n"
        "tokenize it once where the hub can be reached (titan-data tokenize --dataset"
        f" {name} --tokenizer TOKENIZER --out DIR) and train on that folder (dataset = DIR)\n"
        f"or point dataset_path at a local copy of {source.hub_repo}\n{cache}"
    )


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _has_token() -> bool:
    import huggingface_hub  # noqa: PLC0415

    return huggingface_hub.get_token() is not None
