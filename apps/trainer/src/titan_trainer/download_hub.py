"""`titan-download`'s work, once its flags are read: the repo's files through huggingface_hub
into its cache, then placed in the local folder (see `titan_trainer.download`)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import are_progress_bars_disabled, filter_repo_objects
from tqdm import tqdm

from titan_data import find_tokenizer_file
from titan_trainer.hf_assets import ASSETS, DownloadError


def fetch(repo_id: str, patterns: list[str], token: str | None, revision: str | None) -> Path:
    """The repo's files matching `patterns` in the Hugging Face cache; its snapshot folder.
    Raises DownloadError saying what to do when the Hub cannot be reached or refuses."""
    try:
        return Path(
            snapshot_download(repo_id, allow_patterns=patterns, token=token, revision=revision)
        )
    except GatedRepoError:
        raise DownloadError(
            f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id}, then "
            "give a token that may read it\n" + _TOKEN_HINT
        ) from None
    except RepositoryNotFoundError:
        raise DownloadError(
            f"the Hub has no repo {repo_id} that this token may read (a private repo needs a "
            "token)\ncheck the name, or " + _TOKEN_HINT
        ) from None
    except RevisionNotFoundError:
        raise DownloadError(f"{repo_id} has no revision {revision!r}") from None
    except LocalEntryNotFoundError as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        endpoint = os.environ.get("HF_ENDPOINT", "").strip()
        hub = f"the Hub at {endpoint} (HF_ENDPOINT)" if endpoint else "the Hub"
        why = (
            "HF_HUB_OFFLINE is set, so only the cache is read"
            if offline
            else f"{hub} cannot be reached (no network, or a proxy or firewall in the way)"
        )
        cause = e.__cause__ or e.__context__
        where = "unset HF_HUB_OFFLINE and run this" if offline else "run this"
        raise DownloadError(
            f"{why}, and the cache ({_cache_dir()}) holds no copy of {repo_id}"
            + (f" ({type(cause).__name__})" if cause is not None and not offline else "")
            + f"\n{where} where {hub} can be reached, or point HF_HUB_CACHE at a cache that"
            " holds the repo"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise DownloadError(
                f"the Hub refused {repo_id} (HTTP {status}): it is gated or private and the token "
                "is missing or may not read it\n" + _TOKEN_HINT
            ) from None
        raise DownloadError(f"the Hub answered HTTP {status} for {repo_id}: {e}") from None


_TOKEN_HINT = (
    "pass --token hf_..., set HF_TOKEN, or run `hf auth login` "
    "(tokens: https://huggingface.co/settings/tokens)"
)


def _cache_dir() -> str:
    return constants.HF_HUB_CACHE


def place(
    snapshot: Path, patterns: list[str], local_dir: Path, progress: bool = True
) -> list[Path]:
    """The files of `snapshot` that match `patterns` (the cache may hold others, from earlier
    downloads) into `local_dir` at the same relative path: a hard link to the cached file when
    both are on one disk, else a copy. Returns the files placed."""
    names = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()]
    files = [snapshot / n for n in sorted(filter_repo_objects(names, allow_patterns=patterns))]
    placed = []
    for source in tqdm(files, desc=f"place in {local_dir}", unit="file", disable=not progress):
        target = local_dir / source.relative_to(snapshot)
        target.parent.mkdir(parents=True, exist_ok=True)
        real = source.resolve()  # the cache's snapshot holds links to its blobs
        if target.exists():
            if target.samefile(real):
                placed.append(target)
                continue
            target.unlink()
        try:
            os.link(real, target)
        except OSError:
            shutil.copyfile(real, target)
        placed.append(target)
    return placed


def download(a: argparse.Namespace) -> int:
    patterns = sorted({p for kind in a.assets for p in ASSETS[kind]})
    local_dir = Path(a.local_dir or os.path.join("assets", "hf", a.repo_id.split("/")[-1]))
    snapshot = fetch(a.repo_id, patterns, a.token, a.revision)
    placed = place(snapshot, patterns, local_dir, progress=not are_progress_bars_disabled())
    if not placed:
        raise DownloadError(
            f"{a.repo_id} has no files matching {', '.join(patterns)}; check --assets"
        )
    print(f"{len(placed)} files of {a.repo_id} in {local_dir}")
    if "tokenizer" in a.assets:
        try:
            found = find_tokenizer_file(str(local_dir))
        except FileNotFoundError:
            print(
                f"note: {a.repo_id} has neither tokenizer.model nor tokenizer.json (the files"
                " Titan reads)",
                file=sys.stderr,
            )
        else:
            print(f"tokenizer: {found}")
            print(f"use it with: --model.hf_assets_path {local_dir}")
    if "weights" in a.assets:
        print(
            f"weights: titan-ckpt convert hf-to-dcp {local_dir} OUT --model llama3 --flavor NAME, "
            f"or [checkpoint] initial_load_path = {local_dir!s} with initial_load_in_hf = true"
        )
    return 0
