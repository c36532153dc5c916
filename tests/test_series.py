"""The series in its two forms: our files (pyllama_pp/native/sched/) + hook patches, and the reviewer's series that
patches/export.py writes (one commit per mechanism: its hooks and its files), on the real pinned tree."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
SCHED = ROOT / "pyllama_pp" / "native" / "sched"
sys.path.insert(0, str(PATCHES))
from apply import read_series, read_sources  # noqa: E402  (patches/apply.py)

SOURCES = read_sources(PATCHES / "sources")
GIT_ENV = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.invalid",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.invalid")


def _run(cmd: list, cwd: Path = ROOT, env: dict | None = None) -> str:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{cmd}: exit {res.returncode}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.fixture(scope="module")
def pinned() -> Path:
    """The pinned upstream tree, as the build gets it (the build left it in the cache)."""
    return Path(_run([sys.executable, ROOT / "vendor" / "llama.cpp" / "fetch.py"]).strip())


@pytest.fixture(scope="module")
def exported(tmp_path_factory, pinned) -> Path:
    """export.py mbox: the reviewer's series (git-format patches and their series file)."""
    out = tmp_path_factory.mktemp("mbox")
    _run([sys.executable, PATCHES / "export.py", "mbox", out, "--upstream", pinned])
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def _patched_tree(pinned: Path, work: Path, series: Path, sources: Path | None = None) -> dict[str, bytes]:
    cmd = [sys.executable, PATCHES / "apply.py", "--upstream", pinned, "--work", work, "--series", series]
    _run(cmd + (["--sources", sources] if sources else []))
    return _tree(work / "patched" / "src")


def test_exported_series_gives_the_tree_the_build_uses(exported, pinned, tmp_path):
    names = [p.name for p in read_series(exported / "series")]
    assert names == [p.name for p in read_series(PATCHES / "series")], "one exported patch per patch of the series"
    ours = _patched_tree(pinned, tmp_path / "ours", PATCHES / "series", PATCHES / "sources")
    theirs = _patched_tree(pinned, tmp_path / "theirs", exported / "series")
    assert sorted(theirs) == sorted(ours), set(theirs) ^ set(ours)
    differ = [f for f in ours if ours[f] != theirs[f]]
    assert not differ, f"the exported series gives other bytes in {differ}"
    # each of our files arrives in the commit of its patch, with its final content
    for src, dest, number in SOURCES:
        adding = [p for p in exported.glob("*.patch") if f"\n+++ b/{dest}\n" in p.read_text()]
        assert [p.name[:4] for p in adding] == [number], (dest, [p.name for p in adding])
        assert ours[dest] == src.read_bytes()


def test_import_of_the_exported_series_gives_back_our_patches_and_files(exported, pinned, tmp_path):
    # a reviewer's (or developer's) work tree: the pristine tree, then `git am` of the exported series
    tree = tmp_path / "llama"
    shutil.copytree(pinned, tree)
    _run(["git", "init", "-q"], tree, GIT_ENV)
    _run(["git", "add", "-A"], tree, GIT_ENV)
    _run(["git", "commit", "-q", "-m", "pristine"], tree, GIT_ENV)
    _run(["git", "am", "-q", "--whitespace=nowarn", *sorted(exported.glob("*.patch"))], tree, GIT_ENV)
    repo = tmp_path / "repo"   # a copy of what import writes: patches/, our files
    shutil.copytree(PATCHES, repo / "patches", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(SCHED, repo / SCHED.relative_to(ROOT))
    for p in (repo / "patches").glob("0*.patch"):
        p.unlink()
    for src, _, _ in SOURCES:
        (repo / src.relative_to(ROOT)).write_text("stale\n")
    _run([sys.executable, PATCHES / "export.py", "import", tree, "--repo", repo])
    assert _tree(repo / "patches") == _tree(PATCHES), "import did not give back patches/ byte for byte"
    assert _tree(repo / SCHED.relative_to(ROOT)) == _tree(SCHED)


@pytest.mark.parametrize("name", sorted(p.name for p in [*SCHED.glob("*.cpp"), *SCHED.glob("*.c")]))
def test_our_file_compiles_against_the_pinned_headers(name, pinned):
    if name.endswith(".c"):
        cc, std = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"), "-std=c11"
    else:
        cc, std = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++"), "-std=c++17"
    assert cc, "no C/C++ compiler (the build needs one too)"
    _run([cc, std, "-fsyntax-only", "-I", SCHED, "-I", pinned / "ggml" / "include",
          "-I", pinned / "ggml" / "src", "-I", pinned / "include", "-I", pinned / "src", "-I", pinned / "common",
          SCHED / name])


def test_every_file_in_sched_is_in_the_manifest_and_no_patch_touches_one():
    listed = {src.name for src, _, _ in SOURCES}
    assert listed == {p.name for p in SCHED.iterdir()}, "pyllama_pp/native/sched/ and patches/sources differ"
    dests = {dest for _, dest, _ in SOURCES}
    names = {Path(d).name for d in dests}
    for patch in read_series(PATCHES / "series"):
        touched = set(re.findall(r"^diff --git a/(\S+) b/(\S+)$", patch.read_text(), re.M))
        paths = {p for pair in touched for p in pair}
        assert not paths & dests, f"{patch.name} touches our files {sorted(paths & dests)}: edit them in sched/"
        new = set(re.findall(r"^\+\+\+ b/(\S+)\n@@ -0,0 ", patch.read_text(), re.M))
        assert not {Path(p).name for p in new} & names, f"{patch.name} creates a file of ours: {sorted(new)}"
    assert {n for _, _, n in SOURCES} <= {p.name[:4] for p in read_series(PATCHES / "series")}


def test_the_gather_mirror_of_our_devices_matches_the_public_header():
    # gather_abi.h mirrors ggml-backend-pp.h for VDEV and the CUDA gather, which the baseline variant builds too
    header = (SCHED / "ggml-backend-pp.h").read_text()
    ours = dict(re.findall(r"\b(GGML_BACKEND_PP_GATHER_[A-Z]+)\s*=?\s*(\d+)", header))
    mirror = (ROOT / "pyllama_pp" / "native" / "gather_abi.h").read_text()
    pairs = re.findall(r"constexpr int \w+\s*=\s*(\d+);\s*// (GGML_BACKEND_PP_GATHER_[A-Z]+)", mirror)
    assert len(pairs) == 6, pairs
    for value, name in pairs:
        assert ours.get(name) == value, f"gather_abi.h: {name} = {value}, ggml-backend-pp.h: {ours.get(name)}"
