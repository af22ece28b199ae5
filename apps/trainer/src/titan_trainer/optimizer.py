"""The optimizer over every model part this rank holds: AdamW and Adam built in, anything else
found by name (`[optimizer] name`) through titan-core's plugin registry (`titan.optimizers`
entry points, such as titan-parallel's `Ranger21`, or `module:attr`)."""

from __future__ import annotations

import difflib

import torch
from torch import nn

from titan_core import PluginError, available, get_logger, plugins, resolve

log = get_logger("optimizer")

BUILT_IN = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def optimizer_problem(name: str) -> str | None:
    """Why `[optimizer] name` names no optimizer, or None when it does."""
    if name in BUILT_IN:
        return None
    try:
        resolve(plugins.OPTIMIZERS, name)
    except PluginError as e:
        if ":" in name:
            return f"[optimizer] name = {name!r}: {e}"
        known = [*BUILT_IN, *sorted(available(plugins.OPTIMIZERS))]
        close = difflib.get_close_matches(name, known, n=1) or [
            k for k in known if k.lower() == name.lower()
        ]
        hint = f"\ndid you mean {close[0]}?" if close else ""
        return (
            f"[optimizer] name = {name!r} is not an optimizer; built in: AdamW, Adam; installed "
            f"(titan.optimizers): {', '.join(known[2:]) or 'none'}{hint}\n"
            "install a package that registers it, or give an import path as module:attr"
        )
    return None


def build_optimizer(
    model_parts: list[nn.Module], cfg, *, total_steps: int = 1, dims=None
) -> torch.optim.Optimizer:
    """The optimizer `cfg` ([optimizer]) names, over the trainable parameters of `model_parts`,
    for a run of `total_steps` steps laid out as `dims`."""
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    if cfg.name not in BUILT_IN:
        factory = resolve(plugins.OPTIMIZERS, cfg.name)
        return factory(params, cfg, total_steps=total_steps, dims=dims)
    kwargs = dict(
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.state_dtype != "float32":
        # torch's AdamW keeps its moments in the parameters' dtype; titan-parallel's AdamW
        # takes the same steps with moments stored in bfloat16.
        from titan_parallel import AdamW

        return AdamW(params, **kwargs, state_dtype=getattr(torch, cfg.state_dtype))
    cls = BUILT_IN[cfg.name]
    if cfg.implementation == "fused":
        try:
            return cls(params, fused=True, **kwargs)
        except (RuntimeError, ValueError) as e:
            log.warning("fused %s is not available here (%s); using foreach", cfg.name, e)
            return cls(params, foreach=True, **kwargs)
    return cls(params, foreach=cfg.implementation == "foreach", **kwargs)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the last step: the one an optimizer scheduled itself
    (`scheduled_lr`) when it did, else the first group's `lr`."""
    group = optimizer.param_groups[0]
    return group.get("scheduled_lr", group["lr"])
