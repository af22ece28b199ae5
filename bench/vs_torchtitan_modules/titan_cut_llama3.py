"""Titan's side of bench/vs_torchtitan.py: Llama 3.1 8B's flavor cut as cut_llama3_shapes says.

    titan-train --model.name titan_cut_llama3:spec --model.flavor 8B-4   (this folder on PYTHONPATH)

Titan sizes a model's vocabulary by its tokenizer (`titan_trainer.model.model_args_for`); the
bench's tokenizer has exactly the flavor's vocabulary (128256 ids), as torchtitan's model keeps.
"""

from __future__ import annotations

import dataclasses

from cut_llama3_shapes import CUTS

from titan_core.protocols import ModelSpec
from titan_models.llama3 import Transformer, llama3_flavors

spec = ModelSpec(
    name="titan_cut_llama3",
    flavors={name: dataclasses.replace(llama3_flavors["8B"], **cut) for name, cut in CUTS.items()},
    build=Transformer,
)
