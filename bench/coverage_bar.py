#!/usr/bin/env python3
"""Upload-all's coverage bar (patch 0005): at which expert coverage does uploading every expert beat copying the
used ones after a routing-id readback per layer?

Tiny preset with skewed routing (skews 0.15 / 0.3 / 0.5 / 0.8: about 79 / 65 / 46 / 32% of the experts per layer
per ubatch of 64), two VDEVs with dedicated 0.1 GB/s links (the main job's devices), ts 3,5, pp1024 / ub64;
the patched build with the default (auto) bar, the old 85% bar and coverage ignored (always upload all), each
against its own baseline run. Rows into bench/out/coverage_bar/ (results.jsonl, results.md) unless --out says.
  python bench/coverage_bar.py [--reps N] [--devices SPEC --out DIR]   (e.g. one shared link: "vdev:2x256MiB@0.1GBps,shared")
--direct adds patch 0008 (DIRECT=2: below the bar the devices read the used experts from pinned host memory, no
readbacks); its rows go to bench/out/coverage_bar_direct/ unless --out says otherwise.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import _common as C
from pyllama_pp import runner

SKEWS = (0.15, 0.3, 0.5, 0.8)
SETTINGS = (("auto bar (default)", {}), ("bar 85% (old)", {"UPLOAD_ALL_MIN_COV": 85}), ("upload all", {"UPLOAD_ALL_MIN_COV": 0}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per test (default 2)")
    ap.add_argument("--out", type=Path, default=C.OUT / "coverage_bar",
                    help="output folder (default bench/out/coverage_bar, or bench/out/coverage_bar_direct with --direct)")
    ap.add_argument("--devices", default=C.DEFAULT_DEVICES, help=f"device spec (default {C.DEFAULT_DEVICES})")
    ap.add_argument("--direct", action="store_true", help="also the auto bar with DIRECT=2 (patch 0008)")
    args = ap.parse_args()
    settings = SETTINGS + ((("auto bar + DIRECT=2", {"DIRECT": 2}),) if args.direct else ())
    if args.direct and args.out == ap.get_default("out"):
        args.out = args.out.parent / "coverage_bar_direct"
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("results.jsonl", "results.csv", "results.md"):
        (args.out / name).unlink(missing_ok=True)
    cfgs = [C.config(C.synth_model(routing="skewed", skew=skew), args.devices, ts=C.DEFAULT_TS, n_batch=1024,
                     n_ubatch=64, tests=[["pp", 1024]], reps=args.reps, switches=ext, label=f"skew {skew} | {name}")
            for skew in SKEWS for name, ext in settings]
    df = runner.ab(cfgs, out_dir=args.out, progress=True)
    rows = []
    for skew in SKEWS:
        cells = []
        for name, _ in settings:
            p = df[(df.label == f"skew {skew} | {name}") & (df.variant == "patched")].iloc[0]
            how = "upload-all" if (p.get("upload_all") or 0) > (p.get("id_readbacks") or 0) else "selective"
            how = "direct" if (p.get("direct_reads") or 0) > max(p.get("upload_all") or 0, p.get("id_readbacks") or 0) else how
            cells.append(f"{p['speedup']:.2f}x ({how}, {p['avg_ts']:.0f} t/s)")
        cov = df[df.label == f"skew {skew} | {SETTINGS[0][0]}"].coverage.dropna()
        rows.append([f"{skew}", f"{100 * cov.iloc[0]:.0f}%" if len(cov) else ""] + cells)
    table = C.md_table(["skew", "coverage", *[n for n, _ in settings]], rows, "rr" + "l" * len(settings))
    m = C.machine()
    text = (f"# Upload-all's coverage bar\n\n- command: `{C.command_line()}`\n"
            f"- devices: `{args.devices}`, ts 3,5, pp1024 / ub64, tiny preset with skewed routing\n"
            f"- machine: {m['cpu']}, nproc {m['nproc']}\n"
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n\n"
            "Speedup of the patched build over its own baseline run; in brackets what it did (more upload-all decisions "
            "than readbacks = upload-all; direct reads more than either = direct) and its t/s.\n\n" + table)
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
