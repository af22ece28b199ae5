"""Hugging Face weights at real widths, imported and exported shard by shard (titan-ckpt's
`load_hf_weights` and `save_hf_weights`, as `initial_load_in_hf` and `last_save_in_hf` use
them) by 4 ranks on real gloo process groups, under FSDP 2 x TP 2 and PP 2 x FSDP 2.

Two flavors of Llama 3: `small` (20M parameters, 80 MB in float32: 512 wide, 8 heads of 64
and 2 key/value heads, a 16,384-token vocabulary, 1 block; its embedding and output, 32 MiB
each, make the bound's one-tensor term large against the few MiB a process's heap varies by)
in the default suite, and `313mb`
(78M parameters, 313 MB: 1024 wide, 16 heads of 64 and 4 key/value heads, a 16,384-token
vocabulary, 4 blocks), marked `slow` (`uv run nox -s slow`; its figures are in titan-ckpt's
README). transformers builds the flavor from random weights and saves it in several
safetensors files. The 4 ranks start once per flavor; each layout imports the checkpoint,
computes the logits of a batch (the last pipeline stage's, under PP) and exports its own
shards; then transformers' `from_pretrained` loads each export. Checked:

- the logits of every layout equal transformers' (1e-4, as the other HF tests);
- each export holds exactly the checkpoint's tensors (bitwise: float32 both ways), in files
  that an index maps, and transformers' logits from it equal the original's;
- each rank's peak resident memory (VmHWM, which sees torch's allocations and the file pages
  safetensors maps) stays below 1/4 of the model plus its largest tensor: its shards and one
  tensor in flight. For the import, the peak above the rank's level before its weights
  existed (materialisation and import, measured); for the export, its shards plus the peak
  above the level the export starts at. The old path (every rank reading, or gathering, the
  whole model) is far above the bound. Printed per rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip(
    "transformers", reason="the logits comparison needs transformers (test extra)"
)
from safetensors import safe_open  # noqa: E402 - after the transformers check

WORLD, BATCH, SEQ = 4, 2, 32
READY = "written"
FLAVORS = {
    # llama3 arguments; the checkpoint's file size (save_pretrained) and the export's
    # (max_shard_bytes), so that both have several files.
    "small": dict(
        args=dict(dim=512, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=16384),
        save_shard="12MB",
        export_shard=16 * 2**20,
    ),
    "313mb": dict(
        args=dict(dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, vocab_size=16384),
        save_shard="40MB",
        export_shard=48 * 2**20,
    ),
}
LAYOUTS = {
    "fsdp2_tp2": dict(data_parallel_shard_degree=2, tensor_parallel_degree=2),
    "pp2_fsdp2": dict(
        data_parallel_shard_degree=2,
        pipeline_parallel_degree=2,
        pipeline_parallel_microbatch_size=1,
    ),
}


def llama_args(flavor: str):
    from titan_models import llama3_flavors

    return dataclasses.replace(
        llama3_flavors["debugmodel"], **FLAVORS[flavor]["args"], multiple_of=256,
        max_seq_len=SEQ, rope_theta=500000.0,
    )  # fmt: skip


def tokens(flavor: str) -> torch.Tensor:
    vocab = FLAVORS[flavor]["args"]["vocab_size"]
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


# ----------------------------------------------------------------------------- memory


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def settled_rss_mib() -> float:
    """This process's resident memory once freed heap memory is handed back to the system
    (glibc's malloc_trim; elsewhere nothing to hand back), so that memory reused later counts."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status_mib("VmRSS")


def peak_mib(fn, since: float) -> float:
    """How far this process's resident memory rose above `since` (MiB) at its peak while `fn`
    ran. Linux's peak (VmHWM, which sees torch's allocations and the file pages safetensors
    maps) is reset through /proc/self/clear_refs; where that is refused, a thread samples
    VmRSS every millisecond."""
    settled_rss_mib()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        peak = [_status_mib("VmRSS")]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _status_mib("VmRSS"))
                time.sleep(0.001)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        try:
            fn()
        finally:
            done.set()
            watcher.join()
        return peak[0] - since
    fn()
    return _status_mib("VmHWM") - since


# ----------------------------------------------------------------------------- the ranks


def _logits(runtime, parts, dims, flavor: str) -> torch.Tensor | None:
    """This rank's logits of `tokens(flavor)`: under PP the first stage's ranks send their hidden
    states to the last stage's, which return the logits (every FSDP rank runs the same
    batch, as it must take part in its stage's all-gathers)."""
    from torch.distributed.tensor import DTensor

    (part,) = parts
    with torch.no_grad():
        if runtime.pipeline is None:
            out = part(tokens(flavor))
        else:
            pp = dims.mesh("pp")
            ranks = pp.mesh.flatten().tolist()
            peer = ranks[1 - pp.get_local_rank()]
            if pp.get_local_rank() == 0:
                dist.send(part(tokens(flavor)).contiguous(), dst=peer)
                return None
            hidden = torch.empty(BATCH, SEQ, llama_args(flavor).dim)
            dist.recv(hidden, src=peer)
            out = part(hidden)
    return out.full_tensor() if isinstance(out, DTensor) else out


def run_layout(layout: str, flavor: str, folder: str, out: str) -> dict:
    from titan_ckpt import load_hf_weights, save_hf_weights
    from titan_models import llama3_spec
    from titan_trainer.config import JobConfig
    from titan_trainer.runtime import ParallelRuntime
    from titan_trainer.train import cross_entropy_loss

    cfg = JobConfig()
    cfg.training.seq_len = SEQ
    cfg.training.local_batch_size = BATCH
    cfg.training.mixed_precision_param = "float32"
    for key, value in LAYOUTS[layout].items():
        setattr(cfg.parallelism, key, value)
    dims = cfg.parallelism.build_parallel_dims(WORLD)
    dims.build_mesh("cpu")
    runtime = ParallelRuntime.of(
        cfg, dims, torch.device("cpu"), torch.float32, 0, cross_entropy_loss
    )
    args = llama_args(flavor)
    with torch.device("meta"):
        model = llama3_spec.build(args)
    parts = runtime.parallelize(model)
    adapter = llama3_spec.hf_adapter(args)
    dist.barrier()
    before = settled_rss_mib()  # the level before this rank's weights exist

    def materialize_and_import():
        runtime.materialize(parts)
        runtime.init_weights(parts, parameters=False)  # the rotary tables; weights from HF
        load_hf_weights(parts, adapter, folder)

    imported = peak_mib(materialize_and_import, since=before)
    local_mib = (
        sum(
            (p.to_local() if hasattr(p, "to_local") else p).nbytes
            for part in parts
            for p in part.parameters()
        )
        / 2**20
    )
    logits = _logits(runtime, parts, dims, flavor)
    dist.barrier()
    # What the forward left (FSDP's unsharded root parameters, gloo's buffers) is not the
    # export's: the export is measured from the level it starts at, plus the rank's shards.
    dist.barrier()
    exported = local_mib + peak_mib(
        lambda: save_hf_weights(
            parts, adapter, out, dtype="float32", max_shard_bytes=FLAVORS[flavor]["export_shard"]
        ),
        since=settled_rss_mib(),
    )
    return {
        "import_mib": imported,
        "export_mib": exported,
        "local_mib": local_mib,
        "logits": logits,
    }


def _worker(rank: int, flavor: str, init_file: str, folder: str, work: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(folder, READY)):  # the test process writes it
        if time.monotonic() > deadline:
            raise TimeoutError(f"no Hugging Face checkpoint in {folder} after 300 s")
        time.sleep(0.2)
    results = {}
    for layout in LAYOUTS:
        start = time.perf_counter()
        try:
            results[layout] = run_layout(layout, flavor, folder, os.path.join(work, layout))
        except Exception:  # shown by the tests
            results[layout] = {"error": traceback.format_exc()}
        results[layout]["seconds"] = time.perf_counter() - start
        dist.barrier()
    everyone: list[dict | None] = [None] * WORLD
    dist.all_gather_object(everyone, results)
    if rank == 0:
        torch.save(everyone, os.path.join(work, "results.pt"))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the test process


@pytest.fixture(scope="module", params=["small", pytest.param("313mb", marks=pytest.mark.slow)])
def flavor(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, flavor):
    return tmp_path_factory.mktemp(f"hf_llama_{flavor}")


@pytest.fixture(scope="module")
def launched(flavor, hf_folder):
    """The ranks, started first: they import torch and the trainer while the test process
    writes the checkpoint, then wait for it."""
    mp.set_forkserver_preload(["titan_trainer.train", "titan_models"])
    with tempfile.TemporaryDirectory() as work:
        ctx = mp.start_processes(
            _worker,
            args=(flavor, os.path.join(work, "init"), str(hf_folder), work),
            nprocs=WORLD,
            join=False,
            start_method="forkserver",
        )
        try:
            yield ctx, work
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()


@pytest.fixture(scope="module")
def hf_checkpoint(flavor, hf_folder, launched) -> dict:
    """transformers' LlamaForCausalLM with random weights (norm scales too), saved in several
    files, and its logits of `tokens(flavor)`; written while the ranks start. The weights are drawn
    directly: transformers' own initialisation takes many seconds at this size."""
    from titan_models import llama3_spec

    adapter = llama3_spec.hf_adapter(llama_args(flavor), torch_dtype="float32")
    config = transformers.LlamaConfig(**adapter.hf_config())
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, p in model.named_parameters():
        weights[name] = torch.empty(p.shape)
        if name.endswith("norm.weight"):
            weights[name].uniform_(0.5, 1.5, generator=generator)
        else:
            weights[name].normal_(0.0, 0.02, generator=generator)
    model.load_state_dict(weights, assign=True)
    # The rotary frequencies, a buffer computed from the config: built for real on the CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with torch.no_grad():
        logits = model.eval()(tokens(flavor)).logits
    if not (hf_folder / READY).exists():
        model.save_pretrained(hf_folder, max_shard_size=FLAVORS[flavor]["save_shard"])
        (hf_folder / READY).write_text("")
    tensors = {n: (tuple(p.shape), p.nbytes) for n, p in model.state_dict().items()}
    del model
    gc.collect()
    return {"folder": hf_folder, "logits": logits, "tensors": tensors, "flavor": flavor}


@pytest.fixture(scope="module")
def results(launched, hf_checkpoint) -> list[dict]:
    ctx, work = launched
    deadline = time.monotonic() + 600
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {WORLD} ranks did not finish in 600 s")
    found = torch.load(os.path.join(work, "results.pt"), weights_only=False)
    for layout in LAYOUTS:
        found[0][layout]["export"] = _read_export(os.path.join(work, layout), hf_checkpoint)
    return found


def _read_export(folder: str, hf_checkpoint: dict) -> dict:
    """What the test needs of an export before its folder goes: the files, whether each
    tensor equals the checkpoint's, and transformers' logits from it."""
    source = hf_checkpoint["folder"]
    index = json.loads(Path(folder, "model.safetensors.index.json").read_text())
    source_index = json.loads((source / "model.safetensors.index.json").read_text())
    differing = []
    for name, file in index["weight_map"].items():
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            ours = f.get_tensor(name)
        with safe_open(str(source / source_index["weight_map"][name]), framework="pt") as f:
            if not torch.equal(ours, f.get_tensor(name)):
                differing.append(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens(hf_checkpoint["flavor"])).logits
    return {
        "names": set(index["weight_map"]),
        "files": sorted(set(index["weight_map"].values())),
        "differing": differing,
        "logits": logits,
        "class": type(model).__name__,
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_import_gives_transformers_logits(layout, results, hf_checkpoint):
    per_rank = [r[layout] for r in results]
    for r in per_rank:
        assert "error" not in r, r["error"]
    logits = [r["logits"] for r in per_rank if r["logits"] is not None]
    assert len(logits) == (2 if layout.startswith("pp") else WORLD)  # the last stage's ranks
    for got in logits:
        # fp32 on both sides; only the order of floating-point operations differs (sharded
        # matmuls, attention kernel, rotary formulation): ~1e-6 at this size.
        assert (got - hf_checkpoint["logits"]).abs().max().item() <= 1e-4
    assert hf_checkpoint["logits"].abs().max() > 0.1  # not a comparison of near-zero logits
    print(f"{layout}: " + ", ".join(f"{r['seconds']:.1f}s" for r in per_rank))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_export_is_the_checkpoint_again_and_loads_in_transformers(
    layout, results, hf_checkpoint
):
    assert all("error" not in r[layout] for r in results)
    export = results[0][layout]["export"]
    assert export["class"] == "LlamaForCausalLM"
    assert export["names"] == set(hf_checkpoint["tensors"])
    assert len(export["files"]) > 1 and not export["differing"], export["differing"]
    # Same weights, bit for bit: the same logits.
    assert (export["logits"] - hf_checkpoint["logits"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("direction", ["import", "export"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_rank_holds_more_than_its_shards_and_one_tensor(
    layout, direction, results, hf_checkpoint
):
    sizes = [nbytes for _, nbytes in hf_checkpoint["tensors"].values()]
    model_mib, largest_mib = sum(sizes) / 2**20, max(sizes) / 2**20
    bound = model_mib / WORLD + largest_mib
    growth = [r[layout][f"{direction}_mib"] for r in results]
    local = [r[layout]["local_mib"] for r in results]
    print(
        f"{hf_checkpoint['flavor']} {layout} {direction}: peak RSS for the weights"
        " per rank "
        + ", ".join(f"{g:.0f}" for g in growth)
        + f" MiB (its shards: {', '.join(f'{m:.0f}' for m in local)} MiB); bound: model"
        f" {model_mib:.0f} / {WORLD} + largest tensor {largest_mib:.0f} = {bound:.0f} MiB"
    )
    assert max(growth) < bound
