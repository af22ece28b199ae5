"""One node of a multi-node job: `python -m titan_trainer.launch` runs on every node (the SLURM
script starts it through srun, `run_train.sh` with NNODES > 1 on each host), starts torchrun
for the node's ranks and keeps the nodes together, so that a job on many hosts either runs on
all of them or ends on all of them, saying which node is missing:

- **Roll call** before any rank starts. The head node (node rank 0) serves a small board
  (`node_board.py`) at MASTER_ADDR:MASTER_PORT and every node reports there. A node that has
  not arrived within `--join-timeout` seconds is named and the job ends on every node that did
  (torchrun alone waits out its own timeout and says nothing of who is missing).
- **Ranks** by torchrun with a static rendezvous at MASTER_PORT + 1: node r holds ranks
  r x nproc_per_node ... (r + 1) x nproc_per_node - 1, so a node's ranks are known from its
  rank.
- **Heartbeats** while the ranks run: every node reports to the board every few seconds. The
  head ends the job when a node has been silent for `--lost-after` seconds and names it; a node
  that cannot reach the head for as long ends its own ranks and torchrun (which would otherwise
  retry its lost store until the link came back, holding the allocation). Every process of the
  job, on every node, ends within about lost-after + grace seconds of a node being lost.
- **SIGTERM** (a scheduler's preemption or time-limit notice) is passed on to torchrun, which
  passes it to the ranks: they agree on a step, save a checkpoint there and stop.

The exit status is torchrun's (0 only when every rank finished), or 1 when a node was lost or
never arrived. Nothing here imports torch: the board never carries training data.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from titan_trainer.node_board import Board, BoardClient, serve

PREFIX = "titan: "


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m titan_trainer.launch",
        description="One node of a multi-node Titan job (see the module docstring).",
    )
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument(
        "--node-rank",
        type=int,
        default=os.environ.get("SLURM_NODEID"),
        help="this node's rank, 0 for the head node (default: SLURM_NODEID, under srun)",
    )
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-addr", required=True, help="the head node's address")
    parser.add_argument(
        "--master-port", type=int, default=29500, help="the roll call's port; torchrun's is +1"
    )
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument(
        "--join-timeout", type=float, default=600.0, help="seconds the nodes wait for each other"
    )
    parser.add_argument(
        "--lost-after",
        type=float,
        default=60.0,
        help="seconds a node may be silent before the job ends",
    )
    parser.add_argument(
        "--grace", type=float, default=10.0, help="seconds ranks get to stop before SIGKILL"
    )
    parser.add_argument("--node-names", default="", help="comma-separated, in node-rank order")
    parser.add_argument(
        "--exit-file",
        default="",
        help="where the head node writes, as it ends, its exit status and 'lost' when a node"
        " was lost, else 'ended' (for the batch script)",
    )
    argv = list(argv)
    rest = []
    if "--" in argv:
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1 :]
    args = parser.parse_args(argv)
    if args.node_rank is None:
        parser.error(
            "--node-rank is needed outside srun (0 on the head node, 1, 2, ... on the others)"
        )
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1}")
    if args.nnodes > 1 and _is_loopback(args.master_addr):
        parser.error(
            f"--master-addr {args.master_addr} is a loopback address: the other"
            f" {args.nnodes - 1} node(s) cannot reach it; give the head node's address on the"
            " network the nodes share"
        )
    return args, rest


def _is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


class Node:
    """This node's view of the job: its rank, the names of the nodes, and its line to the
    board (the board itself on the head node)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = args.node_rank
        self.head = self.rank == 0
        given = [n for n in args.node_names.split(",") if n]
        self.names = given if len(given) == args.nnodes else []
        self.me = self.name(self.rank) if self.names else socket.gethostname()
        self.beat_every = min(max(args.lost_after / 6, 0.5), 10.0)
        self.board: Board | None = None
        self.client = BoardClient(args.master_addr, args.master_port, self.beat_every)

    def call(self, method: str, *params, timeout: float | None = None):
        """A board method: in this process on the head node, over the network elsewhere."""
        if self.board is not None:
            return getattr(self.board, method)(*params)
        return self.client.call(method, *params, timeout=timeout)

    def name(self, rank: int) -> str:
        if self.names:
            return self.names[rank]
        if self.board is not None and rank in self.board.hosts:
            return self.board.hosts[rank]
        return f"node rank {rank}"

    def ranks(self, rank: int) -> str:
        n = self.args.nproc_per_node
        first, last = rank * n, rank * n + n - 1
        return f"rank {first}" if n == 1 else f"ranks {first}-{last}"

    def where(self) -> str:
        return f"{self.name(0)} at {self.args.master_addr}:{self.args.master_port}"


def say(message: str) -> None:
    print(PREFIX + message, file=sys.stderr, flush=True)


def roll_call(node: Node) -> bool:
    """Every node reports at the head's board; the head waits for all of them and says go, or
    names the missing ones. True when the job goes ahead."""
    return head_roll_call(node) if node.head else join_roll_call(node)


def head_roll_call(node: Node) -> bool:
    args, started = node.args, time.monotonic()
    board = Board(args.nnodes)
    try:
        serve(board, args.master_port)
    except OSError as e:
        say(
            f"error: the head node {node.me} cannot serve the roll call on port"
            f" {args.master_port} ({e.strerror or e}); set MASTER_PORT to a free port"
        )
        return False
    node.board = board
    board.arrive(0, socket.gethostname())
    deadline = started + args.join_timeout
    while len(board.hosts) < args.nnodes and time.monotonic() < deadline:
        time.sleep(0.2)
    missing = [r for r in range(args.nnodes) if r not in board.hosts]
    if missing:
        board.verdict = "missing"
        names = ", ".join(f"{node.name(r)} ({node.ranks(r)})" for r in missing)
        say(
            f"error: {len(missing)} of {args.nnodes} nodes did not arrive within"
            f" {args.join_timeout:.0f} s: {names}. Their launch never started or cannot reach"
            f" the head node {node.where()} (their own message, if any, says which); the job"
            " ends on the nodes that did arrive. RDZV_TIMEOUT sets how long the nodes wait"
        )
        # The arrived nodes read the verdict before the board goes.
        time.sleep(min(3 * node.beat_every, 5.0))
        return False
    board.verdict = "go"
    say(
        f"{args.nnodes} nodes arrived in {time.monotonic() - started:.1f} s; starting"
        f" {args.nproc_per_node} rank(s) per node (world size {args.nnodes * args.nproc_per_node})"
    )
    return True


def join_roll_call(node: Node) -> bool:
    args = node.args
    deadline = time.monotonic() + args.join_timeout
    reason = ""
    while True:
        try:
            node.call("arrive", node.rank, socket.gethostname())
            break
        except OSError as e:
            reason = str(e)[:160]
        if time.monotonic() >= deadline:
            say(
                f"error: node {node.me} could not reach the head node {node.where()} within"
                f" {args.join_timeout:.0f} s ({reason}): the head node never started, or"
                " MASTER_ADDR is not an address this node reaches"
            )
            return False
        time.sleep(0.5)
    # The head answers within the join timeout; past it (and a lost head's allowance), it is gone.
    deadline = time.monotonic() + args.join_timeout + args.lost_after
    while time.monotonic() < deadline:
        try:
            verdict = node.call("get_verdict")
        except OSError:
            verdict = ""
        if verdict:
            return verdict == "go"
        time.sleep(0.5)
    say(f"error: node {node.me} arrived, but the head node {node.where()} never said go")
    return False


def start_ranks(node: Node, trainer_args: list[str]) -> subprocess.Popen:
    args = node.args
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(args.nnodes), "--node_rank", str(args.node_rank),
        "--nproc_per_node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts),
        "--rdzv_backend", "static", "--master_addr", args.master_addr,
        "--master_port", str(args.master_port + 1),
        "-m", "titan_trainer", *trainer_args,
    ]  # fmt: skip
    return subprocess.Popen(cmd)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc): torchrun starts each rank in a session of its
    own, so a signal to torchrun's process group would miss them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_ranks(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to torchrun (it passes it to the ranks, which write their traces), then SIGKILL
    to whatever of it is left after `grace` seconds: a rank blocked in a collective with a lost
    peer does not get to its signal handler before its timeout."""
    if proc.poll() is not None:
        return
    tree = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    for pid in [proc.pid, *tree, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


class Watch:
    """The heartbeats while the ranks run. A thread reports this node to the board every
    `beat_every` seconds (the head: checks everyone's); the main thread decides from what the
    thread last managed to do, never from a board call of its own."""

    def __init__(self, node: Node, proc: subprocess.Popen) -> None:
        self.node, self.proc = node, proc
        self.last_reached = time.monotonic()
        self.last_error = ""
        self.lost: tuple[int, float] | None = None  # the head: a silent node, for how long
        self.ending = ""  # the others: the head says the job ends, and why
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="titan-heartbeat", daemon=True)

    def _beat(self) -> None:
        node = self.node
        while not self.finished.is_set():
            try:
                self.ending = node.call("beat", node.rank)
                if node.head:
                    self.lost = node.board.silent(node.args.lost_after)
                self.last_reached = time.monotonic()
            except OSError as e:
                self.last_error = str(e).splitlines()[0][:120]
            self.finished.wait(node.beat_every)

    def run(self) -> tuple[int, str | None]:
        """Wait for torchrun; end it early when a node is lost. Returns torchrun's exit status
        and, when the job was ended here, why."""
        node, args = self.node, self.node.args
        self.thread.start()
        failure = None
        while failure is None:
            try:
                code = self.proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if self.lost is not None:
                lost, silent = self.lost
                failure = lost_message(node, lost, silent)
                # Read by every node still in touch; the head's message is the job's.
                node.board.ending = f"node {node.name(lost)} was lost"
            elif self.ending and not node.head:
                failure = ""
            elif time.monotonic() - self.last_reached >= args.lost_after:
                failure = (
                    f"error: node {node.me} ({node.ranks(node.rank)}) has not reached the"
                    f" head node {node.where()} for {time.monotonic() - self.last_reached:.0f} s"
                    f"{f' ({self.last_error})' if self.last_error else ''}: ending this node's"
                    " ranks"
                )
        if failure is not None:
            if failure:
                say(failure)
            stop_ranks(self.proc, args.grace)
            code = self.proc.returncode
        self.finished.set()
        return code, failure


def lost_message(node: Node, lost: int, silent: float) -> str:
    return (
        f"error: node {node.name(lost)} ({node.ranks(lost)}) has not been heard from for"
        f" {silent:.0f} s: its host, its network link or its launcher is gone. Ending the job"
        " on every node; run the same command again (once the node is back, or on other"
        " nodes) to resume from the newest complete checkpoint. LOST_NODE_TIMEOUT"
        f" ({node.args.lost_after:.0f} s) sets how long a node may be silent"
    )


def finish(node: Node, code: int, lost: int | None, failed: bool) -> None:
    """Say this node is done. The head keeps its board up until every node still there has
    said so (the lost one never will), so that none takes the head's exit for a lost head: for
    at most lost_after seconds after a run, or, after it ended the job, the time the others
    need to hear it (a heartbeat) and stop their ranks."""
    try:
        node.call("finish", node.rank, code)
    except OSError:
        return
    if not node.head:
        return
    waited_for = {r for r in range(node.args.nnodes) if r != lost}
    wait = node.args.grace + 2 * node.beat_every if failed else node.args.lost_after
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not waited_for <= set(node.board.finished):
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    args, trainer_args = parse_args(sys.argv[1:] if argv is None else argv)
    node = Node(args)
    code, lost = run_node(node, trainer_args)
    if args.exit_file and node.head:
        # For the batch script: the status, and whether a node was lost (srun would wait for it).
        with open(args.exit_file, "w") as f:
            f.write(f"{code} {'lost' if lost is not None else 'ended'}\n")
    return code


def run_node(node: Node, trainer_args: list[str]) -> tuple[int, int | None]:
    """This node's part of the job: its exit status, and the node the head found lost."""
    if not roll_call(node):
        return 1, None
    proc = start_ranks(node, trainer_args)
    # Passed on, not acted on: torchrun stops the ranks, which save a checkpoint first.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: proc.poll() is None and proc.send_signal(signum))
    watch = Watch(node, proc)
    code, failure = watch.run()
    lost = watch.lost[0] if watch.lost else None
    finish(node, code, lost, failure is not None)
    return (1 if failure is not None else code), lost


if __name__ == "__main__":
    sys.exit(main())
