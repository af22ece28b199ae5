"""What the memory-saving modes cost in speed, said next to the dry run's memory table:
`[training] dtype = "bfloat16"`, `[activation_checkpoint] mode = "memory_budget"` and
`[activation_checkpoint] cpu_offload`. Their memory is in the table itself (the simulation
runs them); the speed is a sentence, as nothing is timed on fake tensors."""

from __future__ import annotations

GiB = 1024**3

HOST_LINK_GB_S = 25.0
"""Bytes per second one way between a GPU and host memory used for the offload's time: a
PCIe Gen4 x16 link's practical rate (Gen5 and NVLink-C2C hosts are faster)."""


def dtype_text(training) -> str:
    """The run's precision in a few words, for the dry run's header."""
    if training.dtype == "bfloat16":
        return "bfloat16 parameters, gradients and optimizer state"
    return "float32" if training.mixed_precision_param == "float32" else "bfloat16"


def ac_text(ac) -> str:
    """The activation checkpointing and offload of a run, for the dry run's header."""
    text = f"AC {ac.mode}"
    if ac.mode == "memory_budget":
        text += f" {ac.memory_budget:g}"
    return text + (" + activation offload" if ac.cpu_offload else "")


def memory_mode_notes(config, offloaded: int) -> list[str]:
    """A note per memory-saving mode the run uses: what it saves and what it costs in speed.
    `offloaded`: bytes one step of the fullest rank moves to host memory."""
    notes = []
    if config.training.dtype == "bfloat16":
        notes.append(
            "[training] dtype = bfloat16: parameters, gradients and optimizer state in"
            " bfloat16 with no float32 master copy (half the bytes of mixed precision, as"
            " counted above); speed as mixed precision, but every update is rounded to"
            " bfloat16 (the loss gap: trainer README, 'Memory-saving modes')"
        )
    ac = config.activation_checkpoint
    if ac.mode == "memory_budget":
        notes.append(
            f"[activation_checkpoint] memory_budget = {ac.memory_budget:g}: the compiler keeps"
            f" at most {ac.memory_budget:.0%} of each block's activations (counted above, as its"
            " partitioner decides); speed: backward recomputes the rest, cheapest FLOPs first"
            " (at 0 about one more forward of the blocks, as full checkpointing)"
        )
    if ac.cpu_offload:
        seconds = 2 * offloaded / (HOST_LINK_GB_S * 1e9)
        notes.append(
            f"[activation_checkpoint] cpu_offload: {offloaded / GiB:.2f} GiB of activations per"
            " step wait in host memory (pinned; not in the table); speed: copied out and back"
            f" on the compute stream, about {seconds:.2f} s per step at"
            f" {HOST_LINK_GB_S:g} GB/s each way"
        )
    return notes
