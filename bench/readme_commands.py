#!/usr/bin/env python3
"""Run every command of the README's fenced shell blocks, as written, so that the docs cannot drift.

The blocks of "Using it" run in order in one empty folder (later commands use the files earlier ones wrote);
a command whose comment starts with "GPU" runs only where the build has a CUDA backend and is reported as skipped
otherwise. The quick start's two commands are not run here: `.ci/run` runs them verbatim and checks that the README
holds exactly them. The install blocks (the offline route) run with `--install` only, from the checkout, with the
placeholder DIR standing for a fresh folder: they download the pinned sdist and build the package again.

Exit 1 when any command fails; a table of command, exit code and seconds on stdout (`--json`: one document).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pyllama_pp.binding import backend_modules

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def blocks(text: str) -> list[tuple[str, list[str]]]:
    """(section heading, command lines) of each ```sh block, comments and blank lines dropped, each line kept with
    its trailing comment (which can mark it GPU)."""
    out, section = [], ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            section = line.lstrip("# ").strip()
        if line.strip() == "```sh":
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                if lines[i].strip() and not lines[i].strip().startswith("#"):
                    body.append(lines[i].strip())
                i += 1
            out.append((section, body))
        i += 1
    return out


def split_comment(line: str) -> tuple[str, str]:
    """The command and its trailing comment ("# ..." outside quotes)."""
    in_quote, q = False, ""
    for k, ch in enumerate(line):
        if ch in "'\"" and (not in_quote or ch == q):
            in_quote, q = (not in_quote), ch
        elif ch == "#" and not in_quote and (k == 0 or line[k - 1] == " "):
            return line[:k].rstrip(), line[k + 1:].strip()
    return line, ""


def commands(text: str, install: bool) -> list[dict]:
    """The commands to run: {"cmd", "where" (usage|install), "gpu"}."""
    out = []
    for section, body in blocks(text):
        if section.startswith("Quick start"):
            continue   # (.ci/run runs these verbatim)
        where = "usage" if section.startswith("Using it") else "install"
        if where == "install" and not install:
            continue
        for line in body:
            cmd, comment = split_comment(line)
            out.append({"cmd": cmd, "where": where, "gpu": comment.startswith("GPU"), "section": section})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="also run the install blocks (a download and a rebuild)")
    ap.add_argument("--keep", type=Path, help="run in this folder (kept) instead of a temporary one")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per command (default: 600)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    todo = commands(README.read_text(), args.install)
    cuda = "CUDA" in backend_modules()
    tmp = tempfile.TemporaryDirectory(prefix="readme-")
    work = args.keep or Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    dl = Path(tmp.name) / "download"
    rows, failed = [], 0
    if not args.json:
        print("| command | exit | seconds |\n| --- | ---: | ---: |")
    for c in todo:
        cmd = c["cmd"].replace(" DIR", f" {dl}").replace("DIR/", f"{dl}/")
        if c["gpu"] and not cuda:
            row = {"command": c["cmd"], "exit": None, "seconds": 0.0, "note": "skipped: no CUDA backend in this build"}
        else:
            t0 = time.time()
            try:
                res = subprocess.run(["bash", "-c", cmd], cwd=work if c["where"] == "usage" else ROOT,
                                     capture_output=True, text=True, timeout=args.timeout,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
                code, tail = res.returncode, (res.stderr or res.stdout)[-1500:]
            except subprocess.TimeoutExpired:
                code, tail = 124, f"timed out after {args.timeout:.0f} s"
            row = {"command": c["cmd"], "exit": code, "seconds": round(time.time() - t0, 1)}
            if code != 0:
                failed += 1
                row["stderr_tail"] = tail
        rows.append(row)
        if not args.json:
            shown = row["command"] if len(row["command"]) <= 110 else row["command"][:107] + "..."
            print(f"| `{shown}` | {'skipped' if row['exit'] is None else row['exit']} | {row['seconds']} |", flush=True)
            if row.get("stderr_tail"):
                print("    " + "\n    ".join(row["stderr_tail"].strip().splitlines()[-6:]), file=sys.stderr)
    ran = sum(1 for r in rows if r["exit"] is not None)
    if args.json:
        print(json.dumps({"rows": rows, "ran": ran, "failed": failed}, indent=1))
    else:
        print(f"\n{ran} of {len(rows)} README commands ran, {failed} failed"
              + (f", {len(rows) - ran} skipped (no CUDA)" if ran < len(rows) else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
