"""Tied parameters: one `nn.Parameter` held by several modules, such as a language model's
token embedding and output projection (Llama 3.2 1B and 3B, GPT-2).

Each parallelism has to keep such a parameter one parameter:
- FSDP puts every module that holds it into one FSDP group (`data_parallel.apply_fsdp`);
- tensor parallel checks up front that the plan splits it the same way in every module that
  holds it, and ties the split parameters again afterwards (`tensor_parallel.apply_tp`);
- pipeline parallel refuses a split that puts its holders on different stages
  (`pipeline_split.check_ties_within_stages`);
- `keep_ties_on_conversion` keeps it tied through `to_empty()` and `.to(device)`: plain
  PyTorch gives each module a fresh parameter when a tensor changes device type (meta -> cpu),
  which unties the weights without a word.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from torch import nn

__all__ = ["keep_ties_on_conversion", "retie", "tied_parameter_groups"]

TiedGroups = list[list[str]]


def tied_parameter_groups(model: nn.Module) -> TiedGroups:
    """The fully qualified names of each parameter that `model` holds under more than one
    name, in registration order (e.g. `[["tok_embeddings.weight", "output.weight"]]`)."""
    names: dict[int, list[str]] = defaultdict(list)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for leaf, param in module._parameters.items():
            if param is not None:
                names[id(param)].append(f"{prefix}.{leaf}" if prefix else leaf)
    return [group for group in names.values() if len(group) > 1]


def _holder(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def retie(model: nn.Module, groups: Sequence[Sequence[str]]) -> None:
    """Make every name of each group hold the parameter its first name holds (in place)."""
    for group in groups:
        first_module, first_leaf = _holder(model, group[0])
        shared = first_module._parameters.get(first_leaf)
        if shared is None:
            continue
        for name in group[1:]:
            module, leaf = _holder(model, name)
            if module._parameters.get(leaf) is not shared:
                module._parameters[leaf] = shared


_TIE_KEEPING: dict[type, type] = {}


def _apply_keeping_ties(self: nn.Module, fn, recurse: bool = True) -> nn.Module:
    # The class made by keep_ties_on_conversion sits right below the model's own class.
    base = next(c for c in type(self).__mro__ if c in _TIE_KEEPING.values())
    out = super(base, self)._apply(fn, recurse)
    retie(self, self._titan_tied_parameters)
    return out


def keep_ties_on_conversion(model: nn.Module, groups: TiedGroups | None = None) -> TiedGroups:
    """Keep `model`'s tied parameters tied through `to_empty()`, `.to()`, `.cuda()` and every
    other `Module._apply` conversion, in place; return the tied groups (names).

    Like `fully_shard`, it gives `model` a subclass of its own class, here one whose `_apply`
    ties the groups again after converting. A model without tied parameters is left alone.
    """
    groups = tied_parameter_groups(model) if groups is None else [list(g) for g in groups]
    if not groups:
        return groups
    model._titan_tied_parameters = groups
    cls = type(model)
    if cls in _TIE_KEEPING.values() or any(c in _TIE_KEEPING.values() for c in cls.__mro__):
        return groups
    if cls not in _TIE_KEEPING:
        _TIE_KEEPING[cls] = type(
            cls.__name__,
            (cls,),
            {"_apply": _apply_keeping_ties, "__module__": cls.__module__, "__doc__": cls.__doc__},
        )
    model.__class__ = _TIE_KEEPING[cls]
    return groups
