"""How `[[optimizer.param_groups]]` (`titan_trainer.param_groups`) take the model's
parameters: each becomes one torch parameter group (two under Muon: the matrices it
orthogonalises and the rest), which the LR schedule scales from the group's own peak.

A parameter's name is the one the model gives it: FSDP, TP, pipeline stages, compile and
activation checkpointing leave it unchanged (their `_orig_mod.` and
`_checkpoint_wrapped_module.` prefixes are removed before matching). A group that matches no
parameter of the model is refused before training (`unmatched_group_problems`, on the full
model before the pipeline split).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

import titan_parallel
from titan_core.init import canonical_name
from titan_trainer.param_groups import ParamGroup

DEFAULT = "default"
"""The label of the parameters no [[optimizer.param_groups]] matches."""


def model_names(parts: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """(name as the model gives it, parameter) for each trainable parameter of `parts`."""
    return [
        (canonical_name(name), p)
        for part in parts
        for name, p in part.named_parameters()
        if p.requires_grad
    ]


def group_index(name: str, groups: list[ParamGroup]) -> int | None:
    """The index of the first group whose regex is found in `name`, or None."""
    for i, group in enumerate(groups):
        if re.search(group.params, name):
            return i
    return None


def label(index: int | None, groups: list[ParamGroup]) -> str:
    return DEFAULT if index is None else f"#{index + 1} {groups[index].params}"


def unmatched_group_problems(cfg, names: list[str]) -> list[str]:
    """A problem for each group that takes no parameter of the whole model (`names`): its
    regex matches nothing, or only names an earlier group already took."""
    taken = {group_index(name, cfg.param_groups) for name in names}
    problems = []
    for i, group in enumerate(cfg.param_groups):
        if i in taken:
            continue
        shadowed = [n for n in names if re.search(group.params, n)]
        why = (
            f"every parameter it matches ({shadowed[0]}, ...) is taken by an earlier group"
            if shadowed
            else f"it matches none of the model's {len(names)} parameter names"
            f" (e.g. {', '.join(names[:3])})"
        )
        problems.append(
            f"[[optimizer.param_groups]] #{i + 1} params = {group.params!r} takes no parameter:"
            f" {why}\nfix the regex or remove the group"
        )
    return problems


def build_param_groups(parts: list[nn.Module], cfg) -> list[dict[str, Any]]:
    """The torch parameter groups of this rank's `parts` for the [optimizer] section `cfg`:
    the parameters no [[optimizer.param_groups]] entry takes first (the [optimizer] values),
    then one group per entry that takes a parameter here, with the entry's values; under Muon
    each is split into the matrices Muon orthogonalises (`use_muon`) and the others."""
    out = []
    for index, kind, params in _grouped(parts, cfg):
        group: dict[str, Any] = {"params": params}
        if index is not None:
            group.update(_overrides(cfg.param_groups[index], cfg))
        if cfg.name == "Muon":
            group["use_muon"] = kind
        out.append(group)
    return out


def _grouped(parts: list[nn.Module], cfg) -> list[tuple[int | None, bool, list[torch.Tensor]]]:
    """(entry index or None, orthogonalised by Muon, parameters) per torch group, in order."""
    embedding = {
        id(p)
        for part in parts
        for m in part.modules()
        if isinstance(m, nn.Embedding)
        for p in m.parameters()
    }
    buckets: dict[tuple[int, bool], list[torch.Tensor]] = {}
    for name, p in model_names(parts):
        index = group_index(name, cfg.param_groups)
        kind = False
        if cfg.name == "Muon":
            chosen = cfg.param_groups[index].muon if index is not None else None
            default = titan_parallel.uses_muon(name, p, id(p) in embedding)
            # Muon takes matrices only: a vector in a `muon = true` group gets AdamW.
            kind = (default if chosen is None else chosen) and p.ndim >= 2
        buckets.setdefault((-1 if index is None else index, kind), []).append(p)
    order = sorted(buckets)  # the default group first, AdamW's part before Muon's
    return [(None if i < 0 else i, kind, buckets[(i, kind)]) for i, kind in order]


def _overrides(entry: ParamGroup, cfg) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if entry.lr is not None:
        out["lr"] = entry.lr
    if entry.weight_decay is not None:
        out["weight_decay"] = entry.weight_decay
    if entry.beta1 is not None or entry.beta2 is not None:
        b1 = cfg.beta1 if entry.beta1 is None else entry.beta1
        out["betas"] = (b1, cfg.beta2 if entry.beta2 is None else entry.beta2)
    if entry.eps is not None:
        out["eps"] = entry.eps
    return out


def membership(model: nn.Module, cfg) -> dict[int, tuple[str, bool]]:
    """Per parameter (by id): (its group's label, whether Muon orthogonalises it) under the
    [optimizer] section `cfg`."""
    out = {}
    for index, kind, params in _grouped([model], cfg):
        for p in params:
            out[id(p)] = (label(index, cfg.param_groups), kind)
    return out
