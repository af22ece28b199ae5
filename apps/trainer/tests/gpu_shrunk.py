"""Model plugins for the GPU suite: `gpu_shrunk:<family>__<layers>` is a shipped family with
every flavor cut to `<layers>` blocks and nothing else changed (widths, heads, vocabulary,
experts); `gpu_shrunk:<family>__<layers>__loop` also computes its experts one by one instead
of with grouped GEMMs. Used as `--model.name gpu_shrunk:llama3__4`."""

from __future__ import annotations

import dataclasses

from titan_core import plugins, resolve


def shrunk(args, layers: int, loop: bool = False):
    changes = {"n_layers": layers}
    if loop and getattr(args, "moe", None) is not None:
        changes["moe"] = dataclasses.replace(args.moe, use_grouped_mm=False)
    return dataclasses.replace(args, **changes)


def fewest_layers(args) -> int:
    """The fewest blocks that keep every kind of block the flavor has (DeepSeek-V3's dense
    blocks come first; Llama 4 alternates dense and MoE blocks; Gemma 3 has one global block
    in every `global_every`, GPT-OSS a windowed one then a full one)."""
    dense_first = getattr(args, "n_dense_layers", 0) or 0
    interleave = getattr(args, "interleave_moe_layer_step", 1) or 1
    windows = [args.attention_window(i) for i in range(args.n_layers)]
    every_window = next(n for n in range(1, args.n_layers + 1) if set(windows[:n]) == set(windows))
    return max(1, dense_first + 1, interleave, every_window)


def __getattr__(name: str):
    family, _, rest = name.partition("__")
    layers, _, mode = rest.partition("__")
    if not layers.isdigit() or mode not in ("", "loop"):
        raise AttributeError(name)
    spec = resolve(plugins.MODELS, family)
    # A flavor that cannot have so few blocks (DeepSeek-V3 671B's three dense ones) stays as
    # it is: only the flavor a run names is used.
    flavors = {
        k: shrunk(v, int(layers), mode == "loop") if int(layers) >= fewest_layers(v) else v
        for k, v in spec.flavors.items()
    }
    return dataclasses.replace(spec, flavors=flavors)
