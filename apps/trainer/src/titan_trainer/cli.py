"""`titan-train` (also `python -m titan_trainer`): parse and check the config, then train."""

from __future__ import annotations

import sys

from titan_core import (
    ConfigError,
    available,
    init_logging,
    load_config,
    plugins,
    render_help,
    world_size_from_env,
)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    from titan_trainer.config import JobConfig

    if "-h" in args or "--help" in args:
        print(render_help(JobConfig))
        return 0
    if "--list-plugins" in args:
        for group in plugins.GROUPS:
            found = available(group)
            print(
                f"{group}: " + (", ".join(f"{k} ({v})" for k, v in sorted(found.items())) or "none")
            )
        return 0
    init_logging()
    from titan_trainer.checks import check_config

    try:
        config = load_config(JobConfig, args)
        check_config(config, world_size_from_env())
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from titan_core import RunFolderError
    from titan_trainer.guards import NonFiniteStepError, StartupError
    from titan_trainer.train import train

    try:
        result = train(config)
    except (StartupError, RunFolderError, NonFiniteStepError) as e:
        # Problems with the run's data, folders or numbers: the message says what to do.
        first, *rest = str(e).split("\n")
        print(
            "\n".join(["titan: error: " + first, *("       " + line for line in rest)]),
            file=sys.stderr,
        )
        return 1
    return 130 if result.stopped_early and not result.steps_run else 0


if __name__ == "__main__":
    sys.exit(main())
