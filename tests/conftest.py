"""Shared fixtures: the tiny synthetic model (made once per session) and a runner for worker jobs.

Both variants ship libraries with the same sonames, so every test that runs a model does it in a worker
process (pyllama_pp.worker.run_job); the test process itself never loads a variant.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

import sys

import pyllama_pp.fit  # noqa: F401  (the module: the package's attribute `fit` is the function)
from pyllama_pp import synth
from pyllama_pp.decode_model import DecodeCosts
from pyllama_pp.stats import max_abs_diff, nmse
from pyllama_pp.worker import run_job


def pytest_configure(config):
    """Under pytest-xdist (`-n auto`, the default here) each pytest worker runs on a core of its own, and so do the
    worker processes its tests start (they inherit the affinity, and a session's threads follow it): ggml's CPU
    threads then never spin against another test's threads."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    if name.startswith("gw") and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(name[2:]) % len(cores)]})

# the costs fit's memory planner prices decode with in tests: a device no faster than the host CPU (a VDEV computes
# with the host's kernels), so that no cache pays and a plan does not move with this machine's load (the decode probe
# times replicas: tests/test_memory_plan.py states its own costs, the probe's own test is marked measured_decode)
STATED_DECODE = DecodeCosts("stated: a device no faster than the host CPU", outside_s=1e-3, resident_s=5e-4,
                            cpu_s=5e-4, cached_s=6e-4)


@pytest.fixture(scope="session", autouse=True)
def _stated_decode_costs():
    """The stated costs for the whole session (from its start: a module's fixture that plans runs before a test's
    own fixtures would), the probe's own function put back around each test marked measured_decode."""
    fit_module = sys.modules["pyllama_pp.fit"]
    measured = fit_module.decode_costs
    fit_module.decode_costs = lambda model, devices, **kw: {-1: STATED_DECODE}
    yield measured
    fit_module.decode_costs = measured


@pytest.fixture(autouse=True)
def _measured_decode_costs(request, monkeypatch, _stated_decode_costs):
    if "measured_decode" in request.keywords:
        monkeypatch.setattr(sys.modules["pyllama_pp.fit"], "decode_costs", _stated_decode_costs)


ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT = 120.0          # seconds; a tiny-model job takes well under one
NMSE_MAX = 1e-6              # the equivalence bound: patched vs baseline, CPU vs VDEV


def assert_logits_match(a: np.ndarray, b: np.ndarray, what: str, limit: float = NMSE_MAX) -> None:
    """NMSE <= limit, with the max abs difference in the message (NMSE alone can hide one large outlier)."""
    assert a.shape == b.shape, f"{what}: logits shapes differ: {a.shape} vs {b.shape}"
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), f"{what}: non-finite logits"
    err = nmse(a, b)
    maxabs = max_abs_diff(a, b)
    assert err <= limit, f"{what}: NMSE {err:.3e} > {limit:.0e} (max abs diff {maxabs:.3e})"


class JobRunner:
    """Runs worker jobs on the tiny model; identical jobs (variant, job, env) are run once per session."""

    def __init__(self, model: str, outdir: Path):
        self.model = model
        self.outdir = outdir
        self._cache: dict[str, dict] = {}
        self._n = 0

    def _key(self, variant: str, job: dict, env: Optional[dict]) -> str:
        return json.dumps([variant, job, {k: str(v) for k, v in (env or {}).items()}], sort_keys=True)

    def run(self, variant: str, job: dict, env: Optional[dict] = None, cache: bool = True) -> dict:
        """run_job with the tiny model filled in (unless the job names another); raises WorkerError."""
        job = {"model": self.model, **job}
        key = self._key(variant, job, env)
        if cache and key in self._cache:
            return self._cache[key]
        if job.get("kind") == "logits" and "out" not in job:
            self._n += 1
            job = {**job, "out": str(self.outdir / f"logits-{self._n}.npy")}
        res = run_job(job, variant, timeout=JOB_TIMEOUT, env=env)
        if job.get("kind") == "logits":
            res = {**res, "logits": np.load(job["out"])}
        if cache:
            self._cache[key] = res
        return res

    def logits(self, variant: str, devices: str = "cpu", placement: Optional[dict] = None,
               ctx: Optional[dict] = None, n_tokens: int = 64, logits: str = "all", seed: int = 0,
               env: Optional[dict] = None, **extra) -> dict:
        """A "logits" job; the result dict has the array under "logits"."""
        job = {"kind": "logits", "devices": devices, "placement": placement or {}, "ctx": ctx or {},
               "n_tokens": n_tokens, "logits": logits, "seed": seed, **extra}
        return self.run(variant, job, env=env)

    def schedule(self, variant: str, devices: str = "cpu", placement: Optional[dict] = None,
                 ctx: Optional[dict] = None, env: Optional[dict] = None, **extra) -> dict:
        job = {"kind": "schedule", "devices": devices, "placement": placement or {}, "ctx": ctx or {}, **extra}
        return self.run(variant, job, env=env)


@pytest.fixture(scope="session", autouse=True)
def _clean_sched_env():
    """Scheduler switches set in the caller's environment would leak into every worker: drop them."""
    mp = pytest.MonkeyPatch()
    for k in list(os.environ):
        if k.startswith("GGML_SCHED_PP_"):
            mp.delenv(k)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_cfg() -> synth.SynthConfig:
    return synth.preset("tiny", seed=1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tiny_cfg) -> str:
    """Path of the tiny synthetic MoE (6 layers, 64 experts / 2 used, ~12 MB), written once per session."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synth.write_gguf(str(path), tiny_cfg)
    return str(path)


@pytest.fixture(scope="session")
def runner(tiny_model, tmp_path_factory) -> JobRunner:
    return JobRunner(tiny_model, tmp_path_factory.mktemp("logits"))


@pytest.fixture(scope="session")
def tiny_info(runner) -> dict:
    """ModelInfo of the tiny model as the baseline build loads it (n_vocab, n_layer, ...)."""
    return runner.schedule("baseline")["model"]


@pytest.fixture(scope="session", name="nmse")
def nmse_fixture():
    return nmse


@pytest.fixture(scope="session", name="assert_logits_match")
def assert_logits_match_fixture():
    return assert_logits_match


@pytest.fixture
def no_worker(monkeypatch):
    """Fails the test if a worker would start for a check (the CLI's, fit's, the soak's, the logits check's: the
    check must happen before). The A/B runner's own measurement workers are left alone: a test may measure first and
    then check bad input."""
    import sys

    # (loaded before the patching below: each of these holds its own run_job)
    import pyllama_pp.check  # noqa: F401
    import pyllama_pp.cli  # noqa: F401
    import pyllama_pp.fit  # noqa: F401
    import pyllama_pp.soak  # noqa: F401
    from pyllama_pp.worker import client

    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started for input that could be checked up front")
    # each module imported run_job by name and holds its own reference to it
    real = client.run_job
    for name, mod in list(sys.modules.items()):
        if (name == "pyllama_pp" or name.startswith("pyllama_pp.")) and name != "pyllama_pp.runner" \
                and getattr(mod, "run_job", None) is real:
            monkeypatch.setattr(mod, "run_job", refuse)


@pytest.fixture
def usage_error(capsys):
    """Runs the CLI on argv and returns its error: exit 2, one `pyllama-pp: error:` statement on stderr (a message of
    several lines - reasons listed under it - has them indented under the first)."""
    from pyllama_pp import cli

    def run(argv: list[str]) -> str:
        rc = cli.main(argv)
        out, err = capsys.readouterr()
        assert rc == 2, (rc, out, err)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert lines and lines[0].startswith("pyllama-pp: error: ") and all(ln.startswith("  ") for ln in lines[1:]), \
            f"not one statement on stderr:\n{err}"
        assert "Traceback" not in err and "\\n" not in err and "stderr tail" not in err, err
        return "\n".join(lines)
    return run



class _ProgressBar:
    """A progress bar that records each step with the name it showed (stands in for the runner's tqdm)."""

    def __init__(self, made: list, total=None, **kw):
        self.total, self.name, self.steps = total, "", []
        made.append(self)

    def set_postfix_str(self, s, refresh=True):
        self.name = s

    def update(self, n=1):
        self.steps.append((n, self.name))

    def close(self):
        pass


@pytest.fixture
def progress_bars(monkeypatch) -> list:
    """The A/B runner's progress bars, recorded: each has `total` and `steps`, [(n, the name shown), ...]."""
    from pyllama_pp import runner

    made: list = []
    monkeypatch.setattr(runner, "tqdm", lambda *a, **k: _ProgressBar(made, *a, **k))
    return made


class _FakeProbe:
    """compute.Probe's surface without running anything: a layer's seconds per prompt token at each n_ubatch are
    `per_token(n_ubatch)`; no bound before measuring (nothing is skipped)."""

    per_token = staticmethod(lambda u: 1e-6)

    def __init__(self, model, devices, n_tokens, ubatches, **kw):
        self.n_tokens = n_tokens

    def compute(self, u):
        from pyllama_pp.compute import LayerCompute
        return {-1: LayerCompute("vdev", self.n_tokens, {u: self.n_tokens * self.per_token(u)}, {u: 0.0})}

    def optimistic(self, u, slack):
        return None

    def skip(self, u):
        pass

    def close(self):
        pass


@pytest.fixture
def fake_compute(monkeypatch):
    """fit_ubatch's compute probe replaced: fake_compute(per_token) makes a layer take per_token(n_ubatch) seconds a
    prompt token (the choice's logic, not timing, is under test); the closest pairs "measure" at their prediction."""
    import sys

    def use(per_token):
        probe = type("FakeProbe", (_FakeProbe,), {"per_token": staticmethod(per_token)})
        monkeypatch.setattr(sys.modules["pyllama_pp.fit"], "Probe", probe)
        monkeypatch.setattr(sys.modules["pyllama_pp.fit"], "measure_prompts",
                            lambda plans, **kw: [p.predicted_ts for p in plans])
    return use
