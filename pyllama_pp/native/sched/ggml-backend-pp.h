#pragma once

// Scheduler extension for pipeline parallelism with host-resident weights.
//
// Switches are one typed table (name, type, default, range, meaning), parsed once per process from the environment
// (GGML_SCHED_PP_<NAME>, e.g. GGML_SCHED_PP_GATE=0), changeable by name, and copied into each scheduler when it is
// created. Counters are per scheduler.
// This header only adds functions: the backend module ABI (ggml-backend-impl.h) is unchanged, so
// backend modules built against the pristine tree load into this build.

#include "ggml-backend.h"

#include <stdint.h>

#ifdef  __cplusplus
extern "C" {
#endif

#define GGML_SCHED_PP_EXT_VERSION 4

// version of this extension (GGML_SCHED_PP_EXT_VERSION); a build without it has no such symbol
GGML_API int ggml_backend_sched_pp_ext_version(void);

// switches by name: 0 on success, -1 for an unknown name, -2 for a value the switch does not accept (logged).
// A scheduler reads the switches once, when it is created: a change applies to schedulers created after it.
GGML_API int ggml_backend_sched_pp_set_param(const char * name, int64_t value);
GGML_API int ggml_backend_sched_pp_get_param(const char * name, int64_t * value);
// ... as text: an integer, or for a switch of type "ints" (one value per device) a comma list too ("-2,-4": the
// scheduler's first device -2, its second -4, the others 0; one integer: every device); get writes it like snprintf
// (with a list set, get_param reads 0 and get_param_text the list)
GGML_API int ggml_backend_sched_pp_set_param_text(const char * name, const char * text);
GGML_API int ggml_backend_sched_pp_get_param_text(const char * name, char * buf, size_t size);
// current value of a switch (an unknown name is logged as an error and reads as 0)
GGML_API int64_t ggml_backend_sched_pp_param(const char * name);
// the i-th switch (0-based): its name, current value and what it does; NULL past the last one
GGML_API const char * ggml_backend_sched_pp_param_info(int i, int64_t * value, const char ** description);
// ... its type ("bool", "int" or "ints": an int or a comma list of one per device), default, accepted range [min, max] and, where not every value in the range is
// accepted, the accepted ones ("0,2"; else NULL)
GGML_API const char * ggml_backend_sched_pp_param_spec(int i, const char ** type, int64_t * def, int64_t * min,
                                                       int64_t * max, const char ** values);
// GGML_SCHED_PP_* environment variables that name no switch or hold a value it does not accept (those keep the
// default; each is also logged once as an error): how many, and one line each into buf (like snprintf)
GGML_API int ggml_backend_sched_pp_env_problems(char * buf, size_t size);

// whether uploads from pageable memory to this device can go through pinned staging slots (STAGING on, the
// device has a pinned host buffer type, async copies and events, and pinning works here)
GGML_API bool ggml_backend_sched_pp_staging_usable(ggml_backend_dev_t dev);

// STAGING=1's copier threads, the calling one counted (fit's staging probe copies with as many)
GGML_API int ggml_backend_sched_pp_stage_default_threads(void);

// per-scheduler counters as one JSON object; returns the length it needs (like snprintf)
GGML_API size_t ggml_backend_sched_pp_stats_json(ggml_backend_sched_t sched, char * buf, size_t size);
GGML_API void   ggml_backend_sched_pp_reset_stats(ggml_backend_sched_t sched);
// host-weight bytes the scheduler moved to `backend` so far: its uploads, and DIRECT's and GATHER's estimates
// (an RPC server reports its device's to the client)
GGML_API uint64_t ggml_backend_sched_pp_host_weight_bytes(ggml_backend_sched_t sched, ggml_backend_t backend);

// whether the next graph must be split again rather than reused as it was split (llama asks before it reuses one):
// the scheduler moved ops between backends since (EXPERT_CACHE_MIN_HIT: a layer between the CPU and its cache)
GGML_API bool ggml_backend_sched_pp_resplit(ggml_backend_sched_t sched);

// EXPERT_CACHE in a scheduler whose caller assigns the ops (an RPC server's: each op on the device that holds its
// result): an expert op on a host weight that the caller assigned to `backend` (a device) reads the expert slots
// there where the cache may take it (below op offload's threshold), else stays there with its weight copied in.
// Call after the assignments, before ggml_backend_sched_alloc_graph.
GGML_API void ggml_backend_sched_pp_cache_assigned(ggml_backend_sched_t sched, struct ggml_tensor * op, ggml_backend_t backend);
// the expert cache's counters of `backend` in a scheduler (an RPC server reports its device's to the client); the
// last three are levels: device memory its slots take, the layers that have slots there, the fewest slots of those
struct ggml_backend_pp_cache_counts {
    uint64_t ops, hits, misses, evictions, bytes;
    uint64_t buffer_bytes, layers, slots;
};
GGML_API void ggml_backend_sched_pp_cache_counts(ggml_backend_sched_t sched, ggml_backend_t backend,
                                                 struct ggml_backend_pp_cache_counts * out);

// graph re-reservations forced by ggml_backend_sched_alloc_graph since the last ggml_backend_sched_reserve
GGML_API uint64_t ggml_backend_sched_pp_reallocs_since_reserve(ggml_backend_sched_t sched);

// why the last re-reservation happened (diagnostics: node backends changed, or the first node that outgrew the
// reserved layout); also in the stats JSON as "last_realloc"
GGML_API size_t ggml_gallocr_pp_realloc_reason(struct ggml_gallocr * galloc, struct ggml_cgraph * graph, char * buf, size_t size);

// PLANS: keep up to n earlier allocation plans of a graph allocator (0: none, upstream's behaviour); a reservation
// keeps the plan it replaces
GGML_API void ggml_gallocr_pp_keep_plans(struct ggml_gallocr * galloc, int n);
// make a kept plan that fits the graph (structure, wiring, buffer types, sizes, current buffers) the live one:
// true, and ggml_gallocr_alloc_graph then allocates the graph from it; false: none fits (nothing changed)
GGML_API bool ggml_gallocr_pp_use_kept_plan(struct ggml_gallocr * galloc, struct ggml_cgraph * graph,
                                            const int * node_buffer_ids, const int * leaf_buffer_ids);

// OVERLAP=2: tensors with this flag (transient expert copies, set by the scheduler) are allocated with the size of
// their pool class - the smallest of `sizes` that is at least theirs and at most 1% more - so the blocks of copies
// of nearly one size are interchangeable (n = 0: no pooling; at most GGML_PP_POOL_CLASSES classes)
#define GGML_TENSOR_FLAG_PP_POOLED (1 << 24)
#define GGML_PP_POOL_CLASSES 16
GGML_API void ggml_gallocr_pp_set_pool_sizes(struct ggml_gallocr * galloc, const size_t * sizes, int n);

// GATHER: a device that copies the experts its routing ids select without the host reading the ids. Ordered after
// everything queued on `backend` so far, copy from the pinned host tensor `src` into `dst` (its copy on the device:
// same type and layout) every expert e (index along ne[2]) that one of the int32 ids in `ids` (in the device's
// memory) names - the bytes [e*nb[2], (e+1)*nb[2]) and, unless e is the last expert, the next
// min(nb[2], GGML_BACKEND_PP_GATHER_TAIL) bytes (a kernel may read past an expert's last row, as CUDA's MMQ does:
// those bytes must be numbers, as the selective copy leaves them) - and order work queued on `backend` afterwards
// after the copy. Returns false when it cannot; nothing is queued then. A backend offers one through
// ggml_backend_reg_get_proc_address(reg, "ggml_backend_pp_gather_v4"); a library of its own registers one for a
// backend registry by name (NULL removes it).
// `mode` (extension version 4, PREFETCH): GGML_BACKEND_PP_GATHER_USED is the above; every gather with ids also
// records, on the device, the experts they selected for `src` (its last used set). GGML_BACKEND_PP_GATHER_PREFETCH
// (`ids` NULL): copy the experts of src's last used set, with their tails, into `dst` before the ids exist, and keep
// that set for `dst`; false (nothing queued) where the device has no last used set of `src` or cannot.
// GGML_BACKEND_PP_GATHER_REST: as USED, but leave out the experts the last PREFETCH into `dst` brought (the
// scheduler asks only right after such a prefetch, ordered after it on `backend`).
// GGML_BACKEND_PP_GATHER_BESIDE, or-ed into any of the three: compute may run beside this copy on the device (with
// OVERLAP=2, whose early gathers run on a second stream; the scheduler flags all its gathers then), so a copy that
// leaves the device's cores to that compute pays. A device that declines a flagged mode is asked again without.
// GGML_BACKEND_PP_GATHER_CHAINED, or-ed in too (CHAIN): the copy needs nothing queued on `backend` that the gathers
// the device queued before it (of any backend on the device) were not, together, ordered after, so the device may
// queue it behind all of them without waiting for `backend`; work queued on `backend` afterwards is still ordered
// after the copy. A device that declines it is asked again without, after `backend` waited for what the copy needs.
#define GGML_BACKEND_PP_GATHER_TAIL 512
enum ggml_backend_pp_gather_mode {
    GGML_BACKEND_PP_GATHER_USED     = 0,
    GGML_BACKEND_PP_GATHER_PREFETCH = 1,
    GGML_BACKEND_PP_GATHER_REST     = 2,
    GGML_BACKEND_PP_GATHER_BESIDE   = 16,   // a flag
    GGML_BACKEND_PP_GATHER_CHAINED  = 32,   // a flag
};
typedef bool (*ggml_backend_pp_gather_t)(ggml_backend_t backend, struct ggml_tensor * dst, const struct ggml_tensor * src,
                                         const struct ggml_tensor * ids, int mode /* enum ggml_backend_pp_gather_mode */);
GGML_API void ggml_backend_sched_pp_set_gather(const char * reg_name, ggml_backend_pp_gather_t fn);

// LAYER_MAJOR: the graphs of n ubatches of one batch as one graph that runs them through each layer in turn: a
// layer's nodes of graph 0, then of graph 1, ... A node's layer is the number its name ends in (llama names nodes
// "ffn_moe_gate-12"), else the largest of its sources'; a node with neither goes with its first consumer's layer.
// Each graph keeps its own order, and graph k writes a layer's KV cache before graph k + 1 reads it. The scheduler
// uploads a host weight that splits of several graphs read once per graph (the first split's copy serves the later
// ones). The merged graph shares the graphs' tensors; `ctx` must hold a graph of ggml_backend_pp_layer_major_size
// nodes (ggml_graph_overhead_custom).
GGML_API size_t ggml_backend_pp_layer_major_size(struct ggml_cgraph ** graphs, int n);
GGML_API struct ggml_cgraph * ggml_backend_pp_layer_major_graph(struct ggml_context * ctx, struct ggml_cgraph ** graphs, int n);
// the most graphs of `graph_nodes` nodes (and leafs) each that a merged graph of this scheduler may hold: its graph
// size over graph_nodes, or 1 once a merged graph found no room (ggml_backend_sched_pp_note_layer_major)
GGML_API int ggml_backend_sched_pp_max_group(ggml_backend_sched_t sched, size_t graph_nodes);
// counts a layer-major graph of n_ubatches ubatches (stats: layer_major_graphs, layer_major_ubatches); 0: one could
// not be allocated - the scheduler takes no more (max_group 1)
GGML_API void ggml_backend_sched_pp_note_layer_major(ggml_backend_sched_t sched, int n_ubatches);

#ifdef  __cplusplus
}
#endif
