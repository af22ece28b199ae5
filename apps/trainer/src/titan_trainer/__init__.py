"""titan-trainer: the reference pretraining loop (`titan-train`, `python -m titan_trainer`)."""

import importlib.metadata

__version__ = importlib.metadata.version("titan-llm-trainer")
