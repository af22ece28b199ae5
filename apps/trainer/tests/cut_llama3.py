"""Llama 3.1 8B's widths cut to a few blocks: the shapes of the GPU memory measurements in
issue 31 (dim 4096, 32 heads, 8 KV heads, vocabulary 128256), for the dry run to predict.

    --model.name cut_llama3:spec --model.flavor 8B-8
"""

from __future__ import annotations

import dataclasses

from titan_core.protocols import ModelSpec
from titan_models.llama3 import Transformer, llama3_flavors

spec = ModelSpec(
    name="cut_llama3",
    flavors={
        f"8B-{n}": dataclasses.replace(llama3_flavors["8B"], n_layers=n) for n in (1, 2, 4, 8)
    },
    build=Transformer,
)
