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
    sys.modules[spec.name] = mod  # dataclasses look their module up there
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
    # a caller that needs the whole sdist (bench/archs.py: upstream's tests) is told to give it, not the trimmed one
    assert fetch.source_archive(pin) == trimmed
    with pytest.raises(fetch.FetchError, match="trimmed archive, and this needs the whole sdist"):
        fetch.source_archive(pin, need_sdist=True)
    monkeypatch.setenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", str(archive))
    assert fetch.source_archive(pin, need_sdist=True) == archive
    bad = tmp_path / "bad" / pin["sdist"]   # (a readable sdist of that name, not the pinned one)
    bad.parent.mkdir()
    with tarfile.open(bad, "w:gz") as tar:
        _add(tar, "fakepkg-0.1/README", b"not the pinned release\n")
    monkeypatch.setenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", str(bad))
    with pytest.raises(fetch.FetchError, match="checksum mismatch"):
        fetch.source_archive(pin, need_sdist=True)


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


# --- the download, as build front-ends run it: no pip, the user's index settings, sha256 checked ------------

class _Index:
    """A local package index on 127.0.0.1 (PEP 503 pages and files); records what was asked and with which auth."""

    def __init__(self, root: Path, auth: str | None = None):
        import http.server
        import threading

        self.requests: list[tuple[str, str | None]] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                index.requests.append((self.path, self.headers.get("Authorization")))
                if auth and self.headers.get("Authorization") != auth:
                    self.send_response(401)
                    self.end_headers()
                    return
                f = root / self.path.lstrip("/").split("?")[0]
                if f.is_dir():
                    f = f / "index.html"
                if not f.is_file():
                    self.send_response(404)
                    self.end_headers()
                    return
                body = f.read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "text/html" if f.suffix == ".html" else "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _simple_index(root: Path, project: str, files: dict[str, bytes]) -> Path:
    """A PEP 503 index in root/simple: one project page linking files kept in root/files."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    page = root / "simple" / project
    page.mkdir(parents=True, exist_ok=True)
    links = []
    for name, data in files.items():
        (root / "files" / name).write_bytes(data)
        links.append(f'<a href="../../files/{name}#sha256={_sha(data)}">{name}</a><br/>')
    (page / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    return root / "simple"


@pytest.fixture
def no_pip_python(tmp_path_factory):
    """An interpreter without pip, as inside pip's isolated build environment."""
    venv = tmp_path_factory.mktemp("nopip") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    assert subprocess.run([str(py), "-c", "import pip"], capture_output=True).returncode != 0, "pip is importable"
    return py


def _clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment without the machine's own pip settings (config files, PIP_* and UV_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "PYLLAMA_PP_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PYLLAMA_PP_CACHE=str(tmp_path / "cache"), **extra)
    return env


_DOWNLOAD = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("fetch", sys.argv[1]); m = importlib.util.module_from_spec(spec)
sys.modules["fetch"] = m; spec.loader.exec_module(m)
try:
    print(m.download_sdist(json.loads(sys.argv[2]), Path(sys.argv[3])))
except m.FetchError as e:
    print(e, file=sys.stderr); sys.exit(2)
"""


def _download_without_pip(py: Path, pin: dict, dest: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), "-c", _DOWNLOAD, str(FETCH_PY), json.dumps(pin), str(dest)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_download_without_pip_from_the_users_index(fake, tmp_path, no_pip_python):
    """Today's bug: the build ran `python -m pip download` where pip is not importable. The download must need no
    pip, go to the index PIP_INDEX_URL names (here a local one), and verify the sha256."""
    archive, pin = fake
    _simple_index(tmp_path / "idx", "fakepkg", {archive.name: archive.read_bytes()})
    index = _Index(tmp_path / "idx")
    try:
        env = _clean_env(tmp_path, PIP_INDEX_URL=index.url + "/simple")
        res = _download_without_pip(no_pip_python, pin, tmp_path / "dl", env)
    finally:
        index.close()
    assert res.returncode == 0, res.stderr
    got = Path(res.stdout.strip())
    assert got == tmp_path / "dl" / archive.name and fetch.sha256_file(got) == pin["sha256"]
    assert [r[0] for r in index.requests] == ["/simple/fakepkg/", f"/files/{archive.name}"], index.requests
    assert not list((tmp_path / "dl").glob("*.partial*")), "a partial file was left behind"


def test_download_with_credentials_in_the_index_url(fake, tmp_path):
    archive, pin = fake
    _simple_index(tmp_path / "idx", "fakepkg", {archive.name: archive.read_bytes()})
    import base64
    want = "Basic " + base64.b64encode(b"me:s3cret").decode()
    index = _Index(tmp_path / "idx", auth=want)
    try:
        url = index.url.replace("http://", "http://me:s3cret@") + "/simple"
        settings = fetch.IndexSettings(index_urls=[url])
        got = fetch.download_sdist(pin, tmp_path / "dl", settings)
    finally:
        index.close()
    assert fetch.sha256_file(got) == pin["sha256"]
    assert all(a == want for _, a in index.requests), index.requests
    assert len(index.requests) == 2, index.requests


def test_download_from_file_url_index_and_find_links(fake, tmp_path):
    archive, pin = fake
    simple = _simple_index(tmp_path / "idx", "fakepkg", {archive.name: archive.read_bytes()})
    got = fetch.download_sdist(pin, tmp_path / "dl1", fetch.IndexSettings(index_urls=[simple.as_uri()]))
    assert fetch.sha256_file(got) == pin["sha256"]
    links = tmp_path / "links"
    links.mkdir()
    (links / archive.name).write_bytes(archive.read_bytes())
    # find-links is searched even with no index at all (an air-gapped machine's wheelhouse)
    got = fetch.download_sdist(pin, tmp_path / "dl2", fetch.IndexSettings(find_links=[str(links)], no_index=True))
    assert fetch.sha256_file(got) == pin["sha256"]


def test_download_refuses_a_file_that_is_not_the_pinned_one(fake, tmp_path):
    """The index serves a file of the right name with other bytes: nothing is kept, the error says why and how."""
    archive, pin = fake
    simple = _simple_index(tmp_path / "idx", "fakepkg", {archive.name: b"not the sdist"})
    with pytest.raises(fetch.FetchError) as ei:
        fetch.download_sdist(pin, tmp_path / "dl", fetch.IndexSettings(index_urls=[simple.as_uri()]))
    msg = str(ei.value)
    assert "is not the pinned" in msg and pin["sha256"] in msg and _sha(b"not the sdist") in msg, msg
    assert "PYLLAMA_PP_UPSTREAM_ARCHIVE" in msg, msg
    assert list((tmp_path / "dl").iterdir()) == [], "a file that failed its check was kept"


def test_script_offline_says_which_file_how_to_get_it_and_where_to_point(tmp_path, no_pip_python):
    """The real pin, run as the build runs it (no pip), against an index that has nothing: exit 2 and a message
    naming the sdist, its sha256, the command for a connected machine and the variable."""
    index = _Index(tmp_path / "empty")
    try:
        env = _clean_env(tmp_path, PIP_INDEX_URL=index.url + "/simple")
        res = subprocess.run([str(no_pip_python), str(FETCH_PY)], env=env, capture_output=True, text=True,
                             timeout=120)
    finally:
        index.close()
    pin = fetch.read_pin()
    assert res.returncode == 2 and res.stdout.strip() == "", (res.returncode, res.stdout, res.stderr)
    assert [r[0] for r in index.requests] == ["/simple/llama-cpp-python/"], index.requests
    err = res.stderr
    for must in (pin["sdist"], pin["sha256"], "HTTP 404", f"pip download --no-deps --no-binary {pin['package']}",
                 "fetch.py --download DIR", "PYLLAMA_PP_UPSTREAM_ARCHIVE=", "PIP_FIND_LINKS"):
        assert must in err, f"{must!r} missing from:\n{err}"
    assert "Traceback" not in err and "No module named pip" not in err


def test_index_settings_follow_pip_config_then_environment(tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\nextra-index-url =\n"
                    "    https://a.example/simple\n    https://b.example/simple\nfind-links = /wheels\n"
                    "timeout = 12\n[install]\ncert = /ca.pem\n")
    base = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_DIRS": str(tmp_path / "none"), "PIP_CONFIG_FILE": str(conf)}
    s = fetch.index_settings(base)
    assert s.index_urls == ["https://mirror.example/simple", "https://a.example/simple", "https://b.example/simple"]
    assert s.find_links == ["/wheels"] and s.cert == "/ca.pem" and s.timeout == 12.0 and not s.no_index
    assert str(conf) in s.sources
    s = fetch.index_settings(dict(base, PIP_INDEX_URL="https://env.example/simple", PIP_EXTRA_INDEX_URL="",
                                  PIP_NO_INDEX="1"))
    assert s.index_urls == ["https://env.example/simple"] and s.no_index
    # no configuration at all: PyPI; uv's variables are read too
    none = {"HOME": str(tmp_path / "home"), "PIP_CONFIG_FILE": os.devnull}
    assert fetch.index_settings(none).index_urls == [fetch.PYPI_SIMPLE]
    s = fetch.index_settings(dict(none, UV_DEFAULT_INDEX="https://uv.example/simple",
                                  UV_INDEX="internal=https://i.example/simple"))
    assert s.index_urls == ["https://uv.example/simple", "https://i.example/simple"]


def test_archive_env_takes_a_folder_or_a_file_url(fake, cache, monkeypatch, tmp_path):
    archive, pin = fake
    monkeypatch.setenv("PYLLAMA_PP_UPSTREAM_ARCHIVE", str(archive.parent))
    root = fetch.ensure_tree(pin)
    assert _tree_files(root) == WANTED
    assert fetch._archive_from_env(archive.as_uri(), pin) == archive
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(fetch.FetchError, match=f"folder without {pin['sdist']}"):
        fetch._archive_from_env(str(empty), pin)
