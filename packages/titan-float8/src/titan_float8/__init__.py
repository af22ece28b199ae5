"""titan-float8: Float8 training through torchao, as a Titan model converter."""

import importlib.metadata
from typing import TYPE_CHECKING

from titan_core.lazy import attach

# The public API, each name imported from its module on first use (titan_core.lazy): a
# light module of the package loads without the others, and torch with them.
if TYPE_CHECKING:
    from titan_float8.config import Float8, quiet_torchao_import, recipe_names
    from titan_float8.converter import Float8Converter, build_float8_converter
    from titan_float8.filters import skip_reason, too_small_for_float8
    from titan_float8.hardware import float8_hardware_problem
    from titan_float8.tensor_parallel import float8_tp_styles

__getattr__, __dir__ = attach(__name__, __file__)

__version__ = importlib.metadata.version("titan-llm-float8")  # the pyproject's version, one source

from titan_float8.config import quiet_torchao_import  # noqa: E402 - light, no torch

quiet_torchao_import()  # before whichever module imports torchao first

__all__ = [
    "Float8",
    "Float8Converter",
    "build_float8_converter",
    "float8_hardware_problem",
    "float8_tp_styles",
    "recipe_names",
    "skip_reason",
    "too_small_for_float8",
]
