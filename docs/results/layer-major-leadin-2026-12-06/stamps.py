import sys
rows=[l.split() for l in open(sys.argv[1]) if l.startswith('TSTAMP')]
t0=None; prev=None; first_vdev=False
for _,w,t in rows:
    t=float(t)
    if w=='decode_start': t0=t; prev=t; first_vdev=True; print('---'); continue
    if t0 is None: continue
    if w=='vdev_compute':
        if not first_vdev: continue
        first_vdev=False
    print(f"{w:14s} +{(t-t0)*1e3:9.1f} ms  (step {(t-prev)*1e3:8.1f})"); prev=t
