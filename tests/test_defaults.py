"""One table of defaults (pyllama_pp/defaults.py, as llama-bench's cmd_params_defaults): no literal default for one
of its knobs anywhere else in the package (signatures, dataclass fields, argparse options and their help, `x or N`,
`d.get("knob", N)`, {"knob": N}), the CLI's help shows the table's values, and the thread count is every core
this process may use."""
from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

from pyllama_pp import cli, defaults
from pyllama_pp.check import check_logits
from pyllama_pp.config import RunConfig, expand
from pyllama_pp.placement import fit_context
from pyllama_pp.jobs import LogitsJob, MeasureJob
from pyllama_pp.params import ContextParams, Placement

PKG = Path(__file__).resolve().parents[1] / "pyllama_pp"

# the knobs: the table's fields
KNOBS = {f.name for f in dataclasses.fields(defaults.Defaults)}
# the CLI's option names (argparse dests) of the table's knobs
CLI_NAMES = {"batch": "n_batch", "ubatch": "n_ubatch", "ctx": "n_ctx", "ngl": "n_gpu_layers", "tokens": "n_tokens",
             "threads": "n_threads", "paired": "rounds"}
# literal defaults that stay, by (module, function or class, name), and why
ALLOWED = {
    ("rows", "per_gpu", "reps"): "a divisor (values per rep), not a repetition count",
    ("rows", "rows_from_result", "depth"): "a worker result's depth (0: none), not a choice",
    ("worker.handlers.soak", "soak", "calls"): "a counter that starts at 0",
    ("soak", "SoakResult", "expert_cache"): "the EXPERT_CACHE a soak ran with (a result), not fit's choice",
    ("soak", "judge", "expert_cache"): "the EXPERT_CACHE a soak ran with (a result), not fit's choice",
    # TODO: rpc/server.py's signatures to read defaults.RPC_HOST, RPC_PORT and CONTEXT.variant, as the CLI does
    ("servers.serve", "serve", "variant"): "servers/serve.py's signatures",
    ("servers.serve", "spawn_server", "variant"): "servers/serve.py's signatures",
    ("servers.serve", "wait_listening", "timeout"): "servers/serve.py's signatures (a server's start, not a job)",
}


def _literal(node) -> bool:
    """A value written as a literal: a number or a non-empty string, its negative, or a list / tuple holding one."""
    if isinstance(node, ast.Constant):
        return not isinstance(node.value, bool) and node.value is not None and node.value != ""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _literal(node.operand)
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_literal(e) for e in node.elts)
    if isinstance(node, ast.Lambda):   # field(default_factory=lambda: [...])
        return _literal(node.body)
    return False





def _named(node) -> str:
    """The knob an expression reads: `n_ctx`, `ctx.n_ctx`, `kw.get("timeout")` ("" for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args \
            and isinstance(node.args[0], ast.Constant):
        return node.args[0].value
    return ""


def _dest(call: ast.Call) -> str:
    """An add_argument's dest: dest=, else its first long flag (else its first name), as argparse makes it."""
    for kw in call.keywords:
        if kw.arg == "dest" and isinstance(kw.value, ast.Constant):
            return kw.value.value
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    long = [f for f in flags if f.startswith("--")]
    return (long or flags or [""])[0].lstrip("-").replace("-", "_")


def _help_numbers(node) -> list[str]:
    """Hand-written numbers a help text gives as a default ("default: 512", "the main job: 2048")."""
    parts = [node] if isinstance(node, ast.Constant) else node.values if isinstance(node, ast.JoinedStr) else []
    if isinstance(node, ast.BinOp):   # "..." "..." split over lines with +
        parts = [node.left, node.right]
    found = []
    for p in parts:
        if isinstance(p, ast.Constant) and isinstance(p.value, str):
            found += re.findall(r"(?:default|main job)[^;)(]*?:\s*(-?\d[\d.]*)", p.value)
    return found


def _owner_map(tree) -> dict:
    """Each node -> the name of the innermost function or class around it."""
    owner = {}

    def walk(node, name):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else name
            owner[child] = inner
            walk(child, inner)
    walk(tree, "")
    return owner


def stray_defaults(mod: str, source: str) -> list[str]:
    """Literal defaults of the table's knobs in one module's source: "module:line owner.name = value" each."""
    tree = ast.parse(source)
    owner = _owner_map(tree)
    found = []

    def hit(node, name, value, where=None):
        where = where or owner.get(node, "")
        if name in KNOBS and _literal(value) and (mod, where, name) not in ALLOWED:
            found.append(f"{mod}:{node.lineno} {where}.{name} = {ast.unparse(value)}")

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            pos = a.posonlyargs + a.args
            pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + \
                [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, d in pairs:
                hit(node, arg.arg, d, getattr(node, "name", "<lambda>"))
        elif isinstance(node, ast.ClassDef):
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                    value = st.value
                    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
                        value = next((k.value for k in value.keywords if k.arg in ("default", "default_factory")),
                                     None)
                    if value is not None:
                        hit(st, st.target.id, value, node.name)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            name = CLI_NAMES.get(_dest(node), _dest(node))
            for kw in node.keywords:
                if kw.arg == "default":
                    hit(node, name, kw.value)
                if kw.arg == "help" and name in KNOBS:
                    found += [f"{mod}:{node.lineno} --{_dest(node)}'s help writes the default {n}"
                              for n in _help_numbers(kw.value)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get" and len(node.args) == 2 \
                and isinstance(node.args[0], ast.Constant):
            hit(node, node.args[0].value, node.args[1])
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2:
            hit(node, _named(node.values[0]), node.values[1])
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    hit(node, k.value, v)
    return found


def test_no_literal_default_outside_the_table():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        if rel.parts[0] == "native" or rel.name == "defaults":
            continue
        found += stray_defaults(".".join(rel.parts), path.read_text())
    assert not found, "literal defaults of the table's knobs (read pyllama_pp/defaults.py instead):\n" + "\n".join(found)


def test_the_scan_finds_each_form():
    """The scan can fail: each form of a stray default is found, and reading the table is not."""
    src = '''
from dataclasses import dataclass, field
def f(model, n_ubatch=512, *, timeout=600, reps=RUN.reps): ...
@dataclass
class C:
    n_batch: int = 2048
    tests: list = field(default_factory=lambda: [["pp", 512]])
    devices: str = CONTEXT.devices
def g(args, kw):
    ap.add_argument("-b", "--batch", type=int, default=512, help="n_batch (default: 512)")
    ap.add_argument("-c", "--ctx", type=int, default=FIT.n_ctx, help="n_ctx (default: %(default)s)")
    n = args.n_ctx or 4096
    t = kw.get("timeout", 120)
    ctx = {"n_ubatch": 64, "n_batch": RUN.n_batch}
'''
    found = stray_defaults("m", src)
    for what in ("f.n_ubatch = 512", "f.timeout = 600", "C.n_batch = 2048", "g.n_batch = 512", "g.n_ctx = 4096",
                 "g.timeout = 120", "g.n_ubatch = 64", "--batch's help writes the default 512"):
        assert any(what in line for line in found), (what, found)
    assert len(found) == 8, found
    assert not any(x in line for line in found for x in ("reps", "devices", "FIT", "RUN"))


def test_the_api_reads_the_table():
    """What the library's signatures give is the table's value, context by context."""
    ctx = ContextParams()
    assert (ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, ctx.n_threads) == (defaults.CONTEXT.n_ctx, defaults.CONTEXT.n_batch,
                                                                      defaults.CONTEXT.n_ubatch,
                                                                      defaults.CONTEXT.n_threads)
    cfg = RunConfig("m.gguf")
    assert (cfg.devices, cfg.n_batch, cfg.n_ubatch, cfg.n_ctx, cfg.reps) == \
        (defaults.RUN.devices, defaults.RUN.n_batch, defaults.RUN.n_ubatch, defaults.RUN.n_ctx, defaults.RUN.reps)
    assert cfg.tests == [["pp", n] for n in defaults.RUN.pp] and cfg.placement.host_experts == defaults.RUN.host_experts
    assert expand("m.gguf") == [cfg]
    assert MeasureJob().reps == defaults.RUN.reps and LogitsJob().n_tokens == defaults.CONTEXT.n_tokens
    assert fit_context(None).n_ubatch == defaults.FIT.n_ubatch
    assert Placement().n_gpu_layers == defaults.CONTEXT.n_gpu_layers
    import inspect
    sig = inspect.signature(check_logits).parameters
    assert sig["devices"].default == defaults.CHECK.devices and sig["n_tokens"].default == defaults.CHECK.n_tokens


def test_the_cli_help_shows_the_table():
    """-b / -ub / -p of run and ab, and fit's and check's sizes, come from the table into the parser and its help."""
    ap = cli.build_parser()
    sub = next(a for a in ap._actions if a.dest == "cmd").choices
    help_of = lambda cmd, dest: next(a for a in sub[cmd]._actions if a.dest == dest)
    b = help_of("ab", "batch").help
    assert f"default: {defaults.RUN.n_batch}" in b and f"the main job: {defaults.MAIN_JOB.n_batch}" in b, b
    assert f"default: {defaults.RUN.n_ubatch}" in help_of("run", "ubatch").help
    for cmd, table in (("fit", defaults.FIT), ("check", defaults.CHECK)):
        assert help_of(cmd, "ubatch").default == table.n_ubatch
    assert help_of("check", "batch").default == defaults.CHECK.n_batch
    # (fit's -b: the table's n_batch, or with --ubatch auto the largest n_batch the planner may take: given or not)
    assert help_of("fit", "batch").default is None and f"default: {defaults.FIT.n_batch}" in help_of("fit", "batch").help
    assert help_of("ab", "reps").default == defaults.RUN.reps and help_of("ab", "loads").default == defaults.PAIRED.loads
    text = sub["fit"].format_help()
    assert f"(default: {defaults.FIT.n_ubatch})" in text and f"{max(defaults.UBATCH_CANDIDATES)}" in text


def test_threads_are_every_core_this_process_may_use():
    assert defaults.usable_cores() == len(os.sched_getaffinity(0))
    assert defaults.threads(0) == defaults.usable_cores() and defaults.threads(3) == 3
    from pyllama_pp import devices
    kinds = ("cuda:0", "vdev:1x1MiB@1GBps", "rpc://127.0.0.1:1")
    assert [devices.parse(k).default_margin for k in kinds] == [defaults.MARGINS[k] for k in ("cuda", "vdev", "other")]
