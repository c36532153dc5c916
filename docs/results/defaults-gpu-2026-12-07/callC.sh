#!/usr/bin/env bash
# Call C (device run, carry [".upstream", ".whl", ".cuda"]): prompts with the defaults on a 24-layer model of the
# 30B-A3B shape (locality routing; 16 GB, written in half the time of the full preset), ~6 GiB of the GPU for it:
# the patched build with -ub auto (fit weighs LAYER_MAJOR and the pair), the hand-set LAYER_MAJOR=1 / 0 rows, upstream
# with its own fit, and every weight in VRAM (the ceiling), pp16384 (and PP=... lengths).
N_LAYER=24 MODEL=q24-loc SPARE_GIB=6 source docs/results/defaults-gpu-2026-12-07/common.sh
mkdir -p /tmp/C
row() {  # NAME ARGS...: one run, its table's last line
  local name=$1; shift; [ $(left) -lt 70 ] && { echo "== $name skipped: $(left) s left"; return; }
  echo "== $name ($(left) s left)"
  timeout $(( $(left) - 25 )) /tmp/pp run $M --devices cuda:0 -n 0 -r 2 "$@" -o /tmp/C/$name > /tmp/C/$name.txt 2>&1
  grep -E "layer major|memory:|^patched|^baseline" /tmp/C/$name.txt | cut -c1-220 | tail -4
}
for p in ${PP:-16384}; do
  row default-pp$p   --margin $MARGIN -p $p -ub auto   # (-ub auto makes its own plan: no --fit)
  row lm1-pp$p       --fit --margin $MARGIN -p $p -b $p -ub 4096 --switch LAYER_MAJOR=1
  row lm0-pp$p       --fit --margin $MARGIN -p $p -b $p -ub 8192 --switch LAYER_MAJOR=0
  row upstream-pp$p  --variant baseline --fit --margin $MARGIN -p $p -b $p -ub 8192
  row vram-pp$p      --variant baseline --host-experts none -p $p -b $p -ub 4096
done
cp -r $PYLLAMA_PP_CACHE/compute /tmp/C/probe 2>/dev/null   # (the compute probe's rows: its prompt predictions' inputs)
tar czf $OUT/C.tgz -C /tmp C; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
