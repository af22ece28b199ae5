"""Splitting a block-structured model into pipeline stages (single process, meta device)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titan_core.config import ConfigError
from titan_parallel.pipeline import SCHEDULES, pipeline_stage_ids
from titan_parallel.pipeline_split import (
    build_stage_modules,
    model_units,
    split_balanced,
    split_by_layers,
    validate_split_points,
)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.silu(self.w1(x)))


class Net(nn.Module):
    pre_blocks = ("tok_embeddings",)
    post_blocks = ("norm", "output")

    def __init__(self, n_layers: int = 6, dim: int = 8, vocab: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(n_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def meta_net(**kwargs) -> Net:
    with torch.device("meta"):
        return Net(**kwargs)


def layers_of(stage: list[str]) -> list[int]:
    return [int(n.split(".")[1]) for n in stage if n.startswith("layers.")]


def test_first_and_last_stage_get_fewer_layers_for_embedding_and_output():
    split = split_by_layers(meta_net(n_layers=6), 4)
    # 6 layers + embedding + output = 8 layer-equivalents, 2 per stage.
    assert split == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["layers.5", "norm", "output"],
    ]
    assert split_by_layers(
        meta_net(n_layers=6), 4, first_stage_less_layers=0, last_stage_less_layers=0
    ) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4"],
        ["layers.5", "norm", "output"],
    ]


def test_layers_per_stage_fixes_the_number_of_stages():
    split = split_by_layers(meta_net(n_layers=6), layers_per_stage=1)
    assert len(split) == 8
    assert split[0] == ["tok_embeddings"] and split[-1] == ["norm", "output"]
    assert [layers_of(s) for s in split[1:-1]] == [[i] for i in range(6)]


def test_layers_that_do_not_split_or_too_many_stages_are_config_errors():
    with pytest.raises(
        ConfigError, match="layers_per_stage = 3 does not divide.*= 8 layer-equivalents"
    ):
        split_by_layers(meta_net(n_layers=6), layers_per_stage=3)
    with pytest.raises(ConfigError, match="cannot split 2 layers into 6 pipeline stages"):
        split_by_layers(meta_net(n_layers=2), 6)


def test_explicit_split_points_are_checked_for_coverage_order_and_ends():
    net = meta_net(n_layers=4)
    good = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
    assert validate_split_points(net, good) == good
    with pytest.raises(ConfigError, match="leave out layers.3"):
        validate_split_points(
            net, [["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["norm", "output"]]
        )
    with pytest.raises(ConfigError, match="'layers.9', which is not a block"):
        validate_split_points(
            net, [*good[:1], ["layers.2", "layers.3", "layers.9", "norm", "output"]]
        )
    with pytest.raises(ConfigError, match="out of forward order"):
        validate_split_points(
            net,
            [
                ["tok_embeddings", "layers.2", "layers.3"],
                ["layers.0", "layers.1", "norm", "output"],
            ],
        )
    with pytest.raises(ConfigError, match="'layers.1' is in pipeline stages 0 and 1"):
        validate_split_points(net, [good[0], ["layers.1", *good[1]]])


def test_balancing_by_params_charges_the_embedding_and_output_to_the_end_stages():
    # A large vocabulary makes the embedding and the output each weigh as much as several
    # blocks: the balanced split gives the end stages fewer blocks than the middle ones.
    net = meta_net(n_layers=8, dim=8, vocab=8 * 8 * 8 * 2 // 8)  # vocab x dim = 2 blocks' params
    split = split_balanced(net, 4, by="params")
    assert split[0][0] == "tok_embeddings" and split[-1][-2:] == ["norm", "output"]
    counts = [len(layers_of(s)) for s in split]
    assert sum(counts) == 8 and counts[0] < counts[1] and counts[-1] < counts[2]
    costs = [sum(p.numel() for n in s for p in net.get_submodule(n).parameters()) for s in split]
    block = sum(p.numel() for p in net.layers["0"].parameters())
    assert max(costs) - min(costs) <= block  # no better contiguous split exists for equal blocks


def test_balancing_by_flops_counts_the_output_projection_and_not_the_lookup():
    net = meta_net(n_layers=6, dim=8, vocab=256)
    split = split_balanced(net, 3, by="flops", seq_len=16)
    # The embedding lookup costs no FLOPs, the 8 x 256 output projection costs as much as
    # 4 blocks' 2 x (8 x 32) matmuls: the first stage takes more blocks than the last.
    first, last = len(layers_of(split[0])), len(layers_of(split[-1]))
    assert first > last
    with pytest.raises(ValueError, match="needs seq_len"):
        split_balanced(net, 3, by="flops")


def test_stage_modules_keep_names_and_pass_input_through_removed_modules():
    net = Net(n_layers=4)
    split = split_by_layers(net, 2)
    first, last = build_stage_modules(net, split, [0, 1])
    assert list(first.layers.keys()) == ["0", "1"] and list(last.layers.keys()) == ["2", "3"]
    assert first.norm is None and first.output is None and last.tok_embeddings is None
    # Names (and so checkpoint keys) are those of the whole model.
    assert set(first.state_dict()) | set(last.state_dict()) == set(net.state_dict())
    tokens = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), net(tokens), rtol=0, atol=0)


def test_models_without_declared_blocks_are_refused():
    with pytest.raises(TypeError, match="has no `layers`"):
        model_units(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "style,expected",
    [
        ("single", [[0], [1], [2], [3]]),
        ("loop", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("v", [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ],
)
def test_stage_placement_per_schedule_style(style, expected):
    assert [pipeline_stage_ids(style, r, 4, 2) for r in range(4)] == expected


def test_schedule_table_names_every_schedule_torch_offers():
    from torch.distributed.pipelining import schedules

    offered = {n.removeprefix("Schedule") for n in dir(schedules) if n.startswith("Schedule")}
    assert set(SCHEDULES) == offered
    for name in SCHEDULES:
        assert schedules.get_schedule_class(name).__name__ == f"Schedule{name}"


def test_a_tied_weight_split_across_stages_is_refused_before_any_stage_is_built():
    model = meta_net(n_layers=4)
    model.output.weight = model.tok_embeddings.weight  # tied, as in Llama 3.2 1B or GPT-2
    split = split_by_layers(model, 2)
    with pytest.raises(ConfigError) as e:
        build_stage_modules(model, split, [0])
    message = str(e.value)
    assert "tok_embeddings.weight and output.weight are one tied parameter" in message
    assert "tok_embeddings.weight (stage 0), output.weight (stage 1)" in message
    assert "untie the weights" in message
    # One stage holding both ends keeps the tie, so it is allowed.
    (whole,) = build_stage_modules(model, split_by_layers(model, 1), [0])
    assert whole.output.weight is whole.tok_embeddings.weight
