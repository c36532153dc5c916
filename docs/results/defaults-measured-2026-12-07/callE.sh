#!/usr/bin/env bash
# Call E (device run, carry [".upstream", ".whl", ".cuda"]): prompts pp16384 with the defaults on a 16-layer model of
# the 30B-A3B shape (locality routing), ~4 GiB of the GPU for it: `-ub auto` now runs the pairs it predicts close
# to the best and takes the fastest measured; beside it the hand-set LAYER_MAJOR=1 pairs and upstream with its own fit.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
mkdir -p /tmp/E
row() {  # NAME ARGS...: one run, its table's last lines
  local name=$1; shift; [ $(left) -lt 60 ] && { echo "== $name skipped: $(left) s left"; return; }
  echo "== $name ($(left) s left)"
  timeout $(( $(left) - 20 )) /tmp/pp run $M --devices cuda:0 "$@" -o /tmp/E/$name > /tmp/E/$name.txt 2>&1
  grep -E "layer major|measured|^    [ *] n_ubatch|^patched|^baseline|rror" /tmp/E/$name.txt | cut -c1-220 | tail -8
}
row default-pp16384   --margin $MARGIN -p 16384 -n 0 -r 2 -ub auto
row lm1-pp16384       --fit --margin $MARGIN -p 16384 -n 0 -r 2 -b 16384 -ub 1024,2048 --switch LAYER_MAJOR=1
row upstream-pp16384  --variant baseline --fit --margin $MARGIN -p 16384 -n 0 -r 2 -b 16384 -ub 8192
cp -r /tmp/pp_cache/compute /tmp/E/probe 2>/dev/null; rm -f /tmp/E/probe/*.gguf
tar czf $OUT/E.tgz -C /tmp E; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
