"""The [quantize.linear.float8] config section (torchtitan's key names)."""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field

SECTION = "[quantize.linear.float8]"
AUTO_FILTER_FLAG = "auto_filter_small_kn"
"""torchtitan's switch for `auto_filter_small_kn`, written among the `filter_fqns`."""


class _TorchaoImportNotice(logging.Filter):
    """Importing torchao 0.18 under torch 2.12+ logs that registering its `KernelPreference`
    enum as a pytree constant is deprecated: torchao's business, nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "register_constant() on Enum subclasses is deprecated" not in str(record.msg)


def quiet_torchao_import() -> None:
    """Drop that one notice at its source (torch's pytree logger) before torchao is imported."""
    logger = logging.getLogger("torch.utils._pytree")
    if not any(isinstance(f, _TorchaoImportNotice) for f in logger.filters):
        logger.addFilter(_TorchaoImportNotice())


def recipe_names() -> list[str]:
    """The recipe names the installed torchao's `Float8LinearConfig.from_recipe_name` accepts."""
    # Imported here, not at module level: importing torchao costs seconds, and the config
    # classes are read for --help and config checks before any model exists.
    from torchao.float8 import Float8LinearRecipeName

    return [name.value for name in Float8LinearRecipeName]


@dataclass
class Float8:
    recipe_name: str | None = None
    """torchao Float8 recipe: none or "tensorwise" (one scale per tensor, fastest), "rowwise", or "rowwise_with_gw_hp" (most accurate)."""
    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP-sharded weights in Float8 instead of high precision (tensorwise recipe only)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute every weight's Float8 scale in one all-reduce after the optimizer step (needs enable_fsdp_float8_all_gather)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Leave a linear in high precision when any of these strings occurs in its fully qualified
    name. torchtitan's "auto_filter_small_kn" among them turns auto_filter_small_kn on."""
    auto_filter_small_kn: bool = False
    """Leave linears whose K/N are too small for Float8 to pay off in high precision (torchao's H100 thresholds; see the README)."""
    emulate: bool = False
    """Emulate the Float8 matmuls in high precision: for testing on hardware without Float8 support (e.g. CUDA capability < 8.9)."""

    def __post_init__(self) -> None:
        if AUTO_FILTER_FLAG in self.filter_fqns:  # torchtitan's way to turn the filter on
            from titan_core import get_logger

            self.filter_fqns = [name for name in self.filter_fqns if name != AUTO_FILTER_FLAG]
            self.auto_filter_small_kn = True
            get_logger("config").info(
                '%s filter_fqns "%s" is torchtitan\'s switch: read as %s = true',
                SECTION,
                AUTO_FILTER_FLAG,
                AUTO_FILTER_FLAG,
            )

    @property
    def recipe(self) -> str:
        """The recipe in effect: `recipe_name`, or "tensorwise" when it is none."""
        return self.recipe_name or "tensorwise"

    def validate(self) -> list[str]:
        problems = []
        # torchao is imported only to check a recipe someone named: a run without Float8
        # neither pays for the import nor sees what it logs.
        known = recipe_names() if self.recipe_name is not None else []
        if self.recipe_name is not None and self.recipe_name not in known:
            close = difflib.get_close_matches(self.recipe_name, known, n=1)
            problems.append(
                f'{SECTION} recipe_name = "{self.recipe_name}" is not a torchao Float8 recipe\n'
                f"allowed: none (tensorwise), {', '.join(repr(n) for n in known)}"
                + (f"\ndid you mean {close[0]}?" if close else "")
            )
        elif self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            problems.append(
                f'{SECTION} enable_fsdp_float8_all_gather = true needs the tensorwise recipe, not "{self.recipe}"\n'
                "the weight is cast once with a single scale before the all-gather; set recipe_name to none "
                "or turn enable_fsdp_float8_all_gather off"
            )
        if self.precompute_float8_dynamic_scale_for_fsdp and not self.enable_fsdp_float8_all_gather:
            problems.append(
                f"{SECTION} precompute_float8_dynamic_scale_for_fsdp = true needs enable_fsdp_float8_all_gather = true\n"
                "the precomputed scales are those of the Float8 all-gather; turn both on or both off"
            )
        if any(not name for name in self.filter_fqns):
            problems.append(
                f"{SECTION} filter_fqns contains an empty string, which occurs in every name and would "
                "leave every linear in high precision\nremove it (use [] to filter nothing)"
            )
        return problems
