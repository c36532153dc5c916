#!/usr/bin/env python3
"""Lay out the baseline and patched upstream trees for the superbuild.

    <work>/baseline/src   pristine copy of the pinned tree
    <work>/patched/src    the same + the extension's own files (patches/sources: copied from
                          pyllama_pp/native/sched/ to their paths in the tree) + every patch in
                          patches/series, applied in order (the patches change upstream files only)

Files whose content did not change keep their timestamps, so a rebuild after editing one patch or
source file recompiles only what it touches. A patch that does not apply stops with its name.
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


class PatchError(RuntimeError):
    pass


def read_series(series: Path) -> list[Path]:
    names = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(series.parent / line)
    missing = [str(p) for p in names if not p.is_file()]
    if missing:
        raise PatchError(f"{series} names patches that do not exist: {', '.join(missing)}")
    return names


def read_sources(manifest: Path) -> list[tuple[Path, str, str]]:
    """patches/sources: (our file, its path in the upstream tree, the NNNN of the patch whose commit adds it).

    Our files are named relative to the repository (the folder above patches/)."""
    root = manifest.parent.parent
    entries = []
    for n, line in enumerate(manifest.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        cols = line.split()
        if len(cols) != 3 or not re.fullmatch(r"\d{4}", cols[2]):
            raise PatchError(f"{manifest}:{n}: expected 'FILE PATH_IN_TREE NNNN', got {line!r}")
        entries.append((root / cols[0], cols[1], cols[2]))
    missing = [str(src) for src, _, _ in entries if not src.is_file()]
    if missing:
        raise PatchError(f"{manifest} names files that do not exist: {', '.join(missing)}")
    return entries


def copy_sources(tree: Path, sources: list[tuple[Path, str, str]]) -> None:
    """Our files into the tree at their upstream paths; they must be new there (the patches never create them)."""
    for src, dest, _ in sources:
        q = tree / dest
        if q.exists():
            raise PatchError(f"{src.name} would replace {dest}, a file of the pinned tree: our files must be new there "
                             "(change an upstream file with a patch instead)")
        q.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, q)   # (a fresh mtime, as a patched file gets: sync() writes it only if it changed)


def apply_patch(tree: Path, patch: Path) -> None:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))  # never treat our repo as the target
    git = shutil.which("git")
    if git:
        cmd = [git, "apply", "-p1", "--whitespace=nowarn", str(patch)]
    elif shutil.which("patch"):
        cmd = ["patch", "-p1", "--forward", "--batch", "-i", str(patch)]
    else:
        raise PatchError("neither git nor patch is installed: install one of them (apt-get install git)")
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise PatchError(f"patch {patch.name} does not apply to the pinned tree:\n{res.stderr.strip()}\n"
                         f"Fix: rebase {patch.name} on the pinned tree (vendor/llama.cpp/PIN) or remove it from "
                         "patches/series.")


def sync(src: Path, dst: Path) -> int:
    """Make dst identical to src, touching only files whose content differs. Returns files written."""
    n = 0
    want = set()
    for p in src.rglob("*"):
        rel = p.relative_to(src)
        want.add(rel)
        q = dst / rel
        if p.is_dir():
            q.mkdir(parents=True, exist_ok=True)
        elif not q.is_file() or not filecmp.cmp(p, q, shallow=False):
            q.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, q)
            n += 1
    for q in sorted(dst.rglob("*"), reverse=True):
        if q.relative_to(dst) not in want:
            q.unlink() if not q.is_dir() else shutil.rmtree(q)
            n += 1
    return n


def stamp_of(upstream: Path, patches: list[Path], sources: list[tuple[Path, str, str]] = ()) -> str:
    h = hashlib.sha256(str(upstream).encode())
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    for src, dest, _ in sources:
        h.update(dest.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()


def write_pin_json(out: Path, pin_file: Path, patches: list[Path]) -> None:
    """The pin and the series the build used, for `pyllama-pp info` (read as fetch.py and this script read them)."""
    sys.path.insert(0, str(pin_file.parent))
    from fetch import read_pin  # vendor/llama.cpp/fetch.py
    out.write_text(json.dumps({"pin": read_pin(pin_file), "patches": [p.name for p in patches]}, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--upstream", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--series", type=Path, required=True)
    ap.add_argument("--sources", type=Path, help="patches/sources: the extension's own files, copied in first")
    ap.add_argument("--pin", type=Path, help="vendor/llama.cpp/PIN, for --pin-json")
    ap.add_argument("--pin-json", type=Path, help="also write the pin and the series as JSON here")
    args = ap.parse_args(argv)
    try:
        patches = read_series(args.series)
        sources = read_sources(args.sources) if args.sources else []
        if args.pin_json and args.pin:
            write_pin_json(args.pin_json, args.pin, patches)
        stamp = stamp_of(args.upstream, patches, sources)
        stamp_file = args.work / "trees.stamp"
        if stamp_file.exists() and stamp_file.read_text() == stamp:
            return 0
        args.work.mkdir(parents=True, exist_ok=True)
        sync(args.upstream, args.work / "baseline" / "src")
        with tempfile.TemporaryDirectory(dir=args.work) as tmp:
            tree = Path(tmp) / "src"
            shutil.copytree(args.upstream, tree, symlinks=True)
            copy_sources(tree, sources)
            for p in patches:
                apply_patch(tree, p)
            n = sync(tree, args.work / "patched" / "src")
        stamp_file.write_text(stamp)
        print(f"pyllama_pp: patched tree: {len(sources)} source files, {len(patches)} patches, {n} files updated",
              file=sys.stderr)
    except PatchError as e:
        print(f"pyllama_pp patch error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
