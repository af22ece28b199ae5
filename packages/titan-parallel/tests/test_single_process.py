"""Behaviour that needs no process group: clipping, activation checkpointing, compile wiring,
TP-plan checks and small helpers."""

from __future__ import annotations

import math

import pytest
import torch
from parallel_testmodel import TinyArgs, TinyTransformer, cross_entropy

from titan_core.config import ConfigError
from titan_parallel import (
    ActivationCheckpoint,
    Compile,
    apply_ac,
    apply_compile,
    autocast_context,
    check_tp_plan,
    clip_grad_norm_,
    dist_max,
    dist_mean,
    dist_sum,
    resolve_reshard_after_forward,
    total_grad_norm,
)


def _model_with_grads(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer()
    model.init_weights()
    x = torch.randint(0, TinyArgs().vocab, (2, 9))
    cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_matches_torch_on_plain_tensors(norm_type: float) -> None:
    ours, theirs = _model_with_grads(), _model_with_grads()
    got = clip_grad_norm_(ours.parameters(), 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type)
    torch.testing.assert_close(got, want)  # default fp32 tolerances: same sums, same order
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_clip_grad_norm_errors_on_non_finite_norm_when_asked() -> None:
    model = _model_with_grads()
    next(model.parameters()).grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="diverged"):
        clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_total_grad_norm_without_grads_is_zero() -> None:
    assert total_grad_norm(TinyTransformer().parameters()).item() == 0.0


def test_metric_reduction_without_a_mesh_is_the_value_itself() -> None:
    assert (
        dist_mean(torch.tensor(2.5)) == 2.5
        and dist_sum(3.0) == 3.0
        and dist_max(torch.tensor([4.0])) == 4.0
    )


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("mode", "option", "wrapped"),
    [("full", "op", 2), ("selective", "op", 2), ("selective", "2", 1)],
)
def test_activation_checkpointing_keeps_gradients_and_state_dict_names(
    mode: str, option: str, wrapped: int
) -> None:
    plain = _model_with_grads()
    torch.manual_seed(0)
    model = TinyTransformer()
    names = list(model.state_dict())
    apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=option))
    assert sum("CheckpointWrapper" in type(b).__name__ for b in model.layers.values()) == wrapped
    assert list(model.state_dict()) == names
    model.load_state_dict(plain.state_dict())
    plain.zero_grad()
    torch.manual_seed(1)
    x = torch.randint(0, TinyArgs().vocab, (2, 9))
    for m in (plain, model):
        cross_entropy(m(x[:, :-1]), x[:, 1:]).backward()
    ours = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in _grads(model).items()}
    for name, grad in _grads(plain).items():
        # Recomputation repeats the same kernels on the same inputs: bitwise equal on CPU.
        assert torch.equal(ours[name], grad), name


def test_activation_checkpointing_none_leaves_blocks_alone() -> None:
    model = TinyTransformer()
    apply_ac(model, ActivationCheckpoint(mode="none"))
    assert all(type(b).__name__ == "Block" for b in model.layers.values())


def test_invalid_selective_option_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="selective_ac_option"):
        apply_ac(TinyTransformer(), ActivationCheckpoint(selective_ac_option="sometimes"))


def test_compile_is_per_block_and_keeps_parameter_names() -> None:
    model = TinyTransformer()
    names = [n for n, _ in model.named_parameters()]
    apply_compile(model, Compile(enable=True, backend="eager"))
    assert all(b._compiled_call_impl is not None for b in model.layers.values())
    assert [n for n, _ in model.named_parameters()] == names
    apply_compile(other := TinyTransformer(), Compile(enable=True, components=["loss"]))
    assert all(b._compiled_call_impl is None for b in other.layers.values())


def test_tp_plan_checks_divisibility_and_module_names() -> None:
    model = TinyTransformer()
    assert check_tp_plan(model, model.tp_plan(), 2) == []
    problems = check_tp_plan(model, model.tp_plan(), 3)
    assert any("n_heads = 4 does not divide by tensor_parallel_degree 3" in p for p in problems)
    plan = type(model.tp_plan())(root={"lm_head": "output"}, block={"attn.wq": "colwise"})
    (problem,) = check_tp_plan(model, plan, 2)
    assert "lm_head" in problem and "layers.0.attn.wq" in problem


def test_tp_plan_blocks_give_particular_blocks_their_own_styles() -> None:
    from titan_parallel.tensor_parallel import block_plan

    model = TinyTransformer()
    # Block 1 becomes another kind of block (say a mixture of experts): no w1/w2/w3 of its own.
    model.layers["1"].feed_forward = torch.nn.Sequential(torch.nn.Linear(32, 32))
    plan = model.tp_plan()
    (problem,) = check_tp_plan(model, plan, 2)
    assert "layers.1.feed_forward.w1" in problem and "layers.0." not in problem
    other = {n: s for n, s in plan.block.items() if not n.startswith("feed_forward")}
    plan = type(plan)(root=plan.root, block=plan.block, blocks={"1": other})
    assert check_tp_plan(model, plan, 2) == []
    assert block_plan(plan, "1") == other and block_plan(plan, "0") == plan.block


def test_tp_plan_skips_modules_removed_by_pipeline_parallel() -> None:
    model = TinyTransformer()
    model.output = None
    assert check_tp_plan(model, model.tp_plan(), 2) == []


def test_reshard_after_forward_default_depends_on_pipeline_parallel() -> None:
    assert resolve_reshard_after_forward("default") is True
    assert resolve_reshard_after_forward("default", pp_enabled=True) is False
    assert resolve_reshard_after_forward("always", pp_enabled=True) is True
    assert resolve_reshard_after_forward("never") is False
    with pytest.raises(ValueError, match="sometimes"):
        resolve_reshard_after_forward("sometimes")


def test_autocast_only_without_fsdp_and_below_fp32() -> None:
    with autocast_context(False, torch.bfloat16, "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast_context(True, torch.bfloat16, "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
