"""The optimizer over every model part this rank holds: AdamW and Adam built in, anything else
found by name (`[optimizer] name`) through titan-core's plugin registry (`titan.optimizers`
entry points, such as titan-parallel's `Ranger21` and `Muon`, or `module:attr`), over the
parameter groups of [[optimizer.param_groups]] (see `param_groups`).

On a resume the config's group values win over the checkpoint's (each group's peak learning
rate, weight decay, betas, eps...): the optimizer's state (moments) is restored, its
hyperparameters stay the ones configured, and a warning names what changed."""

from __future__ import annotations

import difflib

import torch
import torch.distributed as dist
from torch import nn

import titan_parallel
from titan_core import (
    ConfigError,
    OptimizerFactory,
    OptimizerPlugin,
    PluginError,
    available,
    get_logger,
    plugins,
    resolve,
)
from titan_trainer.param_grouping import build_param_groups, model_names, unmatched_group_problems

log = get_logger("optimizer")

BUILT_IN = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def optimizer_factory(name: str) -> OptimizerFactory:
    """What `[optimizer] name` names, as a factory: a plugin's own, or for the built-in AdamW
    and Adam the defaults (Adam's two moments; built by `_build`)."""
    return OptimizerPlugin() if name in BUILT_IN else resolve(plugins.OPTIMIZERS, name)


def optimizer_state_copies(optimizer) -> float:
    """Parameter-sized copies the optimizer of an [optimizer] section keeps, in units of the
    (float32) parameters' bytes, as the optimizer's factory reports them
    (`titan_core.OptimizerFactory.state_copies`)."""
    return optimizer_factory(optimizer.name).state_copies(optimizer)


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
    """The optimizer `cfg` ([optimizer]) names, over the trainable parameters of `model_parts`
    (in the torch parameter groups [[optimizer.param_groups]] and Muon ask for; a plain list
    otherwise), for a run of `total_steps` steps laid out as `dims`."""
    optimizer = _build(model_parts, cfg, total_steps, dims)
    keep_configured_groups(optimizer)
    return optimizer


def _build(model_parts, cfg, total_steps: int, dims) -> torch.optim.Optimizer:
    params: list = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    if cfg.param_groups:
        check_groups_match(model_parts, cfg, dims)
    if cfg.param_groups or cfg.name == "Muon":
        params = build_param_groups(model_parts, cfg)
    if cfg.name not in BUILT_IN:
        factory = resolve(plugins.OPTIMIZERS, cfg.name)
        return factory(params, cfg, total_steps=total_steps, dims=dims)
    kwargs = dict(
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.state_dtype != "float32":
        # torch's AdamW keeps its moments in the parameters' dtype; titan-parallel's AdamW
        # takes the same steps with moments stored in bfloat16.
        return titan_parallel.AdamW(params, **kwargs, state_dtype=getattr(torch, cfg.state_dtype))
    cls = BUILT_IN[cfg.name]
    if cfg.implementation == "fused":
        try:
            return cls(params, fused=True, **kwargs)
        except (RuntimeError, ValueError) as e:
            log.warning("fused %s is not available here (%s); using foreach", cfg.name, e)
            return cls(params, foreach=True, **kwargs)
    return cls(params, foreach=cfg.implementation == "foreach", **kwargs)


def check_groups_match(model_parts, cfg, dims) -> None:
    """ConfigError when a [[optimizer.param_groups]] entry takes no parameter of the model
    (the names of every pipeline stage, gathered; a fake process group, the dry run's, has
    been checked on the whole model before the split)."""
    names = [name for name, _ in model_names(model_parts)]
    pp = dims.mesh("pp") if dims is not None and dims.pp_enabled else None
    if pp is not None:
        group = pp.get_group()
        if dist.get_backend(group) == "fake":
            return
        everyone: list = [None] * pp.size()
        dist.all_gather_object(everyone, names, group=group)
        names = [n for stage in everyone for n in stage]
    problems = unmatched_group_problems(cfg, names)
    if problems:
        raise ConfigError(problems)


# Group values a resume keeps from the config (lr follows the schedule from `initial_lr`).
_SHOWN = ("initial_lr", "weight_decay", "betas", "eps", "momentum", "nesterov", "use_muon")


def keep_configured_groups(optimizer: torch.optim.Optimizer) -> None:
    """Make a loaded optimizer keep its configured group values (the checkpoint's moments and
    step counts load as usual); warn once, naming what the checkpoint had otherwise."""
    configured: list[dict] = []

    def before(opt, state_dict):
        configured[:] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    def after(opt):
        changes = []
        for i, (group, mine) in enumerate(zip(opt.param_groups, configured)):
            loaded_peak, peak = group.get("initial_lr"), mine.get("initial_lr")
            for key in _SHOWN:
                if key in mine and group.get(key) != mine[key]:
                    changes.append(f"group {i} {key} {group.get(key)} -> {mine[key]}")
            lr = mine["lr"]
            if loaded_peak and peak is not None and "lr" in group:
                lr = group["lr"] * peak / loaded_peak  # the schedule's factor, on the new peak
            group.update({k: v for k, v in mine.items() if k not in ("lr", "scheduled_lr")})
            group["lr"] = lr
        if changes:
            log.warning(
                "the optimizer's parameter-group values differ from the checkpoint's; the"
                " config's apply from here on (checkpoint -> config): %s",
                "; ".join(changes),
            )

    optimizer.register_load_state_dict_pre_hook(before)
    optimizer.register_load_state_dict_post_hook(after)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the last step: the one an optimizer scheduled itself
    (`scheduled_lr`) when it did, else the first group's `lr` (the default group's, when any
    parameter takes the [optimizer] values)."""
    group = optimizer.param_groups[0]
    return group.get("scheduled_lr", group["lr"])
