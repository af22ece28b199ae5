"""State dicts between a `Decoder`'s names and a Hugging Face checkpoint's, for every family:
one mechanism, given per family as data.

Hugging Face's decoders share a layout: `model.embed_tokens`, `model.layers.{i}.*`,
`model.norm`, `lm_head`. The root names are the same for every family; a family gives the
names inside a block (`layer_names`: our name relative to the block -> theirs, a plain rename)
and, for what is more than a rename, `transforms()`: a `Transform` takes some of a block's
tensors (`ours`) to some of theirs and back, e.g. Llama's rotary permutation of q and k
(`llama3.hf_adapter.Permuted`), experts stacked in ours and one per expert in theirs
(`PerExpert`), two of ours side by side in one of theirs (`Joined`), or a tensor of ours
that their format has no place for (`ZeroOnly`). A name a transform takes is not renamed.

`to_hf` and `from_hf` convert key by key, so a partial state dict (one pipeline stage's)
converts; a transform's tensors convert once all of them are there, and an unknown or
incomplete name raises a KeyError that names it. Tied embeddings: Hugging Face's tied
checkpoints carry only `embed_tokens`; ours has the shared matrix under both names. Tensors
must be full (unsharded): gather DTensors before converting.

Multi-token-prediction layers (`titan_models.mtp`, `n_mtp_layers` in the args) are the layers
after the main blocks in both, named as in DeepSeek-V3's checkpoints (`model.layers.61.*`):
the block's names as in any layer, plus `MTP_NAMES`. DeepSeek's checkpoints also keep a copy
of the embedding and of the output projection in each of them (`MTP_SHARED`), which ours
shares with the main model: `to_hf` writes the copies, and `from_hf` checks that they equal
the main model's (a ValueError names the one that differs) and leaves them out.

`to_hf_slices` and `from_hf_slice` (`titan_core.protocols.SlicedHFAdapter`) convert one box
of one tensor instead, each transform saying which boxes of theirs a box of ours covers:
titan-ckpt imports and exports sharded models with them, each rank touching its own shards
only. The multi-token-prediction copies are written with the matrix they copy; an import
reads the main model's matrix only (the whole-dict `from_hf` is the one that compares them).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from titan_core.protocols import Box, HFSlice

ROOT_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
"""A Hugging Face block's tensor: its layer index, its name in the block."""


NORM_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
"""A block's two RMSNorms."""
EXPERT_WEIGHTS = ("feed_forward.experts.w1", "feed_forward.experts.w3", "feed_forward.experts.w2")
"""A mixture-of-experts block's stacked expert weights (`titan_models.moe.GroupedExperts`)."""
MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
"""A multi-token-prediction layer's own tensors (`titan_models.mtp.MTPLayer`)."""
MTP_SHARED = {
    "embed_tokens.weight": "tok_embeddings.weight",
    "shared_head.head.weight": "output.weight",
}
"""Hugging Face's copies, in each multi-token-prediction layer, of our shared matrices."""


def attention_names() -> dict[str, str]:
    """Grouped-query attention's four projections, by Hugging Face's usual names."""
    return {f"attention.w{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"}


def swiglu_names(ours: str, theirs: str) -> dict[str, str]:
    """A SwiGLU's three projections: w1 (gate), w3 (up), w2 (down)."""
    projections = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    return {f"{ours}.{w}.weight": f"{theirs}.{p}.weight" for w, p in projections.items()}


def gqa_config(args: Any) -> dict[str, Any]:
    """The `config.json` keys of grouped-query attention."""
    return {
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
    }


Read = Callable[[HFSlice], torch.Tensor]
"""Reads a box of a Hugging Face tensor (see `SlicedHFAdapter.from_hf_slice`)."""


def box_shape(index: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


def _shifted(index: Box, dim: int, offset: int) -> Box:
    moved = slice(index[dim].start + offset, index[dim].stop + offset)
    return (*index[:dim], moved, *index[dim + 1 :])


class Transform:
    """Some of a block's tensors that are more than renamed: `ours` (names relative to the
    block) to Hugging Face's and back. `where` (e.g. "LlamaHFAdapter.to_hf: layer 3") starts
    any error message.

    `to_hf_slices` and `from_hf_slice` do the same for one box of one of `ours` (see
    `titan_core.protocols.SlicedHFAdapter`), with names relative to the block."""

    ours: tuple[str, ...] = ()
    theirs: str | None = None

    def part_of(self, hf_name: str) -> Hashable | None:
        """The key under which `from_hf` collects this Hugging Face name (relative to the
        block), or None when it is not this transform's: by default its one name `theirs`."""
        return hf_name if hf_name == self.theirs else None

    def to_hf(self, parts: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def from_hf(self, parts: dict[Hashable, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def complete(self, layer: dict[str, torch.Tensor]) -> None:
        """After import: add to one block's converted tensors what Hugging Face's lack."""

    def to_hf_slices(
        self, name: str, shape: tuple[int, ...], index: Box, tensor: torch.Tensor, where: str
    ) -> list[tuple[HFSlice, torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} converts whole tensors only")

    def from_hf_slice(
        self, name: str, shape: tuple[int, ...], index: Box, read: Read, where: str
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} converts whole tensors only")


class Joined(Transform):
    """Several of ours side by side along `dim` in one of theirs (split by `sizes`, or into
    equal parts)."""

    def __init__(
        self, ours: tuple[str, ...], theirs: str, dim: int, sizes: list[int] | None = None
    ):
        self.ours, self.theirs, self.dim, self.sizes = ours, theirs, dim, sizes

    def to_hf(self, parts, where):
        if parts.keys() != set(self.ours):
            raise KeyError(f"{where} needs both {' and '.join(self.ours)}")
        return {self.theirs: torch.cat([parts[n] for n in self.ours], dim=self.dim)}

    def from_hf(self, parts, where):
        tensor = parts[self.theirs]
        if self.sizes is None:
            pieces = tensor.chunk(len(self.ours), dim=self.dim)
        else:
            pieces = tensor.split(self.sizes, dim=self.dim)
        return {n: piece.contiguous() for n, piece in zip(self.ours, pieces)}

    def _placed(self, name: str, shape: tuple[int, ...], index: Box) -> HFSlice:
        """Where box `index` of our `name` lies in theirs: moved along `dim` past the parts
        before it."""
        dim = self.dim % len(shape)
        sizes = self.sizes or [shape[dim]] * len(self.ours)
        part = self.ours.index(name)
        theirs_shape = (*shape[:dim], sum(sizes), *shape[dim + 1 :])
        return HFSlice(self.theirs, theirs_shape, _shifted(index, dim, sum(sizes[:part])))

    def to_hf_slices(self, name, shape, index, tensor, where):
        return [(self._placed(name, shape, index), tensor)]

    def from_hf_slice(self, name, shape, index, read, where):
        return read(self._placed(name, shape, index))


class PerExpert(Transform):
    """Our experts' stacked weight (experts, in, out), theirs one `nn.Linear` weight (out, in)
    per expert, named by `theirs` with "{}" for the expert's index."""

    def __init__(self, ours: str, theirs: str, num_experts: int):
        self.ours, self.theirs, self.num_experts = (ours,), theirs, num_experts
        before, after = (re.escape(p) for p in theirs.split("{}"))
        self._pattern = re.compile(f"{before}(\\d+){after}")

    @classmethod
    def experts(cls, num_experts: int, theirs: str = "mlp.experts") -> list[PerExpert]:
        """Every stacked weight of our experts: w1, w3, w2 as `{theirs}.{e}.gate_proj`,
        `up_proj`, `down_proj`."""
        names = swiglu_names("feed_forward.experts", theirs + ".{}")
        return [cls(ours.removesuffix(".weight"), hf, num_experts) for ours, hf in names.items()]

    def part_of(self, hf_name: str) -> Hashable | None:
        match = self._pattern.fullmatch(hf_name)
        return int(match.group(1)) if match else None

    def to_hf(self, parts, where):
        (stacked,) = parts.values()
        return {self.theirs.format(e): w.t().contiguous() for e, w in enumerate(stacked.unbind(0))}

    def from_hf(self, parts, where):
        n = self.num_experts
        if sorted(parts) != list(range(n)):
            raise KeyError(
                f"{where} has experts {sorted(parts)[:5]}... of {self.ours[0]}, not all {n}"
            )
        return {self.ours[0]: torch.stack([parts[e].t() for e in range(n)])}

    def _expert_slices(self, shape: tuple[int, ...], index: Box) -> list[HFSlice]:
        """Box (experts, in, out) of ours: the box (out, in) of each of those experts."""
        experts, ins, outs = index
        return [
            HFSlice(self.theirs.format(e), (shape[2], shape[1]), (outs, ins))
            for e in range(experts.start, experts.stop)
        ]

    def to_hf_slices(self, name, shape, index, tensor, where):
        slices = self._expert_slices(shape, index)
        return [(hf, w.t()) for hf, w in zip(slices, tensor.unbind(0))]

    def from_hf_slice(self, name, shape, index, read, where):
        return torch.stack([read(hf).t() for hf in self._expert_slices(shape, index)])


class ZeroOnly(Transform):
    """A tensor of ours that their format has no place for: exported only while it is zero
    (else `to_hf` raises "{where} has {refusal}"), imported as zeros in every block that has
    one of `alongside` (as many as their first dimension)."""

    def __init__(
        self, ours: str, alongside: tuple[str, ...], refusal: str, size: int | None = None
    ):
        """`size`: the length of the zeros imported (default: the first dimension of
        `alongside`'s tensor)."""
        self.ours, self.alongside, self.refusal, self.size = (ours,), alongside, refusal, size

    @classmethod
    def expert_bias(cls, hf_model: str) -> ZeroOnly:
        """The expert bias of auxiliary-loss-free balancing, which `hf_model` has no place for."""
        return cls(
            "feed_forward.expert_bias",
            EXPERT_WEIGHTS,
            f"a non-zero expert bias, which Hugging Face's {hf_model} cannot hold (its routing"
            " would change); train with a flavor whose load_balance_coeff is None (the"
            f" {hf_model} flavors' default)",
        )

    @classmethod
    def router_center(cls, hf_model: str, dim: int) -> ZeroOnly:
        """The router center of router centering (the MoE debug flavors' `router_centering`),
        which `hf_model` has no place for."""
        return cls(
            "feed_forward.router_center",
            EXPERT_WEIGHTS,
            f"a non-zero router center, which Hugging Face's {hf_model} cannot hold (its routing"
            " would change); train with router_centering off (--model.moe_router_centering"
            " false)",
            size=dim,
        )

    def to_hf(self, parts, where):
        if any(torch.count_nonzero(t) for t in parts.values()):
            raise ValueError(f"{where} has {self.refusal}")
        return {}

    def to_hf_slices(self, name, shape, index, tensor, where):
        self.to_hf({name: tensor}, where)
        return []

    def from_hf_slice(self, name, shape, index, read, where):
        return torch.zeros(box_shape(index), dtype=torch.float32)

    def complete(self, layer):
        present = [layer[n] for n in self.alongside if n in layer]
        if present:
            size = present[0].shape[0] if self.size is None else self.size
            layer.setdefault(self.ours[0], torch.zeros(size, dtype=torch.float32))


class DecoderHFAdapter:
    """Satisfies `titan_core.protocols.HFAdapter` for a family's args; a family's adapter
    gives `layer_names`, `transforms()` and `architecture_config()`, and may refuse what its
    Hugging Face class cannot hold (`check_representable`)."""

    layer_names: Mapping[str, str] = {}

    def __init__(
        self,
        args: Any,
        *,
        torch_dtype: str = "bfloat16",
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ):
        self.args = args
        self.torch_dtype = torch_dtype
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._transforms = self.transforms()
        self._taker = {name: t for t in self._transforms for name in t.ours}
        self._to_hf_layer = {o: h for o, h in self.layer_names.items() if o not in self._taker}
        n, depth = args.n_layers, args.n_mtp_layers
        self._mtp_layers = [str(i) for i in range(n, n + depth)]
        if depth:
            self._to_hf_layer |= MTP_NAMES
        self._from_hf_layer = {h: o for o, h in self._to_hf_layer.items()}
        self._from_hf_root = {h: o for o, h in ROOT_NAMES.items()}

    def transforms(self) -> list[Transform]:
        """What is more than a rename in this family's blocks (see the module docstring)."""
        return []

    def check_representable(self) -> None:
        """Raise a ValueError that says why, when the Hugging Face class cannot hold this
        model; `to_hf` and `hf_config` call it first."""

    def architecture_config(self) -> dict[str, Any]:
        """The family's part of `config.json` (architectures, heads, rotary embedding, ...)."""
        raise NotImplementedError

    def hf_config(self) -> dict[str, Any]:
        self.check_representable()
        a = self.args
        return self.architecture_config() | {
            "num_hidden_layers": a.n_layers,
            "hidden_size": a.dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            "attention_bias": a.attention_bias,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.check_representable()
        out: dict[str, torch.Tensor] = {}
        pending: dict[tuple[str, Transform], dict] = defaultdict(dict)
        for name, tensor in state_dict.items():
            if name in ROOT_NAMES:
                out |= self._mtp_copies(name, tensor)
                if name == "output.weight" and self.args.tie_word_embeddings:
                    continue  # Hugging Face's tied checkpoints carry only embed_tokens
                out[ROOT_NAMES[name]] = tensor
                continue
            match = _OURS_LAYER.fullmatch(name)
            layer, suffix = match.groups() if match else (None, None)
            if suffix in self._to_hf_layer:
                out[f"model.layers.{layer}.{self._to_hf_layer[suffix]}"] = tensor
            elif suffix in self._taker:
                transform = self._taker[suffix]
                parts = pending[(layer, transform)]
                parts[suffix] = tensor
                if len(parts) == len(transform.ours):  # in place, so a layer's stay together
                    out |= self._converted(layer, transform, pending.pop((layer, transform)))
            else:
                raise KeyError(f"{type(self).__name__}.to_hf: no Hugging Face name for {name!r}")
        for (layer, transform), parts in pending.items():
            out |= self._converted(layer, transform, parts)  # raises: a part is missing
        if self.args.tie_word_embeddings and "output.weight" in state_dict:
            out.setdefault("model.embed_tokens.weight", state_dict["output.weight"])
        return out

    def _mtp_copies(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """DeepSeek's copies of a shared matrix in each multi-token-prediction layer."""
        if name not in MTP_SHARED.values():
            return {}
        tied = self.args.tie_word_embeddings  # then both copies are the one matrix
        suffixes = [h for h, o in MTP_SHARED.items() if o == name or tied]
        return {f"model.layers.{i}.{h}": tensor for i in self._mtp_layers for h in suffixes}

    def _converted(self, layer: str, transform: Transform, parts: dict) -> dict[str, torch.Tensor]:
        hf = transform.to_hf(parts, f"{type(self).__name__}.to_hf: layer {layer}")
        return {f"model.layers.{layer}.{n}": t for n, t in hf.items()}

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        pending: dict[tuple[str, Transform], dict] = defaultdict(dict)
        layers: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        copies: dict[str, torch.Tensor] = {}
        for name, tensor in hf_state_dict.items():
            if name in self._from_hf_root:
                out[self._from_hf_root[name]] = tensor
                continue
            match = HF_LAYER.fullmatch(name)
            layer, suffix = match.groups() if match else (None, None)
            if layer in self._mtp_layers and suffix in MTP_SHARED:
                copies[name] = tensor
                continue
            if suffix in self._from_hf_layer:
                layers[layer][self._from_hf_layer[suffix]] = tensor
                continue
            taken = self._hf_taker(suffix) if suffix is not None else None
            if taken is None:
                raise KeyError(f"{type(self).__name__}.from_hf: no Titan name for {name!r}")
            transform, key = taken
            pending[(layer, transform)][key] = tensor
        for (layer, transform), parts in pending.items():
            where = f"{type(self).__name__}.from_hf: layer {layer}"
            layers[layer] |= transform.from_hf(parts, where)
        for layer, tensors in layers.items():
            for transform in self._transforms:
                transform.complete(tensors)
            out |= {f"layers.{layer}.{n}": t for n, t in tensors.items()}
        if self.args.tie_word_embeddings:
            # Our module exposes the shared matrix under both names.
            shared = out.get("tok_embeddings.weight", out.get("output.weight"))
            if shared is not None:
                out["tok_embeddings.weight"] = out["output.weight"] = shared
        self._check_mtp_copies(copies, out)
        return out

    def _check_mtp_copies(self, copies: dict[str, torch.Tensor], ours: dict) -> None:
        """Each multi-token-prediction layer's copy of a shared matrix must equal the main
        model's (when the state dict holds both): ours has one matrix for both uses."""
        for name, tensor in copies.items():
            shared = MTP_SHARED[HF_LAYER.fullmatch(name).group(2)]
            if self.args.tie_word_embeddings:
                shared = "tok_embeddings.weight"
            main = ours.get(shared)
            if main is not None and not torch.equal(main, tensor):
                raise ValueError(
                    f"{type(self).__name__}.from_hf: {name} differs from the main model's"
                    f" {ROOT_NAMES[shared]}, but the multi-token-prediction layers share it (as"
                    " DeepSeek-V3 trains them)\nimport into a flavor with n_mtp_layers = 0 to"
                    " leave the MTP layers out"
                )

    def to_hf_slices(
        self, name: str, shape: tuple[int, ...], index: Box, tensor: torch.Tensor
    ) -> list[tuple[HFSlice, torch.Tensor]]:
        if name in ROOT_NAMES:
            if name == "output.weight" and self.args.tie_word_embeddings:
                return []  # written once, as embed_tokens (and its MTP copies with it)
            names = [ROOT_NAMES[name], *self._mtp_copies(name, tensor)]
            return [(HFSlice(hf, shape, index), tensor) for hf in names]
        layer, suffix = self._layer_of(name, "to_hf_slices")
        prefix = f"model.layers.{layer}."
        if suffix in self._to_hf_layer:
            return [(HFSlice(prefix + self._to_hf_layer[suffix], shape, index), tensor)]
        where = f"{type(self).__name__}.to_hf_slices: layer {layer}"
        slices = self._taker[suffix].to_hf_slices(suffix, shape, index, tensor, where)
        return [(dataclasses.replace(hf, name=prefix + hf.name), t) for hf, t in slices]

    def from_hf_slice(
        self, name: str, shape: tuple[int, ...], index: Box, read: Read
    ) -> torch.Tensor:
        if name in ROOT_NAMES:
            if name == "output.weight" and self.args.tie_word_embeddings:
                name = "tok_embeddings.weight"  # the one matrix a tied checkpoint carries
            return read(HFSlice(ROOT_NAMES[name], shape, index))
        layer, suffix = self._layer_of(name, "from_hf_slice")
        prefix = f"model.layers.{layer}."
        if suffix in self._to_hf_layer:
            return read(HFSlice(prefix + self._to_hf_layer[suffix], shape, index))

        def read_in_block(hf: HFSlice) -> torch.Tensor:
            return read(dataclasses.replace(hf, name=prefix + hf.name))

        where = f"{type(self).__name__}.from_hf_slice: layer {layer}"
        return self._taker[suffix].from_hf_slice(suffix, shape, index, read_in_block, where)

    def _layer_of(self, name: str, method: str) -> tuple[str, str]:
        """A block tensor's layer and name in the block; KeyError for a name we cannot convert."""
        match = _OURS_LAYER.fullmatch(name)
        known = match is not None and (
            match.group(2) in self._to_hf_layer or match.group(2) in self._taker
        )
        if not known:
            raise KeyError(f"{type(self).__name__}.{method}: no Hugging Face name for {name!r}")
        return match.group(1), match.group(2)

    def _hf_taker(self, hf_name: str) -> tuple[Transform, Hashable] | None:
        """The transform that takes this Hugging Face name (relative to the block), and the
        key it collects it under."""
        for transform in self._transforms:
            if (key := transform.part_of(hf_name)) is not None:
                return transform, key
        return None
