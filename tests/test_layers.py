"""The package's imports only go down: every module imports only modules on lower floors of a declared order (so no
circle is possible), at module level (no import inside a function, except of a heavy optional dependency, with its
reason on the line), the README's Python examples name only what exists, and every public name and method says
what it takes, gives and raises (Google-style Args / Returns / Raises)."""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from pyllama_pp import layers

PKG = Path(__file__).resolve().parents[1] / "pyllama_pp"
README = PKG.parent / "README.md"

# The floors, lowest first (pyllama_pp.layers.FLOORS: one list, printed into docs/DEVELOPING.md)
FLOORS = [list(mods) for mods, _ in layers.FLOORS]
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
    assert not missing, f"modules without a floor in pyllama_pp/layers.py FLOORS: {missing}"
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


def test_developing_md_lists_the_floors():
    """docs/DEVELOPING.md's layer table is what `python -m pyllama_pp.layers` prints (regenerate it with that)."""
    text = (PKG.parent / "docs" / "DEVELOPING.md").read_text()
    section = text.split(layers.BEGIN, 1)[1].split(layers.END, 1)[0].strip()
    assert section == layers.markdown(), "docs/DEVELOPING.md's layers section is stale: paste `python -m pyllama_pp.layers`"


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


# -- the public API teaches: Google-style sections on every public name and method ------------------------------------
SECTION = re.compile(r"^(\s*)(Args|Attributes|Returns|Raises):\s*$")


def sections(doc: str) -> dict[str, list[str]]:
    """A docstring's Google-style sections: header -> the entry names of its first level ("a, b: ..." gives a, b)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    out, i = {}, 0
    while i < len(lines):
        m = SECTION.match(lines[i])
        i += 1
        if not m:
            continue
        indent, entries, level, head = len(m.group(1)), [], None, None
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            line = lines[i]
            i += 1
            if not line.strip():
                continue
            depth = len(line) - len(line.lstrip())
            level = depth if level is None else level
            if depth == level:
                head = ""   # an entry starts; its names run up to the first colon (they may wrap)
            if head is not None:
                head += " " + line.strip()
                if ":" in head:
                    entries += [n.strip().lstrip("*") for n in head.split(":", 1)[0].split(",")]
                    head = None
        out[m.group(2)] = entries
    return out


def own_nodes(func) -> list:
    """The AST nodes of a function's own body (nested functions, classes and lambdas left out)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    top = tree.body[0]
    out, todo = [], list(ast.iter_child_nodes(top))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def raised_names(nodes) -> tuple[bool, set[str]]:
    """Whether the nodes raise at all, and the exception classes they raise by name (`raise ConfigError(...)`)."""
    raises = [n for n in nodes if isinstance(n, ast.Raise)]
    names = set()
    for r in raises:
        exc = r.exc.func if isinstance(r.exc, ast.Call) else r.exc
        if isinstance(exc, ast.Name) and exc.id.endswith(("Error", "Exception", "Interrupt")):
            names.add(exc.id)
    return bool(raises), names


def returns_value(func) -> bool:
    """Whether a function gives a value: a return annotation other than None, or a `return <value>` in its body."""
    ann = inspect.signature(func).return_annotation
    if ann is not inspect.Signature.empty and ann not in (None, "None"):
        return True
    return any(isinstance(n, ast.Return) and n.value is not None and
               not (isinstance(n.value, ast.Constant) and n.value.value is None) for n in own_nodes(func))


def params(func, skip_first: bool = False) -> list[str]:
    names = list(inspect.signature(func).parameters)
    return names[1:] if skip_first else names


def doc_problems(what: str, doc: str, args: list[str] = (), arg_headers=("Args",), needs_returns=False,
                 raising=()) -> list[str]:
    """What a public name's docstring lacks: a summary; an Args (or a class's Attributes) section that names every
    parameter; Returns when it gives a value; Raises, naming each class raised by name, when its code raises."""
    if not (doc or "").strip():
        return [f"{what} has no docstring"]
    sec, bad = sections(doc), []
    if args:
        got = next((sec[h] for h in arg_headers if h in sec), None)
        if got is None:
            bad.append(f"{what} takes {', '.join(args)} and has no {' / '.join(h + ':' for h in arg_headers)} section")
        else:
            missing = [a for a in args if a not in got]
            if missing:
                bad.append(f"{what}'s {'/'.join(arg_headers)} section does not name {', '.join(missing)}")
    if needs_returns and "Returns" not in sec:
        bad.append(f"{what} returns a value and has no Returns: section")
    for nodes in raising:
        raises, names = raised_names(nodes)
        if raises and "Raises" not in sec:
            bad.append(f"{what} raises and has no Raises: section")
        missing = sorted(names - set(sec.get("Raises", [])))
        if "Raises" in sec and missing:
            bad.append(f"{what}'s Raises: section does not name {', '.join(missing)}")
    return bad


def public_methods(cls) -> dict:
    """The public methods and properties a class of the package defines (or inherits from another of its classes)."""
    out = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next(c for c in cls.__mro__ if name in c.__dict__)
        attr = owner.__dict__[name]
        if owner.__module__.startswith("pyllama_pp") and (
                isinstance(attr, (property, classmethod, staticmethod)) or inspect.isfunction(attr)):
            out[name] = attr
    return out


def name_problems(name: str, obj) -> list[str]:
    what = f"pyllama_pp.{name}"
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return doc_problems(what, obj.__doc__)   # (an exception takes its message, as every exception does)
    if inspect.isclass(obj):
        # (a dataclass's generated __init__ has no source file: its checks are in __post_init__)
        inits = [f for f in (obj.__dict__.get("__init__"), obj.__dict__.get("__post_init__"))
                 if inspect.isfunction(f) and not f.__code__.co_filename.startswith("<")]
        return doc_problems(what, obj.__doc__, args=params(obj), arg_headers=("Args", "Attributes"),
                            raising=[own_nodes(f) for f in inits])
    return doc_problems(what, obj.__doc__, params(obj), needs_returns=returns_value(obj),
                        raising=[own_nodes(obj)])


def method_problems(cls_name: str, name: str, attr) -> list[str]:
    what = f"pyllama_pp.{cls_name}.{name}"
    if isinstance(attr, property):   # (Google style: a property reads as an attribute, so no Returns section)
        return doc_problems(what, attr.__doc__, raising=[own_nodes(attr.fget)])
    func = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
    return doc_problems(what, func.__doc__, params(func, skip_first=not isinstance(attr, staticmethod)),
                        needs_returns=returns_value(func), raising=[own_nodes(func)])


PUBLIC = sorted(__import__("pyllama_pp").__all__)
PUBLIC_CLASSES = [n for n in PUBLIC if inspect.isclass(getattr(__import__("pyllama_pp"), n))]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_teach(name):
    """Every public function and class says what it takes, gives and raises: a docstring; for callables with
    parameters an Args section (a class: Args or Attributes) naming each; Returns when the annotation or a
    `return <value>` says it gives one; Raises when its body (a class: its __init__ / __post_init__) raises, naming
    each exception class raised by name."""
    obj = getattr(importlib.import_module("pyllama_pp"), name)
    if not callable(obj):
        return
    bad = name_problems(name, obj)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("cls_name", PUBLIC_CLASSES)
def test_public_methods_teach(cls_name):
    """The same for every public method and property of a public class (a property: a docstring, and Raises when
    it raises)."""
    cls = getattr(importlib.import_module("pyllama_pp"), cls_name)
    bad = [p for name, attr in public_methods(cls).items() for p in method_problems(cls_name, name, attr)]
    assert not bad, "\n".join(bad)


def test_the_doc_check_can_fail():
    """The checks above find a missing section, an unnamed parameter and an unnamed exception."""
    ConfigError = ValueError  # noqa: N806 (a name for the raise below: the check reads names)

    def f(a, b=1) -> int:
        """Sum.

        Args:
            a: a number.
        Raises:
            ValueError: never.
        """
        if a is None:
            raise ConfigError("no a")
        return a + b

    bad = doc_problems("f", f.__doc__, params(f), needs_returns=returns_value(f), raising=[own_nodes(f)])
    assert any("does not name b" in p for p in bad)
    assert any("no Returns" in p for p in bad)
    assert any("does not name ConfigError" in p for p in bad)
    assert doc_problems("g", "") == ["g has no docstring"]
