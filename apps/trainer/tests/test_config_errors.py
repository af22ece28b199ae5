"""The messages a user sees for bad trainer configs, exactly, through the real command."""

from __future__ import annotations

import pytest

from titan_core import ConfigError, iter_options, load_config
from titan_core.config import describe_type
from titan_trainer.checks import check_config
from titan_trainer.cli import main
from titan_trainer.config import JobConfig


def problems(args, world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(load_config(JobConfig, args), world_size)
    return str(info.value)


def test_unknown_model_name_lists_installed_models():
    assert problems(["--model.name", "llama-3"]) == (
        "titan: config error: [model] name = 'llama-3': no titan.models plugin named 'llama-3'; installed: deepseek_v3, gemma3, gpt_oss, llama3, llama4, qwen3\n"
        "       did you mean llama3?\n"
        "       install a package that registers it under the entry-point group 'titan.models', or give an import path as module:attr"
    )


def test_unknown_flavor_suggests_the_closest():
    assert problems(["--model.flavor", "8b"]) == (
        "titan: config error: [model] flavor = '8b' is not a flavor of llama3\n"
        "       known: debugmodel, 100M, 1B, 3B, 8B, 70B, 405B\n"
        "       did you mean 8B?"
    )


def test_degrees_not_matching_the_job_size():
    assert problems(
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
        world_size=8,
    ) == (
        "titan: config error: parallelism degrees multiply to 4 (data_parallel_shard 2 x tensor_parallel 2)\n"
        "       but the job has 8 processes; use -1 for data_parallel_shard_degree to fill the rest"
    )


def test_sequence_length_not_divisible_by_tp():
    assert problems(
        ["--parallelism.tensor_parallel_degree", "4", "--training.seq_len", "250"], world_size=4
    ) == (
        "titan: config error: [training] seq_len = 250 must divide by 4 (tensor_parallel_degree 4, for sequence parallel)\n"
        "       use a multiple of 4, e.g. 252"
    )


def test_global_batch_not_a_multiple():
    assert problems(["--training.global_batch_size", "12", "--training.local_batch_size", "8"]) == (
        "titan: config error: [training] global_batch_size = 12 is not a multiple of local_batch_size x data-parallel degree = 8 x 1 = 8\n"
        "       gradient accumulation needs a whole number of microbatches; use a multiple, or -1"
    )


def test_unknown_converter():
    text = problems(["--model.converters", "quantize.linear.fp8"])
    assert text.startswith(
        "titan: config error: [model] converters = 'quantize.linear.fp8': no titan.converters plugin named 'quantize.linear.fp8'"
    )
    assert "did you mean quantize.linear.float8?" in text


def test_seed_checkpoint_needs_one_process():
    assert "create_seed_checkpoint needs exactly 1 process, but the job has 2" in problems(
        ["--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "2"],
        world_size=2,
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            ["--optimizer.lr", "-1"],
            "titan: config error: [optimizer] lr = -1.0 is not valid\n       use a positive learning rate",
        ),
        (
            ["--training.steps", "0"],
            "titan: config error: [training] steps = 0 is not valid\n       use 1 or more",
        ),
        (["--lr_scheduler.decay_type", "exp"], 'allowed: "linear", "sqrt", "cosine"'),
        (["--parallelism.tensor_parallel_degree", "0"], "tensor_parallel_degree = 0 is not valid"),
        (
            ["--training.dataloader.num_workers", "-1"],
            "titan: config error: [training.dataloader] num_workers = -1 is not valid\n"
            "       use 0 (load in the training process) or more",
        ),
        (["--model.attn_mask_type", "document"], 'allowed: "causal", "block_causal"'),
        (["--model.moe_aux_loss_alpha", "-0.1"], "[model] moe_aux_loss_alpha = -0.1 is not valid"),
        (
            ["--model.moe_load_balance_coeff", "0"],
            "[model] moe_load_balance_coeff is set but llama3 debugmodel has no mixture-of-experts layers",
        ),
        (
            ["--model.moe_capacity_factor", "0.5"],
            "[model] moe_capacity_factor = 0.5 is not valid\n       use 0 (no limit), 1 or more",
        ),
        (
            ["--model.moe_router_centering", "maybe"],
            '[model] moe_router_centering = "maybe" is not valid (from --model.moe_router_centering)\n'
            "       expected true or false",
        ),
        (
            ["--model.moe_router_centering", "true"],
            "[model] moe_router_centering is set but llama3 debugmodel has no mixture-of-experts layers",
        ),
        (
            [
                "--model.name",
                "qwen3",
                "--model.flavor",
                "debugmodel_moe",
                "--checkpoint.last_save_in_hf",
            ],
            "[checkpoint] last_save_in_hf with qwen3 debugmodel_moe's router centering",
        ),
        (
            ["--model.name", "deepseek_v3", "--model.moe_router_selection", "sinkhorn"],
            "[model] moe_router_selection = 'sinkhorn' with deepseek_v3 debugmodel's expert bias"
            " (moe_load_balance_coeff 0.001): Sinkhorn balances every step itself\n"
            "       set [model] moe_load_balance_coeff = 0 with it",
        ),
        (
            ["--training.mtp_loss_weight", "-0.1"],
            "titan: config error: [training] mtp_loss_weight = -0.1 is not valid\n"
            "       use 0 or more (DeepSeek-V3: 0.3, then 0.1)",
        ),
    ],
)
def test_section_level_errors(args, expected):
    with pytest.raises(ConfigError) as info:
        check_config(load_config(JobConfig, args), 1)
    assert expected in str(info.value)


def test_cli_prints_the_error_without_traceback_and_exits_2(capsys):
    assert main(["--training.stepz", "3"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "titan: config error: unknown key [training] stepz (from --training.stepz)\n"
        "       did you mean steps?\n"
    )


def test_help_lists_sections_of_every_package(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for option in (
        "--training.steps",
        "--parallelism.tensor_parallel_degree",
        "--checkpoint.interval",
        "--quantize.linear.float8.recipe_name",
        "--activation_checkpoint.mode",
        "--job.dump_folder",
    ):
        assert option in out


def test_torchtitan_style_configs_load(tmp_path):
    from pathlib import Path

    configs = Path(__file__).resolve().parents[1] / "configs"
    for path in sorted(configs.glob("*.toml")):
        cfg = load_config(JobConfig, ["--job.config_file", str(path)])
        # Kimi K2 is DeepSeek-V3's architecture: flavors of that family.
        prefixes = {"qwen3": "qwen3", "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3",
                    "llama4": "llama4", "gemma3": "gemma3", "gpt_oss": "gpt_oss"}  # fmt: skip
        family = next((f for p, f in prefixes.items() if path.stem.startswith(p)), "llama3")
        assert cfg.model.name == family


def test_console_ranks_are_checked_against_the_job_size(monkeypatch):
    from titan_trainer.logs import rank_problems

    assert problems(["--logging.ranks", "0,x"]) == (
        "titan: config error: [logging] ranks = '0,x': 'x' is not a rank or a range of ranks\n"
        "       use ranks such as 0, 0,3, 0-3 or all"
    )
    section = load_config(JobConfig, ["--logging.ranks", "0-2,5"]).logging
    assert rank_problems(section, 4) == [
        "[logging] ranks = '0-2,5' names rank 5, but the job has 4 processes\n"
        "use ranks from 0 to 3, or all"
    ]
    assert rank_problems(section, 6) == []
    # Without the key, torchtitan's LOG_RANK variable chooses.
    monkeypatch.setenv("LOG_RANK", "3")
    assert rank_problems(load_config(JobConfig, []).logging, 2) == [
        "LOG_RANK = '3' names rank 3, but the job has 2 processes\nuse ranks from 0 to 1, or all"
    ]


def test_block_causal_attention_runs_with_either_context_parallel_style():
    cp2 = ["--model.attn_mask_type", "block_causal", "--parallelism.context_parallel_degree", "2"]
    for style in ("ring", "alltoall"):
        args = [*cp2, "--parallelism.context_parallel_style", style]
        assert check_config(load_config(JobConfig, args), 2).cp_style() == style
    # "auto" takes all-to-all where the heads divide, the ring (with documents) where not.
    assert check_config(load_config(JobConfig, cp2), 2).cp_style() == "alltoall"
    cp3 = [*cp2[:3], "3", "--training.seq_len", "96"]
    assert check_config(load_config(JobConfig, cp3), 3).cp_style() == "ring"


def test_alltoall_context_parallel_needs_heads_that_divide_by_its_degree():
    # The debug model has 16 query heads: 3 ranks cannot share them evenly.
    args = ["--parallelism.context_parallel_degree", "3", "--training.seq_len", "96"]
    text = problems([*args, "--parallelism.context_parallel_style", "alltoall"], world_size=3)
    assert (
        "[parallelism] context_parallel_style = 'alltoall': 16 query heads per tensor-parallel"
        " rank (16 / tensor_parallel 1) do not divide by context_parallel_degree 3" in text
    ), text
    assert (
        "use context_parallel_style = 'ring', or a context_parallel_degree that divides 16" in text
    )
    # "auto" falls back to the ring there, which takes a causal model at any degree.
    assert check_config(load_config(JobConfig, args), 3).cp_style() == "ring"


def test_block_causal_attention_needs_a_model_that_takes_document_ids():
    from titan_trainer.preflight import preflight_problems

    config = load_config(
        JobConfig,
        [
            "--model.name",
            "runtime_models:third_party_spec",
            "--model.attn_mask_type",
            "block_causal",
        ],
    )
    found, _, _ = preflight_problems(config, 1)
    assert any(
        "[model] attn_mask_type = 'block_causal' needs a model whose forward takes"
        " `document_ids`, and runtime_models:third_party_spec's (ThirdParty) does not" in p
        for p in found
    ), found


def test_block_causal_attention_is_refused_on_a_device_where_its_check_fails():
    """The trainer runs the family's check of its block-causal attention on the job's device
    before training (FlexAttention against the dense mask on CUDA); here the FlexAttention
    path on the CPU, with a mask that lets documents see each other."""
    import torch

    from titan_trainer.checks import block_causal_device_problem
    from titan_trainer.model import model_spec

    args = ["--model.attn_mask_type", "block_causal"]
    config = load_config(JobConfig, args)
    cpu = torch.device("cpu")
    assert block_causal_device_problem(config, cpu, model_spec(config)) is None  # the real one
    leaky = load_config(
        JobConfig, [*args, "--model.name", "runtime_models:leaky_block_causal_spec"]
    )
    problem = block_causal_device_problem(leaky, cpu, model_spec(leaky))
    assert problem.startswith(
        "[model] attn_mask_type = 'block_causal': runtime_models:leaky_block_causal_spec's"
        " block-causal attention (block_causal_impl = 'auto') on cpu: "
    ), problem
    assert (
        "fails its check against the dense mask:\n  flex torch.float32 forward: greatest"
        " difference" in problem
    )
    assert problem.endswith(
        "training would let documents attend to each other, or fail; use another"
        " block_causal_impl ('dense' runs anywhere), attn_mask_type = 'causal' on this"
        " machine, or another torch version"
    )


def test_each_block_causal_impl_is_checked_on_the_device_and_flex_refused_on_the_cpu():
    """The trainer's check runs the chosen implementation: varlen's CPU path passes (forward
    and backward, fp32 and bf16), FlexAttention is refused on the CPU, which has no backward
    for it (training would fail at its first backward step)."""
    import torch

    from titan_trainer.checks import block_causal_device_problem
    from titan_trainer.model import model_spec

    cpu = torch.device("cpu")
    args = ["--model.attn_mask_type", "block_causal", "--model.block_causal_impl"]

    def problem_with(impl: str) -> str | None:
        config = load_config(JobConfig, [*args, impl])
        return block_causal_device_problem(config, cpu, model_spec(config))

    assert problem_with("varlen") is None
    problem = problem_with("flex")
    assert "(block_causal_impl = 'flex') on cpu" in problem, problem
    assert "FlexAttention has no backward on cpu" in problem
    assert "use block_causal_impl = 'dense' or 'varlen'" in problem


def test_block_causal_impl_without_block_causal_attention_is_refused():
    text = problems(["--model.block_causal_impl", "varlen"])
    assert (
        "[model] block_causal_impl = 'varlen' does nothing with attn_mask_type = 'causal': it"
        " picks how a block-causal mask is computed\n       set attn_mask_type = 'block_causal', or"
        " leave block_causal_impl out" in text
    )


def test_block_causal_impl_needs_a_model_that_has_the_attribute():
    from titan_trainer.layout import Layout
    from titan_trainer.preflight import _attention_problems

    def meta(config):  # the model the checks read, with a vocabulary of 16
        return Layout(config, config.parallelism.build_parallel_dims(1), vocab_size=16)

    name = "runtime_models:forward_with_document_ids_spec"
    args = ["--model.name", name, "--model.attn_mask_type", "block_causal"]
    config = load_config(JobConfig, args)
    assert _attention_problems(config, meta(config)) == []  # auto
    config = load_config(JobConfig, [*args, "--model.block_causal_impl", "varlen"])
    assert _attention_problems(config, meta(config)) == [
        "[model] block_causal_impl = 'varlen' needs a model with a `block_causal_impl`"
        f" attribute, and {name}'s (DocumentIds) has none\nleave block_causal_impl = 'auto'"
        " (the model's own choice), or add the attribute (see titan-models'"
        " titan_models.block_causal)"
    ]


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_learning_rate_is_a_config_error_before_anything_starts(value, capsys):
    assert main(["--optimizer.lr", value]) == 2
    err = capsys.readouterr().err
    assert err == (
        f'titan: config error: [optimizer] lr = "{value}" is not valid (from --optimizer.lr)\n'
        "       expected a finite number; the type is float\n"
    )


def test_every_float_key_refuses_nan_and_inf():
    floats = [
        name
        for name, tp, _, _ in iter_options(JobConfig)
        if describe_type(tp) in ("float", "float or none")
    ]
    assert "optimizer.lr" in floats and "training.max_norm" in floats, floats
    for name in floats:
        for value in ("nan", "-inf"):
            with pytest.raises(ConfigError, match="expected a finite number"):
                load_config(JobConfig, [f"--{name}", value])


def test_multi_token_prediction_is_checked_against_the_family_and_context_parallel():
    from titan_trainer.model import model_args_for
    from titan_trainer.preflight import preflight_problems

    def found(*args, world_size=1):
        return preflight_problems(load_config(JobConfig, list(args)), world_size)[0]

    assert found("--model.n_mtp_layers", "1") == [
        "[model] n_mtp_layers = 1: llama3 has no multi-token-prediction layers (deepseek_v3"
        " has)\nleave n_mtp_layers unset for this model"
    ]
    deepseek = ("--model.name", "deepseek_v3")
    assert (
        "[model] n_mtp_layers = -1 is not valid"
        in found(*deepseek, "--model.n_mtp_layers", "-1")[0]
    )
    # Context parallel would cut the sequence between a position and the tokens it reads ahead.
    cp = ("--parallelism.context_parallel_degree", "2", "--training.seq_len", "64")
    assert found(*deepseek, *cp, world_size=2) == [
        "[parallelism] context_parallel_degree = 2: multi-token prediction (n_mtp_layers = 1)"
        " reads the tokens up to 1 positions ahead, which context parallel puts on other"
        " ranks\ntrain with n_mtp_layers = 0, or without context parallel"
    ]
    assert found(*deepseek, *cp, "--model.n_mtp_layers", "0", world_size=2) == []
    # The key sets the depth; unset, the flavor's (1 in the debug flavor).
    from titan_core import plugins, resolve

    spec = resolve(plugins.MODELS, "deepseek_v3")
    for extra, depth in (
        ((), 1),
        (("--model.n_mtp_layers", "2"), 2),
        (("--model.n_mtp_layers", "0"), 0),
    ):
        config = load_config(JobConfig, [*deepseek, *extra])
        assert model_args_for(spec, config, 256).n_mtp_layers == depth


def test_attention_backend_is_refused_where_it_would_do_nothing_or_cannot_work():
    text = problems(
        ["--model.attention_backend", "flash", "--model.attn_mask_type", "block_causal"]
    )
    assert (
        "[model] attention_backend = 'flash' does nothing with attn_mask_type = 'block_causal':"
        " it picks the kernel of causal attention (the mask's own is block_causal_impl)\n"
        "       leave attention_backend out (or 'default')" in text
    )
    text = problems(
        [
            "--model.attention_backend",
            "math",
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.context_parallel_style",
            "ring",
        ],
        world_size=2,
    )
    assert (
        "[model] attention_backend = 'math' does not work with ring context parallel"
        " (context_parallel_degree = 2): torch's ring attention exchanges keys and values for"
        " the fused kernels only\n       use attention_backend = 'auto', 'flash', 'cudnn' or"
        " 'efficient', or context_parallel_style = 'alltoall'" in text
    )
    # DeepSeek-V3's latent attention calls SDPA itself, with no kernel to set.
    text = problems(
        [
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "debugmodel",
            "--model.attention_backend",
            "auto",
        ]  # fmt: skip
    )
    assert (
        "[model] attention_backend = 'auto': deepseek_v3 debugmodel has no attention layer that"
        " takes a kernel (an `sdpa_backend` attribute, as titan-models' GroupedQueryAttention"
        " has)\n       leave attention_backend out (or 'default') for this model" in text
    )


def test_attention_backend_is_checked_or_timed_on_the_device_with_the_ranks_shape(caplog):
    """A named kernel the device lacks is refused before training; a named kernel that runs
    and `auto` (timed here) are set on every attention layer; `default` sets none."""
    import logging

    import torch

    from titan_trainer.attention import apply_attention_backend
    from titan_trainer.layout import Layout

    def apply(backend: str, *extra: str, world: int = 1):
        args = ["--training.seq_len", "64", "--training.local_batch_size", "2", *extra]
        config = load_config(JobConfig, [*args, "--model.attention_backend", backend])
        dims = config.parallelism.build_parallel_dims(world)
        model = Layout(config, dims, vocab_size=16).meta_model()
        choice = apply_attention_backend(config, [model], dims, torch.device("cpu"), torch.float32)
        layers = [block.attention.sdpa_backend for block in model.layers.values()]
        return choice, layers

    with pytest.raises(ConfigError) as info:
        apply("cudnn")
    assert str(info.value) == (
        "titan: config error: [model] attention_backend = 'cudnn': the cudnn kernel cannot run"
        f" this job's attention (2x64, 16/8 heads of 16, float32) on cpu (torch {torch.__version__}):"
        " torch has no cudnn kernel on cpu (it has flash, math)\n"
        "       use attention_backend = 'auto' (the fastest kernel that runs it) or 'default'"
        " (torch's own choice)"
    )
    choice, layers = apply("math")
    assert choice.name == "math" and layers == [choice] * len(layers)
    with caplog.at_level(logging.INFO, logger="titan"):
        choice, layers = apply("auto")
    assert choice.name in ("flash", "math") and layers == [choice] * len(layers)
    (line,) = [r.getMessage() for r in caplog.records if "timed on rank 0" in r.getMessage()]
    assert line.startswith(
        f"attention: {choice.name} for 2x64, 16/8 heads of 16, float32 on cpu (forward +"
        f" backward, timed on rank 0: {choice.name} "
    ), line
    assert apply("default") == (None, [None] * len(layers))
    # Context parallel: the rank's half of the sequence, and no math kernel (ring attention
    # exchanges keys and values for the fused kernels only).
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titan"):
        choice, _ = apply("auto", "--parallelism.context_parallel_degree", "2", world=2)
    (line,) = [r.getMessage() for r in caplog.records if "timed on rank 0" in r.getMessage()]
    assert choice.name == "flash" and " for 2x32, 16/8 heads of 16, " in line, line
    assert "math" not in line
