"""torch.compile in the record: each compiled region as the kernels inductor generates for it.

auto-round compiles by default (``enable_torch_compile``: its wrappers' quantize functions and its
block forward, plain ``torch.compile``). A compiled region does not run as the aten ops a dispatch
mode sees: inductor fuses them into a few generated kernels plus extern calls (cuBLAS, attention),
and its backward is one autograd node whose gradients all appear when it ends. Under
:func:`capture` the record holds what inductor itself produced:

* **The kernels.** Every graph inductor compiles keeps its scheduler's nodes after fusion, in
  launch order (:func:`kernels_of`): one kernel per generated (fused) node, one per extern call;
  each with the bytes inductor counts for it (``BaseSchedulerNode.get_read_write_buffer_accesses``,
  the estimate behind its own ``num_bytes_accessed`` metric), the element count and shape of every
  buffer it touches (for :class:`dpqlab.timeline.shapes.RoleMap`) and, for a matmul or
  attention, its FLOPs. A CPU recording runs inductor's C++ backend, whose fusion decisions come from
  the same scheduler with the C++ backend's rules: its outer-loop fusion joins a per-group reduction
  (the min/max of a weight group) with the pointwise work over the same groups, which Triton fuses
  as one reduction kernel with its epilogue too; where the backends differ otherwise, the GPU check
  counts the launches per lane-iteration on a card and reports them beside the model's.
* **The calls.** A compiled function runs for real (on CPU), with the recording's modes lifted
  (dynamo must not trace them) and its output tensors booked on the lane it ran for; each graph
  call (the forward in the region's lane context, the backward on autograd's thread for that lane,
  the node's stream) puts one *region call* host op and its kernels in the record. The backward is
  lowered with the forward (``force_non_lazy_backward_lowering``), inside the region, not lazily
  under the recording's modes.
* **The compiles.** Every dynamo compile while a model records, with its host seconds on this CPU
  (``TimelineModel.compiles``): on GPUs each lane device compiles (dynamo guards on the device), on
  the one issuing thread.

Static shapes while capturing (``automatic_dynamic_shapes`` off, a cache limit for every lane and
slice size), so every buffer has a concrete size; the FX graph and AOT caches are off so every
compile runs the scheduler. A region that graph-breaks calls more than one forward graph: the
record counts the graphs per call (``TimelineModel.region_graphs``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dpqlab.timeline.record import TimelineModel, lead_of, without_modes
from dpqlab.timeline.shapes import TensorMeta
from dpqlab.timeline.work import ATTENTION, attention_flops, named_args, work_of

__all__ = ["CompiledGraph", "Kernel", "RegionFunction", "capture", "kernels_of"]


@dataclass(frozen=True)
class Kernel:
    """One launch of a compiled graph, at the recorded sizes."""

    name: str  # the extern op's schema name, or "inductor kernel (n nodes)"
    work: str  # matmul, attention or elementwise
    extern: bool  # an extern call (cuBLAS, attention) rather than a generated kernel
    flops: float
    tensors: tuple[TensorMeta, ...]  # every buffer it touches: (element count, bytes inductor counts, lead)


@dataclass
class CompiledGraph:
    """What inductor made of one FX graph (forward or backward)."""

    backward: bool
    kernels: list[Kernel]
    region: str = ""  # the compiled function it was compiled for, where a model was recording then

    def bytes(self) -> float:
        return float(sum(b for k in self.kernels for _, b, _ in k.tensors))


def _int(expr) -> int:
    from torch._inductor.virtualized import V

    return int(V.graph.sizevars.optimization_hint(expr, fallback=0))


def _buffer_meta(name: str, accessed: int, seqlen: int) -> TensorMeta:
    from torch._inductor.virtualized import V

    buf = V.graph.try_get_buffer(name)
    try:
        shape = tuple(_int(d) for d in buf.get_size())
    except (AttributeError, NotImplementedError):  # no buffer, or several outputs' layout (an extern call's)
        shape = ()
    numel = 1
    for d in shape:
        numel *= d
    return numel, int(accessed), lead_of(shape, seqlen)


def _extern_name(ir_node) -> str:
    op = getattr(ir_node, "op_overload", None)
    if op is not None and hasattr(op, "_schema"):
        return op._schema.name
    return str(getattr(ir_node, "python_kernel_name", "") or type(ir_node).__name__)


def _attention_flops(ir_node, name: str) -> float:
    """From the FX node the extern call came from: its tensors' shapes and ``is_causal``."""
    op = ir_node.op_overload
    origin = next(o for o in ir_node.origins if getattr(o, "target", None) is op)

    def val(a):
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    named = named_args(op._schema, [val(a) for a in origin.args], {k: val(v) for k, v in origin.kwargs.items()})
    order = ("grad_out", "query", "key", "value") if "grad_out" in named else ("query", "key", "value")
    return attention_flops(name, [tuple(named[k].shape) for k in order], bool(named.get("is_causal")))


def _node_kernel(node, seqlen: int) -> Kernel | None:
    from torch._inductor import ir
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    if isinstance(node, NopKernelSchedulerNode):
        return None  # a view or a reinterpretation: no launch
    extern = isinstance(node, ExternKernelSchedulerNode)
    if extern and isinstance(node.node, ir.MultiOutput):
        return None  # picks an output of the extern call before it: no launch
    accesses = node.get_read_write_buffer_accesses(include_reads=True, include_writes=True)
    tensors = tuple(_buffer_meta(name, n, seqlen) for name, n in accesses.items())
    if not extern:
        return Kernel(f"inductor kernel ({len(node.get_nodes())} nodes)", "elementwise", False, 0.0, tensors)
    name = _extern_name(node.node)
    work = work_of(name)
    if work == "attention" and name in ATTENTION:
        flops = _attention_flops(node.node, name)
    else:
        flops = float(node.estimate_flops() or 0.0) if work == "matmul" else 0.0
    return Kernel(name, work, True, flops, tensors)


def kernels_of(graph, seqlen: int) -> list[Kernel]:
    """The launches of a lowered graph (``GraphLowering`` after codegen), in order (module docstring)."""
    return [k for k in (_node_kernel(node, seqlen) for node in graph.scheduler.nodes) if k is not None]


class RegionFunction:
    """A compiled function as the record sees it: its calls go through the active model (if any)."""

    def __init__(self, name: str, compiled: Callable) -> None:
        self.name, self.compiled = name, compiled
        functools.update_wrapper(self, compiled)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # called from a region dynamo traces: inlined there, as without us
            return self.compiled(*args, **kwargs)
        model = TimelineModel.active
        if model is None or model.paused_now:
            return self.compiled(*args, **kwargs)
        return model.run_region(self.name, self.compiled, args, kwargs)

    def __get__(self, obj, objtype=None):  # a compiled method stays a method
        return self if obj is None else functools.partial(self, obj)


def _suppressed(error: type[Exception], fn: Callable, *args) -> None:
    with contextlib.suppress(error):
        fn(*args)


@contextlib.contextmanager
def capture(seqlen: int, sink: list[CompiledGraph] | None = None) -> Iterator[None]:
    """While entered: ``torch.compile`` returns :class:`RegionFunction` wrappers, every inductor graph
    keeps its :class:`CompiledGraph` (also appended to ``sink``), and graph calls and compiles are
    booked into the active model (module docstring)."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo import callback_handler
    from torch._inductor.output_code import CompiledFxGraph

    restore: list[Callable[[], None]] = []

    def patch(owner, name, value):
        real = getattr(owner, name)
        setattr(owner, name, value)
        restore.append(lambda: setattr(owner, name, real))

    real_compile = torch.compile

    def compile_(model=None, **kwargs):
        if model is None:
            return lambda fn: compile_(fn, **kwargs)
        return RegionFunction(getattr(model, "__qualname__", type(model).__name__), real_compile(model, **kwargs))

    real_init, real_call = CompiledFxGraph.__init__, CompiledFxGraph.__call__

    def init(self, current_callable, graph, gm, *args, **kwargs):
        real_init(self, current_callable, graph, gm, *args, **kwargs)
        backward = bool((getattr(self, "fx_kwargs", None) or {}).get("is_backward"))
        model = TimelineModel.active
        self._dpq_graph = CompiledGraph(backward, kernels_of(graph, seqlen), model.region_name() if model else "")
        if sink is not None:
            sink.append(self._dpq_graph)

    def call(self, inputs):
        model = TimelineModel.active
        graph = getattr(self, "_dpq_graph", None)
        if model is None or graph is None or model.paused_now:
            return real_call(self, inputs)
        args = list(inputs)  # the call may clear the list it is given (boxed calling convention)
        with model.paused(), without_modes():
            out = real_call(self, inputs)
        model.graph_call(graph, args, out)
        return out

    started: dict[str, float] = {}

    def on_start(args):
        started[str(args.compile_id)] = time.perf_counter()

    def on_end(args):
        t0 = started.pop(str(args.compile_id), None)
        model = TimelineModel.active
        if model is not None and t0 is not None and getattr(args.callback_trigger, "name", "") == "DYNAMO":
            model.compiles.append((str(args.compile_id), time.perf_counter() - t0))

    patch(torch, "compile", compile_)
    patch(CompiledFxGraph, "__init__", init)
    patch(CompiledFxGraph, "__call__", call)
    patch(functorch_config, "force_non_lazy_backward_lowering", True)
    patch(functorch_config, "enable_autograd_cache", False)
    patch(inductor_config, "fx_graph_cache", False)
    patch(dynamo_config, "automatic_dynamic_shapes", False)
    patch(dynamo_config, "cache_size_limit", max(dynamo_config.cache_size_limit, 256))
    patch(dynamo_config, "accumulated_cache_size_limit", max(dynamo_config.accumulated_cache_size_limit, 1024))
    callback_handler.register_start_callback(on_start)
    callback_handler.register_end_callback(on_end)
    for remove, callback in ((callback_handler.remove_start_callback, on_start),
                             (callback_handler.remove_end_callback, on_end)):
        # (torch._dynamo.reset() inside the capture already dropped them)
        restore.append(functools.partial(_suppressed, ValueError, remove, callback))
    try:
        yield
    finally:
        while restore:
            restore.pop()()
