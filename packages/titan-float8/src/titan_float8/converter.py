"""Float8 training as a model converter: swap eligible nn.Linear for torchao's Float8Linear.

The trainer builds the converter from its [quantize.linear.float8] section and ParallelDims,
calls `convert` on the model while it is still on the meta device and before tensor parallel
and FSDP, and calls `post_optimizer_hook` after every optimizer step.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from titan_core import ConfigError, ParallelDims, get_logger
from titan_float8.config import SECTION, Float8
from titan_float8.filters import skip_reason
from titan_float8.hardware import float8_hardware_problem

log = get_logger("float8")


class Float8Converter:
    """Satisfies `titan_core.Converter`. After `convert`, `converted` lists the FQNs that
    became Float8Linear and `skipped` maps every other nn.Linear's FQN to the reason."""

    def __init__(self, section: Float8, tp_degree: int = 1):
        self.section = section
        self.tp_degree = tp_degree
        self.converted: list[str] = []
        self.skipped: dict[str, str] = {}

    def linear_config(self):
        """The torchao `Float8LinearConfig` this section describes."""
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.section.recipe)
        return dataclasses.replace(
            config,
            enable_fsdp_float8_all_gather=self.section.enable_fsdp_float8_all_gather,
            emulate=self.section.emulate,
        )

    def _keep(self, module: nn.Module, fqn: str) -> bool:
        reason = skip_reason(module, fqn, self.section, self.tp_degree)
        if reason is None:
            self.converted.append(fqn)
        else:
            self.skipped[fqn] = reason
        return reason is None

    def convert(self, model: nn.Module) -> None:
        from torchao.float8 import convert_to_float8_training

        if isinstance(model, nn.Linear):
            # torchao returns a new module for a root nn.Linear; in-place conversion cannot.
            raise TypeError(
                "convert() swaps submodules in place; wrap a bare nn.Linear in a container"
            )
        self.converted, self.skipped = [], {}
        convert_to_float8_training(model, module_filter_fn=self._keep, config=self.linear_config())
        s = self.section
        log.info(
            "Float8 %s%s: converted %d of %d linear layers%s",
            s.recipe,
            " (emulated)" if s.emulate else "",
            len(self.converted),
            len(self.converted) + len(self.skipped),
            ", Float8 FSDP all-gather" if s.enable_fsdp_float8_all_gather else "",
        )
        for fqn, reason in self.skipped.items():
            log.info("  kept %s in high precision: %s", fqn, reason)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        if not self.section.precompute_float8_dynamic_scale_for_fsdp:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        # Pipeline parallel hands over one module per stage.
        for part in model if isinstance(model, list) else [model]:
            precompute_float8_dynamic_scale_for_fsdp(part)


def _device_of(dims: ParallelDims | None) -> torch.device:
    if dims is not None:
        try:
            return torch.device(dims.world_mesh.device_type)
        except RuntimeError:  # mesh not built yet: fall through to what this process sees
            pass
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_float8_converter(
    section: Float8, dims: ParallelDims | None = None, *, device: torch.device | str | None = None
) -> Float8Converter:
    """A Float8 converter for this section and job layout.

    Checks up front that the combination can run: the section's own rules, and real Float8
    matmuls on `device` (default: the device type of `dims`' mesh if built, else cuda when
    visible, else cpu) unless `emulate` is on. Raises `titan_core.ConfigError`.
    """
    problems = section.validate()
    if not problems:
        hardware = float8_hardware_problem(
            device if device is not None else _device_of(dims), section.emulate
        )
        if hardware:
            problems.append(hardware)
    if problems:
        raise ConfigError(problems)
    if section.enable_fsdp_float8_all_gather and dims is not None and not dims.fsdp_enabled:
        log.warning(
            "%s enable_fsdp_float8_all_gather has no effect without FSDP (data_parallel_shard_degree x "
            "context_parallel_degree = 1); turning it and precompute_float8_dynamic_scale_for_fsdp off",
            SECTION,
        )
        section = dataclasses.replace(
            section,
            enable_fsdp_float8_all_gather=False,
            precompute_float8_dynamic_scale_for_fsdp=False,
        )
    return Float8Converter(section, tp_degree=dims.tp if dims is not None else 1)
