"""Every command the root and trainer READMEs show in a shell block is run, exactly as shown,
by a test: the training commands here (from a scratch folder, so that their `outputs/` land
there, with `UV_PROJECT` pointing `uv run` at this checkout), the others by the test named in
RUN_ELSEWHERE. A command added to a README without a test fails the first test below."""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
READMES = (REPO / "README.md", REPO / "apps/trainer/README.md", REPO / "bench/README.md")

MAIN_JOB = "uv run titan-train --job.config_file apps/trainer/configs/debug_model.toml"
SHORT_JOB = f"{MAIN_JOB} --training.steps 20"
RANGER21_JOB = (
    f"{MAIN_JOB} --optimizer.name Ranger21 --training.steps 3 --job.dump_folder outputs/ranger21"
)
FOUR_PROCESSES = (
    "uv run torchrun --nproc_per_node 4 -m titan_trainer --job.config_file "
    "apps/trainer/configs/debug_model.toml --parallelism.data_parallel_shard_degree 2 "
    "--parallelism.tensor_parallel_degree 2 --training.steps 20"
)
MOE_JOB = (
    "uv run titan-train --job.config_file apps/trainer/configs/qwen3_moe_debug.toml "
    "--training.steps 20"
)
FAMILY_JOBS = {
    family: f"uv run titan-train --job.config_file apps/trainer/configs/{family}_debug.toml "
    "--training.steps 10"
    for family in ("deepseek_v3", "llama4")
}
GEMMA3_JOB = (
    "uv run titan-train --job.config_file apps/trainer/configs/gemma3_debug.toml "
    "--training.steps 10"
)
RUN_HERE = {
    MAIN_JOB, SHORT_JOB, RANGER21_JOB, FOUR_PROCESSES, MOE_JOB, *FAMILY_JOBS.values(), GEMMA3_JOB
}  # fmt: skip
LAUNCH_8B = "NGPU=8 CONFIG_FILE=configs/llama3_8b.toml apps/trainer/run_train.sh"
SBATCH_70B = (
    "sbatch --nodes 8 --gpus-per-node 8 apps/trainer/scripts/multinode.sbatch "
    "configs/llama3_70b.toml"
)
CLUSTER_TESTS = "apps/trainer/tests/test_cluster_slurm.py::"
RUN_ELSEWHERE = {
    # CI itself (.ci/run runs exactly this).
    "uv run nox": ".ci/run",
    "uv sync --all-packages --extra llama": (
        "tools/test_docs.py::test_root_readme_install_command_works_as_shown"
    ),
    # The launch scripts as shown, from a shell with no Titan on PATH (below); with the
    # cluster tools replaced by recorders, how they resolve configs.
    LAUNCH_8B: "apps/trainer/tests/test_readme_commands.py::"
    "test_the_launch_scripts_find_the_workspace_and_stop_once_when_the_data_is_out_of_reach",
    SBATCH_70B: "apps/trainer/tests/test_readme_commands.py::"
    "test_the_launch_scripts_find_the_workspace_and_stop_once_when_the_data_is_out_of_reach",
    # On a real SLURM test cluster (tests marked `cluster`, `nox -s cluster`).
    "sbatch --nodes 2 apps/trainer/scripts/multinode.sbatch debug_model --training.steps 10": (
        f"{CLUSTER_TESTS}test_the_readme_slurm_command_trains_across_two_nodes_as_one_host_does"
    ),
    **dict.fromkeys(
        [
            f"NNODES=2 NODE_RANK={rank} MASTER_ADDR=10.0.0.1 apps/trainer/run_train.sh "
            "--training.steps 10"
            for rank in (0, 1)
        ],
        f"{CLUSTER_TESTS}test_run_train_sh_across_two_hosts_trains_as_one_host_does",
    ),
    **dict.fromkeys(
        [
            "python3 tools/slurm_cluster.py up --nodes 2",
            "export SLURM_CONF=/tmp/titan-cluster/slurm.conf",
            "python3 tools/slurm_cluster.py down",
        ],
        f"{CLUSTER_TESTS}test_the_readme_commands_start_and_stop_the_test_cluster",
    ),
    "NGPU=8 CONFIG_FILE=configs/llama3_8b.toml apps/trainer/run_train.sh --training.steps 100": (
        "apps/trainer/tests/test_shipped_files.py::test_run_train_sh_finds_the_config_from_any_folder"
    ),
    "titan-train --job.config_file debug_model --training.steps 5": (
        "apps/trainer/tests/test_shipped_files.py::"
        "test_the_readme_runs_a_shipped_config_by_name_from_any_folder"
    ),
    "titan-train --list-configs": (
        "apps/trainer/tests/test_shipped_files.py::"
        "test_list_configs_and_config_path_answer_without_importing_torch"
    ),
    # The generation block, in order, from a scratch folder (training, conversion, generation
    # from DCP, from Hugging Face files and under torchrun).
    **dict.fromkeys(
        [
            "titan-train --job.config_file debug_model --training.steps 10 --training.seq_len 64 "
            "--checkpoint.enable --job.dump_folder outputs/gen",
            "titan-ckpt convert dcp-to-hf outputs/gen/checkpoint/step-10 outputs/gen_hf",
            'titan-generate outputs/gen --prompt "The list" --max-new-tokens 50',
            'titan-generate outputs/gen_hf --tokenizer byte --prompt "The list" --max-new-tokens 50',
            "torchrun --standalone --nproc_per_node 2 -m titan_trainer.generate outputs/gen "
            '--prompt "The list" --max-new-tokens 50',
        ],
        "apps/trainer/tests/test_generate.py::"
        "test_greedy_text_is_the_same_from_dcp_tp_and_hf_and_equals_transformers",
    ),
    # Against a local Hugging Face cache (no network in CI).
    **dict.fromkeys(
        [
            "titan-download meta-llama/Llama-3.1-8B",
            "titan-download meta-llama/Llama-3.1-8B --assets tokenizer weights",
        ],
        "apps/trainer/tests/test_download.py::"
        "test_the_readme_commands_place_the_assets_where_the_configs_look",
    ),
    # The README's comparison: the job twice, and titan-compare on the two folders.
    **dict.fromkeys(
        [
            "titan-train --job.config_file debug_model --training.steps 5 --job.dump_folder "
            "outputs/first",
            "titan-train --job.config_file debug_model --training.steps 5 --job.dump_folder "
            "outputs/again",
            "titan-compare outputs/first outputs/again --tolerance 1e-5",
        ],
        "apps/trainer/tests/test_shipped_files.py::"
        "test_the_readme_runs_a_shipped_config_by_name_from_any_folder",
    ),
    "LOG_RANK=0,1 NGPU=2 apps/trainer/run_train.sh --training.steps 10": (
        "apps/trainer/tests/test_shipped_files.py::"
        "test_run_train_sh_finds_the_config_from_any_folder"
    ),
    "MAX_RESTARTS=3 NGPU=2 apps/trainer/run_train.sh --checkpoint.enable --checkpoint.interval 3 "
    "--training.steps 10": (
        "apps/trainer/tests/test_elastic_restart.py::"
        "test_a_killed_rank_is_restarted_and_the_job_ends_as_if_nothing_failed"
    ),
    # The lighthouse and the three replica groups, with a free port for the lighthouse.
    **dict.fromkeys(
        [
            "torchft_lighthouse --bind [::]:29510 --min_replicas 1 --join_timeout_ms 10000 &",
            *(
                "TORCHFT_LIGHTHOUSE=http://localhost:29510 MAX_RESTARTS=3 "
                "apps/trainer/run_train.sh --fault_tolerance.enable --fault_tolerance.group_size 3 "
                f"--fault_tolerance.replica_id {g} --job.dump_folder outputs/ft_group{g} &"
                for g in range(3)
            ),
        ],
        "apps/trainer/tests/test_fault_tolerance_e2e.py::"
        "test_with_every_group_required_the_run_ends_as_if_nothing_failed",
    ),
    # bench/README.md: the GPU command refuses here; the CPU session runs every script; the
    # throughput commands run as shown with toy sizes appended (the full ones take minutes).
    "uv run nox -s bench-gpu": (
        "apps/trainer/tests/test_bench_commands.py::"
        "test_bench_gpu_without_a_gpu_says_so_and_fails_without_writing_a_file"
    ),
    "uv run nox -s bench": (
        "apps/trainer/tests/test_bench_commands.py::test_nox_bench_runs_every_cpu_script"
    ),
    **dict.fromkeys(
        [
            "uv run python bench/throughput.py --flavors debugmodel --dtype float32 --steps 12 "
            '--variants "eager;--compile.enable"',
            "uv run python bench/throughput.py --flavors debugmodel --dtype bfloat16 --steps 6 "
            '--variants "eager;--compile.enable"',
            "uv run python bench/throughput.py --flavors 100M --dtype float32 --steps 3 --warmup 1",
            "uv run python bench/throughput.py --flavors debugmodel --dtype bfloat16 --seq-len 256 "
            '--steps 12 --variants "default;--model.attention_backend auto;--model.attention_backend'
            ' math"',
        ],
        "apps/trainer/tests/test_bench_commands.py::"
        "test_bench_readme_throughput_commands_run_at_toy_sizes",
    ),
    **dict.fromkeys(
        [
            "uv run python tools/gpu_bundle.py gpu-bundle --python-version 3.12 --with-torchtitan",
            "bash gpu-bundle/run_vs_torchtitan.sh",
        ],
        "tools/test_vs_torchtitan.py::"
        "test_the_bundle_imports_torchtitan_from_its_wheels_and_the_bench_refuses_without_a_gpu",
    ),
    "uv run python bench/long_context.py": (
        "apps/trainer/tests/test_bench_commands.py::"
        "test_bench_readme_long_context_command_runs_at_toy_sizes"
    ),
    "uv run python bench/ckpt.py --only checksums --mb 64,200,683 --saves 7": (
        "apps/trainer/tests/test_bench_commands.py::test_bench_readme_ckpt_command_runs_at_toy_sizes"
    ),
    'uv run python bench/step_time_cpu.py --models debug --layouts "1 process,PP 2 (1F1B)"': (
        "apps/trainer/tests/test_bench_commands.py::"
        "test_bench_readme_step_time_cpu_command_measures_and_predicts"
    ),
    "uv run python bench/step_time_published.py --from-record": (
        "apps/trainer/tests/test_bench_commands.py::"
        "test_bench_readme_step_time_command_prices_the_recorded_runs"
    ),
    "uv run titan-train --job.config_file apps/trainer/configs/llama3_70b.toml --dry-run": (
        "apps/trainer/tests/test_shipped_configs_dry_run.py::"
        "test_shipped_config_dry_runs_at_its_documented_size_and_fits"
    ),
}


def readme_commands() -> set[str]:
    """The commands of the READMEs' shell blocks: continuation lines joined, comments dropped."""
    commands = set()
    for readme in READMES:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", readme.read_text(), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                command = re.sub(r"\s+#.*$", "", line).strip()
                if command and not command.startswith("#"):
                    commands.add(" ".join(command.split()))
    return commands


def test_every_readme_command_is_run_by_a_test():
    commands = readme_commands()
    untested = commands - RUN_HERE - set(RUN_ELSEWHERE)
    assert not untested, f"README commands no test runs: {sorted(untested)}"
    stale = (RUN_HERE | set(RUN_ELSEWHERE)) - commands
    assert not stale, f"commands tested here that no README shows any more: {sorted(stale)}"
    for test in set(RUN_ELSEWHERE.values()):
        path, _, name = test.partition("::")
        assert (REPO / path).is_file(), test
        if name:  # a test function that exists, not only its file
            assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), test


def _run_as_shown(command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # The config path in the command is relative to the repository root: a scratch folder with
    # `apps` linked in reads the same files and keeps the run's outputs out of the checkout.
    if not (tmp_path / "apps").exists():  # a second command in the same folder
        (tmp_path / "apps").symlink_to(REPO / "apps")
    env = {**os.environ, "UV_PROJECT": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        shlex.split(command),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        start_new_session=True,
    )


def _losses(output: str) -> dict[int, float]:
    """{step: loss} from the logged step lines (`12:00:00 INFO step   10 | loss 4.1 | ...`)."""
    return {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"\bstep\s+(\d+) \| loss ([\d.]+)", output)
    }


def _run_side_by_side(jobs: list[tuple[str, Path]]) -> list[subprocess.CompletedProcess]:
    """Each (command, folder) as shown, all at once: a one-process CPU job computes on one
    thread (OMP_NUM_THREADS=1), and importing torch is single-threaded, so two jobs side by
    side keep both cores of a CI machine busy where one would leave one idle."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: _run_as_shown(*job), jobs))


def test_the_main_job_and_its_short_form_train_as_shown(tmp_path):
    runs = {50: MAIN_JOB, 20: SHORT_JOB}
    for steps in runs:
        (tmp_path / str(steps)).mkdir()
    with ThreadPoolExecutor(1) as pool:  # the main job beside the two short ones
        main_job = pool.submit(_run_as_shown, MAIN_JOB, tmp_path / "50")
        short = _run_as_shown(SHORT_JOB, tmp_path / "20")
        _check_the_readme_job(short, tmp_path / "20", 20)
        # The trainer README's second command, in the folder of the short form (a fresh run
        # there).
        ranger_job = _run_as_shown(RANGER21_JOB, tmp_path / "20")
        _check_the_readme_job(main_job.result(), tmp_path / "50", 50)
    out = ranger_job.stdout + ranger_job.stderr
    assert ranger_job.returncode == 0, ranger_job.stdout[-2000:] + ranger_job.stderr[-3000:]
    assert "Ranger21 schedules its own learning rate" in out
    ranger = _losses(out)
    assert sorted(ranger) == [1, 3] and all(v == v for v in ranger.values()), ranger
    # Each command its own dump folder, each run's TensorBoard series named for what it trains.
    _assert_one_named_series(tmp_path / "20/outputs/debug", "llama3-debugmodel-AdamW", 20)
    _assert_one_named_series(tmp_path / "20/outputs/ranger21", "llama3-debugmodel-Ranger21", 3)


def _assert_one_named_series(dump: Path, label: str, steps: int) -> None:
    from titan_trainer.plots import read_event_folders, runs_under

    runs = runs_under(str(dump))
    assert len(runs) == 1, runs
    name = Path(runs[0][0]).name
    assert re.fullmatch(rf"\d{{8}}-\d{{6}}-{label}-[0-9a-f]{{4}}", name), name
    assert max(read_event_folders(runs[0][1])["loss"]) == steps


def _assert_the_readme_sample_line_is_step_5_of(out: str) -> None:
    """The root README's sample line is the main job's step 5 as this repository computes it
    in float32 (a CPU without bf16 instructions; `auto` picks bf16 on GPUs and on CPUs that
    have them, whose losses differ in the third decimal): the learning rate always, the loss
    and the gradient norm where the job computed in float32."""
    (sample,) = re.findall(r"^step    5 \|.*$", (REPO / "README.md").read_text(), re.M)
    line = next(x for x in out.splitlines() if "step    5 |" in x)
    ours, readme = _fields(line), _fields(sample)
    assert list(ours) == list(readme), (line, sample)
    assert ours["lr"] == readme["lr"], (line, sample)
    if "compute torch.float32" in out:
        assert abs(float(ours["loss"]) - float(readme["loss"])) <= 1e-3, (line, sample)
        assert abs(float(ours["grad_norm"]) / float(readme["grad_norm"]) - 1) <= 0.01


def _fields(line: str) -> dict[str, str]:
    """{name: value} of a metric line's `name value` fields (`step 5`, `loss 4.3555`, ...)."""
    out = {}
    for field in line[line.index("step") :].split(" | "):
        words = field.split()
        name = words[-1] if words[0][0].isdigit() else words[0]  # `3,078 tok/s`, `loss 4.3`
        out[name] = words[0] if words[0][0].isdigit() else words[1]
    return out


def _check_the_readme_job(done: subprocess.CompletedProcess, folder: Path, steps: int) -> None:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    losses = _losses(done.stdout + done.stderr)
    assert min(losses) == 1 and max(losses) == steps, sorted(losses)
    # Byte-level vocabulary (259 ids, padded to 320): a fresh model predicts near-uniformly.
    assert abs(losses[1] - math.log(320)) < 1.0, losses
    # The README promises a pretraining run: real text is learnable quickly, the loss falls
    # well below its start.
    assert losses[steps] < min(0.8 * losses[1], losses[1] - 1.5), losses
    run = folder / "outputs/debug"
    assert (run / "config.toml").read_text().count("[training]") == 1
    assert list((run / "tb").rglob("events.out.tfevents.*")), "no TensorBoard events written"
    line = next(x for x in (done.stdout + done.stderr).splitlines() if f"step {steps:4d} |" in x)
    for token in ("tok/s", "TFLOP/s", "MFU", "GiB", "s/step", "grad_norm", "lr"):
        assert token in line, line
    assert "[lr_scheduler] warmup_steps" not in done.stderr  # warm-up shorter than the run
    if steps == 50:  # the root README's command
        _assert_the_readme_sample_line_is_step_5_of(done.stdout + done.stderr)
    # Nothing before Titan's own first line: no torchao notice in a run without Float8.
    assert "register_constant() on Enum subclasses" not in done.stderr, done.stderr[:2000]


def test_the_four_process_command_trains_as_shown(tmp_path):
    done = _run_as_shown(FOUR_PROCESSES, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    losses = _losses(done.stdout + done.stderr)
    assert max(losses) == 20 and losses[20] < 0.8 * losses[min(losses)], losses
    assert "dp_shard 2 x tp 2" in done.stdout + done.stderr  # the layout asked for, on 4 ranks


def test_the_moe_command_trains_and_reports_the_experts_load(tmp_path):
    done = _run_as_shown(MOE_JOB, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    losses = _losses(out)
    assert max(losses) == 20 and losses[20] < 0.8 * losses[min(losses)], losses
    loads = [float(x) for x in re.findall(r"experts max/mean ([\d.]+)", out)]
    # One per metric line; 8 experts: between even (1) and all on one (8).
    assert len(loads) == len(losses) and all(1.0 <= x <= 8.0 for x in loads), loads
    assert "Qwen3-MoE debug model" in out


def test_the_deepseek_v3_and_llama4_commands_train_their_debug_flavors(tmp_path):
    for family in FAMILY_JOBS:
        (tmp_path / family).mkdir()
    runs = _run_side_by_side([(command, tmp_path / f) for f, command in FAMILY_JOBS.items()])
    for family, done in zip(FAMILY_JOBS, runs, strict=True):
        out = done.stdout + done.stderr
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        # The shipped debug configs warm up for fewer steps than the README's runs take.
        assert "[lr_scheduler] warmup_steps" not in out, out[-3000:]
        losses = _losses(out)
        # On the embedded corpus from the first step: the loss falls well below its start.
        assert max(losses) == 10 and losses[10] < 0.8 * losses[min(losses)], (family, losses)
        loads = [float(x) for x in re.findall(r"experts max/mean ([\d.]+)", out)]
        top_k = {"deepseek_v3": 2, "llama4": 1}[family]
        # One per metric line; 8 experts: between even (1) and all on one (8 / top_k).
        assert len(loads) == len(losses) and all(1.0 <= x <= 8 / top_k for x in loads), loads


def test_the_gemma3_command_trains_its_debug_flavor(tmp_path):
    done = _run_as_shown(GEMMA3_JOB, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    losses = _losses(out)
    # On the embedded corpus from the first step: the loss falls well below its start.
    assert max(losses) == 10 and losses[10] < 0.8 * losses[min(losses)], losses
    assert "Gemma 3 debug model" in out


def test_the_launch_scripts_find_the_workspace_and_stop_once_when_the_data_is_out_of_reach(
    tmp_path,
):
    """The README's 8B and SLURM commands as shown, from a shell with uv and no Titan on PATH
    (a fresh clone: uv is the only prerequisite). Each finds the workspace's environment, runs
    the checks once for the job's size (8 and 64 processes) and stops there, before torchrun or
    srun starts anything: C4 cannot be read from here. The hub's address is a closed port on
    this machine, so that this holds wherever the test runs, and fails fast."""
    (tmp_path / "apps").symlink_to(REPO / "apps")
    tools = tmp_path / "tools"
    tools.mkdir()
    # sbatch runs a spooled copy of the script in the folder it was submitted from; srun is
    # recorded (it must never be reached here).
    # (--nodes N --gpus-per-node G script ...: a whole node's GPUs, as SLURM says them).
    (tools / "sbatch").write_text(
        "#!/usr/bin/env bash\nset -e\nnodes=$2; gpus=$4; script=$5; shift 5\n"
        'mkdir -p "$SPOOL"; cp "$script" "$SPOOL/slurm_script"\n'
        "SLURM_NNODES=$nodes SLURM_GPUS_ON_NODE=$gpus SLURM_SUBMIT_DIR=$PWD SLURM_JOB_ID=7 "
        'SLURM_JOB_NODELIST=n[1-8] exec bash "$SPOOL/slurm_script" "$@"\n'
    )
    (tools / "scontrol").write_text(
        '#!/usr/bin/env bash\nif [ "$1 $2" = "show node" ]; then echo "NodeName=$3 NodeAddr=10.1.2.3";'
        " else for i in 1 2 3 4 5 6 7 8; do echo n$i; done; fi\n"
    )
    (tools / "srun").write_text('#!/usr/bin/env bash\necho "$@" >> "$SPOOL/srun"\n')
    for tool in tools.iterdir():
        tool.chmod(0o755)
    uv = shutil.which("uv")
    assert uv, "uv is the README's one prerequisite"
    path = f"{tools}:{Path(uv).parent}:/usr/bin:/bin"
    env = {
        k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT")
    }
    env.update(PATH=path, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="0")
    env.update(SPOOL=str(tmp_path / "spool"))
    # run_train.sh from a scratch folder that sees apps/ (were it to start the ranks, their
    # outputs would land there); sbatch from the checkout, as the README shows (srun, the
    # only thing that would start anything, is recorded).
    for line, cwd in ((LAUNCH_8B, tmp_path), (SBATCH_70B, REPO)):
        words = shlex.split(line)
        at = next(i for i, w in enumerate(words) if "=" not in w)
        done = subprocess.run(
            words[at:], cwd=cwd, capture_output=True, text=True, timeout=600,
            env={**env, **dict(w.split("=", 1) for w in words[:at])},
        )  # fmt: skip
        out = done.stdout + done.stderr
        assert done.returncode == 2, out[-3000:]
        assert "No module named" not in out and "cannot import titan_trainer" not in out
        said = re.findall(r"titan: config error: \[training\] dataset c4 \(allenai/c4", out)
        assert len(said) == 1, out[-3000:]  # once for the job, not once per rank
        assert "cannot reach the Hugging Face hub" in out and "titan-data tokenize" in out
        assert "HF_HUB_OFFLINE=1" in out and "local copy of allenai/c4" in out
        assert "[rank" not in out and "Traceback" not in out  # no rank was started
        assert not (tmp_path / "spool" / "srun").exists()
        # Checked for the job's size (8 processes; 8 nodes x 8): the layout raised nothing. (The
        # disk this test runs on may also be too small for the job's checkpoints: that one is
        # this machine's, not the command's.)
        errors = re.findall(r"titan: config error: (.*)", out)
        others = [e for e in errors if "will not fit on the disk" not in e]
        assert len(others) == 1, out[-3000:]
