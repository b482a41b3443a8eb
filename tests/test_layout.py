"""The package's shape: the runtime imports no auto-round, no import cycle among dpq's modules
(function-level imports included), fault injection only in the scaffolding, no ``import *``, no
re-exports."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

DPQ = Path(__file__).resolve().parent.parent / "dpq"
DPQLAB = DPQ.parent / "dpqlab"


def _module_name(path: Path) -> str:
    parts = path.relative_to(DPQ.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_modules() -> list[str]:
    """Everything in dpq/ but the adapter (dpq/autoround/) and the demo (dpq/demo/)."""
    return sorted(_module_name(p) for p in DPQ.rglob("*.py")
                  if not {"autoround", "demo"} & set(p.relative_to(DPQ).parts))


def test_runtime_imports_no_auto_round():
    """Each runtime module imports in a fresh interpreter where auto_round cannot be imported,
    and none of them pulls it in."""
    modules = _runtime_modules()
    assert "dpq.session" in modules and "dpq.tune_loop" in modules
    code = f"""
import importlib, sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "auto_round" or name.startswith("auto_round."):
            raise ImportError(f"blocked: {{name}}")
        return None

sys.meta_path.insert(0, Blocker())
for name in {modules!r}:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m == "auto_round" or m.startswith("auto_round."))
assert not leaked, leaked
print("ok", len({modules!r}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=DPQ.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The dpq modules ``path`` imports anywhere: at module level and inside functions and classes
    (an import deferred into a function body is a cycle all the same, only hidden until called)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in out if m in known and m != name}


def test_no_import_cycle_among_dpq_modules():
    """dpq's and dpqlab's modules; function-level imports included (:func:`_imports`)."""
    paths = {_module_name(p): p for root in (DPQ, DPQLAB) for p in root.rglob("*.py")}
    known = set(paths)
    graph = {name: _imports(path, name, known) for name, path in paths.items()}
    # a package's __init__ importing its own submodules is not a cycle back into them
    for name in graph:
        graph[name] = {m for m in graph[name] if not (paths[name].name == "__init__.py"
                                                      and m.startswith(name + "."))}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def lab_imports(path: Path, name: str) -> list[str]:
    """The dpqlab modules ``path`` imports anywhere (function-level imports included)."""
    lab = {_module_name(p) for p in DPQLAB.rglob("*.py")}
    return sorted(m for m in _imports(path, name, lab) if m == "dpqlab" or m.startswith("dpqlab."))


def test_dpq_never_imports_the_lab():
    """dpqlab/ (the tools: timeline model, stream checker, fakes, faults, GPU check) is not in the wheel:
    no module of dpq/ imports it, the runtime, the adapter and the demo alike."""
    users = [f"{p.relative_to(DPQ.parent)}: {m}" for p in sorted(DPQ.rglob("*.py"))
             for m in lab_imports(p, _module_name(p))]
    assert (DPQLAB / "simulated_link.py").is_file() and not users, users


def test_an_import_of_the_lab_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\ndef f():\n    from dpqlab.timeline import record\n"
                       "from dpqlab import faults\n")
    assert lab_imports(planted, "dpq.planted") == ["dpqlab", "dpqlab.faults", "dpqlab.timeline",
                                                  "dpqlab.timeline.record"]


# what only fault injection (dpqlab/faults.py) has any reason to name
FAULT_WORDS = ("DPQ_TEST_FAULT", "inject_fault", "fault_point", "lane_fault", "dpq.faults")


def test_fault_injection_is_only_scaffolding():
    """No module of the runtime or the adapter injects faults, reads the fault switch or names
    either: tests make lanes fail from outside (dpqlab.faults replaces what a run looks up)."""
    assert (DPQLAB / "faults.py").is_file()
    found = [f"{p.relative_to(DPQ.parent)}: {word}" for p in sorted(DPQ.rglob("*.py"))
             for word in FAULT_WORDS if word in p.read_text()]
    assert not found, found


def _reexports(tree: ast.Module) -> list[str]:
    """Names in a module's ``__all__`` that it imports rather than defines."""
    defined, exported = set(), []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    defined.add(target.id)
                    if target.id == "__all__":
                        exported = [e.value for e in node.value.elts]
    return [name for name in exported if name not in defined]


def test_modules_export_only_what_they_define():
    """No module re-exports another's names (a glue between the halves of a split file); a
    package's ``__init__`` is its public API and gathers names from its modules."""
    found = [f"{p.relative_to(DPQ.parent)}: {name}" for p in sorted(DPQ.rglob("*.py")) if p.name != "__init__.py"
             for name in _reexports(ast.parse(p.read_text()))]
    assert not found, found
    # the check sees what it is for: an imported name in __all__
    assert _reexports(ast.parse("from x import a\ndef b(): pass\n__all__ = ['a', 'b']")) == ["a"]


def _private_imports(tree: ast.Module) -> list[str]:
    """``from <dpq module> import _name``: a module reaching into another's private names."""
    return [f"{node.lineno} {a.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.level or (node.module or "").startswith("dpq")) for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")]


def test_no_module_imports_another_ones_private_names():
    found = [f"{p.relative_to(DPQ.parent)}:{hit}" for p in sorted(DPQ.rglob("*.py"))
             for hit in _private_imports(ast.parse(p.read_text()))]
    assert not found, found
    assert _private_imports(ast.parse("from dpq.mirror import _move, ok\nfrom . import _x")) == ["1 _move", "2 _x"]


def test_no_star_import():
    found = [f"{p.relative_to(DPQ.parent)}:{node.lineno}" for p in DPQ.rglob("*.py")
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ImportFrom)
             and any(a.name == "*" for a in node.names)]
    assert not found, found


# The patch table's own state: what the installs replaced and the stack of frames the runs live in.
PATCH_TABLE_STATE = {"_stack", "_last", "_saved", "_replaced", "_ours", "_chained"}
_MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque"}


def _module_state(tree: ast.Module, classes: set[str]) -> list[tuple[int, str]]:
    """Module-level names bound to a mutable value (a list/dict/set display or comprehension, a call
    of a mutable builtin or of a class defined in the package), and names a function rebinds with ``global``."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            v = node.value
            call = ast.unparse(v.func).rsplit(".", 1)[-1] if isinstance(v, ast.Call) else None
            if isinstance(v, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) \
                    or call in _MUTABLE_CALLS or call in classes:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [(node.lineno, ast.unparse(t)) for t in targets if ast.unparse(t) != "__all__"]
    found += [(n.lineno, name) for n in ast.walk(tree) if isinstance(n, ast.Global) for name in n.names]
    return found


def test_the_adapter_keeps_no_module_state_but_the_patch_table():
    """A run's state lives in its frame of the patch table (dpq.autoround.run.Run), passed down from
    there; module-level values in dpq/autoround/ are constants (tuples, frozensets, read-only mappings)."""
    paths = sorted((DPQ / "autoround").glob("*.py"))
    trees = {p: ast.parse(p.read_text()) for p in paths}
    classes = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    found = [f"{p.name}:{line} {name}" for p, t in trees.items() for line, name in _module_state(t, classes)
             if not (p.name == "patches.py" and name in PATCH_TABLE_STATE)]
    assert not found, found
    # the check sees what it is for: a list, a dict display, a package class instance, a global rebinding
    probe = ast.parse("a = []\nb: dict = {}\nc = Run()\nd = ()\ndef f():\n    global d\n")
    assert [name for _, name in _module_state(probe, {"Run"})] == ["a", "b", "c", "d"]


@pytest.mark.parametrize("spec", ["cuda:256", "256", "cuda:128,cuda:0", [300]])
def test_device_index_above_127_is_refused(spec):
    """torch keeps a device index in 8 bits: 'cuda:256' would silently be cuda:0."""
    from dpq.planning.lane_devices import parse_device_spec

    errors = [e.error for e in parse_device_spec(spec) if e.error]
    assert errors and "above 127" in errors[0], errors


def test_device_parsing_sits_below_the_plan():
    """The spec reads device lists and worlds from dpq.planning.lane_devices, which the plan imports too: neither
    of them imports the plan."""
    paths = {_module_name(p): p for p in DPQ.rglob("*.py")}
    known = set(paths)
    for name in ("dpq.planning.spec", "dpq.planning.lane_devices"):
        assert "dpq.planning.plan" not in _imports(paths[name], name, known), name
    assert "dpq.planning.lane_devices" in _imports(paths["dpq.planning.plan"], "dpq.planning.plan", known)


def test_phase_records_are_made_in_one_place():
    """Every seam's phase goes through ``seams_common.run_phase``: a ``PhaseRecord`` is constructed in
    one place only (``Run.record_phase``), and the seams are handed their run by the patch table
    (``or_idle`` where nothing is installed), not through accessors callable from anywhere."""
    calls = [f"{p.relative_to(DPQ.parent)}:{node.lineno}" for p in DPQ.rglob("*.py")
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Call)
             and getattr(node.func, "id", getattr(node.func, "attr", None)) == "PhaseRecord"]
    assert len(calls) == 1 and calls[0].startswith("dpq/autoround/run.py:"), calls
    common = ast.parse((DPQ / "autoround" / "seams_common.py").read_text())
    functions = {node.name for node in common.body if isinstance(node, ast.FunctionDef)}
    assert {"run_phase", "or_idle"} <= functions and not {"config", "world", "scratch"} & functions, functions


# -- each patched function is handed its run ---------------------------------------------------------

# what reads the patch table's stack of runs (dpq.autoround.patches), and the read-backs allowed outside it:
# after the fact, for records and reports (Note [each replacement is handed its run])
STACK_READS = frozenset({"enabled_run", "reported", "_top_run", "_stack", "_last", "_HANDS"})
READ_BACKS = frozenset({("integration.py", "run_summary", "reported"),
                        ("integration.py", "auto_world_report", "reported"),
                        ("seams_common.py", "reported", "reported"), ("cli.py", "_where", "reported")})


def stack_reads(tree: ast.AST) -> list[tuple[str, int, str]]:
    """(enclosing function, line, name) of every read of the run stack in a module: an attribute of
    ``patches`` in :data:`STACK_READS`, or such a name imported from it."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if (isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and child.value.id == "patches"
                    and child.attr in STACK_READS):
                found.append((where, child.lineno, child.attr))
            if isinstance(child, ast.ImportFrom) and (child.module or "").endswith("patches"):
                found.extend((where, child.lineno, a.name) for a in child.names if a.name in STACK_READS)
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_no_stack_lookup_of_the_run_outside_the_patch_table():
    """Note [each replacement is handed its run]: outside dpq/autoround/patches.py nothing reads the
    stack of runs but the read-backs of :data:`READ_BACKS`; every patched function gets its run as its
    first argument."""
    found = [f"{p.relative_to(DPQ.parent)}:{line} {fn} reads patches.{name}" for p in sorted(DPQ.rglob("*.py"))
             if p.name != "patches.py" for fn, line, name in stack_reads(ast.parse(p.read_text()))
             if (p.name, fn, name) not in READ_BACKS]
    assert not found, found
    from dpq.autoround import patches

    for p in patches.TABLE:  # every replacement takes the run first
        module, _, name = p.replacement.partition(":")
        fn = getattr(importlib.import_module(module), name)
        assert next(iter(inspect.signature(fn).parameters)) == "run", p.replacement


def test_a_stack_lookup_outside_the_patch_table_is_found():
    planted = ast.parse("from dpq.autoround.patches import enabled_run\n"
                        "def quantize_block(self, block):\n    run = patches.enabled_run()\n"
                        "def run_summary():\n    return patches.reported()\n")
    assert [(fn, name) for fn, _, name in stack_reads(planted)] == [
        ("<module>", "enabled_run"), ("quantize_block", "enabled_run"), ("run_summary", "reported")]
    assert ("integration.py", "quantize_block", "enabled_run") not in READ_BACKS


# -- the contracts the code cites are in the repository --------------------------------------------

DESIGN = DPQ.parent / "docs" / "DESIGN.md"
CITED = r"\b[Cc]ontracts? (\d+)(?: and (\d+))?"


def cited_contracts(text: str) -> set[int]:
    import re

    return {int(n) for m in re.finditer(CITED, text) for n in m.groups() if n}


def missing_contracts(sources: dict[str, str], design: str) -> list[str]:
    """Each (file, contract number) cited in ``sources`` that ``design`` has no "**N." heading for."""
    import re

    defined = {int(n) for n in re.findall(r"^\*\*(\d+)\. ", design, re.M)}
    return sorted(f"{name}: contract {n}" for name, text in sources.items() for n in cited_contracts(text)
                  if n not in defined)


def test_every_contract_the_code_cites_is_in_docs_design():
    sources = {str(p.relative_to(DPQ.parent)): p.read_text() for p in DPQ.rglob("*.py")}
    assert set().union(*(cited_contracts(t) for t in sources.values())) >= {1, 3, 4, 6, 7}
    assert missing_contracts(sources, DESIGN.read_text()) == []


def test_a_cited_contract_that_is_not_there_is_found():
    assert missing_contracts({"x.py": "as contract 9 says"}, DESIGN.read_text()) == ["x.py: contract 9"]
    assert missing_contracts({"x.py": "contracts 3 and 12"}, "**3. The exchange.**\n") == ["x.py: contract 12"]


# -- the tests' own modules stay theirs --------------------------------------------------------------


def imports_of_tests(source: str) -> list[str]:
    """The ``tests`` modules ``source`` imports (any level: module or function)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "tests" or a.name.startswith("tests.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "tests" or node.module.startswith("tests.")):
            found.append(node.module)
    return found


def test_nothing_outside_tests_imports_from_tests():
    """dpq/, benchmarks/ and scripts/ never import the test suite's modules: what they share with
    it is scaffolding in dpqlab/."""
    root = DPQ.parent
    found = [f"{p.relative_to(root)}: {m}" for folder in ("dpq", "dpqlab", "benchmarks", "scripts")
             for p in sorted((root / folder).rglob("*.py")) for m in imports_of_tests(p.read_text())]
    assert found == []


def test_an_import_from_tests_is_found():
    nested = "def f():\n    from tests import conftest\nimport tests.mutants\nimport testsuite\n"
    assert sorted(imports_of_tests(nested)) == ["tests", "tests.mutants"]
    assert imports_of_tests("from tests.conftest import x") == ["tests.conftest"]


# -- communicators are known by what they declare ----------------------------------------------------

# The registry (dpq/comm/communicators.py) and the modules that define the kinds name them; nothing else does.
COMMUNICATOR_HOMES = {"communicators.py", "comm_base.py", "nccl_comm.py", "fallback_p2p.py", "process_group.py",
                      "nccl_lifecycle.py"}


def communicator_names_compared(source: str, names: set[str]) -> list[int]:
    """The lines of ``source`` that compare something with a communicator kind's name (``==``, ``!=``,
    ``in`` a literal holding one, ``match`` on one)."""

    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(named(e) for e in node.elts)

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(named(n) for n in (node.left, *node.comparators)):
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and named(node.value):
            lines.append(node.lineno)
    return lines


def test_no_communicator_name_is_compared_outside_the_registry():
    """issue 30: the plan, the session and the engine ask a kind what it declares (``nccl``,
    ``sends_to_peers``, ``shares_handles``, ``setup_failure``, ``canonical_order``), never its name."""
    from dpq.comm.communicators import COMMUNICATORS

    names = set(COMMUNICATORS)
    found = [f"{p.relative_to(DPQ.parent)}:{line}" for p in sorted(DPQ.rglob("*.py"))
             if p.name not in COMMUNICATOR_HOMES and "testing" not in p.relative_to(DPQ).parts
             for line in communicator_names_compared(p.read_text(), names)]
    assert found == []


def test_a_compared_communicator_name_is_found():
    names = {"cupy-nccl", "torch-nccl", "local"}
    planted = ('if communicator == "cupy-nccl":\n    pass\nx = kind in ("torch-nccl", "p2p")\n'
               'y = "local" != name\nz = name == "cupy"\nmatch n:\n    case "local":\n        pass\n')
    assert communicator_names_compared(planted, names) == [1, 3, 4, 7]


# -- no probing of dpq's own objects -------------------------------------------------------------------

# getattr/hasattr with a name a dpq class defines, on an object that is not dpq's (why, each)
FOREIGN_PROBES = {
    ("dpq/engine/compiles.py", "name"): "dynamo's compile trigger, an enum of torch's",
    ("dpq/comm/process_group.py", "abort"): "torch's process-group backend (abort exists in some builds)",
    ("dpq/streams.py", "empty_cache"): "a torch device module (torch.cuda, torch.xpu, ...)",
    ("dpq/nccl_comm.py", "available"): "CuPy's nccl module (cupy.cuda.nccl.available: False where libnccl is missing)",
}


def own_attributes(sources) -> set[str]:
    """Every attribute name a class in ``sources`` defines: its body's functions, assignments and
    annotations, and what its methods assign to ``self``."""
    names: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            names |= {sub.attr for sub in ast.walk(node) if isinstance(sub, ast.Attribute)
                      and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name) and sub.value.id == "self"}
    return names


def probes_of(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each ``getattr``/``hasattr`` in ``source`` asking for one of ``names``."""
    return [(node.lineno, node.args[1].value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names]


def test_the_runtime_probes_none_of_its_own_objects():
    """issue 30: the runtime asks dpq's objects through their types (protocols, isinstance), never
    ``getattr``/``hasattr`` of an attribute a dpq class defines; the exceptions are torch's objects
    whose names happen to match (FOREIGN_PROBES, each with why)."""
    files = sorted(DPQ.rglob("*.py"))
    own = own_attributes(p.read_text() for p in files if "testing" not in p.relative_to(DPQ).parts)
    found = [(str(p.relative_to(DPQ.parent)), name) for p in files
             if not {"autoround", "demo", "testing"} & set(p.relative_to(DPQ).parts)
             for _, name in probes_of(p.read_text(), own)]
    assert sorted(set(found) - set(FOREIGN_PROBES)) == []
    assert set(FOREIGN_PROBES) <= set(found)  # each exception still needed


def test_a_probe_of_an_own_attribute_is_found():
    planted = ("class LanesHung(Exception):\n    def __init__(self):\n        self.stuck = True\n"
               "def f(err):\n    return getattr(err, 'stuck', False) or hasattr(err, 'peer') or getattr(err, 'x')\n")
    assert probes_of(planted, own_attributes([planted])) == [(5, "stuck")]
    assert "stuck" in own_attributes([planted]) and "x" not in own_attributes([planted])


ROOT = DPQ.parent
FUNCTION_LINES = 60  # a runtime function's code (its docstring aside) fits on one screen


def _code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of a function's body: from its first statement after the docstring to its end (the
    signature and the docstring not counted)."""
    body = fn.body
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
        body[0].value.value, str)
    if doc and len(body) == 1:
        return 0
    return fn.end_lineno - body[1 if doc else 0].lineno + 1


def _long_functions(tree: ast.Module) -> list[tuple[str, int]]:
    return [(n.name, _code_lines(n)) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(n) > FUNCTION_LINES]


def test_no_runtime_function_is_longer_than_a_screen():
    """Every function of the runtime has at most 60 lines of code (nanoGPT: the loop on one screen)."""
    found = [f"{name}.{fn} ({n} lines)" for name in _runtime_modules()
             for fn, n in _long_functions(ast.parse(_path_of(name).read_text()))]
    assert not found, found
    # the check sees what it is for: 61 lines of code, a long docstring not counted
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    assert [n for _, n in _long_functions(ast.parse(f"def f():\n{body}"))] == [61]
    assert _long_functions(ast.parse('def f():\n    """' + "\n" * 80 + '"""\n' + body[body.index("\n") + 1:])) == []


def _path_of(name: str) -> Path:
    path = ROOT.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _bound_to_dpq(tree: ast.Module) -> dict[str, str]:
    """Names an import binds (at any depth: function-level imports too) to a dpq module or a name in
    one: local name -> dotted target."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "dpq":
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] == "dpq":
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def _dotted(expr: ast.expr, bound: dict[str, str]) -> str | None:
    if isinstance(expr, ast.Name):
        return bound.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _dotted(expr.value, bound)
        return f"{base}.{expr.attr}" if base else None
    return None


def _runtime_owner(expr: ast.expr, bound: dict[str, str], runtime: set[str], known: set[str]) -> str | None:
    """``expr``'s dotted target when it is a runtime module or something in one (the longest known
    module prefix decides: dpq.autoround.tune is the adapter's, dpq.streams._BACKENDS the runtime's)."""
    target = _dotted(expr, bound)
    if target is None:
        return None
    parts = target.split(".")
    module = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known), None)
    return target if module in runtime else None


def _replaced_runtime_attributes(tree: ast.Module, runtime: set[str], known: set[str]) -> list[str]:
    """Where ``tree`` replaces an attribute of a runtime module or class: an assignment to one (or to
    an item of one: a module's registry dict), or ``setattr``/``delattr``/any ``*patch*`` call on one."""
    bound = _bound_to_dpq(tree)
    owner = lambda e: _runtime_owner(e, bound, runtime, known)  # noqa: E731
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            base = t.value if isinstance(t, (ast.Attribute, ast.Subscript)) else None
            hit = base is not None and owner(base)
            if hit:
                found.append(f"{node.lineno} {ast.unparse(t)}")
        if isinstance(node, ast.Call) and node.args:
            name = node.func.id if isinstance(node.func, ast.Name) else \
                node.func.attr if isinstance(node.func, ast.Attribute) else ""
            if (name in ("setattr", "delattr") or "patch" in name.lower()) and owner(node.args[0]):
                found.append(f"{node.lineno} {name}({ast.unparse(node.args[0])}, ...)")
    return found


def test_no_tool_replaces_a_runtime_attribute():
    """No code outside tests/ (the adapter, the scaffolding in dpqlab/, benchmarks, scripts) assigns to an
    attribute of a dpq runtime module or class: the runtime's private names are no API, and a tool that
    patched one stops seeing the run silently when it is renamed. Tools see a run through
    dpq.engine.phases' observers and the declared seams (Note [observers, not patches]); what only
    tests do (mutations that re-introduce a defect) lives in tests/."""
    paths = {_module_name(p): p for p in DPQ.rglob("*.py")}
    known, runtime = set(paths), set(_runtime_modules())
    files = [p for p in sorted(ROOT.glob("**/*.py"))
             if p.relative_to(ROOT).parts[0] in ("dpq", "dpqlab", "benchmarks", "scripts")]
    assert any(p.relative_to(ROOT).parts[0] == "dpqlab" for p in files)
    found = [f"{p.relative_to(ROOT)}:{hit}" for p in files
             for hit in _replaced_runtime_attributes(ast.parse(p.read_text()), runtime, known)]
    assert not found, found
    # the check sees what it is for: a planted patch of each kind, and what is not one
    planted = ast.parse(
        "import dpq.streams as s\nfrom dpq.tune_loop import TuneEngine\nfrom dpq import exchange\n"
        "s._BACKENDS['cpu'] = 1\nTuneEngine.step = f\nsetattr(exchange.GradBuckets, 'x', 1)\n"
        "self._patch(s, 'backend', g)\n"
        "import torch\ntorch.autograd.backward = f\nfrom dpq.autoround import tune\ntune.make = g\nengine.doing = 1\n")
    assert [h.split()[0] for h in _replaced_runtime_attributes(planted, runtime, known)] == ["4", "5", "6", "7"]


def test_every_marker_the_readme_command_leaves_out_runs_in_its_own_ci_stage():
    """pyproject's addopts deselects a few slow groups from the README's test command (``not <marker>``);
    each must have a ``.ci/run`` stage that selects it (``-m <marker>``), or those tests would never run."""
    import re
    import tomllib

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    left_out = re.findall(r"not (\w+)", options["addopts"])
    declared = {m.split(":")[0] for m in options["markers"]}
    ci = (ROOT / ".ci" / "run").read_text()
    assert {"compile_cli", "gpu_check_dry_run", "torchrun_cli"} <= set(left_out) <= declared
    missing = [m for m in left_out if not re.search(rf"pytest -m {m}\b", ci)]
    assert not missing, f"deselected by addopts but no .ci/run stage selects them: {missing}"
