"""titan-ckpt: distributed checkpointing over torch.distributed.checkpoint (DCP) with atomic and
async saves, resharding on load, seed checkpoints and Hugging Face safetensors import/export."""

import importlib.metadata

from titan_ckpt.config import Checkpoint
from titan_ckpt.dcp_io import dcp_to_torch_file, load_consolidated, save_model_checkpoint
from titan_ckpt.hf import export_hf, import_hf, read_safetensors
from titan_ckpt.layout import list_checkpoints
from titan_ckpt.manager import CheckpointManager, CheckpointSaveError
from titan_ckpt.plugin import build_checkpointer

__version__ = importlib.metadata.version("titan-ckpt")  # the pyproject's version, one source

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "CheckpointSaveError",
    "build_checkpointer",
    "dcp_to_torch_file",
    "export_hf",
    "import_hf",
    "list_checkpoints",
    "load_consolidated",
    "read_safetensors",
    "save_model_checkpoint",
]
