"""Memory statistics on CUDA (allocator counters) and on CPU (process RSS and its peak)."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

GiB = 1024**3


@dataclass(frozen=True)
class MemoryStats:
    current_gib: float
    """Memory in use now: allocated tensors on CUDA, the process's resident set on CPU."""
    peak_gib: float
    """The most in use since the last `reset_peak()`."""
    reserved_gib: float
    """CUDA: held by the caching allocator; CPU: same as current."""
    total_gib: float
    """The device's capacity (GPU memory, or the machine's RAM)."""


class MemoryMonitor:
    def __init__(self, device: torch.device):
        self.device = device
        self.reset_peak()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            # Linux resets the process's high-water mark (VmHWM) when 5 is written here.
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass

    def stats(self) -> MemoryStats:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return MemoryStats(
                torch.cuda.memory_allocated(self.device) / GiB,
                torch.cuda.max_memory_allocated(self.device) / GiB,
                torch.cuda.memory_reserved(self.device) / GiB,
                total / GiB,
            )
        current, peak = _cpu_rss_bytes()
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return MemoryStats(current / GiB, peak / GiB, current / GiB, total / GiB)


def _cpu_rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process."""
    current = peak = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    current = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
    except (
        OSError
    ):  # not Linux: ru_maxrss is the lifetime peak (kilobytes on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        current = peak
    return current, max(peak, current)
