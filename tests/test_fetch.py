"""vendor/llama.cpp/fetch.py: verify and extract the pinned upstream tree, on a small FAKE sdist.

Nothing here touches the network or the real cache: PYLLAMA_PP_CACHE points at a tmp folder and the
archive comes from PYLLAMA_PP_UPSTREAM_ARCHIVE.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FETCH_PY = ROOT / "vendor" / "llama.cpp" / "fetch.py"


def _load_fetch():
    spec = importlib.util.spec_from_file_location("pyllama_pp_fetch_under_test", FETCH_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fetch = _load_fetch()

PKG = "fakepkg-0.1"
PREFIX = f"{PKG}/vendor/llama.cpp/"
# files the build needs (fetch.wanted() keeps them) ...
WANTED = {
    "CMakeLists.txt": b"cmake_minimum_required(VERSION 3.14)\nproject(fake)\n",
    "LICENSE": b"MIT License (fake)\n",
    "include/llama.h": b"#pragma once\nint llama_fake(void);\n",
    "src/llama.cpp": b"#include \"llama.h\"\nint llama_fake(void) { return 42; }\n",
    "common/common.h": b"// common\n",
    "ggml/CMakeLists.txt": b"# ggml\n",
    "ggml/include/ggml.h": b"#pragma once\n",
    "ggml/src/ggml.c": b"int ggml_fake;\n",
    "ggml/src/ggml-backend.cpp": b"// backend\n",
    "ggml/src/ggml-cpu/ggml-cpu.c": b"// cpu\n",
    "ggml/src/ggml-cuda/ggml-cuda.cu": b"// cuda\n",
    # incompressible, and last in the archive: a byte flipped in the middle of the .tar.gz lands here
    "vendor/blob.bin": np.random.default_rng(7).integers(0, 256, 256 * 1024, dtype=np.uint8).tobytes(),
}
# ... and files it does not (other backends, docs, tools; a file outside the tree prefix)
UNWANTED = {
    "docs/build.md": b"# docs\n",
    "tools/main/main.cpp": b"int main() {}\n",
    "ggml/src/ggml-metal/ggml-metal.m": b"// metal\n",
    "ggml/src/ggml-vulkan/ggml-vulkan.cpp": b"// vulkan\n",
}
OUTSIDE = {f"{PKG}/setup.py": b"# not part of the tree\n"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def _flip_byte(src: Path, dst: Path, offset: int) -> None:
    data = bytearray(src.read_bytes())
    data[offset] ^= 0xFF
    dst.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """A fake sdist (.tar.gz with the pin's tree prefix) and a pin that matches it."""
    d = tmp_path_factory.mktemp("fake_sdist")
    archive = d / f"{PKG}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in OUTSIDE.items():
            _add(tar, name, data)
        for rel, data in UNWANTED.items():
            _add(tar, PREFIX + rel, data)
        for rel, data in WANTED.items():
            _add(tar, PREFIX + rel, data, 0o755 if rel.endswith(".c") else 0o644)
    pin = {
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "commit_date": "2026-01-01",
        "package": "fakepkg",
        "version": "0.1",
        "sdist": archive.name,
        "sha256": fetch.sha256_file(archive),
        "tree_prefix": PREFIX,
        "tree_sha256": fetch.tree_hash({rel: _sha(data) for rel, data in WANTED.items()}),
    }
    return archive, pin


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder for this test (the real ~/.cache/pyllama_pp is never touched)."""
    c = tmp_path / "cache"
    monkeypatch.setenv("PYLLAMA_PP_CACHE", str(c))
    monkeypatch.delenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", raising=False)
    return c


def _tree_files(tree: Path) -> dict[str, bytes]:
    return {p.relative_to(tree).as_posix(): p.read_bytes() for p in tree.rglob("*")
            if p.is_file() and p.name != ".complete"}


def _complete_trees(cache: Path) -> list[Path]:
    return list((cache / "upstream").glob("*/.complete")) if (cache / "upstream").exists() else []


def _leftovers(cache: Path) -> list[Path]:
    return list((cache / "upstream").glob(".extract-*")) if (cache / "upstream").exists() else []


# ---------------------------------------------------------------------------------------------------------

def test_wanted_selection():
    for rel in WANTED:
        assert fetch.wanted(rel), rel
    for rel in UNWANTED:
        assert not fetch.wanted(rel), rel


def test_tree_hash_is_order_independent_and_content_sensitive():
    a = {"x": _sha(b"1"), "y": _sha(b"2")}
    b = {"y": _sha(b"2"), "x": _sha(b"1")}
    assert fetch.tree_hash(a) == fetch.tree_hash(b)
    assert fetch.tree_hash(a) != fetch.tree_hash({"x": _sha(b"1"), "y": _sha(b"3")})
    assert fetch.tree_hash(a) != fetch.tree_hash({"x": _sha(b"1"), "z": _sha(b"2")})


def test_extract_keeps_only_the_wanted_files(fake, tmp_path):
    archive, pin = fake
    dest = tmp_path / "tree"
    got = fetch.extract(archive, pin, dest)
    assert got == pin["tree_sha256"]
    files = _tree_files(dest)
    assert files == WANTED, f"extracted {sorted(files)}, wanted {sorted(WANTED)}"
    assert os.stat(dest / "ggml/src/ggml.c").st_mode & 0o100, "file modes are kept"


def test_ensure_tree_from_archive_env_and_cached(fake, cache, monkeypatch, tmp_path):
    archive, pin = fake
    monkeypatch.setenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", str(archive))
    root = fetch.ensure_tree(pin)
    assert cache in root.parents, f"{root} is not inside the test cache {cache}"
    assert (root / ".complete").read_text().strip() == pin["commit"]
    assert _tree_files(root) == WANTED
    assert not _leftovers(cache)
    # a second call uses the verified tree in the cache: the archive is not needed any more
    monkeypatch.setenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", str(tmp_path / "gone.tar.gz"))
    assert fetch.ensure_tree(pin) == root


def test_corrupted_archive_fails_with_checksum_mismatch(fake, cache, monkeypatch, tmp_path):
    archive, pin = fake
    bad = tmp_path / archive.name
    _flip_byte(archive, bad, archive.stat().st_size // 2)
    monkeypatch.setenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", str(bad))
    with pytest.raises(fetch.FetchError) as ei:
        fetch.ensure_tree(pin)
    msg = str(ei.value)
    assert "checksum mismatch" in msg, msg
    assert pin["sha256"] in msg and fetch.sha256_file(bad) in msg, f"expected and actual sha256 missing: {msg}"
    assert "Fix:" in msg and "PYLLAMA_PP_UPSTREAM_ARCHIVE" in msg, f"no fix in: {msg}"
    assert not _complete_trees(cache), "a tree was cached from a corrupt archive"
    assert not _leftovers(cache), f"partial extraction left behind: {_leftovers(cache)}"


def test_unreadable_archive_fails_clearly(fake, cache, monkeypatch, tmp_path):
    archive, pin = fake
    bad = tmp_path / archive.name
    _flip_byte(archive, bad, 0)  # the gzip magic: not an archive any more
    monkeypatch.setenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", str(bad))
    with pytest.raises(fetch.FetchError) as ei:
        fetch.ensure_tree(pin)
    assert str(bad) in str(ei.value) and "Fix:" in str(ei.value), str(ei.value)
    assert not _complete_trees(cache)


def test_missing_archive_env_fails_clearly(fake, cache, monkeypatch, tmp_path):
    _, pin = fake
    missing = tmp_path / "no-such-archive.tar.gz"
    monkeypatch.setenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", str(missing))
    with pytest.raises(fetch.FetchError) as ei:
        fetch.ensure_tree(pin)
    msg = str(ei.value)
    assert "PYLLAMA_PP_UPSTREAM_ARCHIVE" in msg and str(missing) in msg, msg
    assert "does not name a file" in msg and "Fix:" in msg, msg


def test_trimmed_archive_round_trip(fake, cache, monkeypatch, tmp_path):
    archive, pin = fake
    tree = tmp_path / "tree"
    fetch.extract(archive, pin, tree)
    (tree / ".complete").write_text(pin["commit"] + "\n")  # as ensure_tree leaves it: must not be packed
    trimmed = tmp_path / "trimmed.tar.xz"
    fetch.write_trimmed(tree, trimmed, pin)

    with tarfile.open(trimmed, "r:xz") as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile(names[0]).read())
    assert names[0] == fetch.MANIFEST, "the manifest must be the first member"
    assert ".complete" not in names
    assert sorted(names[1:]) == sorted(WANTED)
    assert manifest == {"commit": pin["commit"], "sdist_sha256": pin["sha256"], "tree_sha256": pin["tree_sha256"]}

    dest = tmp_path / "again"
    assert fetch.extract(trimmed, pin, dest) == pin["tree_sha256"]
    assert _tree_files(dest) == WANTED

    # and through the environment variable, as on an offline machine
    monkeypatch.setenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", str(trimmed))
    root = fetch.ensure_tree(pin)
    assert _tree_files(root) == WANTED


def _rewrite_trimmed(src: Path, dst: Path, change: dict[str, bytes]) -> None:
    with tarfile.open(src, "r:xz") as tin, tarfile.open(dst, "w:xz") as tout:
        for m in tin:
            data = tin.extractfile(m).read()
            _add(tout, m.name, change.get(m.name, data), m.mode)
        for name, data in change.items():
            if name not in tin.getnames():
                _add(tout, name, data)


def test_tampered_trimmed_archive_fails_tree_check(fake, tmp_path):
    archive, pin = fake
    tree = tmp_path / "tree"
    fetch.extract(archive, pin, tree)
    trimmed = tmp_path / "trimmed.tar.xz"
    fetch.write_trimmed(tree, trimmed, pin)
    tampered = tmp_path / "tampered.tar.xz"
    _rewrite_trimmed(trimmed, tampered, {"src/llama.cpp": WANTED["src/llama.cpp"].replace(b"42", b"43")})
    with pytest.raises(fetch.FetchError) as ei:
        fetch.extract(tampered, pin, tmp_path / "out")
    msg = str(ei.value)
    assert "does not match the pin" in msg and pin["tree_sha256"] in msg, msg
    assert "Fix:" in msg, msg

    extra = tmp_path / "extra.tar.xz"  # an added file changes the tree too
    _rewrite_trimmed(trimmed, extra, {"src/evil.cpp": b"// injected\n"})
    with pytest.raises(fetch.FetchError, match="does not match the pin"):
        fetch.extract(extra, pin, tmp_path / "out2")


def test_trimmed_archive_with_unsafe_path_is_refused(fake, tmp_path):
    _, pin = fake
    evil = tmp_path / "evil.tar.xz"
    with tarfile.open(evil, "w:xz") as tar:
        _add(tar, fetch.MANIFEST, b"{}")
        _add(tar, "../escaped.txt", b"outside\n")
    dest = tmp_path / "sub" / "out"
    with pytest.raises(fetch.FetchError, match="unsafe path"):
        fetch.extract(evil, pin, dest)
    assert not (tmp_path / "sub" / "escaped.txt").exists()


# --- the script, as the build runs it -----------------------------------------------------------------------

def _run_script(tmp_path: Path, archive: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYLLAMA_PP_CACHE=str(tmp_path / "cache"), PYLLAMA_PP_UPSTREAM_ARCHIVE=str(archive))
    return subprocess.run([sys.executable, str(FETCH_PY)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_script_missing_archive_exits_2(tmp_path):
    missing = tmp_path / "missing.tar.gz"
    res = _run_script(tmp_path, missing)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "pyllama_pp fetch error" in res.stderr and str(missing) in res.stderr, res.stderr
    assert "does not name a file" in res.stderr, res.stderr
    assert res.stdout.strip() == "", "nothing on stdout when it fails (the build reads the tree path there)"
    assert "Traceback" not in res.stderr


def test_script_wrong_archive_exits_2(fake, tmp_path):
    archive, _ = fake  # a valid .tar.gz, but not the pinned sdist
    res = _run_script(tmp_path, archive)
    real_pin = fetch.read_pin()
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "checksum mismatch" in res.stderr and real_pin["sha256"] in res.stderr, res.stderr
    assert "Fix:" in res.stderr and res.stdout.strip() == ""
    assert "Traceback" not in res.stderr
    assert not list((tmp_path / "cache").glob("upstream/*/.complete"))
