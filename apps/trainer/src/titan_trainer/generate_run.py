"""`titan-generate`'s work, once its flags are read: the model built from its source (split
with tensor parallel over the processes under torchrun), and the tokens it generates."""

from __future__ import annotations

import argparse

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_core import init_distributed, plugins, resolve, resolve_device_type
from titan_core.distributed import destroy_distributed
from titan_models import Sampling, generate
from titan_parallel import apply_tp
from titan_trainer.generate_source import GenerateError, Source, find_source


def build_generator_model(source: Source, device, dtype, tp_mesh=None):
    """The model on `device` in `dtype` with the source's weights, split over `tp_mesh` when
    it has more than one rank."""
    with torch.device("meta"):
        model = source.spec.build(source.args)
    if tp_mesh is not None and tp_mesh.size() > 1:
        apply_tp(model, tp_mesh, model.tp_plan(), sequence_parallel=False, loss_parallel=False)
    model.to_empty(device=device)
    weights = source.read_weights()
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise GenerateError(f"{source.where} lacks weights for {', '.join(missing[:5])}")
    with torch.no_grad():
        for name, param in expected.items():
            full = weights[name].to(device=device, dtype=param.dtype)
            if isinstance(param, DTensor):
                # Every rank holds the full tensor: take this rank's shard without sending it.
                full = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
            param.copy_(full)
    model.to(dtype)
    model.init_buffers(device)  # the rotary table stays float32
    return model.eval()


def run(a: argparse.Namespace) -> int:
    sampling = Sampling(a.temperature, a.top_k, a.top_p)
    try:
        sampling.validate()
    except ValueError as e:
        raise GenerateError(str(e)) from None
    source = find_source(a)
    tokenizer = resolve(plugins.DATA, source.data_plugin).build_tokenizer(source.tokenizer)
    prompt = tokenizer.encode(a.prompt, bos=True, eos=False)
    limit = source.args.max_seq_len
    if len(prompt) + a.max_new_tokens > limit:
        raise GenerateError(
            f"the prompt ({len(prompt)} tokens) and --max-new-tokens {a.max_new_tokens} need "
            f"{len(prompt) + a.max_new_tokens} positions, but the model has {limit}\n"
            f"use --max-new-tokens {max(limit - len(prompt), 0)} or less"
        )
    info = init_distributed(resolve_device_type(a.device))
    try:
        mesh = None
        if info.world_size > 1:
            mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("tp",))
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
        model = build_generator_model(source, info.device, dtype, mesh)
        generator = torch.Generator(device=info.device).manual_seed(a.seed)
        new = generate(
            model,
            torch.tensor([prompt] * a.samples, device=info.device),
            a.max_new_tokens,
            sampling,
            stop_tokens={tokenizer.eos_id} if a.stop_at_eos else frozenset(),
            vocab_limit=tokenizer.vocab_size,
            generator=generator,
        )
        if info.rank == 0:
            for row in new.tolist():
                if a.stop_at_eos and tokenizer.eos_id in row:
                    row = row[: row.index(tokenizer.eos_id)]
                print(a.prompt + tokenizer.decode(row))
                if a.samples > 1:
                    print("-" * 40)
    finally:
        destroy_distributed()
    return 0
