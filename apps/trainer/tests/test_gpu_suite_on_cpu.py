"""What the GPU suite (test_gpu.py) relies on, checked without a GPU: its shrunk configs change
the number of blocks and nothing else, and each keeps every kind of block its flavor has."""

from __future__ import annotations

import dataclasses

import pytest

from titan_core import plugins, resolve


@pytest.mark.parametrize(
    "family", ["llama3", "qwen3", "deepseek_v3", "llama4", "gemma3", "gpt_oss"]
)
def test_a_shrunk_family_differs_from_the_shipped_one_in_its_block_count_only(family):
    from gpu_shrunk import fewest_layers

    shipped = resolve(plugins.MODELS, family)
    for mode in ("", "__loop"):
        shrunk = resolve(plugins.MODELS, f"gpu_shrunk:{family}__4{mode}")
        assert shrunk.flavors.keys() == shipped.flavors.keys()
        for name, args in shipped.flavors.items():
            cut = shrunk.flavors[name]
            if fewest_layers(args) > 4:  # such a flavor is left whole (never run at 4 blocks)
                assert cut == args
                continue
            assert cut.n_layers == 4
            expected = dataclasses.replace(args, n_layers=4)
            if mode and getattr(args, "moe", None) is not None:
                assert cut.moe.use_grouped_mm is False
                expected = dataclasses.replace(
                    expected, moe=dataclasses.replace(args.moe, use_grouped_mm=False)
                )
            assert cut == expected, name
