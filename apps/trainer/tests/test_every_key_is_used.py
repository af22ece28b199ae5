"""Every key `titan-train --help` documents does something: while the trainer runs (after the
config is loaded and checked, and not counting dumps of the whole config), each key is read
by the code that acts on it. Three runs in one process cover almost all of them
(key_usage.py); the few that only multi-process layouts or a GPU reach are named below with
the test that exercises them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from titan_core.config import iter_options
from titan_trainer.config import JobConfig

TESTS = Path(__file__).parent
REPO = TESTS.parents[2]

# key -> the test that shows its effect, for keys the single-process runs cannot reach.
ELSEWHERE = {
    "comm.mode": "apps/trainer/tests/test_dry_run.py::test_torchtitan_spelling_simulates_each_pipeline_rank",
    "dry_run.all_ranks": "apps/trainer/tests/test_dry_run.py::test_all_ranks_simulates_every_pipeline_rank",
    "parallelism.fsdp_reshard_after_forward": "apps/trainer/tests/test_parallel_e2e.py::test_fsdp2_x_tp2_on_4_processes_with_validation_matches_one_process",
    "parallelism.disable_loss_parallel": "apps/trainer/tests/test_parallel_e2e.py::test_fsdp2_x_tp2_on_4_processes_with_validation_matches_one_process",
    "parallelism.enable_sequence_parallel": "apps/trainer/tests/test_parallel_e2e.py::test_fsdp2_x_tp2_on_4_processes_with_validation_matches_one_process",
    "parallelism.expert_tensor_parallel_degree": "apps/trainer/tests/test_moe_e2e.py::test_layouts_that_cannot_split_experts_are_refused_before_start",
    "parallelism.context_parallel_style": "apps/trainer/tests/test_context_parallel_documents_e2e.py::test_block_causal_attention_under_context_parallel_trains_like_one_process",
    "parallelism.context_parallel_rotate_method": "apps/trainer/tests/test_parallel_4d_e2e.py::test_three_way_layout_on_8_processes_matches_one_process",
    "parallelism.pipeline_parallel_first_stage_less_layers": "apps/trainer/tests/test_parallel_e2e.py::test_pipeline_x_fsdp_trains_and_validates_like_one_process_for_5_steps",
    "parallelism.pipeline_parallel_last_stage_less_layers": "apps/trainer/tests/test_parallel_e2e.py::test_pipeline_x_fsdp_trains_and_validates_like_one_process_for_5_steps",
    "parallelism.module_fqns_per_model_part": "apps/trainer/tests/test_parallel_e2e.py::test_pipeline_x_fsdp_trains_and_validates_like_one_process_for_5_steps",
    "fault_tolerance.outer_lr": "apps/trainer/tests/test_fault_tolerance_e2e.py::test_diloco_groups_train_on_without_a_killed_group_and_end_equal",
    "fault_tolerance.outer_momentum": "apps/trainer/tests/test_fault_tolerance_e2e.py::test_diloco_groups_train_on_without_a_killed_group_and_end_equal",
    "fault_tolerance.lighthouse": "apps/trainer/tests/test_fault_tolerance_e2e.py::test_survivors_keep_stepping_and_the_restarted_group_catches_up",
    "profiling.save_memory_snapshot_folder": "apps/trainer/tests/test_gpu.py::test_memory_snapshot_is_written_on_cuda",
}


def test_every_documented_key_is_read_while_the_trainer_runs(tmp_path):
    out = tmp_path / "read.json"
    result = subprocess.run(
        [sys.executable, "key_usage.py", str(out), str(tmp_path / "runs")],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    read = set(json.loads(out.read_text()))
    documented = [name for name, *_ in iter_options(JobConfig)]
    unread = [k for k in documented if k not in read and k not in ELSEWHERE]
    assert not unread, f"documented keys nothing reads: {unread}"
    # The exceptions stay few, and none of them is read here after all.
    assert not set(ELSEWHERE) & read, set(ELSEWHERE) & read


def test_each_exception_names_a_test_that_exists():
    for key, test in ELSEWHERE.items():
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), (key, test)
