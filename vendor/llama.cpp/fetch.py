#!/usr/bin/env python3
"""Fetch, verify and extract the pinned upstream llama.cpp tree (stdlib only).

The tree is the ``vendor/llama.cpp/`` folder of the PyPI source package named in ``PIN``.
Nothing of it is committed: it is downloaded with pip into a cache outside the repository,
checked against the pinned sha256, and only the parts the build needs are extracted.

Usage:
    fetch.py                       extract (if needed) and print the tree's path
    fetch.py --write-trimmed F     also write a trimmed .tar.xz (a few MB) for offline machines
    fetch.py --tree-hash           print the hash of the selected files (to update PIN)

Environment:
    PYLLAMA_PP_UPSTREAM_ARCHIVE    a local sdist or trimmed .tar.xz to use instead of downloading
    PYLLAMA_PP_CACHE               cache folder (default ~/.cache/pyllama_pp)
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

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
    return Path(os.environ.get("PYLLAMA_PP_CACHE") or Path.home() / ".cache" / "pyllama_pp")


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


def download_sdist(pin: dict[str, str], dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / pin["sdist"]
    if target.exists():
        return target
    spec = f"{pin['package']}=={pin['version']}"
    print(f"pyllama_pp: downloading {spec} (source package, ~77 MB) into {dest}", file=sys.stderr)
    # --no-binary for this package only (build dependencies keep their wheels);
    # --no-build-isolation so pip does not build its build backend from source.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
           "--no-binary", pin["package"], spec, "-d", str(dest)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not target.exists():
        raise FetchError(
            f"could not download {spec} with pip (exit {res.returncode}):\n{res.stderr[-2000:]}\n"
            "Fix: check the network/PyPI access, or download the sdist elsewhere and set "
            "PYLLAMA_PP_UPSTREAM_ARCHIVE=/path/to/" + pin["sdist"] + " (or a trimmed .tar.xz made by "
            "'fetch.py --write-trimmed')."
        )
    return target


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
        got = sha256_file(archive)
        if got != pin["sha256"]:
            raise FetchError(
                f"checksum mismatch for {archive}:\n  expected {pin['sha256']}\n  got      {got}\n"
                "Fix: delete the file (it is corrupt or not the pinned release) and run the build again, "
                "or point PYLLAMA_PP_UPSTREAM_ARCHIVE at the genuine " + pin["sdist"] + "."
            )
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


def ensure_tree(pin: dict[str, str] | None = None) -> Path:
    """Return the path of the verified, extracted upstream tree, fetching it if needed."""
    pin = pin or read_pin()
    root = cache_dir() / "upstream" / f"{pin['commit'][:12]}-{pin.get('tree_sha256', 'unpinned')[:12]}"
    if (root / ".complete").exists():
        return root
    archive_env = os.environ.get("PYLLAMA_PP_UPSTREAM_ARCHIVE")
    if archive_env:
        archive = Path(archive_env).expanduser()
        if not archive.is_file():
            raise FetchError(f"PYLLAMA_PP_UPSTREAM_ARCHIVE={archive_env} does not name a file. "
                             "Fix: give the path of the sdist or of a trimmed .tar.xz, or unset it to download.")
    else:
        archive = download_sdist(pin, cache_dir() / "dl")
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
    ap.add_argument("--write-trimmed", metavar="OUT.tar.xz", type=Path)
    ap.add_argument("--tree-hash", action="store_true", help="print the tree hash of the selected files")
    args = ap.parse_args(argv)
    pin = read_pin()
    try:
        if args.tree_hash:
            pin = dict(pin)
            pin.pop("tree_sha256", None)
            with tempfile.TemporaryDirectory() as tmp:
                archive = Path(os.environ.get("PYLLAMA_PP_UPSTREAM_ARCHIVE") or download_sdist(pin, cache_dir() / "dl"))
                print(extract(archive, pin, Path(tmp)))
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
