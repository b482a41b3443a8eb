"""Refusal texts live in one place (dpq/refusals.py), and each names the problem and the fix."""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Sequence
from pathlib import Path

import pytest

from dpq import refusals

DPQ = Path(__file__).resolve().parent.parent / "dpq"
HOME = DPQ / "refusals.py"
HOMES = {HOME}
COLLECTORS = {"reasons", "problems", "notes"}  # the lists refusal texts are gathered in
MIN_PROSE = 12  # literal characters in a string that make it a sentence rather than a label or a separator

# Modules of work in progress elsewhere that still build texts inline (each must still do so:
# the entry goes once its texts moved to dpq/refusals.py).
PENDING: dict[str, str] = {}

_SAMPLES = {str: "x", int: 2, float: 1.5, bool: True, object: "x", Sequence[str]: ["a", "b"], Sequence[int]: [1, 2]}


def _texts() -> dict[str, str]:
    """Every text of ``refusals.__all__``, functions called with sample values of their annotated types."""
    out = {}
    for name in refusals.__all__:
        if name == "LINES" or name in refusals.LINES:
            continue  # parts of another text, checked through it
        value = getattr(refusals, name)
        if isinstance(value, str):
            out[name] = value
            continue
        hints = typing.get_type_hints(value)
        kwargs = {}
        for p in inspect.signature(value).parameters.values():
            if p.default is not p.empty:
                continue
            assert hints.get(p.name) in _SAMPLES, f"refusals.{name}({p.name}): annotate it with one of {_SAMPLES}"
            kwargs[p.name] = _SAMPLES[hints[p.name]]
        out[name] = value(**kwargs)
    return out


def test_every_text_names_the_problem_and_a_fix():
    texts = _texts()
    assert len(texts) >= 60 and texts["HPU_MULTI_LANE"] and texts["lane_failed"]
    assert "Fix: " in refusals.patch_mismatch("0.18.0", ["0.16.1"], [refusals.symbol_missing("A.b")])
    for name, text in texts.items():
        assert isinstance(text, str), name
        problem, sep, fix = text.partition("Fix: ")
        assert sep, f"refusals.{name} names no fix: {text!r}"
        assert problem.strip() and len(fix.strip()) >= 10, f"refusals.{name}: {text!r}"
    assert refusals.bad_count(batch_size=0, accumulate=1).startswith("batch_size and gradient_accumulate_steps")


def _prose(node: ast.AST) -> int:
    """Literal characters of the longest sentence-like string (three words or more: an identifier
    or a separator is not one) among the string constants and f-strings anywhere under ``node``."""
    n = 0
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            text = sub.value
        elif isinstance(sub, ast.JoinedStr):
            text = "".join(v.value for v in sub.values if isinstance(v, ast.Constant))
        else:
            continue
        if text.strip().count(" ") >= 2:
            n = max(n, len(text.strip()))
    return n


def _collector(node: ast.AST) -> str | None:
    target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else node
    return target.id if isinstance(target, ast.Name) and target.id in COLLECTORS else None


def inline_texts(source: str, path: str = "<source>") -> list[str]:
    """Where ``source`` builds a refusal text itself: a sentence appended/added to a reasons,
    problems or notes list (directly or as an argument of a call inside it), or any string that
    names a fix (``Fix:``)."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "append", "extend", "insert") and _collector(node):
            if any(_prose(a) >= MIN_PROSE for a in node.args):
                found.append(f"{where}: {_collector(node)}.{node.func.attr}(<text>)")
        elif isinstance(node, ast.AugAssign) and _collector(node.target) and _prose(node.value) >= MIN_PROSE:
            found.append(f"{where}: {_collector(node.target)} += <text>")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "Fix:" in node.value:
            found.append(f"{where}: a 'Fix:' text")
    return found


def test_the_static_check_can_fail():
    assert inline_texts('reasons.append("the block is on the moon; Fix: land it")')
    assert inline_texts('problems.append(f"world {w} is too large for this machine")')
    assert inline_texts('reasons += [f"lane {k} is slower than a snail here"]')
    assert inline_texts('reasons.append(home_alone("the parent has no weights at all"))')
    assert inline_texts('raise ValueError(f"bad {x}. Fix: another")')
    assert not inline_texts('reasons.append(refusals.too_few_samples(n, s))')
    assert not inline_texts('reasons.append(refusals.rtn_override(name, "_quantize_layer_via_rtn"))')
    assert not inline_texts('reasons.extend(plan.reasons); notes.append(f"auto: {why}; {where}")')


def test_no_module_outside_refusals_builds_a_refusal_text_inline():
    """(dpqlab, scaffolding for tests and benchmarks that no run of dpq imports, words its own
    errors to the developer running them.)"""
    found, pending = [], {}
    for path in sorted(DPQ.rglob("*.py")):
        if path in HOMES or "testing" in path.relative_to(DPQ).parts:
            continue
        rel = str(path.relative_to(DPQ.parent))
        hits = inline_texts(path.read_text(), rel)
        if rel in PENDING:
            pending[rel] = hits
        else:
            found += hits
    assert not found, "refusal texts built outside dpq/refusals.py:\n" + "\n".join(found)
    still = {rel for rel in PENDING if (DPQ.parent / rel).exists()}
    assert all(pending.get(rel) for rel in still), f"no inline texts left: drop from PENDING {still - set(pending)}"


@pytest.mark.parametrize("module", ["dpq.comm.communicators", "dpq.planning.plan"])
def test_the_hpu_text_is_one_text(module):
    src = (DPQ / f"{module.removeprefix('dpq.').replace('.', '/')}.py").read_text()
    assert "Gaudi" not in src  # the sentence itself lives in dpq/refusals.py only
