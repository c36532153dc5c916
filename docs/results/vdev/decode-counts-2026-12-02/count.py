import sys, json
from pyllama_pp.session import Session, Placement, ContextParams
variant, devices = sys.argv[1], sys.argv[2]
ext = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
M = "/tmp/pp_models_local/small-L12-uniform-s1.gguf"
s = Session(M, devices=devices, placement=Placement(host_experts="all"), ctx=ContextParams(n_ctx=256, n_batch=512, n_ubatch=512), variant=variant, ext_params=ext)
s.eval([1, 2, 3, 4], logits="last")
pos = 4
for i in range(4):   # warm-up tokens
    s.eval([5 + i], pos0=pos, clear=False, stats=False, logits="last"); pos += 1
s.reset_counters()
N = 32
for i in range(N):
    s.eval([9 + i], pos0=pos, clear=False, stats=False, logits="last"); pos += 1
c = s.device_counters()
keys = ("host_syncs", "event_records", "event_waits", "graph_computes", "h2d_copies", "d2h_copies", "d2d_copies", "h2d_bytes", "d2h_bytes")
print(variant, devices, ext, {k: [round(d[k] / N, 2) for d in c] for k in keys})
