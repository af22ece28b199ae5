"""The memory of compiled code, simulated: what a region compiled by inductor saves for backward
and allocates while it runs, without compiling a kernel.

Compiled code needs less memory than the same code run eagerly, for two reasons, and the
simulation reproduces both:

- **What is saved for backward.** AOTAutograd traces each compiled region's forward and
  backward together, and a partitioner decides which tensors the forward saves and which the
  backward recomputes. `simulated_backend()` is a torch.compile backend that traces exactly as
  inductor does (its decompositions, its joint-graph passes and its min-cut partitioner, so
  selective activation checkpointing's policy is honoured the same way), then runs the two
  partitioned graphs eagerly instead of generating kernels. A memory tracker then sees the
  tensors the compiled region really saves.
- **What a fused kernel never writes.** Inductor fuses element-wise operations and reductions
  into kernels; their intermediates live in registers, not in memory. The graphs run here
  allocate only what inductor materialises: graph outputs (activations saved for backward,
  gradients), the outputs of reductions and of the kernels inductor calls rather than
  generates (matmuls, attention, collectives: inductor's own tables say which), and the inputs
  those kernels read. Every other intermediate is computed outside the tracker's count (see
  `counts_allocations`): the float32 logits of a compiled cross-entropy, for one, are never
  written to memory.

What it leaves out: inductor reusing a dead buffer for a new one of the same size (which only
lowers transient peaks within a region), and buffers inductor decides to materialise for speed
(a pointwise result read by many kernels).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import fx, nn

from titan_core import get_logger

log = get_logger("parallel")

_EAGER_BACKENDS = ("eager", "aot_eager")
"""Backends that already run the traced graphs eagerly: simulated by themselves."""

_state = threading.local()


def counts_allocations() -> bool:
    """False while a simulated compiled region computes an intermediate that inductor would
    fuse away: a memory tracker should not count the tensors created then."""
    return not getattr(_state, "fused", False)


@contextlib.contextmanager
def _fused() -> Iterator[None]:
    before = getattr(_state, "fused", False)
    _state.fused = True
    try:
        yield
    finally:
        _state.fused = before


def simulated_backend(backend: str | Callable = "inductor") -> str | Callable:
    """The torch.compile backend that simulates `backend` on fake tensors for a memory estimate.

    `eager` and `aot_eager` run eagerly already and are returned unchanged; any other backend
    (inductor, or a callable) is simulated as inductor: traced and partitioned as inductor
    does, the graphs run eagerly, fused intermediates left uncounted (see the module
    docstring)."""
    if isinstance(backend, str) and backend in _EAGER_BACKENDS:
        return backend
    if backend != "inductor":
        log.info("memory estimate: compile backend %r is simulated as inductor", backend)
    return _simulate_inductor


def _simulate_inductor(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import partition_fn, select_decomp_table

    # The settings of torch's own aot_eager_decomp_partition backend (inductor's tracing with
    # the code generation left out), with inductor's partition function, which also runs
    # inductor's joint-graph passes before the min-cut partitioner.
    with functorch_config.patch(unlift_effect_tokens=True):
        return aot_autograd(
            fw_compiler=_fused_runner,
            bw_compiler=_fused_runner,
            partition_fn=partition_fn,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


def _fused_runner(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
    """Runs `gm` eagerly, each value freed after its last use as inductor's generated code
    does, with the values inductor would fuse away computed outside the trackers' count."""
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    (output,) = (n for n in graph.nodes if n.op == "output")
    fused = _fused_nodes(graph)
    last_user: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for used in node.all_input_nodes:
            last_user[used] = node
    freed_after: dict[fx.Node, list[fx.Node]] = {}
    for used, user in last_user.items():
        freed_after.setdefault(user, []).append(used)
    for node in nodes:  # computed but never read
        if node not in last_user:
            freed_after.setdefault(node, []).append(node)

    def run(args: list) -> list:
        env = dict(zip(placeholders, args, strict=True))
        # Boxed calling convention: the caller's list is cleared so that each input (a saved
        # activation, in backward) is freed after its last use here, not when the call ends.
        args.clear()
        for node in nodes:
            env[node] = _run_node(gm, node, env, node in fused)
            for done in freed_after.get(node, ()):
                del env[done]
        return list(fx.node.map_arg(output.args[0], env.__getitem__))

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _run_node(gm: fx.GraphModule, node: fx.Node, env: dict, fused: bool):
    if node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    if node.op == "call_function":
        target = node.target
    elif node.op == "call_method":
        target = getattr(args[0], node.target)
        args = args[1:]
    else:  # call_module
        target = gm.get_submodule(node.target)
    if not fused:
        return target(*args, **kwargs)
    with _fused():
        return target(*args, **kwargs)


# ----------------------------------------------------------------------------- what fuses


@functools.cache
def _inductor_tables() -> tuple[dict, frozenset]:
    """Inductor's lowerings, and the operators it calls as kernels of their own (matmuls,
    attention, fallbacks), whose inputs it must materialise."""
    import torch._inductor.kernel  # noqa: F401  (registers the matmul lowerings)
    from torch._inductor import lowering

    return lowering.lowerings, frozenset(lowering.needs_realized_inputs) | frozenset(
        lowering.fallbacks
    )


# Lowered operators whose output inductor always materialises: they write it element by
# element in an order of their own (scatter-like), or sort.
_WRITES_OWN_BUFFER = {
    "scatter",
    "scatter_add",
    "scatter_reduce",
    "index_put",
    "_unsafe_index_put",
    "index_add",
    "sort",
    "topk",
    "cumsum",
    "cumprod",
}


def _kind(node: fx.Node) -> str:
    """view: aliases its first input; kernel: materialises its inputs and output; reduction:
    materialises its output; fusible: an element-wise computation inductor inlines."""
    target = node.target
    if node.op in ("placeholder", "get_attr"):
        return "input"
    if node.op != "call_function":
        return "kernel"
    if target is operator.getitem:
        return "view"
    if not isinstance(target, torch._ops.OpOverload):  # higher-order ops, Python functions
        return "kernel"
    if target.is_view:
        return "view"
    lowerings, kernels = _inductor_tables()
    if (
        target.namespace not in ("aten", "prims")
        or target._schema.is_mutable
        or target in kernels
        or target not in lowerings
    ):
        return "kernel"
    if target._schema.name.split("::")[-1] in _WRITES_OWN_BUFFER:
        return "reduction"
    out = node.meta.get("val")
    sizes = [_numel(a.meta.get("val")) for a in node.all_input_nodes]
    if isinstance(out, torch.Tensor) and sizes and _numel(out) < max(sizes):
        return "reduction"
    return "fusible"


def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


def _fused_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose values inductor would never write to memory."""
    kinds = {node: _kind(node) for node in graph.nodes if node.op != "output"}

    def base(node: fx.Node) -> fx.Node:
        while kinds.get(node) == "view" and node.all_input_nodes:
            node = node.all_input_nodes[0]
        return node

    materialised = {
        node for node, kind in kinds.items() if kind in ("input", "kernel", "reduction")
    }
    for node, kind in kinds.items():
        if kind == "kernel":
            materialised.update(base(arg) for arg in node.all_input_nodes)
    for node in graph.nodes:
        if node.op == "output":
            materialised.update(base(arg) for arg in node.all_input_nodes)
    return {node for node in kinds if base(node) not in materialised}


# ----------------------------------------------------------------------------- tracking


@contextlib.contextmanager
def compiled_regions_traceable(parts: Sequence[nn.Module]) -> Iterator[None]:
    """Let modules compiled with `nn.Module.compile()` run their compiled code under a memory
    tracker.

    The tracker follows modules with global hooks; dynamo would trace those hooks into the
    compiled graph (and recompile for them). `torch.compile(module)` avoids that by running
    the module as an optimized module, which the trackers' hooks skip; this gives
    `module.compile()`'d modules the same treatment for the duration of the block.
    """
    from torch._dynamo.eval_frame import _set_in_optimized_module

    wrapped = []
    for part in parts:
        for module in part.modules():
            inner = getattr(module, "_compiled_call_impl", None)
            if inner is None:
                continue

            def call(*args, _inner=inner, **kwargs):
                with _set_in_optimized_module():
                    return _inner(*args, **kwargs)

            module._compiled_call_impl = call
            wrapped.append((module, inner))
    try:
        yield
    finally:
        for module, inner in wrapped:
            module._compiled_call_impl = inner
