#!/usr/bin/env bash
# Call A (device run, carry [".upstream", ".whl"]): build, the preset, then fit with no switch at the margin
# (the expert cache auto, workload chat: its alternatives and choice), the plan for decode alone, and the defaults'
# decode A/B: each variant with its own fit (upstream's: no cache), tg128 @ d2048.
source docs/results/defaults-gpu-2026-12-07/common.sh
timeout $(( $(left) - 30 )) /tmp/pp fit $M --devices cuda:0 --margin $MARGIN -c 4096 -o /tmp/A/plan-chat.json \
    2>&1 | tee /tmp/A/plan-chat.txt | tail -22
echo "== decode workload ($(left) s left)"
timeout $(( $(left) - 30 )) /tmp/pp fit $M --devices cuda:0 --margin $MARGIN -c 4096 --workload decode -o /tmp/A/plan-decode.json \
    2>&1 | tee /tmp/A/plan-decode.txt | grep -A12 "memory:"
echo "== ab defaults ($(left) s left)"
timeout $(( $(left) - 20 )) /tmp/pp ab $M --devices cuda:0 --fit each --margin $MARGIN -p 0 -n 128 -d 2048 -r 3 -o /tmp/A/ab-default \
    2>&1 | tee /tmp/A/ab-default.txt | tail -12
cp -r /tmp/pp_cache/compute /tmp/A/probe 2>/dev/null; rm -f /tmp/A/probe/*.gguf
tar czf $OUT/A.tgz -C /tmp A; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
