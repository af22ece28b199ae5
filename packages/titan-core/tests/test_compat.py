"""Running on the oldest supported torch (2.11) and on the GPU's process group, from a CPU:
what a newer torch adds is looked up, and its absence is said once."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from titan_core import set_collective_timeout
from titan_core.compat import accepts, note_missing
from titan_core.device import process_group_backend
from titan_core.distributed import device_backend_name


@pytest.fixture
def compat_log(monkeypatch):
    """The lines titan_core.compat logs, with its once-per-process memory emptied."""
    import titan_core.compat

    monkeypatch.setattr(titan_core.compat, "_noted", set())
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(f"{record.levelname} {record.getMessage()}")
    logger = logging.getLogger("titan.compat")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    yield lines
    logger.removeHandler(handler)


def test_a_gpu_group_carries_a_cpu_backend_beside_the_accelerators():
    # DCP's async save and collectives of CPU tensors need the CPU one (see the trainer's
    # resume test, which runs this group with gloo in NCCL's place).
    assert process_group_backend("cuda") == "cuda:nccl,cpu:gloo"
    assert process_group_backend("xpu") == "xpu:xccl,cpu:gloo"
    assert process_group_backend("cpu") == "gloo"


def test_the_device_backend_of_a_group_is_the_accelerators(single_process_group):
    assert device_backend_name() == "gloo"
    group = dist.new_group(backend="cuda:gloo,cpu:gloo")  # NCCL's place taken by gloo
    assert device_backend_name(group) == "gloo"


@pytest.mark.parametrize("hide_set_timeout", [False, True], ids=["as-installed", "torch-2.11"])
def test_collective_timeout_is_set_with_or_without_dist_set_timeout(
    single_process_group, monkeypatch, compat_log, hide_set_timeout
):
    if hide_set_timeout:  # torch 2.11 has only the private _set_pg_timeout
        monkeypatch.delattr(dist, "set_timeout", raising=False)
    group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    try:
        assert set_collective_timeout(7) >= 1
        assert backend.options._timeout == timedelta(seconds=7)
    finally:
        set_collective_timeout(300)
    said = [line for line in compat_log if "set_timeout" in line]
    if hasattr(dist, "set_timeout"):
        assert said == []
    else:
        assert said == [
            f"INFO torch {torch.__version__} has no torch.distributed.set_timeout:"
            " using its older _set_pg_timeout"
        ]


def test_a_missing_feature_is_said_once_and_keyword_support_is_detected(compat_log):
    for _ in range(3):
        note_missing("the moon", "nothing is lit at night", off=True)
    assert compat_log == [
        f"WARNING torch {torch.__version__} has no the moon: nothing is lit at night"
    ]
    assert accepts(dist.init_process_group, "device_id")
    assert not accepts(dist.init_process_group, "no_such_argument")
    assert not accepts(len, "anything")  # a builtin without a signature
