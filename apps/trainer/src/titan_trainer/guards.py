"""What keeps a run honest: one run per dump folder, folders that can be written, data that can
make batches, and steps whose loss or gradient norm is NaN or inf never reaching the weights.

`StepGuard` checks every step before `optimizer.step()` without reading anything back to the
host: with a fused optimizer (the default, `[optimizer] implementation = "fused"`) the
verdict goes to the optimizer as a device tensor (`found_inf`, the mechanism torch's
GradScaler uses) and the fused kernel skips the update on the device. The host reads the
step's values, and the verdict, only when it logs (`read`), and then stops the run if a step
was skipped. Optimizers that cannot skip on the device are checked on the host every step,
which costs one synchronisation per step.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from titan_core import FolderLock, RunFolderError, any_rank, check_writable, get_logger

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
            check_writable(dump, purpose="dump folder")
            ckpt = config.checkpoint
            if ckpt.enable or ckpt.create_seed_checkpoint:
                check_writable(os.path.join(dump, ckpt.folder), purpose="checkpoint folder")
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


def build_checked_loader(data, **kwargs):
    """The data plugin's loader; its refusals (no tokens, bad rows, unreadable data) become a
    StartupError that names the dataset keys."""
    try:
        return data.build_dataloader(**kwargs)
    except (ValueError, FileNotFoundError) as e:
        raise StartupError(f"[training] dataset {kwargs.get('dataset')!r}: {e}") from e


class StepGuard:
    """Checks each step's loss and gradient norm before the optimizer step, and hands their
    values to the host only on `read()` (one synchronisation per logged step)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        # Fused Adam/AdamW skip their update on the device when `found_inf` is non-zero.
        self.on_device = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and bool(
            optimizer.defaults.get("fused")
        )
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._first_bad: torch.Tensor | None = None  # [step, loss, grad_norm] of the first bad step
        self._bad_steps: torch.Tensor | None = None

    def before_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Call between clipping and `optimizer.step()`, on every rank (the values are global)."""
        loss, grad_norm = loss.detach().float(), grad_norm.detach().float().to(loss.device)
        self._pending.append((step, loss, grad_norm))
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if not self.on_device:
            if bool(bad):  # a host synchronisation every step: this optimizer cannot skip itself
                raise self._error(step, float(loss), float(grad_norm), 1)
            return
        self.optimizer.found_inf = bad.float()
        # torch.full launches a fill; torch.tensor(step, device=...) would copy from the host
        # and wait for the device.
        values = torch.stack([torch.full((), float(step), device=loss.device), loss, grad_norm])
        if self._first_bad is None:
            self._first_bad = torch.full_like(values, float("nan"))
            self._bad_steps = torch.zeros((), device=loss.device)
        first_time = bad & (self._bad_steps == 0)
        self._first_bad = torch.where(first_time, values, self._first_bad)
        self._bad_steps = self._bad_steps + bad.float()

    def read(self) -> list[tuple[int, float, float]]:
        """(step, loss, grad_norm) of every step since the last read, in one read-back; raises
        NonFiniteStepError if any of them was skipped."""
        if not self._pending:
            return []
        values = [torch.stack([loss, norm]) for _, loss, norm in self._pending]
        if self._bad_steps is not None:
            values += [self._first_bad, self._bad_steps.reshape(1)]
        flat = torch.cat(values).tolist()
        rows = [
            (step, flat[2 * i], flat[2 * i + 1]) for i, (step, _, _) in enumerate(self._pending)
        ]
        self._pending = []
        if self._bad_steps is not None and flat[-1] > 0:
            step, loss, norm = flat[-4:-1]
            raise self._error(int(step), loss, norm, int(flat[-1]))
        return rows

    def _error(self, step: int, loss: float, grad_norm: float, count: int) -> NonFiniteStepError:
        later = f" (and {count - 1} later one{'s' if count > 2 else ''})" if count > 1 else ""
        return NonFiniteStepError(
            f"step {step}: loss {loss} and grad_norm {grad_norm}: not finite; that update{later} was"
            " not applied, so the weights and every checkpoint hold finite values; stopping."
            " Lower [optimizer] lr, or check the data"
        )


def skipped_rows_total(loader, dp_mesh, device: torch.device) -> int:
    """Bad rows the data-parallel ranks' loaders have skipped, summed (0 for loaders that do not
    count them). A collective over `dp_mesh`; called at logging steps only."""
    count = torch.tensor([float(getattr(loader, "skipped_rows", 0))])
    if dp_mesh is None:
        return int(count.item())
    count = count.to(device if dp_mesh.device_type != "cpu" else "cpu")
    dist.all_reduce(count, group=dp_mesh.get_group())
    return int(count.item())
