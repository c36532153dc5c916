#!/usr/bin/env bash
# Call B (right after A, on the machine A left warm; carry [".upstream", ".whl", ".cuda"] in case it is fresh): the
# hand-set alternatives at the same margin, patched only (A ran the baseline with its own fit): decode tg128 @ d2048
# with the cache's size given (reserved before placing, so fit moves layers to host RAM for it) and with none.
source docs/results/defaults-gpu-2026-12-07/common.sh
mkdir -p /tmp/B
for size in ${SIZES:-0 1850MiB 3700MiB 5500MiB}; do
  [ $(left) -lt 100 ] && { echo "== $size skipped: $(left) s left"; continue; }
  echo "== --expert-cache $size ($(left) s left)"
  timeout $(( $(left) - 25 )) /tmp/pp run $M --devices cuda:0 --fit --margin $MARGIN -p 0 -n 128 -d 2048 -r 3 \
      --expert-cache $size -o /tmp/B/run-$size 2>&1 | tee /tmp/B/run-$size.txt | tail -4
done
tar czf $OUT/B.tgz -C /tmp B; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
