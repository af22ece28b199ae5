"""titan-ckpt: distributed checkpointing over torch.distributed.checkpoint (DCP) with atomic and
async saves, resharding on load, seed checkpoints and Hugging Face safetensors import/export."""

import importlib.metadata
from typing import TYPE_CHECKING

from titan_core.lazy import attach

# The public API, each name imported from its module on first use (titan_core.lazy): a
# light module of the package loads without the others, and torch with them.
if TYPE_CHECKING:
    from titan_ckpt.config import Checkpoint
    from titan_ckpt.dcp_io import (
        checkpoint_problems,
        dcp_to_torch_file,
        load_consolidated,
        nonfinite_tensors,
        save_model_checkpoint,
        value_problems,
    )
    from titan_ckpt.errors import CheckpointLoadError, CheckpointSaveError
    from titan_ckpt.hf import export_hf, import_hf, read_safetensors
    from titan_ckpt.hf_sharded import load_hf_weights, save_hf_weights
    from titan_ckpt.layout import list_checkpoints
    from titan_ckpt.manager import CheckpointManager
    from titan_ckpt.plugin import build_checkpointer
    from titan_ckpt.preflight import check_loadable, check_space, resume_point
    from titan_ckpt.safe_read import UnsafeCheckpointError
    from titan_ckpt.states import ModelState, OptimizerState
    from titan_ckpt.storage import StorageUnavailableError

__getattr__, __dir__ = attach(__name__, __file__)

__version__ = importlib.metadata.version("titan-llm-ckpt")  # the pyproject's version, one source

__all__ = [
    "check_loadable",
    "check_space",
    "resume_point",
    "Checkpoint",
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointSaveError",
    "UnsafeCheckpointError",
    "StorageUnavailableError",
    "build_checkpointer",
    "checkpoint_problems",
    "dcp_to_torch_file",
    "export_hf",
    "import_hf",
    "list_checkpoints",
    "load_hf_weights",
    "load_consolidated",
    "nonfinite_tensors",
    "value_problems",
    "ModelState",
    "OptimizerState",
    "read_safetensors",
    "save_hf_weights",
    "save_model_checkpoint",
]
