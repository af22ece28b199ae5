"""What keeps a run honest: one run per dump folder, folders that can be written, and steps
whose loss or gradient norm is NaN or inf never reaching the weights. (Data that cannot make
batches is refused by `titan_trainer.data`.)

`StepGuard` checks every step before `optimizer.step()` without reading anything back to the
host: with a fused optimizer (the default, `[optimizer] implementation = "fused"`) the
verdict goes to the optimizer as a device tensor (`found_inf`, the mechanism torch's
GradScaler uses) and the fused kernel skips the update on the device. The host reads the
step's values, and the verdict, only when it logs (`read`), and then stops the run if a step
was skipped. Optimizers that cannot skip on the device are checked on the host every step,
which costs one synchronisation per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_core import FolderLock, RunFolderError, any_rank, check_writable, get_logger
from titan_trainer.checkpointing.space import folder_to_write

log = get_logger("guards")


class StartupError(RuntimeError):
    """A problem found before training starts (data, folders): printed as one message."""


class NonFiniteStepError(FloatingPointError):
    """A step's loss or gradient norm was NaN or inf; its update was not applied."""


def claim_run_folders(config, rank: int) -> FolderLock | None:
    """Write-test the dump folder (and the checkpoint folder when checkpointing is on) and
    claim the dump folder for this run, on rank 0; every rank learns the outcome. Raises
    RunFolderError naming the folder and the reason, or the run that holds it."""
    lock, error = None, None
    if rank == 0:
        dump = config.job.dump_folder
        try:
            check_writable(
                dump, purpose="dump folder", hint="point --job.dump_folder at another folder"
            )
            # None for a URL folder (s3://...): the checkpointer probes it when it is built.
            folder = folder_to_write(config)
            if folder is not None:
                check_writable(
                    folder,
                    purpose="checkpoint folder",
                    hint="point --checkpoint.folder at another folder (relative to the dump folder)",
                )
            lock = FolderLock(
                dump,
                purpose="dump folder",
                hint="wait for that run to end, stop it, or give this run another --job.dump_folder",
            )
        except RunFolderError as e:
            error = e
        if lock is not None and lock.taken_over is not None:
            log.warning(
                "took over the dump folder from a run that is gone (%s)",
                lock.taken_over.describe(),
            )
    if any_rank(error is not None):
        if lock is not None:
            lock.release()
        raise error or RunFolderError("rank 0 could not claim the dump folder (see its log)")
    return lock


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` skips its update on the device when its `found_inf` is non-zero:
    torch's fused Adam, AdamW, SGD and Adagrad do (those torch's GradScaler hands `found_inf`);
    any other is checked on the host."""
    fused = isinstance(optimizer, torch.optim.Adam | torch.optim.SGD | torch.optim.Adagrad)
    return fused and bool(optimizer.defaults.get("fused"))


class StepGuard:
    """Checks each step's loss and gradient norm before the optimizer step, and hands their
    values to the host only on `read()` (one synchronisation per logged step).

    A non-finite step is never applied. With `max_in_a_row` 0 the run stops at the next read
    (at once for an optimizer that cannot skip on the device); with N > 0 up to N non-finite
    steps in a row are skipped and counted (`skipped`), and one more stops the run."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_in_a_row: int = 0):
        self.optimizer = optimizer
        self.max_in_a_row = max_in_a_row
        self.on_device = skips_on_device(optimizer)
        self.skipped = 0  # non-finite steps skipped so far (as of the last read, on the device)
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        # On the device: [step, loss, grad_norm] of the latest bad step; bad steps in all, in
        # the current streak and in the longest streak.
        self._last_bad: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._streak = 0  # on the host, for optimizers checked there
        # First step at which this rank's own loss (before the reduction) was not finite.
        self._local_first: torch.Tensor | None = None

    def before_step(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        local_loss: torch.Tensor | None = None,
    ) -> bool:
        """Call between clipping and `optimizer.step()`, on every rank (the values are global;
        `local_loss`, this rank's own before the reduction, lets an error name the rank).
        Returns whether to call `optimizer.step()`: False for a bad step that the host has
        seen and skips (an optimizer that cannot skip on the device)."""
        loss, grad_norm = loss.detach().float(), grad_norm.detach().float().to(loss.device)
        if local_loss is not None:
            own_bad = ~torch.isfinite(local_loss.detach().float().to(loss.device))
            if self._local_first is None:
                self._local_first = torch.full((), float("nan"), device=loss.device)
            first = own_bad & torch.isnan(self._local_first)
            self._local_first = torch.where(first, float(step), self._local_first)
        self._pending.append((step, loss, grad_norm))
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if not self.on_device:
            # A host synchronisation every step: this optimizer cannot skip by itself.
            if not bool(bad):
                self._streak = 0
                return True
            self._streak += 1
            self.skipped += 1
            if self._streak > self.max_in_a_row:
                raise self._error(step, float(loss), float(grad_norm), self._streak)
            self._warn(step, float(loss), float(grad_norm))
            return False
        self.optimizer.found_inf = bad.float()
        # torch.full launches a fill; torch.tensor(step, device=...) would copy from the host
        # and wait for the device.
        values = torch.stack([torch.full((), float(step), device=loss.device), loss, grad_norm])
        if self._last_bad is None:
            self._last_bad = torch.full_like(values, float("nan"))
            self._counts = torch.zeros(3, device=loss.device)
        self._last_bad = torch.where(bad, values, self._last_bad)
        total, streak, longest = self._counts.unbind()
        streak = torch.where(bad, streak + 1, 0.0)
        self._counts = torch.stack([total + bad.float(), streak, torch.maximum(longest, streak)])
        return True

    def read(self) -> list[tuple[int, float, float]]:
        """(step, loss, grad_norm) of every step since the last read, in one read-back; raises
        NonFiniteStepError if more bad steps came in a row than allowed."""
        if not self._pending:
            return []
        values = [torch.stack([loss, norm]) for _, loss, norm in self._pending]
        if self._counts is not None:
            values += [self._last_bad, self._counts]
        flat = torch.cat(values).tolist()
        rows = [
            (step, flat[2 * i], flat[2 * i + 1]) for i, (step, _, _) in enumerate(self._pending)
        ]
        self._pending = []
        if self._counts is not None:
            (step, loss, norm), (total, _, longest) = flat[-6:-3], flat[-3:]
            new, self.skipped = int(total) - self.skipped, int(total)
            if longest > self.max_in_a_row:
                raise self._error(int(step), loss, norm, int(longest if self.max_in_a_row else new))
            if new:
                self._warn(int(step), loss, norm, new)
        return rows

    def _warn(self, step: int, loss: float, grad_norm: float, new: int = 1) -> None:
        log.warning(
            "step %d: loss %s and grad_norm %s: not finite; update skipped (%d skipped in this"
            " window, %d in all; more than %d in a row stops the run)",
            step, loss, grad_norm, new, self.skipped, self.max_in_a_row,
        )  # fmt: skip

    def _error(self, step: int, loss: float, grad_norm: float, count: int) -> NonFiniteStepError:
        if self.max_in_a_row:
            what = (
                f"{count} non-finite steps in a row, more than [training] max_nonfinite_in_a_row"
                f" = {self.max_in_a_row} allows; none of them was applied"
            )
        else:
            # `step` is the latest bad step of the window read.
            earlier = (
                f" (and {count - 1} earlier one{'s' if count > 2 else ''})" if count > 1 else ""
            )
            what = f"that update{earlier} was not applied"
        if self._weights_finite():
            weights = f"{what}, and the weights hold finite values (checked now)"
        else:
            weights = (
                f"{what}, but the weights already hold NaN or inf: an earlier update made them so"
                " although its loss and gradient norm were finite (a learning rate too high,"
                " or not finite)"
            )
        return NonFiniteStepError(
            f"step {step}: loss {loss} and grad_norm {grad_norm}: not finite; {weights};"
            f" stopping. {self._origin()}. Lower [optimizer] lr, or check the data; resume from"
            " the last checkpoint"
        )

    def _weights_finite(self) -> bool:
        """Whether every parameter the optimizer steps holds finite values, on every rank: one
        check per tensor and one reduction, on the error path only (every rank reaches it at
        the same step, the verdict being global)."""
        tensors = [
            (p.to_local() if isinstance(p, DTensor) else p).detach()
            for group in self.optimizer.param_groups
            for p in group["params"]
        ]
        tensors = [t for t in tensors if t.is_floating_point() and t.numel()]
        if not tensors:
            return True
        device = tensors[0].device  # (CPU offload keeps every parameter on the CPU)
        bad = torch.stack([(~torch.isfinite(t)).any().to(device) for t in tensors]).any().float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def _origin(self) -> str:
        """Which ranks' own losses went non-finite first: one all-gather, on the error path
        only (every rank reaches it at the same step, the verdict being global)."""
        mine = self._local_first
        if mine is None:
            return "Where it began is not known (no per-rank loss was given)"
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            firsts = [float(t) for t in every]
        else:
            firsts = [float(mine)]
        seen = [(s, r) for r, s in enumerate(firsts) if s == s]  # not NaN: it went bad
        if not seen:
            return (
                "Every rank's own loss was finite: the gradients went non-finite in the backward"
                " pass or their reduction"
            )
        step = min(s for s, _ in seen)
        ranks = [r for s, r in seen if s == step]
        names = ", ".join(map(str, ranks))
        return f"Rank{'s' if len(ranks) > 1 else ''} {names}'s own loss was not finite first, at step {int(step)}"
