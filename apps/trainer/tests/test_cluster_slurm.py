"""The multi-node path on a real SLURM cluster (tools/slurm_cluster.py: slurmctld and a slurmd per
node, each node in its own network namespace with its own address, hostname and a hosts file
written as Debian writes it, its own name on 127.0.1.1), through the commands the READMEs show:
the SLURM script, and run_train.sh across hosts without a scheduler. Each job's losses are
compared with the same job on one host, or with one process.

Every test here is marked `cluster` (`nox -s cluster`); without root, Linux network namespaces
or Debian's slurm-wlm and munge, each is skipped with that reason."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from cluster import (
    REPO,
    job_env,
    losses,
    output,
    sbatch,
    slurm_cluster,
    start_cluster,
    submission_folder,
    wait_for_job,
)
from conftest import fp32_args, start_cli

pytestmark = pytest.mark.cluster

# The root README's two SLURM lines: the GPU job and the same script on CPU nodes.
SBATCH_GPU = (
    "sbatch --nodes 8 --gpus-per-node 8 apps/trainer/scripts/multinode.sbatch "
    "configs/llama3_70b.toml"
)
SBATCH_CPU = (
    "sbatch --nodes 2 apps/trainer/scripts/multinode.sbatch debug_model --training.steps 10"
)
# The trainer README's two lines for a job across hosts without a scheduler.
ACROSS_HOSTS = [
    "NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 apps/trainer/run_train.sh --training.steps 10",
    "NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 apps/trainer/run_train.sh --training.steps 10",
]
README_STEPS = 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two CPU nodes of one CPU each (as SLURM sees them: one process per node)."""
    started = start_cluster(tmp_path_factory.mktemp("cluster"), nodes=2, cpus=1)
    yield started
    slurm_cluster.down(started.dir)


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The README's debug job as one host runs it with the same world size (2 processes,
    torchrun on this machine): started once, read by the tests that compare with it."""
    folder = tmp_path_factory.mktemp("one_host")
    started = start_cli(
        ["--job.config_file", "debug_model", "--training.steps", str(README_STEPS),
         "--job.dump_folder", str(folder / "outputs/debug")],
        nproc=2,
    )  # fmt: skip
    cache = {}

    def result() -> dict[int, float]:
        if not cache:
            done = started.result(900)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
            cache.update(losses(folder / "outputs/debug"))
        return cache

    return result


def test_the_readme_slurm_command_trains_across_two_nodes_as_one_host_does(
    cluster, one_host, tmp_path
):
    """The README's CPU line as shown: one process per node (each node has one CPU), the
    rendezvous on the first node's real address although its own name resolves to 127.0.1.1
    there, and the losses of the same job on one host, bit for bit (same world size, same
    layout, the same collectives in the same order)."""
    folder = submission_folder(tmp_path / "submit")
    job = sbatch(SBATCH_CPU, folder, job_env(cluster))
    state = wait_for_job(cluster, job)
    out = output(folder, job)
    assert state == "COMPLETED", out[-4000:]
    said = re.search(r"multinode.sbatch: 2 node\(s\) x 1 process\(es\) \(the CPUs SLURM gave.*"
                     r"rendezvous at n1 (\S+):29500", out)  # fmt: skip
    assert said and said.group(1) == cluster.addresses["n1"], out[-4000:]
    assert "titan: 2 nodes arrived" in out and "2 processes on cpu | dp_shard 2" in out
    got = losses(folder / "outputs/debug")
    assert sorted(got) == [1, 5, 10], got  # the debug config logs every 5th step
    assert got == one_host(), (got, one_host())


def test_run_train_sh_across_two_hosts_trains_as_one_host_does(cluster, one_host, tmp_path):
    """The trainer README's two lines, one on each node (MASTER_ADDR: the head's address),
    with no scheduler: the same losses as one host, bit for bit."""
    folder = submission_folder(tmp_path / "hosts")
    env = job_env(cluster)
    procs = []
    for node, line in zip(cluster.nodes, ACROSS_HOSTS, strict=True):
        words = shlex.split(line.replace("10.0.0.1", cluster.addresses["n1"]))
        at = next(i for i, w in enumerate(words) if "=" not in w)
        variables = dict(w.split("=", 1) for w in words[:at])
        log = open(folder / f"{node}.out", "w")  # noqa: SIM115  (closed below)
        procs.append((log, slurm_cluster.run_on(
            cluster, node, "env", *(f"{k}={v}" for k, v in {**env, **variables}.items()),
            "bash", words[at], *words[at + 1:],
            cwd=folder, stdout=log, stderr=subprocess.STDOUT,
        )))  # fmt: skip
    for log, proc in procs:
        try:
            assert proc.wait(timeout=600) == 0, (folder / f"{log.name}").read_text()[-4000:]
        finally:
            log.close()
    head = (folder / "n1.out").read_text()
    assert "titan: 2 nodes arrived" in head and "2 processes on cpu" in head, head[-3000:]
    assert losses(folder / "outputs/debug") == one_host()


def test_hsdp_and_pipeline_parallel_across_nodes_equal_one_process(
    cluster, tmp_path, same_doc_dataset
):
    """HSDP with the replicas on different nodes and each node's two ranks sharding (ranks 0-1
    on n1, 2-3 on n2: the shard groups stay within a node), and a pipeline whose two stages
    are on different nodes, each against one process with the same global batch (8 samples,
    every sample the same document, so that no layout can change a batch)."""
    common = [
        *fp32_args(
            ["--job.config_file", "debug_model", "--training.seq_len", "128",
             "--metrics.log_freq", "1", "--metrics.save_plots_folder", ""],
            same_doc_dataset,
        ),
        "--metrics.enable_tensorboard", "true",  # the losses at full precision
    ]  # fmt: skip
    reference = start_cli(
        [*common, "--job.dump_folder", str(tmp_path / "one"), "--training.local_batch_size", "8"]
    )
    layouts = {
        "hsdp": (
            {"NPROC_PER_NODE": "2"},
            ["--training.local_batch_size", "2",
             "--parallelism.data_parallel_replicate_degree", "2",
             "--parallelism.data_parallel_shard_degree", "2"],
        ),
        "pp": (
            {},
            ["--training.local_batch_size", "8", "--parallelism.data_parallel_shard_degree", "1",
             "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_microbatch_size", "4"],
        ),
    }  # fmt: skip
    runs = {}
    for name, (variables, args) in layouts.items():
        folder = submission_folder(tmp_path / name)
        job = sbatch(
            ["sbatch", "--nodes", "2", "apps/trainer/scripts/multinode.sbatch", "debug_model",
             *common[2:], "--job.dump_folder", "outputs/run", *args],
            folder, job_env(cluster, **variables),
        )  # fmt: skip
        # One job at a time on the two nodes (the script asks for whole nodes).
        state = wait_for_job(cluster, job)
        out = output(folder, job)
        assert state == "COMPLETED", out[-4000:]
        runs[name] = (out, losses(folder / "outputs/run"))
    done = reference.result(600)
    assert done.returncode == 0, done.stderr[-3000:]
    one = losses(tmp_path / "one")
    assert sorted(one) == list(range(1, 5)), one
    hsdp_out, hsdp = runs["hsdp"]
    assert "2 node(s) x 2 process(es) (NPROC_PER_NODE) = 4" in hsdp_out
    assert "4 processes on cpu | dp_replicate 2 x dp_shard 2 |" in hsdp_out, hsdp_out[-3000:]
    pp_out, pp = runs["pp"]
    assert "2 processes on cpu | pp 2 |" in pp_out, pp_out[-3000:]
    for name, got in (("hsdp", hsdp), ("pp", pp)):
        assert sorted(got) == sorted(one), (name, got)
        for step, loss in one.items():
            # fp32; gradients summed in another order (across 4 ranks, or 2 microbatches per
            # stage): ~1e-6 relative, as in the one-host layout tests.
            assert got[step] == pytest.approx(loss, abs=2e-4), (name, step, got, one)
    # The identical samples are memorised fast: the comparison covers a moving loss.
    assert one[4] < one[1] - 0.5, one


@pytest.mark.parametrize("gpus", [8, 4])
def test_the_gpu_command_starts_a_process_per_gpu_slurm_gives(tmp_path, gpus):
    """The README's GPU line (node count 2) on a cluster whose nodes have `gpus` GPUs as SLURM
    sees them (a generic resource; nothing to compute on): sbatch accepts it, the script runs
    the checks once for 2 x `gpus` processes and stops there (the 70B config reads C4 from the
    hub, which no test reaches), before any rank starts."""
    cluster = start_cluster(tmp_path / "gpu-cluster", nodes=2, cpus=1, gpus=gpus)
    try:
        folder = submission_folder(tmp_path / "submit")
        line = SBATCH_GPU.replace("--nodes 8", "--nodes 2")
        line = line.replace("--gpus-per-node 8", f"--gpus-per-node {gpus}")
        env = job_env(cluster, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="0")
        job = sbatch(line, folder, env)
        state = wait_for_job(cluster, job)
        out = output(folder, job)
    finally:
        slurm_cluster.down(cluster.dir)
    assert state == "FAILED", out[-3000:]
    assert f"2 node(s) x {gpus} process(es) (the GPUs SLURM gave each node) = {2 * gpus}" in out
    said = re.findall(r"titan: config error: \[training\] dataset c4 \(allenai/c4", out)
    assert len(said) == 1, out[-3000:]  # once for the job, not once per rank or node
    assert "titan: " + "2 nodes arrived" not in out and "[rank" not in out  # no rank started


def test_the_readme_commands_start_and_stop_the_test_cluster():
    """The trainer README's three lines, as shown, from the checkout's root: `up` starts two
    idle nodes and prints the `export` line the README shows; `down` leaves nothing behind (no
    namespace, no daemon, no hosts file)."""
    readme = (REPO / "apps/trainer/README.md").read_text()
    up, export, down = (
        "python3 tools/slurm_cluster.py up --nodes 2",
        "export SLURM_CONF=/tmp/titan-cluster/slurm.conf",
        "python3 tools/slurm_cluster.py down",
    )
    assert f"{up}\n{export}\n{down}\n" in readme
    if why := slurm_cluster.missing_prerequisites():
        pytest.skip(f"no SLURM test cluster on this machine: {why}")
    started = subprocess.run(shlex.split(up), cwd=REPO, capture_output=True, text=True)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        assert export in started.stdout.splitlines(), started.stdout
        cluster = slurm_cluster.Cluster.load("/tmp/titan-cluster")
        assert slurm_cluster.node_states(cluster) == {"n1": "idle", "n2": "idle"}
        namespaces = [cluster.namespace(n) for n in cluster.nodes]
        pids = list(cluster.pids.values())
    finally:
        stopped = subprocess.run(shlex.split(down), cwd=REPO, capture_output=True, text=True)
    assert stopped.returncode == 0, stopped.stderr
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces), listed
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert not any(Path("/etc/netns", ns).exists() for ns in namespaces)
