#!/usr/bin/env python3
"""Fetch, verify and extract the pinned upstream llama.cpp tree (stdlib only).

The tree is the ``vendor/llama.cpp/`` folder of the PyPI source package named in ``PIN``. Nothing of it is
committed: the build downloads the sdist into a cache outside the repository, checks it against the pinned
sha256, and extracts only the parts the build needs. The download uses the standard library alone, because
build front-ends (pip's build isolation, ``python -m build``, uv) run this without pip importable; it reads the
user's index settings the way pip does (pip.conf files, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS,
PIP_NO_INDEX, PIP_CERT, PIP_PROXY, and uv's UV_* equivalents), so it works behind a mirror.

Usage:
    fetch.py                       extract (if needed) and print the tree's path
    fetch.py --download DIR        only download the verified sdist into DIR (for an offline machine)
    fetch.py --write-trimmed F     also write a trimmed .tar.xz (a few MB) for offline machines
    fetch.py --tree-hash           print the hash of the selected files (to update PIN)

Environment:
    PYLLAMA_PP_UPSTREAM_ARCHIVE    a local sdist or trimmed .tar.xz (file, folder or file:// URL): no download
    PYLLAMA_PP_CACHE               cache folder (default $XDG_CACHE_HOME/pyllama_pp or ~/.cache/pyllama_pp)
"""
from __future__ import annotations

import argparse
import base64
import configparser
import hashlib
import io
import json
import netrc
import os
import re
import shutil
import ssl
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Iterator, Mapping
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit
from urllib.request import url2pathname

HERE = Path(__file__).resolve().parent
MANIFEST = "PYLLAMA_PP_TRIMMED.json"

# What the build needs (UPSTREAM-MAP.md §G). Folders are taken whole; "ggml/src/*" means its files only.
KEEP_DIRS = (
    "cmake/", "include/", "src/", "common/", "vendor/", "licenses/",
    "ggml/cmake/", "ggml/include/", "ggml/src/ggml-cpu/", "ggml/src/ggml-cuda/", "ggml/src/ggml-rpc/",
)
KEEP_FILES = ("CMakeLists.txt", "LICENSE", "ggml/CMakeLists.txt")


class FetchError(RuntimeError):
    """The upstream tree could not be fetched or verified; the message says how to fix it."""


def read_pin(path: Path = HERE / "PIN") -> dict[str, str]:
    pin = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pin[key.strip()] = value.strip()
    return pin


def cache_dir() -> Path:
    if os.environ.get("PYLLAMA_PP_CACHE"):
        return Path(os.environ["PYLLAMA_PP_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pyllama_pp"


def wanted(rel: str) -> bool:
    if rel in KEEP_FILES or any(rel.startswith(d) for d in KEEP_DIRS):
        return True
    # top-level files of ggml/src (ggml.c, ggml-backend.cpp, ...), not its other backend folders
    return rel.startswith("ggml/src/") and "/" not in rel[len("ggml/src/"):]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_hash(files: dict[str, str]) -> str:
    """One hash over the selected files: sorted 'path sha256' lines."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel} {files[rel]}\n".encode())
    return h.hexdigest()


# --- download (stdlib only: pip is not importable inside a build front-end's isolated environment) ---------

PYPI_SIMPLE = "https://pypi.org/simple"
SIMPLE_ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"


@dataclass
class IndexSettings:
    """Where to look for the sdist: the user's pip (and uv) settings, read the way pip reads them."""

    index_urls: list[str] = field(default_factory=lambda: [PYPI_SIMPLE])  # the primary index first
    find_links: list[str] = field(default_factory=list)                  # folders or pages of links
    no_index: bool = False
    cert: str | None = None
    proxy: str | None = None
    timeout: float = 60.0
    sources: list[str] = field(default_factory=list)                     # which files / variables said so


def _pip_config_files(env: Mapping[str, str]) -> list[Path]:
    """pip's configuration files, in the order pip loads them (later files override earlier ones)."""
    cfg_file = env.get("PIP_CONFIG_FILE")
    if cfg_file == os.devnull:
        return []
    home = Path(env.get("HOME") or Path.home())
    xdg_dirs = [d for d in (env.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(os.pathsep) if d]
    files = [Path(d) / "pip" / "pip.conf" for d in xdg_dirs] + [Path("/etc/pip.conf")]
    files += [home / ".pip" / "pip.conf", Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf"]
    for prefix in (env.get("VIRTUAL_ENV"), sys.prefix):  # the user's venv, also seen from an isolated build
        if prefix:
            files.append(Path(prefix) / "pip.conf")
    if cfg_file:
        files.append(Path(cfg_file))
    seen, out = set(), []
    for f in files:
        if f not in seen:
            seen.add(f)
            out.append(f)
    return out


def _split_urls(value: str | None) -> list[str]:
    return [u for u in (value or "").split() if u]


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def index_settings(env: Mapping[str, str] | None = None) -> IndexSettings:
    """The index URLs, find-links, certificate, proxy and timeout pip would use here.

    pip's config files ([global], then [download] / [install]), then PIP_* variables; uv's UV_DEFAULT_INDEX /
    UV_INDEX_URL / UV_INDEX / UV_EXTRA_INDEX_URL / UV_FIND_LINKS / UV_NO_INDEX too, so `uv pip install` behind a
    mirror works the same way.
    """
    env = os.environ if env is None else env
    cfg: dict[str, str] = {}
    sources: list[str] = []
    for f in _pip_config_files(env):
        if not f.is_file():
            continue
        parser = configparser.RawConfigParser()
        try:
            parser.read(f, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeError) as e:
            raise FetchError(f"cannot read pip's configuration file {f} ({e}). Fix: correct or remove it.")
        used = False
        for section in ("global", "download", "install"):
            if parser.has_section(section):
                for key, value in parser.items(section):
                    cfg[key] = value
                    used = True
        if used:
            sources.append(str(f))

    def get(key: str) -> str | None:
        var = "PIP_" + key.upper().replace("-", "_")
        if env.get(var) is not None:
            sources.append(var)
            return env[var]
        return cfg.get(key)

    s = IndexSettings(sources=sources)
    primary = (get("index-url") or env.get("UV_DEFAULT_INDEX") or env.get("UV_INDEX_URL") or PYPI_SIMPLE).strip()
    extras = _split_urls(get("extra-index-url")) + _split_urls(env.get("UV_EXTRA_INDEX_URL"))
    # UV_INDEX: space-separated, each "URL" or "name=URL"
    extras += [u.split("=", 1)[1] if "=" in u and "://" in u.split("=", 1)[1] else u
               for u in _split_urls(env.get("UV_INDEX"))]
    s.index_urls = list(dict.fromkeys([primary] + extras))
    s.find_links = list(dict.fromkeys(_split_urls(get("find-links")) + _split_urls(env.get("UV_FIND_LINKS"))))
    s.no_index = _truthy(get("no-index")) or _truthy(env.get("UV_NO_INDEX"))
    s.cert = get("cert") or None
    s.proxy = get("proxy") or None
    try:
        s.timeout = float(get("timeout") or get("default-timeout") or 60)
    except ValueError:
        s.timeout = 60.0
    return s


def normalize_name(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


class _Links(HTMLParser):
    """The <a href> links of a PEP 503 page (or any page of links): [(text or file name, href)]."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append(("".join(self._text).strip(), self._href))
            self._href = None


def redact(url: str) -> str:
    """The URL without user:password@ and without a #fragment (for requests and messages)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def _filename_of(url: str) -> str:
    return unquote(urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1])


class _Net:
    """urllib with pip's certificate, proxy, timeout and credentials (user:password@ in a URL, or ~/.netrc)."""

    def __init__(self, settings: IndexSettings):
        self.timeout = settings.timeout
        ctx = ssl.create_default_context(cafile=settings.cert) if settings.cert else ssl.create_default_context()
        handlers: list[Any] = [urllib.request.HTTPSHandler(context=ctx)]
        if settings.proxy:
            proxy = settings.proxy if "://" in settings.proxy else "http://" + settings.proxy
            handlers.append(urllib.request.ProxyHandler({"http": proxy, "https": proxy}))
        self.opener = urllib.request.build_opener(*handlers)
        self.credentials: dict[tuple[str, int | None], tuple[str, str]] = {}

    def _auth(self, url: str) -> tuple[str, dict[str, str]]:
        """The URL without user:password@ and the headers that carry them. As pip does, credentials seen once for a
        host (in an index URL) go with every later request to that host (the files its pages link to)."""
        parts = urlsplit(url)
        host = (parts.hostname or "", parts.port)
        user, password = parts.username, parts.password
        if user is not None:
            self.credentials[host] = (unquote(user), unquote(password or ""))
        elif parts.scheme in ("http", "https"):
            if host not in self.credentials:
                try:
                    found = netrc.netrc().authenticators(parts.hostname or "")
                except (OSError, netrc.NetrcParseError):
                    found = None
                if found:
                    self.credentials[host] = (found[0], found[2] or "")
        headers = {"User-Agent": "pyllama_pp-fetch"}
        if host in self.credentials:
            token = base64.b64encode(":".join(self.credentials[host]).encode()).decode()
            headers["Authorization"] = "Basic " + token
        return redact(url), headers

    def open(self, url: str, accept: str | None = None):
        url, headers = self._auth(url)
        if accept:
            headers["Accept"] = accept
        last: Exception | None = None
        for attempt in range(3):  # transient network errors and 5xx are retried; 4xx are not
            try:
                return self.opener.open(urllib.request.Request(url, headers=headers), timeout=self.timeout)
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise
                last = e
            except (urllib.error.URLError, OSError) as e:
                if isinstance(getattr(e, "reason", None), FileNotFoundError) or isinstance(e, FileNotFoundError):
                    raise
                last = e
            if attempt < 2:
                time.sleep(1 + attempt)
        assert last is not None
        raise last


def _local_path(url: str) -> Path | None:
    """A folder or file named by a plain path or a file:// URL; None for http(s)."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return Path(url2pathname(parts.path))
    if parts.scheme in ("", ) or (len(parts.scheme) == 1 and os.name == "nt"):
        return Path(url).expanduser()
    return None


def _links_in_page(net: _Net, url: str) -> list[tuple[str, str]]:
    """(file name, absolute URL) of every file a simple-index page or find-links page lists."""
    local = _local_path(url)
    if local is not None:
        if local.is_dir():
            page = local / "index.html"
            if not page.is_file():  # a plain folder of files
                return [(p.name, p.resolve().as_uri()) for p in sorted(local.iterdir()) if p.is_file()]
            local, url = page, page.resolve().as_uri()
        if not local.is_file():
            raise FileNotFoundError(f"{local} does not exist")
        body, ctype = local.read_bytes(), "text/html"
    else:
        with net.open(url, accept=SIMPLE_ACCEPT) as resp:
            body, ctype = resp.read(), resp.headers.get("Content-Type", "")
            url = resp.geturl()
    if "json" in ctype:
        data = json.loads(body)
        return [(f["filename"], urljoin(url, f["url"])) for f in data.get("files", [])]
    parser = _Links()
    parser.feed(body.decode("utf-8", errors="replace"))
    return [(text if text and "/" not in text else _filename_of(href), urljoin(url, href))
            for text, href in parser.links]


def _candidate_urls(settings: IndexSettings, pin: dict[str, str], net: _Net, tried: list[str]) -> Iterator[str]:
    """URLs of the pinned sdist: find-links first (local, as pip prefers them), then each index."""
    want = pin["sdist"]
    pages = list(settings.find_links)
    if not settings.no_index:
        pages += [u.rstrip("/") + "/" + normalize_name(pin["package"]) + "/" for u in settings.index_urls]
    for page in pages:
        try:
            links = _links_in_page(net, page)
        except urllib.error.HTTPError as e:
            tried.append(f"{redact(page)}: HTTP {e.code} {e.reason}")
            continue
        except (urllib.error.URLError, OSError, ValueError, json.JSONDecodeError) as e:
            tried.append(f"{redact(page)}: {getattr(e, 'reason', e)}")
            continue
        hits = [u for name, u in links if name == want]
        if not hits:
            tried.append(f"{redact(page)}: lists no {want}")
        yield from hits


def _download_to(net: _Net, url: str, target: Path, expect_sha256: str) -> None:
    """Copy url to target through a .partial file, checking the sha256; target appears only when it is right."""
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    h = hashlib.sha256()
    try:
        local = _local_path(url)
        src = open(local, "rb") if local is not None else net.open(url)
        with src, open(partial, "wb") as out:
            total = int(getattr(src, "headers", {}).get("Content-Length") or 0) if local is None else local.stat().st_size
            done, shown = 0, 0.0
            for chunk in iter(lambda: src.read(1 << 20), b""):
                out.write(chunk)
                h.update(chunk)
                done += len(chunk)
                if total and done / total - shown >= 0.25:
                    shown = done / total
                    print(f"pyllama_pp: {done / 1e6:.0f} / {total / 1e6:.0f} MB", file=sys.stderr)
        got = h.hexdigest()
        if got != expect_sha256:
            raise FetchError(f"{redact(url)} is not the pinned {target.name}: sha256 {got}, expected {expect_sha256}")
        os.replace(partial, target)
    finally:
        if partial.exists():
            partial.unlink()


def offline_help(pin: dict[str, str]) -> str:
    """What to do where the sdist cannot be downloaded: the file, how to get it, how to point the build at it."""
    spec = f"{pin['package']}=={pin['version']}"
    return (
        f"The build needs {pin['sdist']} (sha256 {pin['sha256']}, about 77 MB), the source package of {spec}.\n"
        "Fix, on a machine that reaches PyPI (either line):\n"
        f"    python3 -m pip download --no-deps --no-binary {pin['package']} {spec} -d DIR\n"
        "    python3 vendor/llama.cpp/fetch.py --download DIR\n"
        "then copy it here and build with\n"
        f"    PYLLAMA_PP_UPSTREAM_ARCHIVE=/path/to/{pin['sdist']}   (a file, its folder, or a file:// URL)\n"
        "or put it in a folder pip already searches (PIP_FIND_LINKS=DIR, or find-links in pip.conf). A trimmed\n"
        "archive (2-3 MB) written by 'fetch.py --write-trimmed OUT.tar.xz' on a machine that has built once works too."
    )


def download_sdist(pin: dict[str, str], dest: Path, settings: IndexSettings | None = None) -> Path:
    """Download the pinned sdist into dest, from the user's find-links and indexes, verified by its sha256."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / pin["sdist"]
    if target.exists() and sha256_file(target) == pin["sha256"]:
        return target
    settings = settings or index_settings()
    net = _Net(settings)
    tried: list[str] = []
    print(f"pyllama_pp: fetching {pin['sdist']} (source package of the pinned llama.cpp, ~77 MB) into {dest}",
          file=sys.stderr)
    for url in _candidate_urls(settings, pin, net, tried):
        try:
            _download_to(net, url, target, pin["sha256"])
            return target
        except FetchError as e:
            tried.append(str(e))
        except urllib.error.HTTPError as e:
            tried.append(f"{redact(url)}: HTTP {e.code} {e.reason}")
        except (urllib.error.URLError, OSError) as e:
            tried.append(f"{redact(url)}: {getattr(e, 'reason', e)}")
    where = "\n".join(f"  - {t}" for t in tried) or "  (no index to try: no-index is set and no find-links)"
    how = ", ".join(settings.sources) or "pip's default"
    raise FetchError(f"could not download {pin['sdist']}. Tried (index settings from {how}):\n{where}\n"
                     + offline_help(pin))


def _archive_from_env(value: str, pin: dict[str, str]) -> Path:
    """PYLLAMA_PP_UPSTREAM_ARCHIVE: a file, a folder holding the sdist or one trimmed archive, or a file:// URL."""
    path = _local_path(value)
    if path is None:
        raise FetchError(f"PYLLAMA_PP_UPSTREAM_ARCHIVE={value} is not a local path. Fix: give a file, a folder or a "
                         "file:// URL (for a remote index use PIP_INDEX_URL / PIP_FIND_LINKS instead).")
    if path.is_dir():
        if (path / pin["sdist"]).is_file():
            return path / pin["sdist"]
        trimmed = [p for p in sorted(path.glob("*.tar.xz")) if _is_trimmed(p)]
        if len(trimmed) == 1:
            return trimmed[0]
        raise FetchError(f"PYLLAMA_PP_UPSTREAM_ARCHIVE={value} is a folder without {pin['sdist']} "
                         f"({len(trimmed)} trimmed archives in it). Fix: put the sdist there, or name the file.\n"
                         + offline_help(pin))
    if not path.is_file():
        raise FetchError(f"PYLLAMA_PP_UPSTREAM_ARCHIVE={value} does not name a file. Fix: give the path of the "
                         "sdist or of a trimmed .tar.xz, or unset it to download.\n" + offline_help(pin))
    return path


def _members_from_sdist(archive: Path, pin: dict[str, str]):
    prefix = pin["tree_prefix"]
    with tarfile.open(archive, "r:*") as tar:
        for m in tar:
            if m.isfile() and m.name.startswith(prefix):
                rel = m.name[len(prefix):]
                if wanted(rel):
                    yield rel, tar.extractfile(m).read(), m.mode


def _members_from_trimmed(archive: Path):
    with tarfile.open(archive, "r:*") as tar:
        for m in tar:
            if m.isfile() and m.name != MANIFEST:
                yield m.name, tar.extractfile(m).read(), m.mode


def _check_sdist(archive: Path, pin: dict[str, str]) -> None:
    got = sha256_file(archive)
    if got != pin["sha256"]:
        raise FetchError(
            f"checksum mismatch for {archive}:\n  expected {pin['sha256']}\n  got      {got}\n"
            "Fix: delete the file (it is corrupt or not the pinned release) and run the build again, "
            "or point PYLLAMA_PP_UPSTREAM_ARCHIVE at the genuine " + pin["sdist"] + "."
        )


def _is_trimmed(archive: Path) -> bool:
    try:
        with tarfile.open(archive, "r:*") as tar:
            first = tar.next()
            return first is not None and first.name == MANIFEST
    except tarfile.TarError as e:
        raise FetchError(f"{archive} is not a readable tar archive ({e}). Fix: delete it and fetch again.")


def extract(archive: Path, pin: dict[str, str], dest: Path) -> str:
    """Extract the selected files into dest (which must not exist), verify, return the tree hash."""
    trimmed = _is_trimmed(archive)
    if not trimmed:
        _check_sdist(archive, pin)
    members = _members_from_trimmed(archive) if trimmed else _members_from_sdist(archive, pin)
    files: dict[str, str] = {}
    try:
        for rel, data, mode in members:
            if rel.startswith("/") or ".." in Path(rel).parts:
                raise FetchError(f"{archive}: unsafe path {rel!r} in archive")
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            os.chmod(out, (mode & 0o777) | 0o600)
            files[rel] = hashlib.sha256(data).hexdigest()
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        raise FetchError(f"{archive} is damaged ({e}). Fix: delete it and fetch again.")
    got = tree_hash(files)
    want = pin.get("tree_sha256")
    if want and got != want:
        raise FetchError(
            f"the upstream tree extracted from {archive} does not match the pin:\n  expected tree "
            f"{want}\n  got tree      {got}\nFix: use the genuine {pin['sdist']} or a trimmed archive "
            "written by this fetch.py."
        )
    return got


def source_archive(pin: dict[str, str], need_sdist: bool = False) -> Path:
    """The archive the tree comes from: PYLLAMA_PP_UPSTREAM_ARCHIVE (a file, a folder or a file:// URL) or the sdist
    downloaded into the cache. need_sdist: the whole sdist, checked against the pin (for files the trimmed archive
    leaves out); a trimmed archive is refused then."""
    env = os.environ.get("PYLLAMA_PP_UPSTREAM_ARCHIVE")
    archive = _archive_from_env(env, pin) if env else download_sdist(pin, cache_dir() / "dl")
    if need_sdist:
        if _is_trimmed(archive):
            raise FetchError(f"{archive} is a trimmed archive, and this needs the whole sdist. Fix: give "
                             f"{pin['sdist']} in PYLLAMA_PP_UPSTREAM_ARCHIVE, or unset it to download.")
        _check_sdist(archive, pin)
    return archive


def ensure_tree(pin: dict[str, str] | None = None) -> Path:
    """Return the path of the verified, extracted upstream tree, fetching it if needed."""
    pin = pin or read_pin()
    root = cache_dir() / "upstream" / f"{pin['commit'][:12]}-{pin.get('tree_sha256', 'unpinned')[:12]}"
    if (root / ".complete").exists():
        return root
    archive = source_archive(pin)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root.parent))
    try:
        extract(archive, pin, tmp)
        (tmp / ".complete").write_text(pin["commit"] + "\n")
        if root.exists():
            shutil.rmtree(root)
        tmp.rename(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def write_trimmed(tree: Path, out: Path, pin: dict[str, str]) -> None:
    files = {}
    paths = sorted(p for p in tree.rglob("*") if p.is_file() and p.name != ".complete")
    for p in paths:
        files[p.relative_to(tree).as_posix()] = sha256_file(p)
    manifest = json.dumps({"commit": pin["commit"], "sdist_sha256": pin["sha256"],
                           "tree_sha256": tree_hash(files)}, indent=1).encode()
    with tarfile.open(out, "w:xz", preset=6) as tar:
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        for p in paths:
            tar.add(p, arcname=p.relative_to(tree).as_posix(), recursive=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--download", metavar="DIR", type=Path,
                    help="download the verified sdist into DIR and print its path (nothing is extracted)")
    ap.add_argument("--write-trimmed", metavar="OUT.tar.xz", type=Path,
                    help="also write a trimmed archive of the extracted tree (2-3 MB) for offline machines")
    ap.add_argument("--tree-hash", action="store_true", help="print the tree hash of the selected files")
    args = ap.parse_args(argv)
    pin = read_pin()
    try:
        if args.download:
            print(download_sdist(pin, args.download))
            return 0
        if args.tree_hash:
            pin = dict(pin)
            pin.pop("tree_sha256", None)
            with tempfile.TemporaryDirectory() as tmp:
                print(extract(source_archive(pin), pin, Path(tmp)))
            return 0
        tree = ensure_tree(pin)
        if args.write_trimmed:
            write_trimmed(tree, args.write_trimmed, pin)
            print(f"wrote {args.write_trimmed} ({args.write_trimmed.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
        print(tree)
    except FetchError as e:
        print(f"pyllama_pp fetch error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
