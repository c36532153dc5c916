#!/usr/bin/env python3
"""The patch series as a reviewer of upstream reads it: one commit per mechanism, its hooks and its own files.

pyllama_pp keeps the series in two parts: patches/*.patch (listed in patches/series) change upstream files only -
hooks, build lines, the few lines that must sit inside upstream functions - and the extension's own files live in
pyllama_pp/native/sched/ in their final form (patches/sources: each one's path in the tree and the patch whose
commit adds it). apply.py lays both out for the build. This script joins them, and splits such a series back:

    export.py git DIR       a git work tree of the pinned tree in DIR: the pristine tree, then one commit per patch
                            (its hooks and the files patches/sources gives it), its message the patch's header
    export.py mbox DIR      the same commits as git-format patches in DIR, with a series file (to send or review)
    export.py import DIR    back from such a work tree (edited, committed): its commits, without our files, ->
                            patches/*.patch and patches/series; our files at its HEAD -> pyllama_pp/native/sched/;
                            the commit that adds each of them -> the patch column of patches/sources

The shared files (the public header, the private header with every hook's declaration, the switch table) go into
the first commit in their final form, so a commit before the last builds only with the files of the later ones.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from apply import PatchError, read_series, read_sources  # noqa: E402  (patches/apply.py, beside this script)

BASE_DATE = "2000-01-01T00:00:00+00:00"   # the pristine commit's, so that a tree's commit ids repeat
IDENTITY = {"GIT_AUTHOR_NAME": "pyllama_pp", "GIT_AUTHOR_EMAIL": "pyllama_pp@users.noreply.invalid",
            "GIT_COMMITTER_NAME": "pyllama_pp", "GIT_COMMITTER_EMAIL": "pyllama_pp@users.noreply.invalid"}
FORMAT_PATCH = ["-c", "core.abbrev=7", "format-patch", "-q", "--no-signature", "--zero-commit", "-N"]


def git(tree: Path, *args: str, env: dict | None = None, text: bool = True) -> str:
    full = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent), GIT_CONFIG_NOSYSTEM="1", **IDENTITY,
                **(env or {}))
    res = subprocess.run(["git", *args], cwd=tree, env=full, capture_output=True, text=text)
    if res.returncode != 0:
        raise PatchError(f"git {' '.join(args[:3])} failed in {tree}:\n{res.stderr.strip()}")
    return res.stdout


def pinned_tree() -> Path:
    """The pinned upstream tree, as the build gets it (vendor/llama.cpp/fetch.py prints its path)."""
    fetch = HERE.parent / "vendor" / "llama.cpp" / "fetch.py"
    res = subprocess.run([sys.executable, str(fetch)], capture_output=True, text=True)
    if res.returncode != 0:
        raise PatchError(f"could not get the pinned tree:\n{res.stderr.strip()}")
    return Path(res.stdout.strip())


def make_tree(upstream: Path, out: Path, root: Path) -> Path:
    """The series as commits in a new git work tree `out`; returns it."""
    patches = read_series(root / "patches" / "series")
    sources = read_sources(root / "patches" / "sources")
    numbers = {p.name[:4] for p in patches}
    stray = sorted({n for _, _, n in sources} - numbers)
    if stray:
        raise PatchError(f"patches/sources gives files to patches {', '.join(stray)}, which are not in patches/series")
    if out.exists() and any(out.iterdir()):
        raise PatchError(f"{out} exists and is not empty: name a new folder")
    shutil.copytree(upstream, out, symlinks=True, dirs_exist_ok=True)
    marker = out / ".complete"   # (the cache's marker, not part of llama.cpp)
    pin = marker.read_text().strip() if marker.is_file() else "pinned"
    marker.unlink(missing_ok=True)
    git(out, "init", "-q")
    git(out, "add", "-A")
    base_env = {"GIT_AUTHOR_DATE": BASE_DATE, "GIT_COMMITTER_DATE": BASE_DATE}
    git(out, "commit", "-q", "--no-verify", "-m", f"llama.cpp {pin[:9]} (pinned, trimmed)", env=base_env)
    for patch in patches:
        try:
            git(out, "am", "-q", "--whitespace=nowarn", "--committer-date-is-author-date", str(patch))
        except PatchError as e:
            raise PatchError(f"{patch.name} does not apply to the pinned tree with the patches before it:\n{e}") from None
        mine = [(src, dest) for src, dest, n in sources if n == patch.name[:4]]
        for src, dest in mine:
            (out / dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out / dest)
        if mine:
            date = git(out, "log", "-1", "--format=%aI").strip()
            git(out, "add", "--", *[dest for _, dest in mine])
            git(out, "commit", "-q", "--no-verify", "--amend", "--no-edit", env={"GIT_COMMITTER_DATE": date})
    return out


def write_series(folder: Path, names: list[str]) -> None:
    (folder / "series").write_text("# pyllama_pp patch series, applied in order to the pinned tree (vendor/llama.cpp/PIN)\n"
                                   + "".join(n + "\n" for n in names))


def export_mbox(upstream: Path, out: Path, root: Path) -> list[Path]:
    """The series as git-format patches in `out` (hooks and new files together), with a series file."""
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("[0-9][0-9][0-9][0-9]-*.patch")):
        raise PatchError(f"{out} holds patches already: name a new or empty folder")
    with tempfile.TemporaryDirectory() as tmp:
        tree = make_tree(upstream, Path(tmp) / "llama", root)
        base = git(tree, "rev-list", "--max-parents=0", "HEAD").strip()
        git(tree, *FORMAT_PATCH, "-o", str(out.resolve()), f"{base}..HEAD")
    written = sorted(out.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    write_series(out, [p.name for p in written])
    return written


def import_tree(tree: Path, root: Path) -> list[str]:
    """A work tree made by make_tree (edited, committed) back into patches/ and our files; returns the patch names."""
    pdir = root / "patches"
    manifest = pdir / "sources"
    sources = read_sources(manifest)
    roots = git(tree, "rev-list", "--max-parents=0", "HEAD").split()
    if len(roots) != 1:
        raise PatchError(f"{tree}: expected one root commit (the pristine tree), found {len(roots)}")
    commits = git(tree, "rev-list", "--reverse", f"{roots[0]}..HEAD").split()
    # which commit adds each of our files: its patch number
    added: dict[str, str] = {}
    for i, c in enumerate(commits, 1):
        for f in git(tree, "diff-tree", "--no-commit-id", "--name-only", "-r", "--diff-filter=A", c).splitlines():
            added.setdefault(f, f"{i:04d}")
    missing = [dest for _, dest, _ in sources if dest not in added]
    if missing:
        raise PatchError(f"{tree}: no commit adds {', '.join(missing)} (patches/sources names them)")
    with tempfile.TemporaryDirectory() as tmp:
        excludes = [f":(exclude){dest}" for _, dest, _ in sources]
        git(tree, *FORMAT_PATCH, "-o", tmp, f"{roots[0]}..HEAD", "--", ".", *excludes)
        new = sorted(Path(tmp).glob("*.patch"))
        if len(new) != len(commits):
            raise PatchError(f"{tree}: {len(commits)} commits gave {len(new)} patches: a commit that changes only "
                             "our files has no patch of its own (fold it into its mechanism's commit)")
        for old in pdir.glob("[0-9][0-9][0-9][0-9]-*.patch"):
            old.unlink()
        for p in new:
            shutil.copyfile(p, pdir / p.name)
    names = [p.name for p in new]
    write_series(pdir, names)
    for src, dest, _ in sources:
        data = _blob(tree, dest)
        if not src.is_file() or src.read_bytes() != data:
            src.write_bytes(data)
    # the patch column follows the commit that adds each file (the rest of the manifest stays as it is)
    lines = []
    dests = {dest: added[dest] for _, dest, _ in sources}
    for line in manifest.read_text().splitlines():
        cols = line.split("#", 1)[0].split()
        if len(cols) == 3 and cols[1] in dests:
            line = re.sub(r"\d{4}(\s*(#.*)?)$", lambda m: dests[cols[1]] + m.group(1), line)
        lines.append(line)
    manifest.write_text("\n".join(lines) + "\n")
    return names


def _blob(tree: Path, path: str) -> bytes:
    res = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=tree, capture_output=True)
    if res.returncode != 0:
        raise PatchError(f"{tree}: HEAD has no {path}")
    return res.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["git", "mbox", "import"])
    ap.add_argument("dir", type=Path, help="the work tree (git, import) or the folder of patches (mbox)")
    ap.add_argument("--upstream", type=Path, help="the pinned tree (default: what vendor/llama.cpp/fetch.py prints)")
    ap.add_argument("--repo", type=Path, default=HERE.parent,
                    help="the pyllama_pp checkout whose patches/ and files are read or written (default: this one)")
    args = ap.parse_args(argv)
    try:
        if args.command == "import":
            names = import_tree(args.dir.resolve(), args.repo.resolve())
            print(f"patches/: {len(names)} patches; our files updated from {args.dir}", file=sys.stderr)
            return 0
        upstream = args.upstream or pinned_tree()
        if args.command == "git":
            tree = make_tree(upstream, args.dir.resolve(), args.repo.resolve())
            print(tree)
        else:
            for p in export_mbox(upstream, args.dir, args.repo.resolve()):
                print(p)
    except PatchError as e:
        print(f"export.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
