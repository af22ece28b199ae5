"""Context parallel checks that need no process group: sequence-length rules, the torch
version pin and the CPU kernel registration. Numerical parity runs in
test_pipeline_and_context_parallel_distributed.py."""

from __future__ import annotations

import pytest
import torch

from titan_core import ParallelDims
from titan_core.config import ConfigError
from titan_parallel import context_parallel as cp


@pytest.mark.parametrize(
    "seq_len,cp_degree,tp_degree,load_balance,ok",
    [
        (16, 2, 1, True, True),  # 4 chunks of 4
        (18, 2, 1, True, False),  # 18 % 4
        (18, 2, 1, False, True),  # 2 shards of 9
        (24, 4, 1, True, True),
        (20, 4, 1, True, False),
        (16, 2, 2, True, True),
        (24, 2, 4, True, False),  # 24 % (4 x 4)
        (6, 1, 4, True, False),  # sequence parallel alone: 6 % 4
        (7, 1, 1, True, True),  # no CP, no TP: anything goes
    ],
)
def test_seq_len_must_divide_by_cp_chunks_times_tp(seq_len, cp_degree, tp_degree, load_balance, ok):
    if ok:
        cp.check_cp_seq_len(seq_len, cp_degree, tp_degree=tp_degree, load_balance=load_balance)
        if load_balance:  # agrees with titan_core's divisor for the same degrees
            dims = ParallelDims(world_size=cp_degree * tp_degree, cp=cp_degree, tp=tp_degree)
            assert seq_len % dims.seq_len_divisor == 0
    else:
        with pytest.raises(ConfigError, match=rf"\[training\] seq_len = {seq_len} must divide by"):
            cp.check_cp_seq_len(seq_len, cp_degree, tp_degree=tp_degree, load_balance=load_balance)


def test_seq_len_error_names_the_degrees_and_suggests_lengths():
    with pytest.raises(ConfigError) as err:
        cp.check_cp_seq_len(2050, 4, tp_degree=2)
    message = str(err.value)
    assert (
        "2 x context_parallel_degree 4 (load-balanced chunks) x tensor_parallel_degree 2 = 16"
        in message
    )
    assert "use seq_len = 2048 or 2064" in message


def test_torch_outside_the_checked_range_is_refused_with_the_range(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    with pytest.raises(
        RuntimeError, match=r"checked with torch 2\.11 to 2\.15, not torch 2\.16\.0"
    ):
        cp.enable_cpu_ring_attention()
    monkeypatch.setattr(torch, "__version__", "2.10.1+cpu")
    with pytest.raises(RuntimeError, match=r"install torch>=2\.11,<2\.16"):
        cp.enable_cpu_ring_attention()


def test_cpu_flash_kernels_join_torchs_cp_op_table_only():
    internals = cp._cp_internals()
    before = dict(internals.custom_ops)
    cp.enable_cpu_ring_attention()
    cp.enable_cpu_ring_attention()  # idempotent
    added = set(internals.custom_ops) - set(before)
    aten = torch.ops.aten
    expected = {
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    }
    assert added <= expected and expected <= set(internals.custom_ops)
    # Outside a CP region DTensor's live handler table does not route the CPU kernel anywhere.
    from torch.distributed.tensor import DTensor

    assert not expected & set(DTensor._op_dispatcher._custom_op_handlers)


def test_the_cpu_kernel_has_the_signature_the_ring_handler_expects():
    # The handler forwards these arguments by name; a torch release that renamed or added
    # one would break ring attention silently, so the schemas are pinned here.
    fwd = str(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default._schema)
    bwd = str(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default._schema)
    assert fwd.endswith(
        "(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, *,"
        " Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)"
    )
    assert bwd.endswith(
        "(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp,"
        " float dropout_p, bool is_causal, *, Tensor? attn_mask=None, float? scale=None)"
        " -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)"
    )


def test_unknown_rotate_method_is_a_config_error():
    context = cp.cp_context(None, [torch.zeros(1, 8)], [1], rotate_method="ring")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="context_parallel_rotate_method = 'ring' is not valid"):
        context.__enter__()


def test_buffers_that_are_views_of_one_window_are_refused():
    # The trainer's loader yields inputs and labels as slices of one packed window; sharding
    # them in place would overwrite one with the other. Found by the 8-rank trainer test.
    window = torch.arange(2 * 9).view(2, 9)
    inputs, labels = window[:, :-1], window[:, 1:]
    context = cp.cp_context(None, [inputs.contiguous(), labels], [1, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"buffer 1 \(shape \(2, 8\)\) is not contiguous"):
        context.__enter__()
    inputs, labels = window.view(-1)[:8].view(1, 8), window.view(-1)[8:16].view(1, 8)
    context = cp.cp_context(None, [inputs, labels], [1, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffers 0 and 1 share one storage"):
        context.__enter__()


def test_every_private_torch_name_is_found_at_import_on_this_torch():
    assert cp.check_cp_support() == []
    assert len(cp._FOUND) == len(cp._PRIVATE_NAMES) and cp._MISSING == []


def test_a_torch_without_one_of_the_private_names_is_named_with_the_supported_versions(
    monkeypatch,
):
    from titan_parallel.config import Parallelism

    ring = cp._cp_internals()
    monkeypatch.delattr(ring, "_templated_ring_attention_backward")
    _, missing = cp._find_private_names()  # what the import-time lookup finds on such a torch
    assert missing == [f"{cp._RING}._templated_ring_attention_backward"]
    monkeypatch.setattr(cp, "_MISSING", missing)
    (problem,) = cp.check_cp_support()
    assert "checked with torch 2.11 to 2.15" in problem
    assert f"lacks internals it uses: {cp._RING}._templated_ring_attention_backward" in problem
    assert "install torch>=2.11,<2.16, or set [parallelism] context_parallel_degree = 1" in problem
    # The config check reports it before any process group exists, only when CP is on.
    assert problem in Parallelism(context_parallel_degree=2).validate()
    assert Parallelism().validate() == []
    with pytest.raises(RuntimeError, match="lacks internals"):
        cp.enable_cpu_ring_attention()
