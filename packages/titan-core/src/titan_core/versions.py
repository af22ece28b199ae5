"""What a command's `--version` prints: its package's version and those of the Titan packages,
torch and Python beside it, read from the installed metadata (no import, so it answers at
once), which is what a bug report needs."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys

DISTRIBUTIONS = (
    "titan-llm-core",
    "titan-llm-parallel",
    "titan-llm-ckpt",
    "titan-llm-float8",
    "titan-llm-data",
    "titan-llm-models",
    "titan-llm-trainer",
)
"""Titan's distributions on the package index."""


def version_text(prog: str, distribution: str) -> str:
    """`prog VERSION (distribution)`, then a line with every installed Titan package's
    version, torch's and Python's."""
    others = [f"{name} {_version(name)}" for name in DISTRIBUTIONS if _version(name)]
    others += [
        f"torch {_version('torch') or 'not installed'}",
        f"Python {platform.python_version()}",
    ]
    return f"{prog} {_version(distribution)} ({distribution})\n" + ", ".join(others)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def add_version_flag(parser: argparse.ArgumentParser, prog: str, distribution: str) -> None:
    """`--version` on `parser`: `version_text` as written (argparse's own action rewraps it)."""

    class _Version(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(version_text(prog, distribution))
            sys.exit(0)

    parser.add_argument("--version", nargs=0, action=_Version, help="show the versions and exit")
