"""`[eval]` scores a training run's model as lm-evaluation-harness scores the same weights.

A debug model trains 20 steps in one process and evaluates the six example tasks
(apps/trainer/tasks: HellaSwag, ARC, PIQA, MMLU, LAMBADA and WikiText formats) at its end,
writing each item's log-likelihoods; its Hugging Face snapshot (`[checkpoint] hf_interval`)
holds the weights, config and the byte tokenizer's files. lm-eval's `hf` model then scores the export on the same task
files, written as lm-eval task YAMLs. Each item's choice log-likelihoods agree within 1e-4
(fp32 on both sides; the attention kernels and rotary formulation differ), `acc`/`acc_norm`
are equal to the item, perplexities within 1e-4 relative. The same weights evaluated under
FSDP 2, TP 2 and PP 2 give the same per-item log-likelihoods within 1e-4."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from conftest import DEBUG_TOML, run_cli, start_cli

TASKS = Path(__file__).resolve().parents[1] / "tasks"
NAMES = [
    "pydocs_hellaswag",
    "pydocs_arc",
    "pydocs_piqa",
    "pydocs_mmlu",
    "pydocs_lambada",
    "pydocs_wikitext",
]
STEPS = 20
ITEMS = 32  # per task (wikitext: its 8 pages); `slow` scores every item of the files
LOGLIK_TOL = 1e-4
"""fp32 on both sides; the order of floating-point operations differs (attention kernel,
rotary formulation): ~1e-5 over a continuation of a few dozen tokens."""


def train_args(dump: Path, items: int = ITEMS) -> list[str]:
    return [
        "--job.config_file", str(DEBUG_TOML),
        "--job.dump_folder", str(dump),
        "--metrics.save_plots_folder", "",
        "--training.mixed_precision_param", "float32",
        "--eval.tasks", ",".join(str(TASKS / f"{n}.toml") for n in NAMES),
        "--eval.max_examples", str(items),
        "--eval.log_samples", "true",
    ]  # fmt: skip


def train_and_score(dump: Path, items: int) -> str:
    """20 steps, the tasks scored after the last, a Hugging Face snapshot of the same weights."""
    result = run_cli(
        [
            *train_args(dump, items),
            "--training.steps",
            str(STEPS),
            "--eval.freq",
            "1000",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "1000",
            "--checkpoint.hf_interval",
            str(STEPS),
            "--metrics.save_plots_folder",
            "plots",
        ]  # fmt: skip
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    dump = tmp_path_factory.mktemp("eval") / "run"
    return dump, train_and_score(dump, ITEMS)


def read_samples(dump: Path, step: int) -> dict[str, list[dict]]:
    folder = dump / "eval_samples" / f"step-{step}"
    return {
        n: [json.loads(line) for line in (folder / f"{n}.jsonl").read_text().splitlines()]
        for n in NAMES
    }


def read_results(dump: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in (dump / "eval_results.jsonl").read_text().splitlines()]
    return {r["task"]: r for r in rows}


def test_scores_are_logged_with_their_cost(trained, tmp_path, capsys):
    dump, output = trained
    results = read_results(dump)
    assert sorted(results) == sorted(NAMES)
    for name, row in results.items():
        assert row["step"] == STEPS and row["forwards"] > 0 and row["seconds"] > 0, row
        assert f"step   {STEPS} | eval {name} | " in output
    # 20 steps on the corpus put the true ending of a held-out sentence first more often
    # than chance (0.25 with four choices).
    assert results["pydocs_hellaswag"]["acc_norm"] > 0.3, results["pydocs_hellaswag"]
    assert results["pydocs_wikitext"]["bits_per_byte"] < 4.0, results["pydocs_wikitext"]
    # A plot per task beside the loss plot; the scores in TensorBoard, for titan-compare.
    for name in NAMES:
        assert (dump / "plots" / f"eval_{name}.png").stat().st_size > 0
    from titan_trainer.compare import main as compare
    from titan_trainer.plots import read_scalars

    scalars = read_scalars(str(dump))
    assert scalars["eval/pydocs_hellaswag/acc_norm"] == {
        STEPS: pytest.approx(results["pydocs_hellaswag"]["acc_norm"])
    }
    # titan-compare lines the scores of two runs up (here the run and a copy of its events).
    shutil.copytree(dump / "tb", tmp_path / "copy" / "tb")
    metric = "eval/pydocs_hellaswag/acc_norm"
    args = [str(dump), str(tmp_path / "copy"), "--metric", metric, "--tolerance", "0", "--plot", ""]
    assert compare(args) == 0
    assert metric in capsys.readouterr().out


def test_a_task_longer_than_the_context_stops_the_job_before_its_first_step(tmp_path):
    result = run_cli(
        [
            *train_args(tmp_path / "run"),
            "--training.seq_len",
            "64",
            "--eval.tasks",
            str(TASKS / "pydocs_hellaswag.toml"),
        ]  # fmt: skip
    )
    assert result.returncode != 0
    assert (
        "pydocs_hellaswag.jsonl, item" in result.stderr
        and "longer than the model's 64" in result.stderr
    )
    assert "| loss " not in result.stdout + result.stderr


# lm-eval's YAML for each task: the same fields, templates in Jinja.
def lm_eval_yaml(name: str, tasks: Path) -> str:
    data = lambda n: f"dataset_kwargs:\n  data_files:\n    test: {tasks / n}\n"  # noqa: E731
    head = f"task: {name}\ndataset_path: json\ntest_split: test\n"
    mc = "output_type: multiple_choice\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    if name == "pydocs_hellaswag":
        return (
            head + data(f"{name}.jsonl") + mc + "fewshot_split: test\nnum_fewshot: 1\n"
            'doc_to_text: "{{ctx}}"\ndoc_to_choice: "{{endings}}"\ndoc_to_target: "{{label}}"\n'
        )
    if name == "pydocs_arc":
        return (
            head + "dataset_kwargs:\n  data_files:\n"
            f"    test: {tasks / 'pydocs_arc.jsonl'}\n    train: {tasks / 'pydocs_arc_shots.jsonl'}\n"
            + mc
            + "fewshot_split: train\nnum_fewshot: 1\nfewshot_config:\n  sampler: first_n\n"
            'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
            'doc_to_choice: "{{choices.text}}"\n'
            'doc_to_target: "{{choices.label.index(answerKey)}}"\n'
        )
    if name == "pydocs_piqa":
        return (
            head + data(f"{name}.jsonl") + mc + 'doc_to_text: "Question: {{goal}}\\nAnswer:"\n'
            'doc_to_choice: "{{[sol1, sol2]}}"\ndoc_to_target: label\n'
        )
    if name == "pydocs_mmlu":
        return (
            head
            + data(f"{name}.jsonl")
            + mc
            + 'doc_to_text: "{{question}}\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. '
            '{{choices[2]}}\\nD. {{choices[3]}}\\nAnswer:"\n'
            'doc_to_choice: ["A", "B", "C", "D"]\ndoc_to_target: answer\n'
        )
    if name == "pydocs_lambada":
        return (
            head + data(f"{name}.jsonl") + "output_type: loglikelihood\n"
            "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
            "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
            "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
        )
    return (
        head + data(f"{name}.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{page}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n"
    )


def test_scores_equal_lm_evaluation_harness_on_the_exported_weights(trained, tmp_path):
    dump, _ = trained
    check_against_lm_eval(dump, tmp_path, ITEMS)


@pytest.mark.slow
def test_every_item_of_the_task_files_scores_as_lm_eval_scores_it(tmp_path):
    """All of each file (300 HellaSwag, 200 ARC/PIQA/MMLU/LAMBADA items, 8 WikiText pages)."""
    train_and_score(tmp_path / "run", -1)
    check_against_lm_eval(tmp_path / "run", tmp_path, None)


def check_against_lm_eval(dump: Path, tmp_path: Path, items: int | None) -> None:
    lm_eval = pytest.importorskip("lm_eval", reason="the reference is lm-eval (dev group)")
    from lm_eval.tasks import TaskManager

    # The run's Hugging Face snapshot ([checkpoint] hf_interval): weights, config, tokenizer.
    export = dump / "checkpoint" / "hf" / f"step-{STEPS}"
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()
    yamls = tmp_path / "tasks"
    yamls.mkdir()
    for name in NAMES:
        (yamls / f"{name}.yaml").write_text(lm_eval_yaml(name, TASKS))
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(export), "dtype": "float32", "max_length": 256},
        tasks=NAMES,
        task_manager=TaskManager(include_path=str(yamls)),
        limit=items,
        batch_size=8,
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,  # no standard errors: the scores are compared, not their spread
    )
    ours, results = read_samples(dump, STEPS), read_results(dump)
    worst = {}
    for name in NAMES:
        theirs = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        mine = ours[name]
        assert len(theirs) == len(mine), name
        for a, b in zip(mine, theirs):
            lls = [float(r[0]) for r in b["filtered_resps"]] if name != "pydocs_wikitext" else None
            mine_ll = a["loglik"] if isinstance(a["loglik"], list) else [a["loglik"]]
            ref_ll = lls if lls is not None else [float(b["filtered_resps"][0])]
            worst[name] = max(worst.get(name, 0.0), *(abs(x - y) for x, y in zip(mine_ll, ref_ll)))
            if name == "pydocs_wikitext":
                assert math.isclose(a["loglik"], float(b["filtered_resps"][0]), rel_tol=LOGLIK_TOL)
            elif name == "pydocs_lambada":
                assert abs(a["loglik"] - lls[0]) <= LOGLIK_TOL, (name, a, b["filtered_resps"])
                assert a["greedy"] == bool(b["filtered_resps"][0][1]), (name, a["item"])
            else:
                assert max(abs(x - y) for x, y in zip(a["loglik"], lls)) <= LOGLIK_TOL, (name, a)
                assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"]), (name, a, b)
        reference = out["results"][name]
        for metric, value in reference.items():
            key = metric.split(",")[0]
            if key in results[name] and not metric.endswith("stderr,none"):
                assert math.isclose(results[name][key], value, rel_tol=LOGLIK_TOL), (name, metric)
    print("largest |log-likelihood difference| per task:", worst)


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.data_parallel_shard_degree", "2"],
        [
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
        [
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.pipeline_parallel_degree",
            "2",
        ],
        pytest.param(
            [
                "--parallelism.data_parallel_shard_degree",
                "1",
                "--parallelism.context_parallel_degree",
                "2",
            ],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["fsdp2", "tp2", "pp2", "cp2"],
)
def test_the_same_weights_score_alike_on_each_layout(trained, tmp_path, layout):
    dump, _ = trained
    # The trained weights, one step at lr 1e-30 (below every weight's float32 spacing, so the
    # weights stay as they are; 0 is refused), evaluated after it.
    run = start_cli(
        [
            *train_args(tmp_path / "run"),
            *layout,
            "--training.steps",
            "1",
            "--optimizer.lr",
            "1e-30",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "1000",
            "--checkpoint.initial_load_path",
            str(dump / "checkpoint" / f"step-{STEPS}"),
            "--eval.max_examples",
            "24",
        ],  # fmt: skip
        nproc=2,
    )
    result = run.result(900)
    assert result.returncode == 0, result.stderr[-4000:]
    ours, reference = read_samples(tmp_path / "run", 1), read_samples(dump, STEPS)
    for name in NAMES:
        for a, b in zip(ours[name], reference[name]):
            x, y = a["loglik"], b["loglik"]
            x, y = (x, y) if isinstance(x, list) else ([x], [y])
            assert max(abs(p - q) for p, q in zip(x, y)) <= LOGLIK_TOL * max(1, abs(y[0]) / 100), (
                name,
                a,
                b,
            )
            if "acc" in a:
                assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"]), (name, a, b)


@pytest.mark.slow
def test_a_moe_model_scores_alike_under_expert_parallel(tmp_path):
    """Qwen3 MoE's debug model as initialised (the same weights on every layout: Titan's
    initialisation is a function of the seed and each parameter's name), one step at lr 1e-30,
    scored under FSDP 2 and under EP 2 (experts split over the two ranks, all-to-all
    dispatch). Both take the same batches: the router's load-balancing bias moves with the
    step's expert loads whatever the lr, so a run on other batches (one process's) routes
    differently after its step."""
    moe = str(DEBUG_TOML.parent / "qwen3_moe_debug.toml")

    def args(folder: Path) -> list[str]:
        base = train_args(folder, 16)
        base[base.index(str(DEBUG_TOML))] = moe
        return [*base, "--training.steps", "1", "--optimizer.lr", "1e-30"]

    fsdp = start_cli(args(tmp_path / "fsdp"), nproc=2)
    ep = start_cli([*args(tmp_path / "ep"), "--parallelism.expert_parallel_degree", "2"], nproc=2)
    for run in (fsdp, ep):
        result = run.result(900)
        assert result.returncode == 0, result.stderr[-4000:]
    ours, reference = read_samples(tmp_path / "ep", 1), read_samples(tmp_path / "fsdp", 1)
    for name in NAMES:
        for a, b in zip(ours[name], reference[name]):
            x, y = a["loglik"], b["loglik"]
            x, y = (x, y) if isinstance(x, list) else ([x], [y])
            scale = max(1, abs(y[0]) / 100)
            assert max(abs(p - q) for p, q in zip(x, y)) <= LOGLIK_TOL * scale, (name, a, b)
