"""A model family with a Hugging Face adapter, as titan-models would register one: the toy model
of ckpt_toy under HF-style names, with one weight stored transposed to exercise layout changes."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ckpt_toy import ToyModel

from titan_core.protocols import HFSlice, ModelSpec

_NAMES = {
    r"embed\.weight": "model.embed_tokens.weight",
    r"layers\.(\d+)\.w1\.(weight|bias)": r"model.layers.\1.mlp.up_proj.\2",
    r"layers\.(\d+)\.w2\.(weight|bias)": r"model.layers.\1.mlp.down_proj.\2",
    r"norm\.(weight|bias)": r"model.norm.\1",
    r"out\.weight": "lm_head.weight",
}


@dataclass
class ToyArgs:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2


class ToyAdapter:
    def __init__(self, args: ToyArgs, *, bos_token_id=None, eos_token_id=None):
        # The ids `ModelSpec.hf_adapter` is given (a config.json's); the toy writes none.
        self.args = args

    def to_hf(self, state_dict):
        out = {}
        for key, value in state_dict.items():
            name = _hf_name(key)
            out[name] = value.t() if name == "lm_head.weight" else value
        return out

    def from_hf(self, hf_state_dict):
        reverse = {_hf_name(k): k for k in _keys(self.args)}
        out = {}
        for name, value in hf_state_dict.items():
            out[reverse[name]] = value.t() if name == "lm_head.weight" else value
        return out

    def hf_config(self):
        a = self.args
        return {
            "model_type": "toy",
            "vocab_size": a.vocab_size,
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
        }


def _hf_name(key: str) -> str:
    for pattern, repl in _NAMES.items():
        if re.fullmatch(pattern, key):
            return re.sub(pattern, repl, key)
    raise KeyError(f"no Hugging Face name for {key}")


def _keys(args: ToyArgs) -> list[str]:
    return list(ToyModel(args.vocab_size, args.dim, args.n_layers).state_dict())


TOY_SPEC = ModelSpec(
    name="toy",
    flavors={"tiny": ToyArgs()},
    build=lambda a: ToyModel(a.vocab_size, a.dim, a.n_layers),
    hf_adapter=ToyAdapter,
)


class SlicedToyAdapter(ToyAdapter):
    """The same conversion box by box (`titan_core.protocols.SlicedHFAdapter`): a box of
    `out.weight` is the transposed box of `lm_head.weight`."""

    def to_hf_slices(self, name, shape, index, tensor):
        hf = _hf_name(name)
        if hf == "lm_head.weight":
            return [(HFSlice(hf, shape[::-1], index[::-1]), tensor.t())]
        return [(HFSlice(hf, shape, index), tensor)]

    def from_hf_slice(self, name, shape, index, read):
        hf = _hf_name(name)
        if hf == "lm_head.weight":
            return read(HFSlice(hf, shape[::-1], index[::-1])).t()
        return read(HFSlice(hf, shape, index))


SLICED_TOY_SPEC = dataclasses.replace(TOY_SPEC, hf_adapter=SlicedToyAdapter)
