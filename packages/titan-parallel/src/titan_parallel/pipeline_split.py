"""Split a block-structured model into pipeline stages.

A model that follows `titan_core.protocols.ParallelizableModel` is a sequence of *units*:
its `pre_blocks` modules (the embedding), its repeated `layers` ("layers.0", "layers.1", ...)
and its `post_blocks` modules (final norm, output projection, and any blocks of `layers` that
run after them, such as multi-token-prediction layers, named "layers.K"). A stage owns a
contiguous run of units; the pre-block modules always go to the first stage and the
post-block modules to the last, because the model's `forward` runs them in that order.

Three ways to choose the runs, all returning module names per stage:

- `split_by_layers`: equal shares of layers, where the embedding and the output count as
  `first_stage_less_layers` / `last_stage_less_layers` layers' worth of work, so the first
  and last stages get that many fewer layers (torchtitan's
  `pipeline_parallel_{first,last}_stage_less_layers`).
- `validate_split_points`: an explicit list of module-name lists, checked.
- `split_balanced`: a contiguous partition that minimises the most expensive stage, with
  each module's cost its parameter count or its measured forward FLOPs.

`build_stage_modules` then turns module names into per-stage copies of the (meta) model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from titan_core.config import ConfigError
from titan_parallel.tied import tied_parameter_groups

__all__ = [
    "build_stage_modules",
    "check_ties_within_stages",
    "model_units",
    "split_balanced",
    "split_by_layers",
    "validate_split_points",
]


def model_units(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """The model's (pre-block names, layer names, post-block names), in forward order."""
    for attr in ("layers", "pre_blocks", "post_blocks"):
        if not hasattr(model, attr):
            raise TypeError(
                f"{type(model).__name__} has no `{attr}`; pipeline parallel needs a model that declares"
                " its blocks (see titan_core.protocols.ParallelizableModel)"
            )
    if not isinstance(model.layers, nn.ModuleDict):
        raise TypeError(
            f"{type(model).__name__}.layers is a {type(model.layers).__name__}; pipeline parallel needs an"
            " nn.ModuleDict so that block names stay stable when blocks are deleted"
        )
    post = list(model.post_blocks)
    # Blocks the model runs after its output (post_blocks "layers.K") go with the output.
    layers = [f"layers.{key}" for key in model.layers if f"layers.{key}" not in post]
    return list(model.pre_blocks), layers, post


def split_by_layers(
    model: nn.Module,
    num_stages: int | None = None,
    *,
    layers_per_stage: int | None = None,
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
) -> list[list[str]]:
    """Module names per stage, with the layers shared out evenly.

    The embedding counts as `first_stage_less_layers` layers and the output as
    `last_stage_less_layers`. Give either `num_stages` (the units are spread as evenly as
    possible, earlier stages taking the remainder) or `layers_per_stage` (every stage holds
    exactly that many units, so the number of stages follows and the units must divide).
    """
    pre, layers, post = model_units(model)
    if first_stage_less_layers < 0 or last_stage_less_layers < 0:
        raise ConfigError(
            "[parallelism] pipeline_parallel_first_stage_less_layers / last_stage_less_layers must be >= 0"
        )
    units = len(layers) + first_stage_less_layers + last_stage_less_layers
    if layers_per_stage is not None:
        if layers_per_stage < 1:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_layers_per_stage = {layers_per_stage} is not valid\n"
                "use 1 or more"
            )
        if units % layers_per_stage:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_layers_per_stage = {layers_per_stage} does not divide"
                f" the model's {len(layers)} layers + {first_stage_less_layers} (embedding)"
                f" + {last_stage_less_layers} (output) = {units} layer-equivalents\n"
                "choose a divisor, or change pipeline_parallel_{first,last}_stage_less_layers"
            )
        stages_needed = units // layers_per_stage
        if num_stages is not None and num_stages != stages_needed:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_layers_per_stage = {layers_per_stage} makes"
                f" {stages_needed} stages but the schedule needs {num_stages}\n"
                f"use pipeline_parallel_layers_per_stage = {units / num_stages:g} or leave it unset"
            )
        num_stages = stages_needed
    if num_stages is None or num_stages < 1:
        raise ValueError("give num_stages (>= 1) or layers_per_stage")
    sizes = [units // num_stages + (1 if i < units % num_stages else 0) for i in range(num_stages)]
    sizes[0] -= first_stage_less_layers
    sizes[-1] -= last_stage_less_layers
    if num_stages == 1:
        sizes = [len(layers)]
    if min(sizes) < 0 or (num_stages > 1 and 0 in sizes[1:-1]):
        raise ConfigError(
            f"cannot split {len(layers)} layers into {num_stages} pipeline stages"
            f" (first stage {first_stage_less_layers} and last stage {last_stage_less_layers} fewer)\n"
            "use fewer stages (pipeline_parallel_degree or stages per rank), or less "
            "pipeline_parallel_{first,last}_stage_less_layers"
        )
    out: list[list[str]] = []
    start = 0
    for i, size in enumerate(sizes):
        names = layers[start : start + size]
        start += size
        if i == 0:
            names = pre + names
        if i == num_stages - 1:
            names = names + post
        out.append(names)
    return out


def validate_split_points(
    model: nn.Module, split_points: Sequence[Sequence[str]]
) -> list[list[str]]:
    """Check an explicit split (module names per stage) and return it as lists.

    Every pre-block, layer and post-block must appear exactly once, pre-blocks in the first
    stage, post-blocks in the last, and the layers in order with no gaps, since activations
    flow from each stage to the next only.
    """
    pre, layers, post = model_units(model)
    order = pre + layers + post
    position = {name: i for i, name in enumerate(order)}
    seen: dict[str, int] = {}
    problems = []
    if not split_points:
        problems.append("pipeline split points are empty; give one list of module names per stage")
    for stage, names in enumerate(split_points):
        if not names:
            problems.append(f"pipeline stage {stage} has no modules")
        for name in names:
            if name not in position:
                problems.append(
                    f"pipeline stage {stage} names {name!r}, which is not a block of the model\n"
                    f"known: {', '.join(order)}"
                )
            elif name in seen:
                problems.append(
                    f"{name!r} is in pipeline stages {seen[name]} and {stage}; give each module once"
                )
            else:
                seen[name] = stage
    missing = [n for n in order if n not in seen]
    if missing:
        problems.append(
            f"pipeline split points leave out {', '.join(missing)}; every block needs a stage"
        )
    if not problems:
        flat = [n for names in split_points for n in names]
        if [position[n] for n in flat] != sorted(position[n] for n in flat):
            problems.append(
                "pipeline split points are out of forward order; stage k must hold the blocks right after"
                f" stage k-1's, embedding first and output last (got {[list(s) for s in split_points]})"
            )
        last = len(split_points) - 1
        problems += [
            f"{n!r} runs before the blocks and must be in stage 0" for n in pre if seen[n] != 0
        ]
        problems += [
            f"{n!r} runs after the blocks and must be in the last stage"
            for n in post
            if seen[n] != last
        ]
    if problems:
        raise ConfigError(problems)
    return [list(names) for names in split_points]


def _module_costs(
    model: nn.Module, by: Literal["params", "flops"], seq_len: int | None
) -> tuple[list[list[str]], list[float]]:
    """Units (pre-blocks grouped, each layer, post-blocks grouped) and their costs."""
    pre, layers, post = model_units(model)
    if by == "params":

        def cost(name: str) -> float:
            return float(sum(p.numel() for p in model.get_submodule(name).parameters()))

    elif by == "flops":
        if seq_len is None:
            raise ValueError("balancing by FLOPs needs seq_len")
        per_module = _forward_flops(model, seq_len)

        def cost(name: str) -> float:
            return float(per_module.get(name, 0))

    else:
        raise ValueError(f"unknown balance measure {by!r}; use 'params' or 'flops'")
    units = ([pre] if pre else []) + [[name] for name in layers] + ([post] if post else [])
    return units, [sum(cost(n) for n in unit) for unit in units]


def _forward_flops(model: nn.Module, seq_len: int) -> dict[str, int]:
    """Forward FLOPs of each submodule for one sequence, measured on meta tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    meta_model = copy.deepcopy(model).to("meta") if _has_real_tensors(model) else model
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            meta_model(tokens)
    except Exception as exc:  # the model's forward is the user's code: say what we tried
        raise RuntimeError(
            f"could not count FLOPs by running {type(model).__name__} on a meta [1, {seq_len}] token batch"
            f" ({exc}); balance by 'params' or give explicit split points"
        ) from exc
    root = type(meta_model).__name__ + "."
    return {
        key.removeprefix(root): sum(counts.values())
        for key, counts in counter.get_flop_counts().items()
        if key.startswith(root)
    }


def _has_real_tensors(model: nn.Module) -> bool:
    return any(not t.is_meta for t in [*model.parameters(), *model.buffers()])


def split_balanced(
    model: nn.Module,
    num_stages: int,
    *,
    by: Literal["params", "flops"] = "flops",
    seq_len: int | None = None,
) -> list[list[str]]:
    """Module names per stage, minimising the cost of the most expensive stage.

    The embedding (pre-blocks) and the output (post-blocks) are charged to the first and last
    stage with their real cost: with `by="params"` their parameter count, with `by="flops"`
    their forward FLOPs for one `seq_len` sequence (counted on meta tensors, no memory used).
    """
    units, costs = _module_costs(model, by, seq_len)
    if num_stages > len(units):
        raise ConfigError(
            f"cannot split {len(units)} pipeline units (embedding, {len(model.layers)} layers, output)"
            f" into {num_stages} stages\nuse fewer stages"
        )
    bounds = _min_max_partition(costs, num_stages)
    return [[n for unit in units[a:b] for n in unit] for a, b in zip(bounds, bounds[1:])]


def _min_max_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Boundaries [0, ..., len(costs)] of the contiguous split into `parts` non-empty runs
    whose largest sum is smallest (dynamic programme; ties go to the earliest cut)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: smallest max-run-cost for the first i units in k runs
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def check_ties_within_stages(model: nn.Module, names_per_stage: Sequence[Sequence[str]]) -> None:
    """Raise a ConfigError if a parameter that several modules share (a tied embedding and
    output projection) would be held by more than one stage.

    Each stage would train its own copy, and the copies would drift apart from the first
    step: pipeline parallel does not synchronise them, so such a split is refused.
    """
    stage_of = {name: i for i, names in enumerate(names_per_stage) for name in names}

    def stage(param_name: str) -> int | None:
        for unit, i in stage_of.items():
            if param_name.startswith(unit + "."):
                return i
        return None  # held by the root itself: every stage keeps it

    problems = []
    for group in tied_parameter_groups(model):
        stages = {name: stage(name) for name in group}
        if len(set(stages.values())) > 1:
            where = ", ".join(
                f"{name} (stage {s})" if s is not None else f"{name} (every stage)"
                for name, s in stages.items()
            )
            problems.append(
                f"{' and '.join(group)} are one tied parameter, but pipeline parallel would put"
                f" its holders on different stages ({where}), and each stage would train its own"
                " copy\nuntie the weights (for Llama: tie_word_embeddings = false), or train"
                " without pipeline parallel"
            )
    if problems:
        raise ConfigError(problems)


def build_stage_modules(
    model: nn.Module, names_per_stage: Sequence[Sequence[str]], stage_ids: Sequence[int]
) -> list[nn.Module]:
    """One copy of `model` per local stage, holding only that stage's modules.

    Blocks the stage does not own are deleted from `layers` (the rest keep their names,
    "layers.5" stays "layers.5", so checkpoints load unchanged); pre- and post-block
    modules it does not own are set to None, which the model's forward passes through.
    Build on the meta device: the copies cost no memory until `to_empty`. A tied parameter
    whose holders would land on different stages raises a ConfigError first
    (`check_ties_within_stages`).
    """
    pre, _, post = model_units(model)
    check_ties_within_stages(model, names_per_stage)
    parts = []
    for stage in stage_ids:
        owned = set(names_per_stage[stage])
        part = copy.deepcopy(model)
        for key in list(part.layers):
            if f"layers.{key}" not in owned:
                del part.layers[key]
        for name in pre + post:
            if name not in owned and not name.startswith("layers."):  # blocks: deleted above
                parent, _, leaf = name.rpartition(".")
                setattr(part.get_submodule(parent) if parent else part, leaf, None)
        parts.append(part)
    return parts
