"""torchtitan's side of bench/vs_torchtitan.py: registers the flavors of cut_llama3_shapes in
torchtitan's `llama3` train spec, each Llama 3.1 8B's `TransformerModelArgs` (torchtitan 0.2.2)
with the cut applied. Imported by torchtitan itself:

    torchrun ... -m torchtitan.train --experimental.custom_import torchtitan_cut_llama3 \\
        --model.name llama3 --model.flavor 8B-4                 (this folder on PYTHONPATH)

torchtitan's train spec holds the `llama3_args` dict itself, so an entry added here is what
`--model.flavor` finds.
"""

from __future__ import annotations

import dataclasses
import sys

from cut_llama3_shapes import CUTS
from torchtitan.models.llama3 import llama3_args

for _name, _cut in CUTS.items():
    llama3_args[_name] = dataclasses.replace(llama3_args["8B"], **_cut)
print(f"torchtitan_cut_llama3: registered llama3 flavors {', '.join(CUTS)}", file=sys.stderr)
