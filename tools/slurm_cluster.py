"""A real SLURM cluster on one Linux machine, for trying and testing Titan's multi-node path.

    sudo python3 tools/slurm_cluster.py up --dir /tmp/titan-cluster --nodes 2
    export SLURM_CONF=/tmp/titan-cluster/slurm.conf
    sbatch --nodes 2 apps/trainer/scripts/multinode.sbatch debug_model --training.steps 20
    sudo python3 tools/slurm_cluster.py down --dir /tmp/titan-cluster

It needs root, Linux network namespaces (iproute2) and Debian's `slurm-wlm` and `munge`
packages (`apt-get install slurm-wlm munge`). What it starts, all of it owned by this cluster
and stopped by `down` (by pid and by name; nothing of the machine's own is touched):

- a bridge with a private /24 and, per compute node `n1`..`nN`, a network namespace joined to
  it by a veth pair (the node's `eth0`), its own hostname (a UTS namespace) and its own hosts
  file. By default the hosts files are written the way Debian and Ubuntu write them: a node's
  own name maps to 127.0.1.1, the other nodes' names to their addresses (`--hosts plain` maps
  a node's own name to its address too);
- a `munged` with a key of its own on a private socket;
- `slurmctld` in the machine's own namespace (on the bridge's address), and one `slurmd` per
  node inside that node's namespaces, with a cgroup v1 tree of its own mounted inside the
  node's mount namespace (slurmd wants one; the machine's own is never mounted over);
- nodes with `--cpus` CPUs each and, with `--gpus N`, N GPUs as a SLURM generic resource whose
  device files are empty files: the path a GPU cluster's jobs take through SLURM
  (`--gpus-per-node`, `SLURM_GPUS_ON_NODE`), with nothing to compute on.

Other commands: `run NODE -- CMD` runs a command on a node (in its namespaces), `cut NODE`
takes a node's link down (a lost node: its processes keep running, unreachable), `heal NODE`
brings it back, `status` prints what `sinfo` says. Everything the cluster writes (config,
logs, state) lies under `--dir`, but for the slurmd spool folders, which hold Unix sockets whose
paths must stay short: /tmp/tsl-<tag>/. The test fixture in
apps/trainer/tests/cluster.py drives this same module.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The cgroup v1 controllers slurmd looks for, mounted in each node's own mount namespace.
CGROUP_CONTROLLERS = ("freezer", "cpuset", "memory", "devices")
LOCK = "/tmp/titan-slurm-cluster.lock"
NEEDED = ("ip", "unshare", "nsenter", "munged", "slurmctld", "slurmd", "sbatch", "sinfo")


@dataclass
class Cluster:
    """What `up` made, written to <dir>/cluster.json so that `down` (or another process) finds
    it: the names and addresses of the nodes and the pids of the daemons."""

    dir: str
    tag: str
    subnet: str
    nodes: list[str]
    addresses: dict[str, str]
    bridge: str
    controller_host: str
    controller_port: int
    slurmd_port: int
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> str:
        return os.path.join(self.dir, "slurm.conf")

    @property
    def bridge_address(self) -> str:
        return f"{self.subnet}.1"

    @property
    def spool(self) -> str:
        """The slurmds' spool folders' parent: a short path, as their sockets need (108 bytes
        at most on Linux; a test's temporary folder can be longer)."""
        return f"/tmp/tsl-{self.tag}"

    def namespace(self, node: str) -> str:
        return f"titan-{self.tag}-{node}"

    def env(self) -> dict[str, str]:
        """The environment in which SLURM's commands talk to this cluster."""
        return {**os.environ, "SLURM_CONF": self.conf}

    def save(self) -> None:
        Path(self.dir, "cluster.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, folder: str | os.PathLike) -> Cluster:
        return cls(**json.loads(Path(folder, "cluster.json").read_text()))


def missing_prerequisites() -> str | None:
    """Why this machine cannot start a cluster, or None when it can."""
    if sys.platform != "linux":
        return "a SLURM test cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "a SLURM test cluster needs root (network namespaces, mounts, slurmd)"
    absent = [tool for tool in NEEDED if shutil.which(tool) is None]
    if absent:
        return (
            f"{', '.join(absent)} not found: install Debian's slurm-wlm and munge"
            " (apt-get install slurm-wlm munge) and iproute2"
        )
    probe = f"titan-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _free_tag() -> str:
    """Five hex digits that no bridge here is named with (the names of a cluster's bridge,
    veth pairs and namespaces carry it; an interface name holds at most 15 characters)."""
    links = _sh("ip", "-o", "link", "show").stdout
    while True:
        tag = os.urandom(3).hex()[:5]
        if f"tbr{tag}" not in links:
            return tag


def _free_subnet() -> str:
    """A 10.x.y.0/24 that no interface of this machine has."""
    used = _sh("ip", "-o", "-4", "addr", "show").stdout
    for x in range(200, 250):
        for y in range(1, 250):
            subnet = f"10.{x}.{y}"
            if f" {subnet}." not in used:
                return subnet
    raise RuntimeError("no free 10.x.y.0/24 for the cluster's bridge")


def up(
    folder: str | os.PathLike,
    nodes: int = 2,
    cpus: int = 1,
    gpus: int = 0,
    hosts: str = "debian",
    slurmd_timeout: int = 300,
    extra_conf: str = "",
) -> Cluster:
    """Start a cluster of `nodes` compute nodes and wait until every node is idle. On a
    failure, what was started is stopped again before the error is raised."""
    why = missing_prerequisites()
    if why:
        raise RuntimeError(why)
    folder = os.path.abspath(folder)
    if Path(folder, "cluster.json").exists():
        down(folder)  # a cluster left running there
    # A fresh cluster: what an earlier one wrote there (its state, its key) goes.
    for name in ("state", "spool", "log", "dev"):
        shutil.rmtree(Path(folder, name), ignore_errors=True)
    Path(folder, "munge.key").unlink(missing_ok=True)
    os.makedirs(folder, exist_ok=True)
    names = [f"n{i}" for i in range(1, nodes + 1)]
    # Clusters started side by side (one per test worker) take their names and subnets in turn.
    lock = open(LOCK, "w")  # noqa: SIM115  (held until the bridge has its address)
    fcntl.flock(lock, fcntl.LOCK_EX)
    tag = _free_tag()
    subnet = _free_subnet()
    cluster = Cluster(
        dir=folder,
        tag=tag,
        subnet=subnet,
        nodes=names,
        addresses={n: f"{subnet}.{10 + i}" for i, n in enumerate(names, 1)},
        bridge=f"tbr{tag}",
        controller_host=socket.gethostname(),
        controller_port=_free_port(),
        slurmd_port=_free_port(),
    )
    cluster.save()
    try:
        try:
            _make_network(cluster, hosts)
        finally:
            lock.close()
        _write_conf(cluster, cpus, gpus, slurmd_timeout, extra_conf)
        _start_munge(cluster)
        _start_controller(cluster)
        for node in names:
            _start_slurmd(cluster, node)
        wait_until_idle(cluster, names)
    except BaseException:
        down(folder)
        raise
    return cluster


def _make_network(cluster: Cluster, hosts: str) -> None:
    _sh("ip", "link", "add", cluster.bridge, "type", "bridge")
    _sh("ip", "addr", "add", f"{cluster.bridge_address}/24", "dev", cluster.bridge)
    _sh("ip", "link", "set", cluster.bridge, "up")
    for i, node in enumerate(cluster.nodes, 1):
        ns, outside = cluster.namespace(node), f"tv{cluster.tag}h{i}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", f"tv{cluster.tag}n{i}")
        _sh("ip", "link", "set", f"tv{cluster.tag}n{i}", "netns", ns)
        _sh("ip", "link", "set", outside, "master", cluster.bridge, "up")
        inside = ("ip", "netns", "exec", ns, "ip")
        _sh(*inside, "link", "set", f"tv{cluster.tag}n{i}", "name", "eth0")
        _sh(*inside, "addr", "add", f"{cluster.addresses[node]}/24", "dev", "eth0")
        _sh(*inside, "link", "set", "eth0", "up")
        _sh(*inside, "link", "set", "lo", "up")
        # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts for the node.
        etc = Path("/etc/netns", ns)
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1\tlocalhost"]
        if hosts == "debian":  # the installer's line: the host's own name on a loopback address
            lines.append(f"127.0.1.1\t{node}")
        lines.append(f"{cluster.bridge_address}\t{cluster.controller_host}")
        lines += [
            f"{addr}\t{n}"
            for n, addr in cluster.addresses.items()
            if hosts != "debian" or n != node
        ]
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        (etc / "hostname").write_text(node + "\n")


def _write_conf(cluster: Cluster, cpus: int, gpus: int, slurmd_timeout: int, extra: str) -> None:
    d = cluster.dir
    for sub in ("state", "log"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    gres = f" Gres=gpu:{gpus}" if gpus else ""
    node_lines = "\n".join(
        f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={cpus} RealMemory=1000{gres} State=UNKNOWN"
        for n, a in cluster.addresses.items()
    )
    Path(d, "slurm.conf").write_text(
        f"""# Written by tools/slurm_cluster.py: a test cluster on one machine.
ClusterName=titan{cluster.tag}
SlurmctldHost={cluster.controller_host}({cluster.bridge_address})
SlurmctldPort={cluster.controller_port}
SlurmdPort={cluster.slurmd_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={cluster.spool}/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={cluster.spool}/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={cluster.spool}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
{"GresTypes=gpu" if gpus else ""}
# How long a node may be silent before SLURM marks it DOWN and ends (or requeues) its jobs.
SlurmdTimeout={slurmd_timeout}
InactiveLimit=0
KillWait=30
MinJobAge=3600
JobRequeue=0
{extra}
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
    )
    Path(d, "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
    for node in cluster.nodes:
        os.makedirs(os.path.join(cluster.spool, node), exist_ok=True)
    if gpus:  # empty files stand in for the devices: SLURM schedules them and says how many
        dev = Path(d, "dev")
        dev.mkdir(exist_ok=True)
        for i in range(gpus):
            (dev / f"gpu{i}").touch()
        Path(d, "gres.conf").write_text(f"Name=gpu File={dev}/gpu[0-{gpus - 1}]\n")


def _start_munge(cluster: Cluster) -> None:
    key = Path(cluster.dir, "munge.key")
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    d = cluster.dir
    _sh(
        "munged", "--force", f"--socket={cluster.spool}/munge.socket", f"--key-file={key}",
        f"--pid-file={d}/munged.pid", f"--log-file={d}/log/munged.log",
        f"--seed-file={d}/munged.seed",
    )  # fmt: skip
    cluster.pids["munged"] = _wait_for_pid(Path(d, "munged.pid"))
    cluster.save()


def _start_controller(cluster: Cluster) -> None:
    with open(Path(cluster.dir, "log", "slurmctld.out"), "ab") as log:
        proc = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", cluster.conf],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=cluster.env(),
        )  # fmt: skip
    cluster.pids["slurmctld"] = proc.pid
    cluster.save()


def node_command(cluster: Cluster, node: str, *cmd: str) -> list[str]:
    """`cmd` as it runs on `node`: inside the node's network namespace (with its hosts file),
    its own hostname and its own mount namespace (its cgroup tree)."""
    mounts = "; ".join(
        f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}"
        for c in CGROUP_CONTROLLERS
    )
    setup = f"hostname {node} && mount -t tmpfs cgroups /sys/fs/cgroup && {mounts}"
    return [
        "ip", "netns", "exec", cluster.namespace(node), "unshare", "--uts", "--mount",
        "--propagation", "private", "sh", "-c", f'{setup} && exec "$@"', "node", *cmd,
    ]  # fmt: skip


def _start_slurmd(cluster: Cluster, node: str, delay: float = 0.0) -> None:
    cmd = ["slurmd", "-D", "-N", node, "-f", cluster.conf]
    if delay:
        cmd = ["sh", "-c", f'sleep {delay} && exec "$@"', "slurmd", *cmd]
    with open(Path(cluster.dir, "log", f"slurmd-{node}.out"), "ab") as log:
        proc = subprocess.Popen(
            node_command(cluster, node, *cmd),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=cluster.env(),
        )  # fmt: skip
    cluster.pids[f"slurmd-{node}"] = proc.pid
    cluster.save()


def _wait_for_pid(path: Path, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text().strip())
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not appear within {timeout:.0f} s")


def node_states(cluster: Cluster) -> dict[str, str]:
    """Each node's state as sinfo prints it (idle, alloc, down*, ...)."""
    done = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=cluster.env()
    )
    states = {}
    for line in done.stdout.splitlines():
        name, state = line.split()
        states[name] = state
    return states


def wait_until_idle(cluster: Cluster, nodes: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = node_states(cluster)
        if all(states.get(n) == "idle" for n in nodes):
            return
        time.sleep(0.5)
    logs = Path(cluster.dir, "log")
    raise RuntimeError(f"the nodes are not idle after {timeout:.0f} s: {states}; logs in {logs}")


def run_on(cluster: Cluster, node: str, *cmd: str, **popen) -> subprocess.Popen:
    """Start `cmd` on `node`: in its network, UTS and mount namespaces (those of its slurmd),
    as a job would run there."""
    pid = cluster.pids[f"slurmd-{node}"]
    # nsenter starts in the node's root folder unless told otherwise: the caller's cwd, if any.
    where = [f"--wd={popen.pop('cwd')}"] if "cwd" in popen else []
    enter = ["nsenter", "-t", str(pid), "--net", "--uts", "--mount", *where]
    return subprocess.Popen([*enter, *cmd], **popen)


def cut(cluster: Cluster, node: str) -> None:
    """Take `node`'s link down: it keeps running, but nothing reaches it or leaves it."""
    _sh("ip", "netns", "exec", cluster.namespace(node), "ip", "link", "set", "eth0", "down")


def heal(cluster: Cluster, node: str) -> None:
    _sh("ip", "netns", "exec", cluster.namespace(node), "ip", "link", "set", "eth0", "up")


def restart_slurmd(cluster: Cluster, node: str, delay: float = 0.0) -> None:
    """Stop `node`'s slurmd and start it again after `delay` seconds (a node that is slow to
    come up)."""
    pid = cluster.pids.get(f"slurmd-{node}")
    if pid:
        _kill(pid, signal.SIGKILL)
    _start_slurmd(cluster, node, delay)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def down(folder: str | os.PathLike) -> None:
    """Stop what `up` started in `folder`: every process in the nodes' namespaces (the
    slurmds, their jobs), slurmctld and munged by pid; then the namespaces, the veth pairs
    (they go with their namespace), the bridge and the hosts files."""
    path = Path(folder, "cluster.json")
    if not path.exists():
        return
    cluster = Cluster.load(folder)
    for node in cluster.nodes:
        ns = cluster.namespace(node)
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            _kill(int(pid), signal.SIGKILL)
    for name in ("slurmctld", "munged", *(f"slurmd-{n}" for n in cluster.nodes)):
        pid = cluster.pids.get(name)
        if pid:
            _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for pid in cluster.pids.values():
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # reap it where it is our child
            os.waitpid(pid, os.WNOHANG)
    for node in cluster.nodes:
        ns = cluster.namespace(node)
        _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(Path("/etc/netns", ns), ignore_errors=True)
    _sh("ip", "link", "del", cluster.bridge, check=False)
    shutil.rmtree(cluster.spool, ignore_errors=True)
    path.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start a cluster and wait until its nodes are idle")
    p_up.add_argument("--nodes", type=int, default=2)
    p_up.add_argument("--cpus", type=int, default=1, help="CPUs of each node (as SLURM sees it)")
    p_up.add_argument("--gpus", type=int, default=0, help="GPUs of each node (a count, no devices)")
    p_up.add_argument("--hosts", choices=("debian", "plain"), default="debian")
    p_up.add_argument("--slurmd-timeout", type=int, default=300)
    for p in (p_up, *(sub.add_parser(c) for c in ("down", "status"))):
        p.add_argument("--dir", default="/tmp/titan-cluster")
    for name in ("cut", "heal", "run"):
        p = sub.add_parser(name)
        p.add_argument("--dir", default="/tmp/titan-cluster")
        p.add_argument("node")
        if name == "run":
            p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "up":
        cluster = up(args.dir, args.nodes, args.cpus, args.gpus, args.hosts, args.slurmd_timeout)
        print(f"cluster up: {', '.join(f'{n} {a}' for n, a in cluster.addresses.items())}")
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    if args.command == "down":
        down(args.dir)
        return 0
    cluster = Cluster.load(args.dir)
    if args.command == "status":
        for node, state in node_states(cluster).items():
            print(node, cluster.addresses.get(node, "?"), state)
    elif args.command == "cut":
        cut(cluster, args.node)
    elif args.command == "heal":
        heal(cluster, args.node)
    else:
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return run_on(cluster, args.node, *cmd).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
