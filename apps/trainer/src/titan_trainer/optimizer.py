"""The optimizer over every model part this rank holds."""

from __future__ import annotations

import torch
from torch import nn

from titan_core import get_logger

log = get_logger("optimizer")

_CLASSES = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def build_optimizer(model_parts: list[nn.Module], cfg) -> torch.optim.Optimizer:
    """AdamW (or Adam) from `cfg` ([optimizer]); `fused` where the parameters' device supports
    it, else `foreach` (said once in the log, since the fallback costs speed)."""
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    kwargs = dict(
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    cls = _CLASSES[cfg.name]
    if cfg.implementation == "fused":
        try:
            return cls(params, fused=True, **kwargs)
        except (RuntimeError, ValueError) as e:
            log.warning("fused %s is not available here (%s); using foreach", cfg.name, e)
            return cls(params, foreach=True, **kwargs)
    return cls(params, foreach=cfg.implementation == "foreach", **kwargs)
