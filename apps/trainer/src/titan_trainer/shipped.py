"""The configs and launch scripts that ship with titan-trainer, and how a config name finds one.

In an installed wheel they sit inside the package (`titan_trainer/configs/*.toml`,
`titan_trainer/run_train.sh`, `titan_trainer/scripts/multinode.sbatch`); in a source checkout
(the workspace's editable install) they sit in apps/trainer/, beside src/, where they are
edited. The same names find them either way. Nothing here imports torch: `titan-train
--list-configs` and `--config-path` answer at once.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path

from titan_core.config import ConfigError

_PACKAGE = Path(__file__).resolve().parent
LAUNCH_SCRIPTS = ("run_train.sh", "scripts/multinode.sbatch")


def shipped_root() -> Path:
    """The folder that holds configs/, run_train.sh and scripts/."""
    checkout = _PACKAGE.parents[1]  # apps/trainer, from apps/trainer/src/titan_trainer
    for root in (_PACKAGE, checkout):
        if (root / "configs").is_dir():
            return root
    raise FileNotFoundError(
        f"titan-trainer's configs are missing (looked in {_PACKAGE / 'configs'} and "
        f"{checkout / 'configs'}); reinstall titan-trainer"
    )


def shipped_configs() -> dict[str, Path]:
    """Config name (file name without .toml) -> its file."""
    return {path.stem: path for path in sorted((shipped_root() / "configs").glob("*.toml"))}


def find_config_file(given: str) -> Path:
    """The TOML file that `--job.config_file given` reads: `given` itself when that file
    exists, else the shipped config it names: `debug_model`, `debug_model.toml` or
    `configs/debug_model.toml` (the trainer folder's own spelling)."""
    path = Path(given).expanduser()
    if path.is_file():
        return path
    configs = shipped_configs()
    name = path.name.removesuffix(".toml")
    names_a_shipped_one = len(path.parts) == 1 or (
        len(path.parts) == 2 and path.parts[0] == "configs" and path.suffix == ".toml"
    )
    if names_a_shipped_one and name in configs:
        return configs[name]
    close = difflib.get_close_matches(name, list(configs), n=1, cutoff=0.6)
    hint = f"\ndid you mean {close[0]}?" if close else ""
    raise ConfigError(
        f"config file {given!r} does not exist, and titan-trainer ships no config of that name\n"
        f"pass a TOML file, or a shipped config: {', '.join(configs)} "
        f"(titan-train --list-configs){hint}"
    )


def describe_shipped() -> str:
    """What `titan-train --list-configs` prints: each config with its description and path,
    then the launch scripts."""
    configs = shipped_configs()
    width = max(map(len, configs), default=0)
    lines = ["configs shipped with titan-trainer (pass the name to --job.config_file):"]
    for name, path in configs.items():
        description = tomllib.loads(path.read_text()).get("job", {}).get("description", "")
        lines.append(f"  {name:<{width}}  {description}")
        lines.append(f"  {'':<{width}}  {path}")
    lines.append("launch scripts (bash PATH ...):")
    root = shipped_root()
    lines.extend(f"  {script:<24}  {root / script}" for script in LAUNCH_SCRIPTS)
    return "\n".join(lines)
