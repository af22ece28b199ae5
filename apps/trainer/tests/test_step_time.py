"""The dry run's step-time model: its parts against their formulas, its systems' files, the
simulated step's counted work against hand counts, the block it prints, the search, and its
predictions against published large-scale runs (recorded work, priced again here)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib

import pytest
import torch
from conftest import TRAINER, run_cli

from titan_core import ConfigError
from titan_trainer.dry_run.hardware import Link, load_system, parse_system, shipped_systems
from titan_trainer.dry_run.step_time import (
    JobShape,
    collective_seconds,
    group_stride,
    pipeline_bubble,
    predict,
)
from titan_trainer.dry_run.step_trace import (
    Collective,
    StepTrace,
    StepWork,
    cpu_flash_causal_share,
)

REPO = TRAINER.parents[1]
RECORD = REPO / "bench" / "results" / "step_time_published.json"
H100 = load_system("h100_sxm")


def _shape(**degrees) -> JobShape:
    full = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1} | degrees
    return JobShape(degrees=full, tokens_per_step=8192, world_size=math.prod(full.values()))


def test_a_ring_costs_its_latencies_and_its_share_of_the_tensor_on_the_right_link():
    degrees = _shape(dp_shard=8).degrees
    c = Collective("all_gather", "fsdp", 8, calls=10, bytes=8 * 10**9)
    intra = H100.intra_node
    expected = 10 * 7 * intra.latency_us * 1e-6 + 8e9 * 7 / 8 / (intra.bandwidth_gbps * 1e9)
    assert collective_seconds(c, H100, degrees) == pytest.approx(expected)
    # all-reduce: reduce-scatter then all-gather, twice the ring
    r = Collective("all_reduce", "fsdp", 8, calls=10, bytes=8 * 10**9)
    assert collective_seconds(r, H100, degrees) == pytest.approx(2 * expected)
    # FSDP over 8 ranks outside TP 8: each group's ranks sit 8 apart, one per node.
    wide = _shape(dp_shard=8, tp=8).degrees
    assert group_stride("fsdp", wide) == 8 and group_stride("tp", wide) == 1
    inter = H100.inter_node
    expected_inter = 10 * 7 * inter.latency_us * 1e-6 + 8e9 * 7 / 8 / (inter.bandwidth_gbps * 1e9)
    assert collective_seconds(c, H100, wide) == pytest.approx(expected_inter)
    assert collective_seconds(Collective("all_gather", "tp", 1, 5, 10**9), H100, wide) == 0
    # A measured system's own link for a kind (gloo's slow reduce-scatter) replaces the
    # intra-node link for that kind only, and never a cross-node one.
    slow = Link(bandwidth_gbps=intra.bandwidth_gbps / 4, latency_us=intra.latency_us)
    measured = dataclasses.replace(H100, links_by_kind={"reduce_scatter": slow})
    rs = Collective("reduce_scatter", "fsdp", 8, calls=10, bytes=8 * 10**9)
    assert collective_seconds(rs, measured, degrees) > 3 * collective_seconds(rs, H100, degrees)
    assert collective_seconds(c, measured, degrees) == pytest.approx(expected)
    assert collective_seconds(rs, measured, wide) == pytest.approx(expected_inter)


def test_the_pipeline_bubble_follows_the_schedule():
    shape = JobShape({"pp": 4}, 1, 4, schedule="1F1B", pp_microbatches=8)
    assert pipeline_bubble(1.0, shape) == pytest.approx(3 / 8)
    interleaved = JobShape({"pp": 4}, 1, 4, "Interleaved1F1B", 8, stages_per_rank=2)
    assert pipeline_bubble(1.0, interleaved) == pytest.approx(3 / 16)
    zbv = JobShape({"pp": 4}, 1, 4, "ZBVZeroBubble", 8, stages_per_rank=2)
    assert pipeline_bubble(1.0, zbv) == pytest.approx(3 / 16 / 3)
    assert pipeline_bubble(1.0, _shape()) == 0


def test_fsdp_traffic_hides_behind_compute_but_tp_traffic_does_not():
    work = StepWork(matmul_flops=H100.peak("bf16") * H100.matmul_efficiency, dtype="bf16")
    work.collectives = [Collective("all_gather", "fsdp", 8, calls=100, bytes=37 * 10**9)]
    hidden = predict("r", work, _shape(dp_shard=8), H100)
    assert hidden.compute == pytest.approx(1.0)
    assert hidden.communication == pytest.approx(37e9 * 7 / 8 / 370e9 + 100 * 7 * 10e-6)
    assert hidden.exposed == pytest.approx(hidden.communication / 100 * 2)  # the unhidden ones
    work.collectives = [Collective("all_gather", "tp", 8, calls=100, bytes=37 * 10**9)]
    exposed = predict("r", work, _shape(tp=8), H100)
    assert exposed.exposed == pytest.approx(exposed.communication)
    assert exposed.step > hidden.step
    # Without overlap (a CPU's), everything is exposed.
    work.collectives = [Collective("all_gather", "fsdp", 8, calls=100, bytes=37 * 10**9)]
    serial = predict("r", work, _shape(dp_shard=8), _replace(H100, overlap=False))
    assert serial.exposed == pytest.approx(serial.communication)


def _replace(system, **changes):
    import dataclasses

    return dataclasses.replace(system, **changes)


def test_every_shipped_system_loads_and_cites_where_its_figures_come_from():
    names = shipped_systems()
    assert {"h100_sxm", "h100_torchtitan", "h200", "a100_sxm"} <= set(names)
    for name in names:
        system = load_system(name)
        assert system.peak("bf16") > 1e14
        for key in ("matmul", "attention", "intra_node", "inter_node"):
            assert len(system.provenance.get(key, "")) > 20, (name, key)
    assert load_system("auto", "A100").name == "DGX A100"


def test_a_users_system_file_loads_and_a_bad_one_is_named(tmp_path):
    text = (TRAINER / "src/titan_trainer/dry_run/systems/h100_sxm.toml").read_text()
    mine = tmp_path / "mine.toml"
    mine.write_text(text.replace('name = "DGX H100"', 'name = "our cluster"'))
    assert load_system(str(mine)).name == "our cluster"
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("matmul = 0.72", "matmul = 72"))
    with pytest.raises(ConfigError, match=r"\[efficiency\] matmul = 72 is a share of peak"):
        load_system(str(bad))
    with pytest.raises(ConfigError, match=r"x.toml: no \[links.intra_node\]"):
        parse_system({"name": "x", "device": "y"}, "x.toml")
    data = tomllib.loads(text)
    del data["devices_per_node"]
    with pytest.raises(ConfigError, match=r"\[top level\] has no devices_per_node"):
        parse_system(data, "x.toml")
    with pytest.raises(ConfigError, match="neither a shipped system nor a file"):
        load_system("h100_sxn")
    assert Link(1.0, 2.0).latency_us == 2.0


def test_the_trace_counts_matmul_and_attention_flops_as_written_out():
    torch.manual_seed(0)
    b, s, d, heads = 2, 64, 32, 4
    linear = torch.nn.Linear(d, 3 * d, bias=False)
    x = torch.randn(b, s, d, requires_grad=True)
    trace = StepTrace()
    with trace.phase("microbatch", repeat=3):
        q, k, v = linear(x).view(b, s, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    work = trace.work()
    # forward 2*b*s*d*3d, backward twice that (input and weight gradients), three microbatches
    assert work.matmul_flops == pytest.approx(3 * 3 * 2 * b * s * d * 3 * d)
    # attention: 4*b*h*s*s*hd forward (two matmuls), 2.5x that backward; torch's CPU kernel
    # computes all of a causal square of 64 positions (one key block)
    full = 3 * (4 + 10) * b * heads * s * s * (d // heads)
    assert work.attention_flops_full == pytest.approx(full)
    assert cpu_flash_causal_share(s, s) == 1.0
    assert work.attention_flops == pytest.approx(full)
    assert work.memory_bytes > 0 and work.compute_ops > 0
    assert StepWork.from_dict(json.loads(json.dumps(work.to_dict()))) == work


def test_the_cpu_attention_kernel_computes_the_causal_share_the_trace_counts():
    # torch's CPU flash kernel computes whole key blocks of up to 512 positions: a causal
    # square of 512 costs what a full one does, one of 2048 about 0.62 of it. Timed here as a
    # ratio of two runs in one process (min of 5 each), against the trace's count.
    import time

    def seconds(fn) -> float:
        fn()
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for length in (512, 2048):
            q = torch.randn(max(1, 2048 // length), 4, length, 64)
            causal = seconds(
                lambda q=q: torch.nn.functional.scaled_dot_product_attention(
                    q, q, q, is_causal=True
                )
            )
            full = seconds(lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, q, q))
            share = cpu_flash_causal_share(length, length)
            assert causal / full == pytest.approx(share, abs=0.12), (length, causal / full, share)
    finally:
        torch.set_num_threads(threads)
    assert cpu_flash_causal_share(512, 512) == 1.0
    assert cpu_flash_causal_share(1024, 1024) == 0.75
    assert cpu_flash_causal_share(1 << 16, 1 << 16) == pytest.approx(0.5, abs=0.01)


def test_debug_model_dry_run_prints_a_predicted_step_time_block(tmp_path):
    result = run_cli(
        [
            *("--job.config_file", "apps/trainer/configs/debug_model.toml", "--dry-run"),
            *("--dry_run.world_size", "2", "--job.dump_folder", str(tmp_path)),
        ]
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "predicted step time on DGX H100 (a model, not a measurement" in out, out
    m = re.search(
        r"predicted: ([\d.]+) s per step, ([\d,]+) tokens/s per device, MFU ([\d.]+)%", out
    )
    assert m and float(m[1]) > 0 and int(m[2].replace(",", "")) > 0, out
    # tokens/s per device = 2 ranks x local batch 8 x seq 256 / step / 2
    assert int(m[2].replace(",", "")) == pytest.approx(8 * 256 / float(m[1]), rel=0.001)
    block = out.split("predicted step time on")[1].split("verdict:")[0]
    assert all("predicted" in line or not line.strip() for line in block.splitlines()[1:2])
    bad = run_cli(
        [
            *("--job.config_file", "apps/trainer/configs/debug_model.toml", "--dry-run"),
            *("--dry_run.system", "nowhere.toml", "--job.dump_folder", str(tmp_path)),
        ]
    )
    # A system that is not there is refused before anything is simulated.
    assert bad.returncode == 2, bad.stdout[-3000:]
    assert "[dry_run] system = 'nowhere.toml' is neither a shipped system nor a file" in bad.stdout
    assert "rank role" not in bad.stdout and "simulating" not in bad.stderr


def test_search_ranks_the_layouts_that_fit_by_predicted_tokens_per_second(tmp_path):
    result = run_cli(
        [
            *("--job.config_file", "apps/trainer/configs/debug_model.toml", "--dry-run"),
            *("--dry_run.world_size", "2", "--dry_run.search"),
            *("--job.dump_folder", str(tmp_path)),
        ],
        timeout=900,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "search: 3 splits of 2 ranks" in out, out
    lines = re.findall(r"^  (\d)\. (.*): ([\d,]+) tokens/s, MFU", out, re.M)
    assert len(lines) >= 4, out
    speeds = [int(s.replace(",", "")) for _, _, s in lines]
    assert speeds == sorted(speeds, reverse=True), out
    labels = [label for _, label, _ in lines]
    assert any("tp 2" in label for label in labels), out
    # every split was simulated (said on stderr as it goes), the pipeline one among them
    assert "simulating pp 2, 1F1B x 8 microbatches" in result.stderr, result.stderr[-3000:]
    assert len({label.split(", AC")[0] for label in labels}) >= 2  # degrees and AC modes vary


def _published():
    rows = {}
    for line in (REPO / "bench" / "published_throughput.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["id"]] = row
    return rows


# Rows the model misses by more than 20%, each explained in docs/step_time.md -> the range its
# error must stay in (a change that widens the miss, or flips its side, fails here).
FAR_OFF = {
    "tt-8b-8gpu-fsdp-compile": (20, 27),
    "tt-asynctp-8b-64gpu-fsdp8-tp8-bf16-async": (20, 40),
    "tt-asynctp-70b-256gpu-fsdp32-tp8-bf16-async": (20, 31),
    "llama3-paper-405b-16384gpu-cp1-8k": (-27, -20),
}


def test_predictions_of_published_runs_are_within_20_percent():
    """The work of each published run the trainer can express, simulated at its real size
    (`bench/step_time_published.py --record`), priced again on the system it ran on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pub", REPO / "bench" / "step_time_published.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    recorded = json.loads(RECORD.read_text())
    published = _published()
    assert set(recorded) == set(bench.ROWS)
    results = [bench.compare(recorded[row], published[row]) for row in bench.ROWS]
    sources = {r["source"] for r in results}
    assert len(sources) >= 2, sources
    for r in results:
        if r["id"] in FAR_OFF:
            low, high = FAR_OFF[r["id"]]
            assert low <= r["error_pct"] <= high, r
        else:
            assert abs(r["error_pct"]) <= 20, r
    readme = (TRAINER / "README.md").read_text()
    for r in results:  # the README's table is these figures
        assert f"| {r['id']} |" in readme and f"{r['error_pct']:+.1f}%" in readme, r


def test_dry_run_prices_on_this_machine_measured_with_system_cpu(tmp_path):
    result = run_cli(
        [
            *("--job.config_file", "apps/trainer/configs/debug_model.toml", "--dry-run"),
            *("--dry_run.system", "cpu", "--dry_run.world_size", "2"),
            *("--job.dump_folder", str(tmp_path)),
        ],
        timeout=900,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert re.search(r"predicted step time on cpu \(.*measured\)", out), out
    m = re.search(r"^predicted: ([\d.e-]+) s per step", out, re.M)
    assert m and float(m[1]) > 0, out


def test_context_parallel_exchanges_are_told_from_fsdp_on_the_group_they_share():
    # With dp_shard 1, FSDP's dp_shard x cp group is the context parallel group itself: its
    # all-gathers and reduce-scatters are FSDP's (hidden behind compute on a GPU), the
    # attention's all-to-alls context parallel's (exposed).
    from titan_core import plugins, resolve
    from titan_trainer.dry_run.timing import LAYOUTS, model_config, simulate_for_cpu

    vocab = resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
    world, extra = LAYOUTS["CP 2"]
    sim = simulate_for_cpu(model_config("debug", extra), world, vocab)
    kinds = {(c.group, c.kind) for role in sim.roles for c in role.trace.collectives}
    assert ("cp", "all_to_all") in kinds, kinds
    assert {("fsdp", "all_gather"), ("fsdp", "reduce_scatter")} <= kinds, kinds
    assert not any(group == "fsdp" and kind == "all_to_all" for group, kind in kinds), kinds
