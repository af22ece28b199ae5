"""Held-out loss during training, every `validation.freq` steps: the mean over every counted
token of the batches (a label of -100 counts for nothing), over every data-parallel rank, so
that a rank with more counted tokens weighs more and any layout gives the number one process
gives. Under pipeline parallel the batches run through the forward-only schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_core import get_logger
from titan_trainer.data import build_checked_loader

log = get_logger("validate")


class Validator:
    """Evaluates the mean loss over the first `steps` batches of the validation dataset (the
    same batches every time, so the numbers are comparable across the run). By default that
    is `pydocs_validation`, the part of the embedded corpus that `pydocs` training never reads."""

    def __init__(
        self,
        cfg,
        data,
        plugin: str,
        tokenizer,
        dp_rank: int,
        dp_world: int,
        train_seq_len: int,
        bad_rows: str = "error",
    ):
        self.cfg = cfg
        kwargs = dict(
            dataset=cfg.dataset,
            dataset_path=cfg.dataset_path,
            text_field=cfg.dataset_text_field,
            tokenizer=tokenizer,
            seq_len=cfg.seq_len if cfg.seq_len != -1 else train_seq_len,
            batch_size=cfg.local_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world,
            infinite=False,
            bad_rows=bad_rows,
        )
        self.build = lambda: build_checked_loader(data, section="validation", **kwargs)

    def due(self, step: int) -> bool:
        return self.cfg.enable and step % self.cfg.freq == 0

    @torch.no_grad()
    def run(self, runtime, model_parts) -> float:
        for part in model_parts:
            part.eval()
        # Everything that meets a collective lives on the training device: NCCL reduces GPU
        # tensors only, gloo both.
        device = runtime.device
        total = torch.zeros(2, dtype=torch.float32, device=device)  # loss sum, tokens
        count = 0
        batches = iter(self.build())
        while self.cfg.steps == -1 or count < self.cfg.steps:
            batch = next(batches, None)
            # Every rank must run the same number of forwards (FSDP and TP gather inside them),
            # so all stop as soon as one runs out of data.
            more = torch.tensor(0 if batch is None else 1, device=device)
            if dist.is_initialized():
                dist.all_reduce(more, op=dist.ReduceOp.MIN)
            if not more.item():
                break
            inputs, labels = (t.to(device) for t in batch)
            total += torch.stack(runtime.eval_loss(model_parts, inputs, labels))
            count += 1
        for part in model_parts:
            part.train()
        if count == 0:
            raise RuntimeError(
                f"validation dataset {self.cfg.dataset!r} produced no batch; use a larger dataset or a smaller seq_len"
            )
        loss_sum, tokens = runtime.reduce_sum(total).tolist()
        if tokens == 0:
            raise RuntimeError(
                f"validation dataset {self.cfg.dataset!r} has no label to count (all are -100)"
            )
        return loss_sum / tokens
