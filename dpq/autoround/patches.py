"""The one patch table: every auto-round symbol dpq replaces, installed and removed in one place.

Each :class:`Patch` names the owner (class or module), the attribute, dpq's replacement (a
``module:function`` path, imported at install) and the run it is handed. What dpq expects of each
auto-round series is that series' module in :mod:`dpq.autoround.versions`: the symbols it patches
with their parameters, what it does not patch and why, the digests of the sources dpq reproduces and
the private callables dpq calls. :func:`install` checks all of it for the installed series before it
touches anything and refuses with :class:`PatchMismatch` (naming the installed auto-round version and
each symbol) when one is missing, its parameters differ or a reproduced source changed: dpq never runs
a changed upstream function through a stale copy.

Installs nest as a stack of :class:`Frame` (one per ``enable()`` or seams-only install), each
holding its run (:class:`dpq.autoround.run.Run`). The outermost install patches; the matching
uninstall puts back what it replaced, except where someone patched over dpq's replacement since:
that patch stays, and dpq's replacement under it passes every call straight through while nothing
is installed (it calls :func:`original`).

Note [each replacement is handed its run]
What is installed is not dpq's function itself but a caller made here (:func:`_handed`) that calls
it with the run as its first argument: for the tuner's and the save's replacements
(``Patch.hands == "tuner"``) the innermost run that is not seams-only, for the seams' (``"top"``)
the top frame's; None while nothing (no such run) is installed, and then the replacement passes
the call through. The run is read here, at the call, from the stack this module keeps, and
nowhere else: a reader of a replacement sees where its settings come from (its first
parameter), and ``tests/test_layout.py`` checks that no module outside this one reads the stack.
Read-back after a run (records, reports) goes through :func:`reported`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from types import MappingProxyType, ModuleType

from dpq import refusals

from .versions import SERIES

__all__ = [
    "TABLE",
    "Frame",
    "Patch",
    "PatchMismatch",
    "chained",
    "check",
    "enabled_run",
    "install",
    "installed",
    "original",
    "ours",
    "patches_for",
    "reported",
    "reproduced_changes",
    "series",
    "series_module",
    "uninstall",
    "uninstall_enabled",
]

_SR = "auto_round.algorithms.quantization.sign_round.quantizer:SignRoundQuantizer"
_RTN = "auto_round.algorithms.quantization.rtn.quantizer"
_V2 = "auto_round.algorithms.quantization.sign_roundv2.quantizer"
_AWQ = "auto_round.algorithms.transforms.awq.base:AWQTransform"


@dataclass(frozen=True)
class Patch:
    owner: str  # "module:Class" or "module"
    name: str  # the attribute replaced
    replacement: str  # dpq's function, "module:function"
    phase: str  # what it serves: "tune", "collection", "search", "save"
    # the run the replacement is handed (Note [each replacement is handed its run]): "tuner" (the
    # innermost run that is not seams-only) or "top" (the top frame's: the seams)
    hands: str = "tuner"

    @property
    def symbol(self) -> str:
        return f"{self.owner.rpartition(':')[2] or self.owner}.{self.name}"

    @property
    def path(self) -> str:
        """The upstream symbol's path as a series module keys it ("module:Class.attr", "module:attr")."""
        return f"{self.owner}.{self.name}" if ":" in self.owner else f"{self.owner}:{self.name}"


TABLE: tuple[Patch, ...] = (
    Patch(_SR, "quantize_block", "dpq.autoround.integration:_delegated_quantize_block", "tune"),
    Patch(_SR, "dispatch_block", "dpq.autoround.integration:_whole_block_dispatch", "tune"),
    Patch("auto_round.algorithms.composer:AlgorithmComposer", "compress_block",
          "dpq.autoround.seams_collection:compress_block", "collection", hands="top"),
    # the output written whole or not at all (dpq.autoround.ranks, dpq.staging)
    Patch("auto_round.compressors.base:BaseCompressor", "quantize_and_save", "dpq.autoround.ranks:quantize_and_save",
          "save"),
    # several processes (dpq.autoround.ranks): rank 0 alone writes; auto-round's own DDP lane stays off dpq's path
    Patch("auto_round.compressors.base:BaseCompressor", "save_quantized", "dpq.autoround.ranks:save_quantized", "save"),
    # auto-round's MLLM and diffusion compressors override the save: rank 0 alone runs the whole override
    Patch("auto_round.compressors.mllm_mixin:MLLMMixin", "save_quantized", "dpq.autoround.ranks:mllm_save_quantized",
          "save"),
    Patch("auto_round.compressors.diffusion_mixin:DiffusionMixin", "save_quantized",
          "dpq.autoround.ranks:diffusion_save_quantized", "save"),
    Patch("auto_round.compressors.base:BaseCompressor", "_adjust_immediate_packing_and_saving",
          "dpq.autoround.ranks:adjust_immediate_packing_and_saving", "save"),
    Patch("auto_round.algorithms.quantization.sign_round.quantizer", "setup_ddp_if_needed_",
          "dpq.autoround.ranks:setup_ddp_if_needed_", "tune"),
    Patch(f"{_RTN}:RTNQuantizer", "quantize_block", "dpq.autoround.seams_rtn:rtn_quantize_block", "search", "top"),
    # 0.16 only (dpq.autoround.versions.v0_17.NOT_PATCHED): 0.17 removed _quantize_targets and stages the
    # init-scale searches into its own search dispatch
    Patch(f"{_RTN}:OptimizedRTNQuantizer", "_quantize_targets", "dpq.autoround.seams_rtn:opt_rtn_quantize_targets",
          "search", "top"),
    Patch(f"{_V2}:SignRoundOptimizedWrapperLinear", "_prepare_init_scale_weight",
          "dpq.autoround.seams_init_scale:prepare_init_scale_weight", "search", "top"),
    Patch(_V2, "search_optimized_init_scale", "dpq.autoround.seams_init_scale:search_optimized_init_scale", "search",
          "top"),
    Patch(_AWQ, "_grid_search_scales", "dpq.autoround.seams_awq:grid_search_scales", "search", "top"),
    Patch(_AWQ, "_run_parent_samples", "dpq.autoround.seams_awq:run_parent_samples", "search", "top"),
    Patch(_AWQ, "_compute_parent_loss", "dpq.autoround.seams_awq:compute_parent_loss", "search", "top"),
    Patch(_AWQ, "_clip_block", "dpq.autoround.seams_awq:clip_block", "search", "top"),
    Patch(_AWQ, "_compute_best_clip", "dpq.autoround.seams_awq:compute_best_clip", "search", "top"),
)
"""Every auto-round symbol dpq replaces for the whole run, in any series; a series patches those its
module (:mod:`dpq.autoround.versions`) lists with their parameters. Besides these, the collection seam
swaps two attributes of one object for the duration of one ``AlgorithmComposer.compress_block`` call
(per-call swaps, undone in its ``finally``): the composer's ``block_forward`` (a ``BlockForwardRunner``)
and the block quantizer's bound ``quantize_block`` (timed)."""


def series_module(version: str | None = None) -> ModuleType | None:
    """What dpq expects of the installed auto-round's series (of ``version``): its module in
    :mod:`dpq.autoround.versions`, None for a series dpq does not cover."""
    return SERIES.get(series(version))


def _source_digest(path: str) -> str | None:
    """sha256 (first 16 hex digits) of the installed source at ``path`` ("module:Class.attr"), None if gone."""
    import hashlib

    try:
        source = inspect.getsource(_resolve(path))
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def reproduced_changes() -> list[str]:
    """The symbols the series' ``REPRODUCED`` pins (:mod:`dpq.autoround.versions`: dpq's runtime reproduces
    them with a fallback) whose installed source differs from the checked one (or is gone). Unlike a
    ``LOOP_REPRODUCED`` source a change here refuses nothing: the caller runs auto-round's own code instead
    of the reproduction (never a stale copy)."""
    module = series_module()
    pinned = module.REPRODUCED if module is not None else {}
    return [path for path, digest in pinned.items() if _source_digest(path) != digest]


class PatchMismatch(RuntimeError):
    """An auto-round symbol dpq would replace is missing or has other parameters than checked."""


def series(version: str | None = None) -> str:
    """The auto-round series ("0.16", "0.17") of ``version`` (default: the installed one)."""
    if version is None:
        from auto_round.version import __version__ as version
    return ".".join(version.split(".")[:2])


def patches_for(version: str | None = None) -> list[Patch]:
    """The table's patches the series of ``version`` (default: installed) patches: those its module lists."""
    module = series_module(version)
    return [p for p in TABLE if module is not None and p.path in module.SIGNATURES]


def params_of(fn) -> str:
    """A function's parameters as compared at install: names, ``*``/``**`` by kind, and defaults
    that are plain literals (annotations ignored: their spelling changes between Pythons)."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        text = prefix + p.name
        if p.default is not p.empty:
            d = p.default
            text += "=" + (repr(d) if d is None or isinstance(d, (bool, int, float, str)) else "...")
        out.append(text)
    return ", ".join(out)


def _resolve(path: str):
    """The object at ``path``: "module", "module:name" or "module:Class.attr"."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for name in attr.split(".") if attr else ():
        obj = getattr(obj, name)
    return obj


_MISSING = object()


def _upstream(owner, name):
    """What a lookup of ``owner.name`` finds (the function dpq replaces and calls through)."""
    raw = inspect.getattr_static(owner, name, _MISSING)
    if raw is _MISSING:
        return _MISSING
    return getattr(raw, "__func__", raw)


def check(version: str | None = None) -> list[str]:
    """Every mismatch between the table and the installed auto-round (empty: all checked)."""
    from auto_round.version import __version__

    version = version or __version__
    module = series_module(version)
    if module is None:
        return []  # compat refused this series when the package was imported
    problems = []
    for p in patches_for(version):
        try:
            owner = _resolve(p.owner)
        except (ImportError, AttributeError) as e:
            problems.append(refusals.symbol_missing(p.owner, str(e)))
            continue
        fn = _upstream(owner, p.name)
        if fn is _MISSING:
            problems.append(refusals.symbol_missing(p.symbol))
            continue
        fn = inspect.unwrap(fn)
        if not getattr(fn, "__module__", "").startswith("auto_round"):
            continue  # someone else's patch, put before dpq's: theirs answers for what it calls
        found, expected = params_of(fn), module.SIGNATURES[p.path]
        if found != expected:
            problems.append(refusals.symbol_differs(p.symbol, found, expected))
    for path, expected in module.LOOP_REPRODUCED.items():
        digest = _source_digest(path)
        if digest != expected:
            symbol = path.rpartition(":")[2]
            problems.append(refusals.symbol_missing(symbol) if digest is None
                            else refusals.source_differs(symbol, digest, expected))
    for path in module.CALLED:
        try:
            _resolve(path)
        except (ImportError, AttributeError):
            problems.append(refusals.symbol_missing(path.rpartition(":")[2]))
    return problems


def _refuse(problems: list[str]) -> PatchMismatch:
    from auto_round.version import __version__

    return PatchMismatch(refusals.patch_mismatch(__version__, sorted(m.RELEASE for m in SERIES.values()), problems))


@dataclass
class Frame:
    """One install (one ``enable()``, or a seams-only install): its run (a :class:`dpq.autoround.run.Run`:
    settings, records and the replacements' scratch)."""

    run: object


_stack: list[Frame] = []  # installed frames, innermost last
_last: Frame | None = None  # the innermost frame of the last run, kept after the outermost uninstall
_saved: dict[tuple[object, str], object] = {}  # owner.__dict__ entries the outermost install replaced
_replaced: dict[tuple[object, str], object] = {}  # the functions those lookups found (ours call through them)
_ours: dict[tuple[object, str], object] = {}  # the replacement installed per (owner, name)
_chained: set[tuple[object, str]] = set()  # ours, left under someone else's later patch: they call us


def install(run) -> Frame:
    """Push ``run`` (a :class:`dpq.autoround.run.Run`); the outermost install checks and patches
    every symbol of the installed series."""
    global _last
    if not _stack:
        _patch()
    f = Frame(run)
    _stack.append(f)
    _last = f
    return f


def uninstall() -> Frame | None:
    """Pop the innermost frame; the outermost one's removal unpatches. A no-op when nothing is installed."""
    global _last
    if not _stack:
        return None
    f = _stack.pop()
    _last = _stack[-1] if _stack else f
    if not _stack:
        _unpatch()
    return f


def uninstall_enabled():
    """Pop frames through the innermost run that is not seams-only (``disable()``: a seams-only install
    above it ends with it). Returns that run (None, nothing popped, when there is none) and whether it
    was the outermost such run."""
    run = enabled_run()
    if run is None:
        return None, False
    while uninstall().run is not run:
        pass
    return run, enabled_run() is None


def installed() -> bool:
    return bool(_stack)


def enabled_run():
    """The innermost installed run that is not seams-only, or None: what the tuner's replacements are
    handed, and whether an ``enable()`` is in effect."""
    for f in reversed(_stack):
        if not f.run.seams_only:
            return f.run
    return None


def _top_run():
    """The top frame's run, or None: what the seams are handed."""
    return _stack[-1].run if _stack else None


def reported(*, seams: bool = False):
    """The run whose records are read after the fact (the run summary, ``auto``'s report, the phase
    records, the CLI's report): the innermost enabled run, else the last one that ended, or None
    (that was a seams-only install, or nothing ran). ``seams``: the seams' view instead, the top frame's
    run, seams-only included, else the last run's."""
    if seams:
        now = _top_run()
        return now if now is not None else (_last.run if _last is not None else None)
    run = enabled_run()
    if run is not None:
        return run
    return _last.run if _last is not None and not _last.run.seams_only else None


_HANDS = MappingProxyType({"tuner": enabled_run, "top": _top_run})


def _handed(fn, hands: str):
    """What is installed for ``fn``: ``fn`` called with its run first (Note [each replacement is handed
    its run])."""
    run_of = _HANDS[hands]

    @functools.wraps(fn)
    def replacement(*args, **kwargs):
        return fn(run_of(), *args, **kwargs)

    return replacement


def ours(owner, name: str):
    """dpq's function behind what is installed as ``owner.name`` (None: not dpq's)."""
    fn = _ours.get((owner, name))
    return getattr(fn, "__wrapped__", None)


def original(owner, name: str):
    """The function dpq's replacement of ``owner.name`` stands in for (to call through); before
    any install, what ``owner.name`` finds now."""
    fn = _replaced.get((owner, name), _MISSING)
    return _upstream(owner, name) if fn is _MISSING else fn


def _patch() -> None:
    problems = check()
    if problems:
        raise _refuse(problems)
    entries = [(p, _resolve(p.owner), _resolve(p.replacement)) for p in patches_for()]
    for p, owner, fn in entries:
        key = (owner, p.name)
        if key in _chained:
            if _upstream(owner, p.name) is not _replaced[key]:
                continue  # ours is still called through the patch that was put over it
            _chained.discard(key)  # that patch was taken off again: patch afresh
        _saved[key] = owner.__dict__.get(p.name, _MISSING)
        _replaced[key] = _upstream(owner, p.name)
        _ours[key] = installed_fn = _handed(fn, p.hands)
        setattr(owner, p.name, installed_fn)


def _unpatch() -> None:
    """Put back what _patch replaced, unless someone patched over ours since: their patch stays."""
    for key, fn in list(_ours.items()):
        owner, name = key
        now = owner.__dict__.get(name, _MISSING)
        if key in _chained and now is not fn:
            continue
        _chained.discard(key)
        if now is not fn:
            _chained.add(key)
            from auto_round.logger import logger

            logger.warning(f"dpq: {owner.__name__}.{name} was patched again after dpq.enable(); leaving that "
                           "patch in place (dpq's, under it, now passes calls through)")
            continue
        saved = _saved.pop(key, _MISSING)
        del _ours[key]
        del _replaced[key]
        if saved is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)


def chained(owner, name: str) -> bool:
    """Whether dpq's replacement of ``owner.name`` was left under someone else's later patch."""
    return (owner, name) in _chained
