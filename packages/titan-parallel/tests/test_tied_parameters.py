"""Tied parameters without a process group: finding them, keeping them tied through
`to_empty`, and which modules FSDP puts in one group."""

from __future__ import annotations

import torch
from gpt2_usermodel import GPT2
from torch import nn

from titan_parallel import keep_ties_on_conversion, tied_parameter_groups
from titan_parallel.data_parallel import _fsdp_groups


def meta_gpt2() -> GPT2:
    with torch.device("meta"):
        return GPT2()


def test_tied_groups_name_every_holder_in_registration_order() -> None:
    assert tied_parameter_groups(meta_gpt2()) == [["wte.weight", "lm_head.weight"]]
    assert tied_parameter_groups(nn.Linear(2, 2)) == []


def test_plain_to_empty_unties_and_keep_ties_on_conversion_keeps_them() -> None:
    untied = meta_gpt2()
    untied.to_empty(device="cpu")  # what PyTorch does on its own: a fresh parameter per module
    assert untied.lm_head.weight is not untied.wte.weight

    model = meta_gpt2()
    assert keep_ties_on_conversion(model) == [["wte.weight", "lm_head.weight"]]
    assert isinstance(model, GPT2) and type(model).__name__ == "GPT2"
    model.to_empty(device="cpu")
    assert model.lm_head.weight is model.wte.weight
    model.to(torch.float64)
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.dtype == torch.float64
    assert len(list(model.parameters())) == len(list(GPT2().parameters()))
    keep_ties_on_conversion(model)  # a second call changes nothing
    assert type(model).__bases__ == (GPT2,)  # not wrapped twice


def test_model_without_ties_is_left_alone() -> None:
    linear = nn.Linear(2, 2)
    assert keep_ties_on_conversion(linear) == [] and type(linear) is nn.Linear


def test_fsdp_puts_modules_sharing_a_parameter_in_one_group() -> None:
    model = meta_gpt2()
    units = [
        [model.wte],
        [model.wpe],
        *([b] for b in model.layers.values()),
        [model.ln_f, model.lm_head],
    ]
    groups = _fsdp_groups(model, units)
    # The embedding joins the output projection's group; everything else stays on its own.
    assert groups == [
        [model.wte, model.ln_f, model.lm_head],
        [model.wpe],
        [model.layers["0"]],
        [model.layers["1"]],
    ]


def test_fsdp_leaves_a_unit_to_the_root_when_it_shares_with_the_root() -> None:
    model = meta_gpt2()
    # A model that does not declare lm_head as a post-block: the root holds it, so the
    # embedding it shares its weight with must stay in the root's group too.
    units = [[model.wte], [model.wpe], *([b] for b in model.layers.values()), [model.ln_f]]
    groups = _fsdp_groups(model, units)
    assert [model.wte] not in groups and [model.wpe] in groups and len(groups) == 4
