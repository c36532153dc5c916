"""The package's imports only go down: every module imports only modules on lower floors of a declared order (so no
circle is possible), at module level (no import inside a function, except of a heavy optional dependency, with its
reason on the line), and the README's Python examples name only what exists."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pyllama_pp"
README = PKG.parent / "README.md"

# The floors, lowest first: a module may import modules of lower floors only.
FLOORS = [
    ["_version", "errors", "_cdef"],
    ["binding"],
    ["_pin", "devices", "params", "counters", "stats", "synth"],
    ["model_file", "plan", "jobs", "row"],
    ["session"],
    ["worker.client"],
    ["worker"],
    ["worker.handlers.base"],
    ["worker.handlers.info", "worker.handlers.schedule", "worker.handlers.logits", "worker.handlers.measure",
     "worker.handlers.workload", "worker.handlers.fit", "worker.handlers.soak"],
    ["worker.handlers"],
    ["worker.loop"],
    ["worker.__main__"],
    ["fit", "soak", "check"],
    ["config"],
    ["rows"],
    ["runner"],
    ["report"],
    ["cli"],
    [""],   # the package's __init__: the public facade, on top
]
FLOOR = {m: i for i, names in enumerate(FLOORS) for m in names}
# heavy dependencies a function may import where only it needs them (each such line says why in a comment)
LAZY_OK = {"pandas", "matplotlib", "matplotlib.pyplot"}


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).with_suffix("")
        if rel.parts[0] == "native":   # (build-time scripts, not installed)
            continue
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    """The package modules an `from ... import ...` names (relative or absolute)."""
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        target = ".".join([p for p in base if p] + ([node.module] if node.module else []))
    elif node.module and node.module.split(".")[0] == "pyllama_pp":
        target = node.module[len("pyllama_pp"):].lstrip(".")
    else:
        return []
    known = modules()
    names = [f"{target}.{a.name}".lstrip(".") for a in node.names]
    found = [n for n in names if n in known]   # `from . import runner` names a module
    return found or [target]


def imports(mod: str, path: Path):
    """(target module, line, inside a function) for each package import of `mod`; and every function-level import."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    lines = path.read_text().splitlines()
    pkg, lazy = [], []
    func_ranges = [(n.lineno, n.end_lineno) for n in ast.walk(tree)
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        inside = any(a < node.lineno <= b for a, b in func_ranges)
        if isinstance(node, ast.ImportFrom):
            targets = resolve(mod, is_pkg, node)
            ext = [] if targets or node.level else [node.module or ""]
        else:
            targets = [a.name[len("pyllama_pp"):].lstrip(".") for a in node.names if a.name.split(".")[0] == "pyllama_pp"]
            ext = [a.name for a in node.names if a.name.split(".")[0] != "pyllama_pp"]
        for t in targets:
            pkg.append((t, node.lineno, inside))
        if inside:
            lazy.append((node.lineno, ext, targets, lines[node.lineno - 1]))
    return pkg, lazy


def test_every_module_has_a_floor():
    missing = sorted(set(modules()) - set(FLOOR))
    assert not missing, f"modules without a floor in tests/test_layers.py FLOORS: {missing}"
    gone = sorted(m for m in FLOOR if m and m not in modules())
    assert not gone, f"FLOORS names modules that do not exist: {gone}"


def test_imports_only_go_down():
    up = []
    for mod, path in modules().items():
        for target, line, _ in imports(mod, path)[0]:
            if target == "":
                up.append(f"{path.name}:{line} imports the package itself")
            elif target not in FLOOR:
                up.append(f"{mod}:{line} imports {target}, which has no floor")
            elif FLOOR[target] >= FLOOR[mod]:
                up.append(f"{mod} (floor {FLOOR[mod]}):{line} imports {target} (floor {FLOOR[target]})")
    assert not up, "imports that do not go down:\n" + "\n".join(up)


def test_no_function_level_imports():
    bad = []
    for mod, path in modules().items():
        for line, ext, targets, text in imports(mod, path)[1]:
            if targets or not set(ext) <= LAZY_OK or "#" not in text:
                bad.append(f"{mod}:{line}: {text.strip()}")
    assert not bad, "imports inside functions (only heavy optional ones, with a reason):\n" + "\n".join(bad)


def test_no_circle():
    graph = {m: {t for t, _, _ in imports(m, p)[0] if t in FLOOR} for m, p in modules().items()}
    seen, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in seen:
            return
        stack.append(m)
        for t in graph.get(m, ()):
            visit(t)
        stack.pop()
        seen.add(m)

    for m in graph:
        visit(m)
    assert len(seen) == len(graph)


def test_the_check_sees_an_upward_import(tmp_path):
    """The checks above can fail: an import of a higher floor, inside a function, is found by both."""
    src = "def f():\n    from .runner import ab\n    return ab\n"
    path = tmp_path / "params.py"
    path.write_text(src)
    pkg, lazy = imports("params", path)
    assert pkg == [("runner", 2, True)] and FLOOR["runner"] > FLOOR["params"]
    assert lazy and lazy[0][2] == ["runner"]


def readme_python() -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S))


def test_readme_names_only_what_exists():
    """Every `pp.NAME` and `from pyllama_pp[.mod] import NAME` in the README's Python blocks exists."""
    code = readme_python()
    assert code, "the README has no Python example"
    pp = importlib.import_module("pyllama_pp")
    missing = [n for n in re.findall(r"\bpp\.(\w+)", code) if not hasattr(pp, n)]
    for mod, names in re.findall(r"from (pyllama_pp(?:\.\w+)*) import ([\w, ]+)", code):
        m = importlib.import_module(mod)
        missing += [f"{mod}.{n.strip()}" for n in names.split(",") if not hasattr(m, n.strip())]
    assert not missing, f"the README names what the package does not have: {missing}"


@pytest.mark.parametrize("name", sorted(__import__("pyllama_pp").__all__))
def test_public_names_teach(name):
    """Every public function and class says what it takes and gives: a docstring, and for callables with
    arguments, an Args (or a class's fields) section."""
    pp = importlib.import_module("pyllama_pp")
    obj = getattr(pp, name)
    if not callable(obj):
        return
    doc = obj.__doc__ or ""
    assert doc.strip(), f"pyllama_pp.{name} has no docstring"
