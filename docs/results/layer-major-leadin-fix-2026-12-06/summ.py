import sys, glob, statistics as st
def parse(f):
    rows=[l.split() for l in open(f) if l.startswith('TSTAMP')]
    segs=[]; cur=None
    for _,w,t in rows:
        t=float(t)
        if w=='decode_start': cur={'t0':t}; segs.append(cur); continue
        if cur is None: continue
        if w=='vdev_compute':
            cur.setdefault('first', t)
            continue
        cur.setdefault(w+'_first', t); cur[w]=t
    out=[]
    for s in segs:
        if 'first' not in s: continue
        lead=(s['first']-s['t0'])*1e3
        if 'group_begin' in s:
            if 'restore' in s:   # old
                inp=(s['ub_inputs_set']-s['ub_build_first'])*1e3; rest=(s['compute']-s['restore'])*1e3
            else:
                inp=(s['inputs_set']-s['allocated'])*1e3; rest=0.0
            out.append((lead, inp, rest))
        else:
            out.append((lead, None, None))
    return out
for pat in sys.argv[1:]:
    leads=[]; inps=[]; rests=[]
    for f in sorted(glob.glob(pat)):
        segs=parse(f)
        for lead,inp,rest in segs[2:]:   # skip the context's first decode and the warm-up prompt
            leads.append(lead)
            if inp is not None: inps.append(inp); rests.append(rest)
    fmt=lambda v: f"{st.median(v):7.0f} [{min(v):.0f}-{max(v):.0f}]" if v else "      -"
    print(f"{pat:40s} n={len(leads):2d} lead-in {fmt(leads)}  inputs {fmt(inps)}  restore {fmt(rests)}")
