from __future__ import annotations

import logging

import pytest
import torch

from titan_core import (
    MemoryMonitor,
    backend_for,
    get_logger,
    init_logging,
    lookup_peak_flops,
    resolve_device_type,
    supports_bf16,
)


def test_device_type_and_backend():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device_type("auto") == expected
    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "nccl"
    with pytest.raises(ValueError, match="no collective backend"):
        backend_for("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")
def test_asking_for_cuda_without_one_names_the_fix():
    with pytest.raises(RuntimeError, match="use --job.device cpu"):
        resolve_device_type("cuda")


@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H20", "bf16", 148.0),
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA B200", "bf16", 2250.0),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "bf16", 121.0),
    ],
)
def test_datasheet_peaks_match_the_most_specific_name(name, dtype, tflops):
    assert lookup_peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_device_never_borrows_a_number():
    assert lookup_peak_flops("Some Future Accelerator", "bf16") is None
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # A100 has no FP8


def test_cpu_memory_stats_track_an_allocation():
    monitor = MemoryMonitor(torch.device("cpu"))
    before = monitor.stats()
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    after = monitor.stats()
    assert after.peak_gib >= before.current_gib + 0.05
    assert after.total_gib > after.current_gib > 0
    del block


def test_logging_quiets_non_zero_ranks(capsys):
    init_logging(rank=1)
    log = get_logger("test")
    log.info("hidden")
    log.warning("shown")
    init_logging(rank=0)
    get_logger("test").info("rank zero speaks")
    out = capsys.readouterr().out
    assert "hidden" not in out and "shown" in out and "rank zero speaks" in out
    assert get_logger().level == logging.INFO


def test_log_to_file_keeps_every_line_from_the_first_and_the_error_that_ended_it(tmp_path, capsys):
    from titan_core.log import log_to_file

    init_logging(rank=1)
    log = get_logger("test")
    log.info("before the file")  # not on rank 1's console, kept for its file
    init_logging(rank=1, console_ranks=[1])  # this rank chosen for the console
    path = tmp_path / "logs" / "rank_1.log"
    with pytest.raises(RuntimeError), log_to_file(str(path), rank=1):
        log.info("inside")
        raise RuntimeError("peer gone")
    log.info("after the file")
    init_logging(rank=0)
    # The file starts with what this process logged before it opened (earlier tests' lines too).
    lines = path.read_text().splitlines()
    stamped = [line for line in lines if line.startswith("[rank")]
    assert all(line.startswith("[rank1] ") for line in stamped)
    assert [line.split(" ", 3)[3] for line in stamped[-3:]] == [
        "INFO titan.test: before the file",
        "INFO titan.test: inside",
        "ERROR titan: stopped: peer gone",
    ]
    assert lines[-1] == "RuntimeError: peer gone" and "Traceback (most recent call last):" in lines
    assert "after the file" not in path.read_text()
    out = capsys.readouterr().out
    assert "before the file" not in out and "inside" in out and "after the file" in out


def test_bf16_on_a_cpu_follows_its_instructions_and_the_isa_torch_dispatches_to():
    """Native bf16 on a CPU needs the instructions (torch's cpuinfo) and torch's kernels using
    them: with `ATEN_CPU_CAPABILITY=avx2` torch computes as on an AVX2-only CPU, and
    `supports_bf16` says no there, whatever this CPU has (how CI checks an AVX2 machine)."""
    import os
    import subprocess
    import sys

    probe = (
        "import torch, titan_core; print(torch.backends.cpu.get_cpu_capability(),"
        " titan_core.supports_bf16(torch.device('cpu')))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe], env=env, capture_output=True, text=True
    )
    assert out.stdout.split() == ["AVX2", "False"], out.stderr
    here = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    native_isa = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
    assert supports_bf16(torch.device("cpu")) == (here and native_isa)
