"""The compiled regions in the timeline model are inductor's own: for auto-round's compiled weight
quantize function (one wrapped layer of the recorded block), the kernels the record holds and their
bytes are exactly the scheduler nodes inductor launches and the bytes it counts for them
(``torch._inductor.metrics``: ``nodes_num_elem`` per node, ``num_bytes_accessed`` per compile), for
its forward and its backward graph."""

from __future__ import annotations

import pytest
import torch

from dpqlab.timeline.compiled import capture
from dpqlab.timeline.scenarios import RECORD_SEQLEN, bf16_cpu, shared_block


@pytest.fixture
def inductor_metrics():
    import torch._inductor.metrics as metrics

    torch._logging.set_logs(inductor_metrics=True)  # inductor counts bytes only with its metrics log on
    metrics.reset()
    try:
        yield metrics
    finally:
        torch._logging.set_logs()
        metrics.reset()


@pytest.mark.parametrize("layer", ["self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"])
def test_timeline_compiled_quant_function_is_inductors(inductor_metrics, layer):
    rec = shared_block(compile=True)
    q = rec.quantizer
    graphs = []
    with capture(RECORD_SEQLEN, sink=graphs), bf16_cpu():
        block = rec.fresh_block()
        q.wrapper_block(block, q.enable_minmax_tuning, False, enable_torch_compile=True, device="cpu")
        wrapped = block.get_submodule(layer)
        torch._dynamo.reset()  # a fresh compile of the quantize function (its shapes may be cached)
        inductor_metrics.reset()
        qweight = wrapped._qdq_weight(wrapped.value, wrapped.min_scale, wrapped.max_scale)[0]
    assert [g.backward for g in graphs] == [False, True]  # the backward lowered with the forward
    nodes = [(type(n).__name__, elems) for n, elems in inductor_metrics.nodes_num_elem]
    launched = [elems for name, elems in nodes if name not in ("NopKernelSchedulerNode",)]
    ours = [sum(b for _, b, _ in k.tensors) for g in graphs for k in g.kernels]
    assert [b // 4 for b in ours] == launched
    assert sum(ours) == inductor_metrics.num_bytes_accessed
    assert all(k.work == "elementwise" and not k.extern for g in graphs for k in g.kernels)
    # one fused kernel per graph: quantize-dequantize forward, and its backward
    assert [len(g.kernels) for g in graphs] == [1, 1]
    weight = wrapped.orig_layer.weight
    assert qweight.shape == weight.shape
