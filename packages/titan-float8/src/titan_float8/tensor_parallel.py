"""Float8-aware tensor-parallel styles, for a parallelizer that wants them.

With the tensorwise recipe, torchao's Float8 TP styles cast a linear's input to Float8 before
the tensor-parallel all-gather and its output gradient before the backward one, so the
collectives move half the bytes. Nothing else changes: the weights are sharded exactly as by
torch's ColwiseParallel / RowwiseParallel / PrepareModuleInput, whose arguments they take.

titan-parallel does not import this package; the trainer (or a user) passes the mapping in.
"""

from __future__ import annotations

from titan_core import ConfigError
from titan_float8.config import SECTION, Float8


def float8_tp_styles(section: Float8 | None = None) -> dict[str, type]:
    """torchao's Float8 TP style classes, keyed by the `titan_core.TPStyle` they replace.

    "colwise" -> Float8ColwiseParallel, "rowwise" -> Float8RowwiseParallel and
    "block_input" -> PrepareFloat8ModuleInput. The other styles ("embedding",
    "sequence_parallel", "output") have no Float8 counterpart: keep torch's.

    Only for the tensorwise recipe: torchao 0.18's styles cast with one tensorwise scale, which
    silently changes the numerics of a rowwise recipe. Rowwise recipes work with tensor parallel
    through torch's plain styles, so a parallelizer should use those instead.
    """
    recipe = section.recipe if section is not None else "tensorwise"
    if recipe != "tensorwise":
        raise ConfigError(
            f'torchao\'s Float8 tensor-parallel styles support only the tensorwise recipe, not {SECTION} recipe_name = "{recipe}"\n'
            "use torch's plain ColwiseParallel/RowwiseParallel with rowwise recipes (they still run Float8 matmuls), "
            "or set recipe_name to none"
        )
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return {
        "colwise": Float8ColwiseParallel,
        "rowwise": Float8RowwiseParallel,
        "block_input": PrepareFloat8ModuleInput,
    }
