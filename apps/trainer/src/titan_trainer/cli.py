"""`titan-train` (also `python -m titan_trainer`): parse and check the config, then train.

`titan-train --dry-run ...` (or `--comm.mode fake_backend`) simulates the job instead of
running it: see `dry_run/`.
"""

from __future__ import annotations

import logging
import os
import sys

# Only what loads without torch: the command line and the TOML are read and checked before
# torch's seconds of import (the config sections load without it, titan_core.lazy), and
# `--version`, `--list-configs` and `--config-path` answer without it.
from titan_core import available, get_logger, plugins
from titan_core.config import ConfigError, load_config, render_help
from titan_core.log import init_logging
from titan_core.versions import version_text
from titan_trainer.config import JobConfig
from titan_trainer.logs import choose_console_ranks
from titan_trainer.shipped import describe_shipped, find_config_file
from titan_trainer.tools import error_text

# Exit statuses (the trainer README's "Exit status"): a shell's 128 + signal number for a run
# that a signal stopped early, so that `titan-train ... && next-stage` stops there too.
FINISHED = 0
ERROR = 1
"""A problem with the run's data, folders, numbers or peers; one `titan: error:` message."""
CONFIG_ERROR = 2
STOPPED_BY_SIGINT = 130
"""Ctrl-C: stopped at the end of the step; the log says what a rerun resumes from (the newest
checkpoint, or none)."""
STOPPED_BY_SIGTERM = 143
"""SIGTERM (a scheduler's preemption or time-limit notice): stopped after saving a full
checkpoint of the current step (when checkpoints are on)."""

MORE_HELP = """
Also:
  titan-train --version              this package's version, the other Titan packages', torch's
  titan-train --list-configs         the configs shipped with titan-trainer and where they are;
                                     --job.config_file takes their names (debug_model, llama3_8b)
  titan-train --config-path NAME     the TOML file --job.config_file NAME reads
  titan-train --list-plugins         installed models, data packages, checkpointers, converters, optimizers
  titan-train ... --dry-run          simulate the job instead of running it: memory per rank on
                                     fake tensors, fit verdict, config/tokenizer/dataset/checkpoint
                                     checks (same as --comm.mode fake_backend; see [dry_run])
  titan-train ... --check            the checks a run makes before it starts, for WORLD_SIZE
                                     processes (config, tokenizer, each dataset's first document
                                     read), then exit: 0 fine, 2 a problem. The launch scripts
                                     run it once before torchrun starts the ranks"""

DATA_CHECKED = "TITAN_DATA_CHECKED"
"""Set to 1 by the launch scripts once `--check` has read the datasets, so that the ranks
do not read them again."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    answered = answer_without_torch(args)
    if answered is not None:
        return answered
    # A misspelled key, a wrong type or an impossible value is said at once, before torch.
    if "-h" in args or "--help" in args:
        print(render_help(JobConfig) + "\n" + MORE_HELP)
        return 0
    if "--dry-run" in args:
        args = [a for a in args if a != "--dry-run"] + ["--comm.mode", "fake_backend"]
    check_only = "--check" in args
    args = [a for a in args if a != "--check"]
    if "--list-plugins" in args:
        return list_plugins()
    init_logging()
    try:
        config = load_config(JobConfig, args, find_config_file=find_config_file)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if config.comm.mode == "fake_backend":
        from titan_trainer.dry_run import main_dry_run  # torch: once the config is checked

        # Run as the command (arguments from sys.argv), this process has only loaded the
        # config; a caller passing its own arguments may have run anything before.
        return main_dry_run(config, own_process=argv is None)
    return check_and_train(config, check_only)


def check_and_train(config, check_only: bool) -> int:
    """The checks a run makes before it starts (`preflight`: the config for this world size,
    the tokenizer, the datasets, the checkpoints), then the run unless `check_only`."""
    # torch: once the config is checked.
    from titan_core import world_size_from_env
    from titan_trainer.preflight import preflight

    choose_console_ranks(config.logging, world_size=world_size_from_env())
    checked = preflight(
        config, world_size_from_env(), open_datasets=check_only or _reads_the_data_first()
    )
    if checked.problems:
        print(ConfigError(checked.problems), file=sys.stderr)
        return 2
    said = os.environ.get(DATA_CHECKED) == "1" and not check_only  # by the launch script
    for note in checked.notes:
        get_logger("checks").log(logging.DEBUG if said else logging.INFO, note)
    if check_only:
        return 0
    return run_training(config, checked.layout)


def list_plugins() -> int:
    """`--list-plugins`: what each entry-point group holds, by name and where it points."""
    for group in plugins.GROUPS:
        found = available(group)
        print(f"{group}: " + (", ".join(f"{k} ({v})" for k, v in sorted(found.items())) or "none"))
    return 0


def answer_without_torch(args: list[str]) -> int | None:
    """`--version`, `--list-configs` and `--config-path NAME`, answered without importing
    torch (seconds): launch scripts call them. The exit status, or None for anything else."""
    if "--version" in args:
        print(version_text("titan-train", "titan-llm-trainer"))
        return 0
    if "--list-configs" in args:
        print(describe_shipped())
        return 0
    if "--config-path" in args:
        rest = args[args.index("--config-path") + 1 :]
        if not rest:
            print("usage: titan-train --config-path NAME_OR_FILE", file=sys.stderr)
            return 2
        try:
            print(find_config_file(rest[0]).resolve())
        except ValueError as e:  # titan_core.ConfigError
            print(e, file=sys.stderr)
            return 2
        return 0
    return None


def run_training(config, layout=None) -> int:
    """Train the checked `config` on this process (with the `Layout` its checks resolved);
    the exit status says how the run ended, and a problem the user can act on is one message,
    without a traceback."""
    # torch and the whole trainer: once the config and the job's checks have passed.
    from titan_core import CheckpointError, RunFolderError
    from titan_trainer.comm import CollectiveError
    from titan_trainer.guards import NonFiniteStepError, StartupError
    from titan_trainer.train import train

    try:
        result = train(config, layout)  # its dims and meta model, resolved once
    except KeyboardInterrupt:  # Ctrl-C before the first step (the steps catch their own)
        print("titan: stopped by Ctrl-C before training started", file=sys.stderr)
        return STOPPED_BY_SIGINT
    except ConfigError as e:  # found once the layout is known, before any memory is used
        print(e, file=sys.stderr)
        return CONFIG_ERROR
    except (
        StartupError,
        RunFolderError,
        NonFiniteStepError,
        CollectiveError,
        CheckpointError,
    ) as e:
        # Problems with the run's data, folders, numbers, peers or checkpoints (none usable, a
        # full disk): the message says what to do.
        print(error_text("titan", e), file=sys.stderr)
        return ERROR
    return {"SIGTERM": STOPPED_BY_SIGTERM, "SIGINT": STOPPED_BY_SIGINT}.get(
        result.stopped_by, FINISHED
    )


def _reads_the_data_first() -> bool:
    """Whether this process reads each dataset's first document before starting: once per
    job (rank 0), unless a launch script's `--check` already did."""
    return os.environ.get(DATA_CHECKED) != "1" and os.environ.get("RANK", "0") == "0"


if __name__ == "__main__":
    sys.exit(main())
