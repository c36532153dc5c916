#!/bin/bash
# usage: drive.sh P UB ROUNDS  -> /tmp/lf/ts_P_UB.txt lines: round variant LM avg_ts stddev leadins (ms)
# old: /tmp/lf/venv-old, main with the first study's stamps.diff less its extra restore passes; new: this branch with
# the same stamps at build_group's steps (temporary, not committed); then: python summ.py '/tmp/lf/run_16384_new_1_*.txt'
P=$1; UB=$2; R=$3; out=/tmp/lf/ts_${P}_${UB}.txt; : > $out
order=("old 1" "new 1" "new 0")
for r in $(seq 1 $R); do
  if [ $((r % 2)) = 0 ]; then seq_=(2 1 0); else seq_=(0 1 2); fi
  for k in "${seq_[@]}"; do set -- ${order[$k]}; v=$1; LM=$2
    if [ $v = old ]; then . /tmp/lf/venv-old/bin/activate; else . /work/venv-leadfix/bin/activate; fi
    f=/tmp/lf/run_${P}_${v}_${LM}_$r.txt; rm -f $f
    PP_TSTAMP=$f pyllama-pp run /tmp/lf/tiny.gguf --devices "vdev:1x4GiB@16GBps" -p $P -n 0 -b $P -ub $UB -r 3 --switch LAYER_MAJOR=$LM --json > ${f%.txt}.json
    python - $f ${f%.txt}.json $r $v $LM >> $out <<'PY'
import json, sys
f, j, r, v, lm = sys.argv[1:]
d = json.load(open(j)); row = [x for x in d["rows"] if x["test"].startswith("pp")][0]
rows = [l.split() for l in open(f) if l.startswith("TSTAMP")]
leads = []; t0 = None
for _, w, t in rows:
    t = float(t)
    if w == "decode_start": t0 = t
    elif w == "vdev_compute" and t0 is not None: leads.append((t - t0) * 1e3); t0 = None
print(r, v, lm, f"{row['avg_ts']:.1f}", f"{row['stddev_ts']:.1f}", " ".join(f"{x:.0f}" for x in leads))
PY
  done
done
