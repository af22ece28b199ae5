"""What the trainer's single-purpose commands (`titan-compare`, `titan-generate`,
`titan-download`) share: a parser whose description is the command module's docstring, and one
shape for the error a user reads (`titan-train` prints its errors in the same shape).

Their flags are spelled `--key-name`, as argparse tools are; `titan-train`'s are
`--section.key_name`, the TOML keys of its config (see the trainer README, "Command lines").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from titan_core.versions import add_version_flag


def tool_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """The parser of command `prog`, its `--help` opening with `description` as written, with
    `--version`."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_version_flag(parser, prog, "titan-llm-trainer")
    return parser


def error_text(prog: str, error: BaseException | str) -> str:
    """`prog: error: <first line>`, the message's further lines indented under it."""
    first, *rest = str(error).split("\n")
    return "\n".join([f"{prog}: error: " + first, *("       " + line for line in rest)])


def run_tool(
    prog: str,
    run: Callable[[argparse.Namespace], int],
    args: argparse.Namespace,
    errors: tuple[type[BaseException], ...],
    status: int,
) -> int:
    """`run(args)`'s exit status; one of `errors` is printed as `error_text` (no traceback),
    and the command exits with `status`."""
    try:
        return run(args)
    except errors as e:
        print(error_text(prog, e), file=sys.stderr)
        return status
