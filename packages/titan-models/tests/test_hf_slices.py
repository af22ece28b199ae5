"""Box-by-box conversion (`to_hf_slices`, `from_hf_slice`) against the whole-tensor one, for
every family and every transform: Llama's per-head permutation (boxes that cut heads in two),
joined tensors (DeepSeek-V3's latent and rotary key, Llama 4's gate_up along the last
dimension), one tensor per expert (Qwen3-MoE, DeepSeek-V3), the zero expert bias and router
center, and tied embeddings. What a sharded import or export relies on: the boxes of any partition of our
tensors cover Hugging Face's tensors exactly once with the same values, and any box of ours
is rebuilt exactly from what it reads."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from titan_core.protocols import HFSlice, is_sliced_hf_adapter
from titan_models import llama3_flavors, llama3_spec
from titan_models.deepseek_v3 import deepseek_v3_flavors, deepseek_v3_spec
from titan_models.gemma3 import gemma3_flavors, gemma3_spec
from titan_models.llama4 import llama4_flavors, llama4_spec
from titan_models.qwen3 import qwen3_flavors, qwen3_spec


def _llama3(tied: bool):
    return llama3_spec, dataclasses.replace(
        llama3_flavors["debugmodel"], dim=96, n_layers=2, n_heads=6, n_kv_heads=2,
        vocab_size=50, max_seq_len=16, tie_word_embeddings=tied,
    )  # fmt: skip


def _qwen3_moe():
    return qwen3_spec, dataclasses.replace(
        qwen3_flavors["debugmodel_moe"], n_layers=2, dim=64, head_dim=16, n_heads=4,
        n_kv_heads=2, hidden_dim=96, vocab_size=50, max_seq_len=16,
    )  # fmt: skip


def _deepseek_v3():
    base = deepseek_v3_flavors["debugmodel"]
    moe = dataclasses.replace(base.moe, num_experts=4, top_k=2, hidden_dim=24, num_groups=2,
                              top_k_groups=1)  # fmt: skip
    return deepseek_v3_spec, dataclasses.replace(
        base, dim=32, n_layers=2, n_dense_layers=1, n_heads=2, vocab_size=50, hidden_dim=40,
        q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        max_seq_len=16, moe=moe,
    )  # fmt: skip


def _llama4():
    base = llama4_flavors["debugmodel"]
    return llama4_spec, dataclasses.replace(
        base, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, hidden_dim=40,
        moe=dataclasses.replace(base.moe, num_experts=3, hidden_dim=24), max_seq_len=16,
        attention_chunk_size=8, interleave_moe_layer_step=1,
    )  # fmt: skip


def _gemma3():
    return gemma3_spec, dataclasses.replace(
        gemma3_flavors["debugmodel"], dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        vocab_size=50, hidden_dim=40, max_seq_len=16,
    )  # fmt: skip


FAMILIES = {
    "llama3": lambda: _llama3(tied=False),
    "llama3_tied": lambda: _llama3(tied=True),
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "llama4": _llama4,
    "gemma3": _gemma3,
}


def _state(spec, args):
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, tensor in model.state_dict().items():
        # Distinct values everywhere (a misplaced element shows); the expert bias and the
        # router center (the debug flavors' router centering) stay zero, as Hugging Face's
        # Qwen3-MoE and Llama 4 can only hold a zero bias and no family a center.
        zero = name.endswith(("expert_bias", "router_center"))
        state[name] = (
            torch.zeros_like(tensor) if zero else torch.rand(tensor.shape, generator=generator)
        )
    if args.tie_word_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def _cuts(size: int, generator: torch.Generator) -> list[int]:
    """Uneven cut points of range(size), as FSDP's and TP's chunking can give."""
    parts = int(torch.randint(1, min(size, 5) + 1, (1,), generator=generator))
    inner = torch.randperm(size - 1, generator=generator)[: parts - 1] + 1 if size > 1 else []
    return [0, *sorted(int(c) for c in inner), size]


def _partition(shape: tuple[int, ...], generator: torch.Generator) -> list[tuple[slice, ...]]:
    """A random grid of boxes that covers a tensor once: every dimension cut unevenly."""
    per_dim = []
    for size in shape:
        cuts = _cuts(size, generator)
        per_dim.append([slice(a, b) for a, b in zip(cuts, cuts[1:])])
    return list(itertools.product(*per_dim))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_slices_convert_exactly_as_whole_tensors(family):
    spec, args = FAMILIES[family]()
    adapter = spec.hf_adapter(args)
    assert is_sliced_hf_adapter(adapter)
    ours = _state(spec, args)
    theirs = adapter.to_hf(ours)
    generator = torch.Generator().manual_seed(1)

    # Export: the boxes of a partition of each of our tensors land on theirs exactly once.
    covered = {name: torch.zeros(t.shape, dtype=torch.int64) for name, t in theirs.items()}
    for name, tensor in ours.items():
        shape = tuple(tensor.shape)
        for box in _partition(shape, generator):
            for hf, piece in adapter.to_hf_slices(name, shape, box, tensor[box]):
                assert hf.shape == tuple(theirs[hf.name].shape), (name, hf)
                assert torch.equal(piece, theirs[hf.name][hf.index]), (name, box, hf)
                covered[hf.name][hf.index] += 1
    for name, count in covered.items():
        assert bool((count == 1).all()), f"{name}: covered {count.min()} to {count.max()} times"

    # Import: any box of ours, rebuilt from the boxes of theirs it reads.
    def read(hf: HFSlice) -> torch.Tensor:
        if hf.name not in theirs:
            raise KeyError(hf.name)
        assert hf.shape == tuple(theirs[hf.name].shape), hf
        return theirs[hf.name][hf.index]

    for name, tensor in ours.items():
        shape = tuple(tensor.shape)
        for box in _partition(shape, generator):
            got = adapter.from_hf_slice(name, shape, box, read)
            assert torch.equal(got, tensor[box]), (name, box)
    boxes = sum(len(_partition(tuple(t.shape), generator)) for t in ours.values())
    print(f"{family}: {len(ours)} tensors, ~{boxes} boxes each way")


def test_a_box_that_cuts_heads_reads_only_the_heads_it_touches():
    spec, args = _llama3(tied=False)
    adapter = spec.hf_adapter(args)
    ours = _state(spec, args)
    theirs = adapter.to_hf(ours)
    name = "layers.1.attention.wq.weight"  # 6 heads of 16 rows
    reads = []

    def read(hf: HFSlice) -> torch.Tensor:
        reads.append(hf)
        return theirs[hf.name][hf.index]

    box = (slice(21, 40), slice(5, 60))  # inside heads 1 and 2
    assert torch.equal(adapter.from_hf_slice(name, (96, 96), box, read), ours[name][box])
    assert [r.index for r in reads] == [(slice(16, 48), slice(5, 60))]
    # Exporting it writes two runs of rows per head it cuts, and nothing else.
    slices = adapter.to_hf_slices(name, (96, 96), box, ours[name][box])
    assert sum(piece.shape[0] for _, piece in slices) == 19 and len(slices) == 4


def test_a_multimodal_llama4_checkpoint_is_read_under_language_model():
    spec, args = _llama4()
    adapter = spec.hf_adapter(args)
    ours = _state(spec, args)
    theirs = {"language_model." + k: v for k, v in adapter.to_hf(ours).items()}
    name = "layers.0.feed_forward.experts.w3"
    box = (slice(1, 3), slice(0, 32), slice(4, 20))

    def read(hf: HFSlice) -> torch.Tensor:
        return theirs[hf.name][hf.index]  # KeyError without the prefix

    assert torch.equal(adapter.from_hf_slice(name, (3, 32, 24), box, read), ours[name][box])


def test_a_name_without_a_hugging_face_counterpart_is_named():
    spec, args = _llama3(tied=False)
    adapter = spec.hf_adapter(args)
    with pytest.raises(KeyError, match="layers.0.attention.bias"):
        adapter.to_hf_slices("layers.0.attention.bias", (4,), (slice(0, 4),), torch.zeros(4))
    with pytest.raises(KeyError, match="rope_cache"):
        adapter.from_hf_slice("rope_cache", (4,), (slice(0, 4),), lambda hf: torch.zeros(4))
