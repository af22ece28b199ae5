"""init_weights on DTensor parameters, as FSDP2 leaves them, in a one-process gloo group.

One rank is enough to check the contract (every parameter is a DTensor and nn.init works on
it, the rope buffer is rebuilt, the result matches a plain model); the numerical parity of
sharded training belongs to titan-parallel's multi-rank tests.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from conftest import build_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from titan_models import Transformer
from titan_models.llama3.rope import build_rope_cache


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


# DTensor warns that CPU meshes lack a dedicated RNG tracker; one rank draws like a plain tensor.
@pytest.mark.filterwarnings("ignore:DTensor random operators:UserWarning")
@pytest.mark.parametrize("tied", [False, True])
def test_init_weights_on_fsdp_dtensor_parameters(one_rank_group, tiny_args, tied):
    args = dataclasses.replace(tiny_args, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Transformer(args)
    for block in model.layers.values():
        fully_shard(block, mesh=one_rank_group)
    fully_shard(model, mesh=one_rank_group)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    if tied:
        assert model.output.weight is model.tok_embeddings.weight
    torch.testing.assert_close(model.rope_cache, build_rope_cache(args), rtol=0, atol=0)
    # On one rank the shard is the whole tensor, so the same seed gives the same init.
    reference = build_model(args, seed=0)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name].full_tensor(), tensor, rtol=0, atol=0)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-6, atol=1e-6)
