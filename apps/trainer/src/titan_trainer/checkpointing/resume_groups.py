"""Whether the optimizer state of the checkpoint a run resumes from loads into the run's
`[[optimizer.param_groups]]`, checked before any process group (the groups themselves:
`titan_trainer.param_groups`)."""

from __future__ import annotations

from torch import nn

from titan_trainer.checkpointing.resume import resume_point, saved_config
from titan_trainer.param_grouping import membership, model_names


def resume_group_problems(config, model: nn.Module) -> list[str]:
    """Whether the optimizer state of the checkpoint this run resumes from loads into this
    run's groups: the same optimizer; under Muon, the same parameters orthogonalised; and no
    group holding parameters that were in different groups there (their saved values could
    not be told apart). Changed values of the same groups are fine: the config's win."""
    point = resume_point(config)
    if point is None:
        return []
    saved_run = saved_config(point)
    if saved_run is None:
        return []
    path = point.path
    saved = saved_run.optimizer
    now = config.optimizer
    fix = (
        f"resume with the [optimizer] it was saved with (see {path}/config.toml), or start a"
        f" new run from its weights: --checkpoint.initial_load_path {path} with another"
        " --checkpoint.folder (initial_load_model_only is on by default)"
    )
    if saved.name != now.name:
        return [
            f"[optimizer] name = {now.name!r}, but the checkpoint this run resumes from ({path})"
            f" holds the state of {saved.name!r}, which does not load into {now.name}\n{fix}"
        ]
    names = {id(p): name for name, p in model_names([model])}
    before, after = membership(model, saved), membership(model, now)
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


def _few(names: list[str]) -> str:
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
