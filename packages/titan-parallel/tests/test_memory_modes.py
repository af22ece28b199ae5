"""Activation offload to host memory and the compiler's activation memory budget
([activation_checkpoint] cpu_offload, mode = "memory_budget"), on the tiny transformer."""

from __future__ import annotations

import pytest
import torch
from parallel_testmodel import TinyArgs, TinyTransformer, cross_entropy
from torch._functorch import config as functorch_config

from titan_core.config import ConfigError
from titan_parallel import (
    ActivationCheckpoint,
    Compile,
    apply_ac,
    apply_compile,
    check_parallelize_config,
)
from titan_parallel.activation_offload import (
    OffloadWrapper,
    host_memory_separate,
    offloaded_bytes,
)
from titan_parallel.memory_estimate import estimate_step_memory

TOKENS = torch.randint(0, TinyArgs().vocab, (2, 17), generator=torch.Generator().manual_seed(0))


def _model(ac: ActivationCheckpoint | None = None, compile: Compile | None = None):
    torch.manual_seed(0)
    model = TinyTransformer()
    model.init_weights()
    if ac is not None:
        apply_ac(model, ac)
    if compile is not None:
        apply_compile(model, compile)
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    cross_entropy(model(TOKENS[:, :-1]), TOKENS[:, 1:]).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _saved_bytes(model) -> int:
    """Bytes autograd saves for backward in one forward (storages counted once)."""
    seen: dict[int, int] = {}

    def pack(t):
        if type(t) is torch.Tensor and not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy(model(TOKENS[:, :-1]), TOKENS[:, 1:])
    loss.backward()
    return sum(seen.values())


def _strip(grads: dict) -> dict:
    from titan_core.init import canonical_name

    return {canonical_name(k): v for k, v in grads.items()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_offloaded_blocks_give_the_same_gradients_and_keep_their_activations_on_the_host(
    compiled,
):
    compile = Compile(enable=True, backend="aot_eager") if compiled else None
    want = _grads(_model())  # eager: one compilation less
    model = _model(ActivationCheckpoint(mode="none", cpu_offload=True), compile)
    assert all(isinstance(b, OffloadWrapper) for b in model.layers.values())
    # The state_dict keys are the unwrapped model's (checkpoints do not see the wrapper).
    assert set(model.state_dict()) == set(TinyTransformer().state_dict())
    with host_memory_separate():
        got = _grads(model)
        moved = offloaded_bytes()
    # Eager: the same kernels on the same values, and the copies to the host and back are
    # exact. Compiled (aot_eager): the traced graph's ops, fp32 rounding at most.
    got, want = _strip(got), _strip(want)
    assert got.keys() == want.keys()
    for name, g in got.items():
        if compiled:
            torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(g, want[name]), name
    assert moved > 0  # the hooks saw the blocks' (compiled blocks': the graphs') saved tensors


def test_offload_takes_the_activations_out_of_a_simulated_devices_count():
    def peak(ac):
        model = _model(ac)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            cross_entropy(model(TOKENS[:, :-1]), TOKENS[:, 1:]).backward()
            opt.step()

        with host_memory_separate():
            return estimate_step_memory([model], opt, step).activations

    plain = peak(ActivationCheckpoint(mode="none"))
    offloaded = peak(ActivationCheckpoint(mode="none", cpu_offload=True))
    # What stays: the embedding's and the head's saved tensors, outside the blocks.
    assert offloaded < plain * 0.6, (offloaded, plain)


def test_memory_budget_keeps_less_for_backward_with_the_same_gradients(monkeypatch):
    monkeypatch.setattr(functorch_config, "activation_memory_budget", 1.0)
    compile = Compile(enable=True, backend="aot_eager")
    torch._dynamo.reset()
    default = _model(ActivationCheckpoint(mode="memory_budget", memory_budget=1.0), compile)
    assert functorch_config.activation_memory_budget == 1.0
    kept_default, want = _saved_bytes(default), _grads(default)
    torch._dynamo.reset()
    tight = _model(ActivationCheckpoint(mode="memory_budget", memory_budget=0.0), compile)
    assert functorch_config.activation_memory_budget == 0.0
    kept_tight, got = _saved_bytes(tight), _grads(tight)
    torch._dynamo.reset()
    assert kept_tight < 0.7 * kept_default, (kept_tight, kept_default)
    # Recomputed values are the same computation: fp32 rounding at most.
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("ac", "compile", "says"),
    [
        (ActivationCheckpoint(mode="memory_budget"), Compile(), "the model is not compiled"),
        (
            ActivationCheckpoint(mode="memory_budget"),
            Compile(enable=True, backend="eager"),
            "backend = eager does not",
        ),
        (
            ActivationCheckpoint(mode="memory_budget", memory_budget=1.5),
            Compile(enable=True, backend="aot_eager"),
            "memory_budget = 1.5 is not valid",
        ),
        (
            ActivationCheckpoint(mode="full", cpu_offload=True),
            Compile(),
            "nothing to offload",
        ),
        (
            ActivationCheckpoint(mode="selective", selective_ac_option="op", cpu_offload=True),
            Compile(),
            "nothing to offload",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused(ac, compile, says):
    from titan_parallel import Parallelism

    problems = check_parallelize_config(Parallelism(), ac, compile)
    assert any(says in p for p in problems), problems
    if ac.validate():  # the section alone is wrong: apply_ac refuses it too
        with pytest.raises(ConfigError):
            apply_ac(TinyTransformer(), ac)


def test_a_torch_without_the_budget_is_told_so(monkeypatch):
    import titan_parallel.config as config

    monkeypatch.setattr(config, "has_memory_budget", lambda: False)
    (problem,) = ActivationCheckpoint(mode="memory_budget").validate()
    assert "does not have" in problem and 'mode = "selective"' in problem
