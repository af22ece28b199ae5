"""`[[optimizer.param_groups]]`: learning rate, weight decay, betas, eps (and Muon's switch)
per group of parameters chosen by a regular expression over their names, for every optimizer.

A parameter's name is the one the model gives it (`layers.0.attention.wq.weight`), whatever
wraps it: FSDP, TP, pipeline stages, compile and activation checkpointing leave it unchanged
(their `_orig_mod.` and `_checkpoint_wrapped_module.` prefixes are removed before matching).
The first group whose regex is found in the name (`re.search`; anchor with ^ and $) takes the
parameter; the others take the [optimizer] values. Each group becomes one torch parameter
group (two under Muon: the matrices it orthogonalises and the rest), which the LR schedule
scales from the group's own peak.

Problems, all before training: a regex that does not compile, a value out of range, `muon`
set for another optimizer (each section's `validate`); a group that matches no parameter of
the model (`unmatched_group_problems`, on the full model before the pipeline split); and a
resume whose checkpoint was saved with other groups (`resume_group_problems`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: [[optimizer.param_groups]] is read and checked with
    import torch  # the rest of the config, before torch's seconds of import
    from torch import nn

DEFAULT = "default"
"""The label of the parameters no [[optimizer.param_groups]] matches."""


@dataclass
class ParamGroup:
    params: str = ""
    """Regular expression searched (`re.search`) in each parameter's name as the model names
    it (`layers.0.attention.wq.weight`; unchanged by FSDP, TP, pipeline stages, compile and
    activation checkpointing). The first group whose regex matches takes the parameter."""
    lr: float | None = None
    """The group's peak learning rate (the LR schedule scales it); none: [optimizer] lr (or,
    for Muon's matrices, [optimizer.muon] lr when set)."""
    weight_decay: float | None = None
    """The group's decoupled weight decay; none: [optimizer] weight_decay."""
    beta1: float | None = None
    """The group's first-moment decay; none: [optimizer] beta1."""
    beta2: float | None = None
    """The group's second-moment decay; none: [optimizer] beta2."""
    eps: float | None = None
    """The group's epsilon; none: [optimizer] eps."""
    muon: bool | None = None
    """Muon only: true, Muon orthogonalises the group's matrices; false, AdamW steps them;
    none: Muon's default (matrices, except embeddings, the output head and MoE routers)."""

    def validate(self) -> list[str]:
        where = f"[[optimizer.param_groups]] params = {self.params!r}"
        if not self.params:
            return [
                "[[optimizer.param_groups]] has no params\n"
                'give the regex of the parameter names it takes, e.g. params = "norm|bias"'
            ]
        try:
            re.compile(self.params)
        except re.error as e:
            return [f"{where} is not a valid regular expression: {e}\nfix the pattern"]
        problems = []
        checks = (
            ("lr", self.lr is None or self.lr >= 0, "use 0 or a positive learning rate"),
            ("weight_decay", self.weight_decay is None or self.weight_decay >= 0, "use 0 or more"),
            ("beta1", self.beta1 is None or 0 <= self.beta1 < 1, "use a value in [0, 1)"),
            ("beta2", self.beta2 is None or 0 <= self.beta2 < 1, "use a value in [0, 1)"),
            ("eps", self.eps is None or self.eps >= 0, "use 0 or more"),
        )
        for key, ok, fix in checks:
            if not ok:
                problems.append(f"{where}: {key} = {getattr(self, key)} is not valid\n{fix}")
        return problems


def optimizer_group_problems(cfg) -> list[str]:
    """Checks of [optimizer] that involve its groups (from `Optimizer.validate`)."""
    problems = []
    if cfg.name != "Muon":
        for group in cfg.param_groups:
            if group.muon is not None:
                problems.append(
                    f"[[optimizer.param_groups]] params = {group.params!r} sets muon = "
                    f"{str(group.muon).lower()}, but [optimizer] name = {cfg.name!r}\n"
                    "muon chooses what Muon orthogonalises; remove it, or use name = 'Muon'"
                )
    return problems


def model_names(parts: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """(name as the model gives it, parameter) for each trainable parameter of `parts`."""
    from titan_core.init import canonical_name  # imports torch

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
    from torch import nn

    import titan_parallel

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


def group_preflight_problems(config, model: nn.Module) -> list[str]:
    """The checks that need the whole model (`model`, on the meta device, before any split):
    every group takes a parameter, and a resume finds the groups its checkpoint has."""
    problems = []
    if config.optimizer.param_groups:
        names = [name for name, _ in model_names([model])]
        problems += unmatched_group_problems(config.optimizer, names)
    return problems + resume_group_problems(config, model)


def resume_group_problems(config, model: nn.Module) -> list[str]:
    """Whether the optimizer state of the checkpoint this run resumes from loads into this
    run's groups: the same optimizer; under Muon, the same parameters orthogonalised; and no
    group holding parameters that were in different groups there (their saved values could
    not be told apart). Changed values of the same groups are fine: the config's win."""
    from titan_trainer.resume_check import resumed_checkpoint, saved_config

    path = resumed_checkpoint(config)
    if path is None:
        return []
    saved_run = saved_config(path)
    if saved_run is None:
        return []
    saved = saved_run.optimizer
    now = config.optimizer
    fix = (
        f"resume with the [optimizer] it was saved with (see {path / 'config.toml'}), or start a"
        f" new run from its weights: --checkpoint.initial_load_path {path} with another"
        " --checkpoint.folder (initial_load_model_only is on by default)"
    )
    if saved.name != now.name:
        return [
            f"[optimizer] name = {now.name!r}, but the checkpoint this run resumes from ({path})"
            f" holds the state of {saved.name!r}, which does not load into {now.name}\n{fix}"
        ]
    names = {id(p): name for name, p in model_names([model])}
    before, after = _membership(model, saved), _membership(model, now)
    problems = []
    if now.name == "Muon":
        switched = [names[i] for i in after if before[i][1] != after[i][1]]
        if switched:
            first = next(i for i in after if names[i] == switched[0])
            was = "orthogonalised by Muon" if before[first][1] else "stepped by AdamW"
            problems.append(
                f"[[optimizer.param_groups]] muon changed since the checkpoint this run resumes"
                f" from ({path}): {_few(switched)} were {was} there and are not now (Muon keeps"
                f" a momentum, AdamW two moments)\n{fix}"
            )
    merged = []
    for group in {g for g, _ in after.values()}:
        sources = {before[i][0] for i in after if after[i][0] == group}
        if len(sources) > 1:
            merged.append((group, sorted(sources)))
    for group, sources in merged:
        members = [names[i] for i in after if after[i][0] == group]
        problems.append(
            f"[[optimizer.param_groups]] changed since the checkpoint this run resumes from"
            f" ({path}): group {group} now holds parameters ({_few(members)}) that were in"
            f" different groups there ({', '.join(sources)}), whose saved values differ\n{fix}"
        )
    return problems


def _membership(model: nn.Module, cfg) -> dict[int, tuple[str, bool]]:
    """Per parameter (by id): (its group's label, whether Muon orthogonalises it)."""
    out = {}
    for index, kind, params in _grouped([model], cfg):
        for p in params:
            out[id(p)] = (label(index, cfg.param_groups), kind)
    return out


def _few(names: list[str]) -> str:
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
