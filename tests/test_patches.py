"""The patch table: every replaced auto-round symbol in one place, checked at install, nested installs."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dpq.autoround import integration, patches, run
from dpq.autoround.versions import SERIES
from dpq.planning.spec import ParallelSpec

ROOT = Path(__file__).resolve().parents[1]


def _targets():
    return [(patches._resolve(p.owner), p.name, patches._resolve(p.replacement)) for p in patches.patches_for()]


def test_install_replaces_every_table_symbol_and_uninstall_restores_them():
    before = {(o, n): o.__dict__.get(n) for o, n, _ in _targets()}
    with integration.parallel_quantization(2, "cpu,cpu"):
        for owner, name, ours in _targets():
            installed = owner.__dict__[name]  # dpq's function, called with its run first (Note [each replacement
            assert installed.__wrapped__ is ours and patches.ours(owner, name) is ours, f"{owner.__name__}.{name}"
            assert patches.original(owner, name) is before[owner, name]  # is handed its run])
    assert {(o, n): o.__dict__.get(n) for o, n, _ in _targets()} == before


def test_table_names_every_auto_round_symbol_dpq_assigns():
    """No module of dpq assigns an attribute of an auto-round class or module itself: the table does
    (the per-call swaps of the collection seam are on instances, for one compress_block call). The
    scaffolding in dpqlab (never imported by the runtime or the adapter) records and replays
    auto-round's own runs for tests and benchmarks, as tests/ does, and may patch it."""
    assigned = set()
    for path in (ROOT / "dpq").rglob("*.py"):
        if "testing" in path.relative_to(ROOT / "dpq").parts:
            continue
        tree = ast.parse(path.read_text())
        upstream = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").startswith("auto_round") for a in node.names}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AugAssign) else []
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("setattr", "delattr"):
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in upstream:
                    assigned.add((path.name, t.value.id, t.attr))
    assert assigned == set()
    names = {p.name for p in patches.TABLE}
    assert {"quantize_block", "dispatch_block", "compress_block", "_grid_search_scales", "_run_parent_samples",
            "_compute_parent_loss", "_clip_block", "_compute_best_clip", "_quantize_targets",
            "_prepare_init_scale_weight", "search_optimized_init_scale",
            "quantize_and_save", "save_quantized", "_adjust_immediate_packing_and_saving",
            "setup_ddp_if_needed_"} == names  # ranks.py


def _auto_round_function(params: str):
    ns = {}
    exec(f"def fake({params}):\n    return None\n", ns)
    ns["fake"].__module__ = "auto_round.changed"
    return ns["fake"]


def test_changed_upstream_signature_is_refused_naming_version_and_symbol(monkeypatch):
    from auto_round.algorithms.transforms.awq.base import AWQTransform
    from auto_round.version import __version__

    before = {(o, n): o.__dict__.get(n) for o, n, _ in _targets()}
    monkeypatch.setattr(AWQTransform, "_clip_block", _auto_round_function("self, block_prefix, mappings, extra=1"))
    with pytest.raises(patches.PatchMismatch) as e:
        integration.enable(2, "cpu,cpu")
    msg = str(e.value)
    assert f"auto-round {__version__}" in msg and "AWQTransform._clip_block(" in msg
    assert "does not run a changed upstream function" in msg
    assert not patches.installed() and patches.enabled_run() is None
    for (owner, name), fn in before.items():
        if name != "_clip_block":
            assert owner.__dict__.get(name) is fn  # nothing was patched


def test_a_changed_source_the_lane_loop_reproduces_is_refused_by_name(monkeypatch):
    """The series module's LOOP_REPRODUCED (dpq.autoround.versions): auto-round code dpq's lane loop
    reproduces op for op (the loss, the runner's batch selection and forward) is pinned by its source's
    digest per series; a changed one refuses the install by name, like a changed signature, and nothing
    is patched."""
    from auto_round.algorithms.block_runner import BlockForwardRunner

    assert patches.check() == []  # the installed series' sources are the recorded ones
    src = "def _select_batch(self, inputs, indices, extra=None):\n    return inputs\n"
    ns: dict = {}
    exec(src, ns)
    monkeypatch.setattr(patches.inspect, "getsource",
                        lambda obj, real=patches.inspect.getsource: src if obj is ns["_select_batch"] else real(obj))
    monkeypatch.setattr(BlockForwardRunner, "_select_batch", ns["_select_batch"])
    with pytest.raises(patches.PatchMismatch, match=r"BlockForwardRunner\._select_batch: its source \(sha256 "
                                                     r"[0-9a-f]{16}\) differs from the one dpq reproduces"):
        integration.enable(2, "cpu,cpu")
    assert not patches.installed()
    monkeypatch.delattr(BlockForwardRunner, "_select_batch")
    assert any(p == "BlockForwardRunner._select_batch is missing" for p in patches.check())


def test_missing_upstream_symbol_is_refused(monkeypatch):
    from auto_round.algorithms.transforms.awq.base import AWQTransform

    monkeypatch.delattr(AWQTransform, "_compute_best_clip")
    with pytest.raises(patches.PatchMismatch, match=r"AWQTransform\._compute_best_clip is missing"):
        integration.enable("auto")
    assert not patches.installed()


def test_per_version_entries():
    v16 = {p.symbol for p in patches.patches_for("0.16.1")}
    v17 = {p.symbol for p in patches.patches_for("0.17.0.dev20261026")}
    assert "OptimizedRTNQuantizer._quantize_targets" in v16 - v17
    assert any(s.endswith("sign_roundv2.quantizer.search_optimized_init_scale") for s in v16 - v17)
    assert v17 < v16
    assert "OptimizedRTNQuantizer._quantize_targets" in SERIES["0.17"].NOT_PATCHED
    assert patches.patches_for("0.18.0") == []


def test_nested_installs_stack_and_a_later_foreign_patch_stays():
    from auto_round.algorithms.composer import AlgorithmComposer as C

    before = C.__dict__["compress_block"]
    outer, inner = run.Run(ParallelSpec(2), seams_only=True), run.Run(ParallelSpec("off"), seams_only=True)
    patches.install(outer)
    patches.install(inner)
    assert patches.reported(seams=True) is inner and C.compress_block is not before
    patches.uninstall()
    assert patches.reported(seams=True) is outer and C.compress_block is not before
    ours = C.__dict__["compress_block"]

    def theirs(self, *a, **k):
        return ours(self, *a, **k)

    C.compress_block = theirs
    try:
        patches.uninstall()
        assert C.__dict__["compress_block"] is theirs and patches.chained(C, "compress_block")
        assert not patches.installed() and patches.reported(seams=True) is outer
    finally:
        C.compress_block = before
    patches.install(outer)  # taken off again: patched afresh
    assert C.__dict__["compress_block"].__wrapped__ is ours.__wrapped__ and not patches.chained(C, "compress_block")
    patches.uninstall()
    assert C.__dict__["compress_block"] is before


def test_no_import_cycle_between_integration_and_the_seams():
    def imports(name):
        tree = ast.parse((ROOT / "dpq" / "autoround" / f"{name}.py").read_text())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                out.add(node.module or "")
                out.update(a.name for a in node.names if not node.module)
        return out

    seams = ["seams_common", "seams_collection", "seams_rtn", "seams_init_scale", "seams_awq", "shard_seams"]
    for s in seams:
        assert "integration" not in imports(s), s
    assert not set(seams) & imports("integration") - {"seams_common"}
    # the table names its replacements by path, imported at install; it imports only the series modules
    assert imports("patches") <= {"versions"}
    assert all(len((ROOT / "dpq" / "autoround" / f"{s}.py").read_text().splitlines()) <= 400 for s in seams)


class _Procs:
    """Two processes seen from ``rank``: rank 0 beats and publishes its folders, the other awaits them."""

    size, group = 2, None

    def __init__(self, rank: int, rank0_folders) -> None:
        self.rank, self.rank0_folders, self.sent, self.awaited = rank, rank0_folders, [], []

    def name(self, rank: int) -> int:
        return rank

    def beat(self, name: str) -> None:
        self.sent.append(("beat", name))

    def publish(self, name: str, value) -> None:
        self.sent.append((name, value))

    def await_rank0(self, name: str):
        self.awaited.append(name)
        return self.rank0_folders


@pytest.mark.parametrize("mixin", ["mllm", "diffusion"])
@pytest.mark.parametrize("rank", [0, 1])
def test_mllm_and_diffusion_saves_are_rank_0s_alone(monkeypatch, mixin, rank):
    """auto-round's MLLM and diffusion compressors override save_quantized: under several processes
    rank 0 alone runs the override (one barrier on every rank: the override's own super() call to
    BaseCompressor.save_quantized is part of rank 0's save, not a second barrier that only rank 0
    would enter), and every rank returns rank 0's folders."""
    import torch.distributed as dist
    from auto_round.compressors.base import BaseCompressor
    from auto_round.compressors.diffusion_mixin import DiffusionMixin
    from auto_round.compressors.mllm_mixin import MLLMMixin

    from dpq.autoround import ranks

    writes, barriers = [], []

    def base_save(self, output_dir=None, format=None, inplace=True, return_folders=False, max_shard_size=None, **kw):
        writes.append(output_dir)
        return (self.model, [f"{output_dir}/w4"]) if return_folders else self.model

    real = ranks._original
    monkeypatch.setattr(ranks, "_original", lambda owner, name: base_save if owner == ranks._BASE else
                        real(owner, name))
    monkeypatch.setattr(dist, "barrier", lambda group=None: barriers.append(group))
    procs = _Procs(rank, ["out/w4"])
    compressor = type("Compressor", (MLLMMixin if mixin == "mllm" else DiffusionMixin, BaseCompressor), {})
    c = object.__new__(compressor)
    c.__dict__.update(model="M", model_context=SimpleNamespace(processor=None, image_processor=None, tokenizer=None))
    out = None if mixin == "diffusion" else "out"  # the diffusion override hands output_dir None to super() alone
    with integration.parallel_quantization(1, processes=procs):  # the save is handed the run, with its processes
        assert compressor.save_quantized(c, out, return_folders=True) == ("M", [f"{out}/w4"] if rank == 0 else
                                                                           ["out/w4"])
        assert patches.ours(MLLMMixin if mixin == "mllm" else DiffusionMixin, "save_quantized") is \
            getattr(ranks, f"{mixin}_save_quantized")
    assert barriers == [None] and writes == ([out] if rank == 0 else [])
    assert procs.sent == ([("beat", "save"), ("save", [f"{out}/w4"])] if rank == 0 else [])
    assert procs.awaited == ([] if rank == 0 else ["save"])  # without a collective deadline, on rank 0's beat
    with integration.parallel_quantization(1):  # one process: straight through, no barrier
        assert compressor.save_quantized(c, out) == "M"
    assert len(writes) == (2 if rank == 0 else 1) and writes[-1] == out and len(barriers) == 1


@pytest.mark.parametrize("version, refused", [("0.15.2", True), ("0.18.0", True), ("0.16.1", False), ("0.17.0", False)])
def test_importing_compat_refuses_an_uncovered_auto_round_by_version(monkeypatch, version, refused):
    """The package imports ``compat`` first, and executing it checks the installed auto-round's series."""
    import importlib.util

    import auto_round.version

    monkeypatch.setattr(auto_round.version, "__version__", version)
    spec = importlib.util.find_spec("dpq.autoround.compat")
    fresh = importlib.util.module_from_spec(spec)  # a second copy: the imported one stays as it is
    if refused:
        with pytest.raises(RuntimeError, match=version.replace(".", r"\.")):
            spec.loader.exec_module(fresh)
    else:
        spec.loader.exec_module(fresh)
        assert fresh.check_auto_round_version() == version
        assert patches.series(version) == version.rsplit(".", 1)[0] and patches.series(version) in fresh.SUPPORTED
    first = ast.parse(Path(integration.__file__).with_name("__init__.py").read_text()).body
    imports = [node for node in first if isinstance(node, ast.ImportFrom)]
    assert (imports[0].level, imports[0].module, [a.name for a in imports[0].names]) == (1, None, ["compat"])


def test_each_replacement_is_handed_its_run(monkeypatch):
    """Note [each replacement is handed its run]: the installed caller hands dpq's function the innermost
    enabled run (the tuner's and the save's replacements pass a seams-only run above it by), the seams the
    top frame's, and after the run, under someone else's later patch, None (dpq's passes through)."""
    from auto_round.algorithms.quantization.sign_round import quantizer
    from auto_round.algorithms.transforms.awq.base import AWQTransform

    from dpq.autoround import ranks, seams_awq

    seen = []
    monkeypatch.setattr(ranks, "setup_ddp_if_needed_", lambda cfg, ar, block, devices: seen.append(cfg) or block)
    monkeypatch.setattr(seams_awq, "compute_best_clip", lambda run, self, layer, feat: seen.append(run))
    outer = integration.enable(2, "cpu,cpu")
    seams = run.Run(ParallelSpec(2, "cpu,cpu"), seams_only=True)
    patches.install(seams)
    try:
        quantizer.setup_ddp_if_needed_(None, "block", [0])
        AWQTransform._compute_best_clip(object(), "layer", "feat")
        assert seen[0] is outer and seen[1] is seams
        patches.uninstall()
        AWQTransform._compute_best_clip(object(), "layer", "feat")
        assert seen[2] is outer
        ours = quantizer.setup_ddp_if_needed_
        monkeypatch.setattr(quantizer, "setup_ddp_if_needed_", lambda *a: ours(*a))  # someone else's, over dpq's
        assert integration.disable() is outer and patches.chained(quantizer, "setup_ddp_if_needed_")
        quantizer.setup_ddp_if_needed_(None, "block", [0])
        assert seen[3] is None
    finally:
        while patches.installed():
            patches.uninstall()
    monkeypatch.undo()
    patches.install(run.Run(seams_only=True))  # taken off again: patched afresh, then put back
    patches.uninstall()
    assert not patches.chained(quantizer, "setup_ddp_if_needed_")


def test_one_module_per_series_lists_what_dpq_expects_of_it():
    """dpq.autoround.versions: one module per covered series (compat's SUPPORTED), each signature one of the
    table's patches, each table patch patched by some series, each listed private callable named in the
    adapter's source and present in the installed series."""
    from dpq.autoround import compat

    assert tuple(SERIES) == compat.SUPPORTED and tuple(m.RELEASE for m in SERIES.values()) == compat.CHECKED
    paths = {p.path for p in patches.TABLE}
    adapter = "\n".join(p.read_text() for p in (ROOT / "dpq" / "autoround").glob("*.py"))
    for module in SERIES.values():
        assert set(module.SIGNATURES) <= paths and module.CALLED and module.LOOP_REPRODUCED and module.REPRODUCED
        for path in module.CALLED:
            assert re.split(r"[.:]", path)[-1] in adapter, path  # a method's or a module function's name
    assert paths == set().union(*(m.SIGNATURES for m in SERIES.values()))
    installed = patches.series_module()
    for path in installed.CALLED:
        assert patches._resolve(path) is not None


def test_a_missing_private_callable_is_refused_by_name(monkeypatch):
    from auto_round.algorithms.transforms.awq.base import AWQTransform

    monkeypatch.delattr(AWQTransform, "_should_skip_clip")
    with pytest.raises(patches.PatchMismatch, match=r"AWQTransform\._should_skip_clip is missing"):
        integration.enable(2, "cpu,cpu")
    assert not patches.installed()
