"""`[[optimizer.param_groups]]`: learning rate, weight decay, betas, eps (and Muon's switch)
per group of parameters chosen by a regular expression over their names, for every optimizer.
This module is the config section, read and checked with the rest of the config before torch
is imported; how the groups take the model's parameters is `titan_trainer.param_grouping`.

A parameter's name is the one the model gives it (`layers.0.attention.wq.weight`), whatever
wraps it: FSDP, TP, pipeline stages, compile and activation checkpointing leave it unchanged.
The first group whose regex is found in the name (`re.search`; anchor with ^ and $) takes the
parameter; the others take the [optimizer] values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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
