// pyllama_pp: the backend scheduler's private state and the hooks of its host-weight pipeline extension
// (ggml-backend-pp.h), shared by ggml-backend.cpp and the extension's files (ggml-backend-pp*.cpp)
#pragma once

#include "ggml-backend.h"
#include "ggml-backend-pp.h"
#include "ggml-backend-impl.h"
#include "ggml-alloc.h"
#include "ggml-impl.h"

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

struct ggml_sched_pp_cache;
struct ggml_sched_pp_copier;
struct ggml_sched_pp_early;
struct ggml_sched_pp_ring;
struct ggml_sched_pp_stage;

#ifndef GGML_SCHED_MAX_BACKENDS
#define GGML_SCHED_MAX_BACKENDS 16
#endif

#ifndef GGML_SCHED_MAX_SPLIT_INPUTS
#define GGML_SCHED_MAX_SPLIT_INPUTS 30
#endif

#ifndef GGML_SCHED_MAX_COPIES
#define GGML_SCHED_MAX_COPIES 4
#endif

struct ggml_backend_sched_split {
    int backend_id;
    int i_start;
    int i_end;
    struct ggml_tensor ** inputs;
    int n_inputs;
    int inputs_capacity;
    // graph view of this split
    struct ggml_cgraph graph;
};

// causes of host waits in the scheduler (ggml_sched_pp_stats::host_wait_us)
enum ggml_sched_pp_wait {
    GGML_SCHED_PP_WAIT_USER_INPUT,   // before a synchronous user-input upload (and the upload itself)
    GGML_SCHED_PP_WAIT_SPLIT_SWITCH, // a split without inputs after a split on another backend
    GGML_SCHED_PP_WAIT_IDS,          // routing-id readback for the selective expert copy
    GGML_SCHED_PP_WAIT_FALLBACK,     // synchronous copy fallback (no async cross-backend copy)
    GGML_SCHED_PP_WAIT_REALLOC,      // re-reservation of the graph buffers (syncs every backend)
    GGML_SCHED_PP_WAIT_INPUT_EVENTS, // early input uploads of an older graph (patch: early inputs)
    GGML_SCHED_PP_WAIT_UPLOAD,       // issuing async host-weight uploads (blocks only if the device queue is full)
    GGML_SCHED_PP_WAIT_COUNT,
};

// counters of the host-weight pipeline extension (ggml-backend-pp.h)
struct ggml_sched_pp_stats {
    uint64_t weight_bytes[GGML_SCHED_MAX_BACKENDS];     // host-weight bytes uploaded to each backend
    uint64_t weight_uploads[GGML_SCHED_MAX_BACKENDS];   // host-weight split inputs uploaded
    uint64_t transient_bytes[GGML_SCHED_MAX_BACKENDS];  // of which through transient (single-slot) copies
    uint64_t transient_inputs;                          // transient copy slots in the last split graph
    uint64_t upload_all;                                // MUL_MAT_ID inputs uploaded whole (no id readback)
    uint64_t selective;                                 // MUL_MAT_ID inputs uploaded by used experts
    uint64_t direct;                                    // MUL_MAT_ID inputs read by the device from pinned host memory (DIRECT)
    uint64_t direct_bytes_est[GGML_SCHED_MAX_BACKENDS]; // ... their bytes estimated from the measured coverage (not counted: no readback)
    uint64_t gather;                                    // MUL_MAT_ID inputs whose used experts the device gathered (GATHER)
    uint64_t gather_bytes_est[GGML_SCHED_MAX_BACKENDS]; // ... their bytes estimated from the measured coverage (no readback)
    uint64_t prefetch;                                  // of those, prefetched a split early by the last used set (PREFETCH)
    uint64_t chained;                                   // gathers queued right behind the device's gather before (CHAIN)
    uint64_t id_readbacks;                              // routing-id readbacks (each blocks the host)
    uint64_t experts_used;                              // sum over readbacks of experts used
    uint64_t experts_total;                             // sum over readbacks of experts available
    uint64_t input_host_waits;                          // host waits before user-input uploads
    uint64_t input_device_waits;                        // device-side waits before user-input uploads
    uint64_t input_early_uploads;                       // user inputs uploaded at the start of the graph
    uint64_t input_event_syncs;                         // host waits for early uploads of an old graph
    uint64_t fallback_syncs;                            // host syncs of the synchronous copy fallback
    uint64_t graphs;                                    // graphs computed
    uint64_t reallocs;                                  // graphs whose allocation forced a re-reservation (syncs all backends)
    uint64_t reallocs_ids_changed;                      // of which because a node changed backend
    uint64_t plan_switches;                             // graphs allocated from a kept plan instead of re-reserving (PLANS)
    uint64_t plan_switch_drains;                        // of which with graphs in flight (synchronized all backends)
    uint64_t offload_owner;                             // offloaded ops placed on the layer's own backend
    uint64_t layer_major_graphs;                        // graphs that ran several ubatches layer by layer (LAYER_MAJOR)
    uint64_t layer_major_ubatches;                      // ... the ubatches they ran
    uint64_t read_again;                                // host expert copies uploaded whole because later splits read them too
    // where the host thread spends its time (microseconds): blocking waits by cause, and the submission of
    // each backend's splits (for a CPU backend that is its compute, for a GPU the kernel launches)
    int64_t  host_wait_us[GGML_SCHED_PP_WAIT_COUNT];    // by cause (ggml_sched_pp_wait)
    uint64_t host_wait_n[GGML_SCHED_PP_WAIT_COUNT];
    int64_t  submit_us[GGML_SCHED_MAX_BACKENDS];        // ggml_backend_graph_compute_async per backend
    int64_t  compute_async_us;                          // all of ggml_backend_sched_graph_compute_async
    int64_t  alloc_us;                                  // all of ggml_backend_sched_alloc_graph
    int64_t  synchronize_us;                            // all of ggml_backend_sched_synchronize
    uint64_t staged_bytes[GGML_SCHED_MAX_BACKENDS];     // host-weight bytes uploaded from pageable memory through pinned staging (STAGING)
    uint64_t overlap_uploads[GGML_SCHED_MAX_BACKENDS];  // host-weight uploads issued on the upload stream (OVERLAP)
    uint64_t stage_waits;                               // host waits for a staging slot the device was still reading
    int64_t  stage_wait_us;                             // time of those waits (part of the "upload" host wait)
    int64_t  stage_copy_us;                             // time the host spent copying pieces into staging slots
    uint64_t stage_copies;                              // ... in that many copies (a copy: one burst of whole pieces, 4 MiB or more, or a slot's or call's rest)
    char     last_realloc[384];                         // why the last re-reservation happened
    char     realloc_log[4][384];                       // the first four reasons since the stats were reset
    int      realloc_log_n;
    int      graph_nodes_min;                           // scheduler graph sizes (nodes incl. input copies)
    int      graph_nodes_max;
    uint64_t cache_ops[GGML_SCHED_MAX_BACKENDS];        // expert ops that read the device's expert cache (EXPERT_CACHE)
    uint64_t cache_hits[GGML_SCHED_MAX_BACKENDS];       // ... lookups of an expert in its layer's slots that found it
    uint64_t cache_misses[GGML_SCHED_MAX_BACKENDS];     // ... that did not (the expert was loaded into a slot)
    uint64_t cache_evictions[GGML_SCHED_MAX_BACKENDS];  // ... of those, misses that replaced a cached expert
    uint64_t cache_bytes[GGML_SCHED_MAX_BACKENDS];      // host-weight bytes uploaded into the slots
    uint64_t cache_cpu_ops[GGML_SCHED_MAX_BACKENDS];    // expert ops of cached layers the guard ran on the CPU (EXPERT_CACHE_MIN_HIT)
    uint64_t cache_leaves[GGML_SCHED_MAX_BACKENDS];     // ... the guard's decisions: a layer to the CPU
    uint64_t cache_returns[GGML_SCHED_MAX_BACKENDS];    // ... a layer back to its cache
    uint64_t cache_shadow_hits[GGML_SCHED_MAX_BACKENDS];   // ... lookups in its shadow of the slots that found the expert
    uint64_t cache_shadow_misses[GGML_SCHED_MAX_BACKENDS]; // ... that did not
    uint64_t cache_cpu_misses[GGML_SCHED_MAX_BACKENDS]; // misses of cached ops the host CPU computed, not the link (EXPERT_HYBRID)
    uint64_t cache_hybrid_layers[GGML_SCHED_MAX_BACKENDS]; // ... a layer's expert ops of a graph where it did (one CPU compute each)
    uint64_t cache_refills[GGML_SCHED_MAX_BACKENDS];    // ... of the CPU's misses, experts copied into slots after it (EXPERT_REFILL)
};

// The switches as a scheduler reads them: the switch table (ggml_sched_pp_params) is copied here once, when the
// scheduler is created, so hot paths read a field, never a name. Each mechanism adds its own fields.
struct ggml_sched_pp_cfg {
    int64_t owner_offload;        // OWNER_OFFLOAD
    int64_t early_inputs;         // EARLY_INPUTS
    int64_t upload_all;           // UPLOAD_ALL
    int64_t upload_all_min;       // UPLOAD_ALL_MIN
    int64_t upload_all_min_cov;   // UPLOAD_ALL_MIN_COV
    int64_t links;                // LINKS
    int64_t staging;              // STAGING
    int64_t direct;               // DIRECT
    int64_t overlap;              // OVERLAP
    int64_t gather;               // GATHER
    int64_t prefetch;             // PREFETCH
    int64_t prefetch2_min_tokens; // PREFETCH2_MIN_TOKENS
    int64_t expert_cache;         // EXPERT_CACHE: not 0 where some device caches
    int64_t expert_cache_dev[GGML_SCHED_MAX_BACKENDS]; // ... each backend's value (MiB; -N: N slots a layer; 0: none)
    int64_t expert_cache_min_hit; // EXPERT_CACHE_MIN_HIT: not 0 where some device guards
    int64_t expert_cache_min_hit_dev[GGML_SCHED_MAX_BACKENDS]; // ... each backend's floor (percent; 0: no guard)
    int64_t expert_hybrid;        // EXPERT_HYBRID: not 0 where some device splits its misses
    int64_t expert_hybrid_dev[GGML_SCHED_MAX_BACKENDS]; // ... each backend's value (0: every miss over its link)
    int64_t expert_refill;        // EXPERT_REFILL: with EXPERT_HYBRID, a decoded token's misses copied into slots after the CPU's share
};

struct ggml_backend_sched {
    bool is_reset; // true if the scheduler has been reset since the last graph split
    bool is_alloc;

    int n_backends;

    ggml_backend_t backends[GGML_SCHED_MAX_BACKENDS];
    ggml_backend_buffer_type_t bufts[GGML_SCHED_MAX_BACKENDS];
    ggml_gallocr_t galloc;

    // hash map of the nodes in the graph
    struct ggml_hash_set  hash_set;
    int                 * hv_tensor_backend_ids; // [hash_set.size]
    struct ggml_tensor ** hv_tensor_copies;      // [hash_set.size][n_backends][n_copies]

    int * node_backend_ids; // [graph_size]
    int * leaf_backend_ids; // [graph_size]

    int * prev_node_backend_ids; // [graph_size]
    int * prev_leaf_backend_ids; // [graph_size]

    // copy of the graph with modified inputs
    struct ggml_cgraph graph;

    // graph splits
    struct ggml_backend_sched_split * splits;
    int n_splits;
    int splits_capacity;

    // pipeline parallelism support
    int n_copies;
    int cur_copy;
    int next_copy;
    ggml_backend_event_t events[GGML_SCHED_MAX_BACKENDS][GGML_SCHED_MAX_COPIES];
    // recorded after the early upload of user inputs to a backend (GGML_SCHED_PP_EARLY_INPUTS)
    ggml_backend_event_t input_events[GGML_SCHED_MAX_BACKENDS][GGML_SCHED_MAX_COPIES];
    bool input_events_pending[GGML_SCHED_MAX_BACKENDS][GGML_SCHED_MAX_COPIES];
    struct ggml_tensor ** graph_inputs;
    int n_graph_inputs;
    int graph_inputs_capacity;

    struct ggml_context * ctx;

    ggml_backend_sched_eval_callback callback_eval;
    void * callback_eval_user_data;

    char * context_buffer;
    size_t context_buffer_size;

    bool op_offload;

    int debug;

    // used for debugging graph reallocations [GGML_SCHED_DEBUG_REALLOC]
    // ref: https://github.com/ggml-org/llama.cpp/pull/17617
    int debug_realloc;
    int debug_graph_size;
    int debug_prev_graph_size;

    // host-weight pipeline extension (ggml-backend-pp.h)
    struct ggml_sched_pp_stats pp;
    struct ggml_sched_pp_cfg   pp_cfg; // the switches, as they were when the scheduler was created
    int    pp_in_flight;   // graphs submitted since the last synchronize
    bool   pp_graph_offloads; // the graph being split has offloaded a host-weight op by batch size
    double pp_cov_ema;     // recent expert coverage measured by id readbacks (-1: none yet)
    bool   pp_overlap_dropped; // OVERLAP=2's early copies did not fit in the compute buffers: this scheduler runs without
    int    pp_n_links;        // host links the GPU backends upload over at once (LINKS): the auto coverage bar of upload-all
    bool   pp_graph_measured; // ... and has measured coverage, or decided not to
    bool   pp_measure_now;    // an expert op of this graph is to read ids back and measure coverage (not DIRECT)
    bool   pp_graph_fresh;    // the graph being computed was split and allocated for this compute, not reused
    uint64_t pp_reallocs_since_reserve;
    std::unordered_map<std::string, int> * pp_dep_counts; // dependency nodes seen after each node (STABLE_DEPS)
    char *   pp_layout_names;   // names of the nodes of the graph the buffers were last reserved for
    int      pp_layout_n;
    int      pp_layout_cap;
    struct ggml_sched_pp_stage * pp_stage[GGML_SCHED_MAX_BACKENDS]; // pinned staging slots per backend (STAGING)
    struct ggml_sched_pp_copier * pp_copier;                        // threads that fill them
    struct ggml_sched_pp_ring * pp_ring[GGML_SCHED_MAX_BACKENDS];   // PREFETCH=2's lanes (OVERLAP=2)
    struct ggml_sched_pp_early * pp_early[GGML_SCHED_MAX_BACKENDS]; // early uploads on a second stream (OVERLAP=2)
    std::unordered_map<const ggml_tensor *, int> * pp_early_copies; // ... the copies ggml-alloc places early: how many splits (1, 2: PREFETCH=2)
    uint64_t pp_graph_seq;                                          // graphs computed (not reset with the stats)
    bool pp_prefetch2_graph;                                        // PREFETCH=2 acts on this graph (PREFETCH2_MIN_TOKENS)
    std::unordered_set<const ggml_tensor *> * pp_shared_copies;     // split-input copies read by a later split too
    std::unordered_set<const ggml_tensor *> * pp_read_again;        // LAYER_MAJOR: host expert weights several expert ops read
    std::vector<struct ggml_sched_pp_again> * pp_again;             // ... their copies placed a layer early (OVERLAP=2)
    bool pp_no_groups;                                              // ... a merged graph found no room: no more of them
    bool pp_direct_dev[GGML_SCHED_MAX_BACKENDS]; // DIRECT: a GPU of a backend whose kernels run on pinned host memory
    ggml_backend_pp_gather_t pp_gather[GGML_SCHED_MAX_BACKENDS]; // GATHER: the device's gather of used experts (or none)
    int  pp_gather_pos[GGML_SCHED_MAX_BACKENDS]; // CHAIN: the device's gathers of this graph are queued after everything
                                                 // its stream had queued before this split (-1: none queued yet)
    int  pp_gather_pos_mem[GGML_SCHED_MAX_BACKENDS]; // ... after the compute of the splits before this one (a prefetch's
                                                     // wait: not the split's own input copies, queued before it)
    bool pp_own_link[GGML_SCHED_MAX_BACKENDS];   // DIRECT's auto mode: no other stage uploads over this backend's host link
    int  pp_first_gpu;                           // DIRECT: the first GPU backend, which keeps the selective copy (-1: none)
    struct ggml_sched_pp_cache * pp_cache;       // EXPERT_CACHE: the devices' expert slots (made at the first op it takes)
};

#define hash_id(tensor) ggml_hash_find_or_insert(&sched->hash_set, tensor)

#define tensor_backend_id(tensor) sched->hv_tensor_backend_ids[hash_id(tensor)]

#define tensor_id_copy(id, backend_id, copy_id) sched->hv_tensor_copies[(id) * sched->n_backends * sched->n_copies + (backend_id) * sched->n_copies + (copy_id)]

#define tensor_copy(tensor, backend_id, copy_id) tensor_id_copy(hash_id(tensor), backend_id, copy_id)

// times one host wait (or one submission) into the extension's counters
struct ggml_sched_pp_timer {
    int64_t * acc;
    uint64_t * n;
    int64_t t0;
    ggml_sched_pp_timer(int64_t * acc, uint64_t * n = nullptr) : acc(acc), n(n), t0(ggml_time_us()) {}
    ~ggml_sched_pp_timer() {
        *acc += ggml_time_us() - t0;
        if (n) {
            (*n)++;
        }
    }
};

#define GGML_SCHED_PP_WAIT(sched, cause) \
    ggml_sched_pp_timer pp_wait_timer_((sched)->pp.host_wait_us + (cause), (sched)->pp.host_wait_n + (cause))

// the state of one graph's computation (ggml_backend_sched_compute_splits) that the hooks share across its splits
struct ggml_sched_pp_graph {
    struct ggml_tensor *       prev_ids_tensor = nullptr; // the ids the used experts below were read from
    std::vector<int32_t>       ids;
    std::vector<ggml_bitset_t> used_ids;
    bool last_events = false;                     // LAST_EVENTS: record events only where they are waited for
    bool idle        = false;                     // nothing in flight when the graph started
    int  last_split[GGML_SCHED_MAX_BACKENDS];     // each backend's last split in the graph
    std::unordered_map<const ggml_tensor *, bool> early_decided; // OVERLAP=2: copies decided (true: uploaded) a split early
    std::unordered_set<const ggml_tensor *> prefetched;          // ... of those, partly filled by PREFETCH
};

// How an expert op gets its weight's experts on a device (ggml_backend_sched_pp_expert_path)
enum ggml_sched_pp_path {
    GGML_SCHED_PP_PATH_NONE,       // nothing to move: no ids to route by, or the copy went up early already
    GGML_SCHED_PP_PATH_LATER,      // a copy, chosen later (early: by its own split; at split: on time)
    GGML_SCHED_PP_PATH_UPLOAD_ALL, // the whole tensor (UPLOAD_ALL; LAYER_MAJOR's copies read again)
    GGML_SCHED_PP_PATH_GATHER,     // the device gathers the used experts by the ids in its memory (GATHER; a
                                   // prefetched copy: the rest)
    GGML_SCHED_PP_PATH_PREFETCH,   // before its ids exist, the experts the weight used last time (PREFETCH)
    GGML_SCHED_PP_PATH_DIRECT,     // the kernel reads the used experts from pinned host memory (DIRECT)
    GGML_SCHED_PP_PATH_SELECTIVE,  // the ids read back on the host, the used experts copied (upstream's)
    GGML_SCHED_PP_PATH_CACHE,      // the device's expert slots: hits read there, misses copied in (EXPERT_CACHE)
    GGML_SCHED_PP_PATH_HOST_CPU,   // no device: the op runs on the host CPU, on the weight where it is
    GGML_SCHED_PP_PATH_HYBRID,     // the cache, its misses split between the link (into slots) and the host CPU,
                                   // which computes its share of the layer's FFN beside the device (EXPERT_HYBRID)
};

// when the path is asked
enum ggml_sched_pp_when {
    GGML_SCHED_PP_AT_SPLIT, // split_graph, after pass 1: an op below op offload's threshold, for the expert cache
    GGML_SCHED_PP_EARLY,    // OVERLAP=2: a split or two before the op's own split, for its copy placed early
    GGML_SCHED_PP_ON_TIME,  // compute_splits: with the inputs of the op's split
};

// what ggml_backend_sched_pp_expert_path decides on about one expert op (besides the scheduler's switches, the
// coverage measured so far, whether a graph is in flight and whether this graph measures)
struct ggml_sched_pp_expert_op {
    enum ggml_sched_pp_when    when;
    int                        backend_id; // the device that runs the op
    struct ggml_tensor *       input;      // the host expert weight
    const struct ggml_tensor * ids;        // the routing ids the op reads
    int64_t                    n_sel;      // tokens x experts used per token (against upload-all's bar)
    int64_t                    n_expert;
    bool transient     = false;  // the weight's copy is transient (GATE): one slot, written on the device's stream
    bool read_again    = false;  // LAYER_MAJOR: later expert ops read the copy too
    bool ids_read      = false;  // the ids are on the host already: an op before read them back
    bool ids_ready     = false;  // the ids are computed, in the device's memory, before what the device does now
                                 // (on time: unless they are an input of the split still to copy; early: where the
                                 // op before, on the same device, routes by them)
    bool early_decided = false;  // on time: the early path asked for this copy (and did not upload it all)
    bool early_done    = false;  // the copy went up early (nothing left)
    bool prefetched    = false;  // PREFETCH brought part of it early: the rest is left
    enum ggml_sched_pp_path declined = GGML_SCHED_PP_PATH_NONE; // a path the caller could not take
    // at split (EXPERT_CACHE)
    bool cache_fits         = false; // the layer has slots on the op's owner for every expert the batch could use
    bool cache_to_cpu       = false; // EXPERT_CACHE_MIN_HIT: the layer's cache does not pay, its ops go to the CPU
    bool cache_fallback_cpu = false; // where the slots cannot serve: the CPU (else the owner, with its weight copied in)
    bool cache_hybrid_fits  = false; // the host CPU can compute the layer's FFN for its misses (EXPERT_HYBRID)

    ggml_sched_pp_expert_op(enum ggml_sched_pp_when when, int backend_id, struct ggml_tensor * input,
                            const struct ggml_tensor * ids, int64_t n_expert)
        : when(when), backend_id(backend_id), input(input), ids(ids), n_sel(ids->ne[0] * ids->ne[1]), n_expert(n_expert) {}
};

// DIRECT: a split-input copy pointed at the host weight while its split is submitted (kernel arguments are taken
// at submission), restored when the split is done with it - so the next graph still finds its own memory
struct ggml_sched_pp_direct_swap {
    struct ggml_tensor *  cpy[GGML_SCHED_MAX_SPLIT_INPUTS];
    void *                data[GGML_SCHED_MAX_SPLIT_INPUTS];
    ggml_backend_buffer_t buffer[GGML_SCHED_MAX_SPLIT_INPUTS];
    int n = 0;
    bool add(struct ggml_tensor * c, const struct ggml_tensor * host) {
        if (n == GGML_SCHED_MAX_SPLIT_INPUTS) {
            return false;
        }
        cpy[n] = c; data[n] = c->data; buffer[n] = c->buffer; n++;
        c->data   = host->data;
        c->buffer = host->buffer; // a weights buffer: no padding to clear (the CUDA backend clears it in compute buffers)
        return true;
    }
    ~ggml_sched_pp_direct_swap() {
        for (int i = 0; i < n; i++) {
            cpy[i]->data   = data[i];
            cpy[i]->buffer = buffer[i];
        }
    }
};

// LAYER_MAJOR with OVERLAP=2: the copy of a weight that several expert ops read, placed for its first reader (split
// `owner`) at split `at` and uploaded there on the second stream (ggml-backend-pp-layer-major.cpp; its uploads, again_uploads: -overlap.cpp)
struct ggml_sched_pp_again {
    int           at;
    int           owner;
    ggml_tensor * input;
};

// OVERLAP=2: a second stream of a device and the events that order its early uploads (ggml-backend-pp-overlap.cpp;
// PREFETCH=2 records its events behind each split here too)
struct ggml_sched_pp_early {
    ggml_backend_t       up        = nullptr;
    ggml_backend_event_t ev_before = nullptr; // compute stream: everything before the split whose early copies go up
    // upload stream: behind each copy's uploads, until the split that reads the copy waits for it (a split waits
    // only for its own copies: with PREFETCH=2 the copies of the split after it go up on the same stream)
    std::unordered_map<const ggml_tensor *, ggml_backend_event_t> ready;
    std::vector<ggml_backend_event_t> spare;  // events no copy waits for
    // early copies of pageable weights (STAGING), queued once the split before them is: the host fills the staging
    // slots while that split computes (filled before it, a slot's wait would hold the split back)
    struct staged_copy {
        ggml_tensor *              input;
        ggml_tensor *              cpy;
        bool                       selective;
        std::vector<ggml_bitset_t> used_ids;
    };
    std::vector<staged_copy> staged;
    // PREFETCH=2: compute stream: behind each split of the graph on this backend (index: split id), so that a
    // prefetch waits only for the last split that used its memory
    std::vector<ggml_backend_event_t> after_split;
    std::vector<uint64_t>             after_graph; // ... the graph (pp_graph_seq) each was recorded in
    bool                 unusable  = false;
};

// EXPERT_CACHE: an op whose source holds per-expert rows routed by its ids (src[2]): MUL_MAT_ID's weight (src[0],
// [.., .., n_expert]) or ADD_ID's expert biases (src[1], [.., n_expert]: gpt-oss); that source, -1 for other ops
static inline int ggml_sched_pp_expert_src(const struct ggml_tensor * op) {
    return op->op == GGML_OP_MUL_MAT_ID ? 0 : op->op == GGML_OP_ADD_ID ? 1 : -1;
}
// ... the dimension of that source that counts its experts
static inline int ggml_sched_pp_expert_dim(const struct ggml_tensor * op) {
    return op->op == GGML_OP_ADD_ID ? 1 : 2;
}

// EXPERT_CACHE: expert ops pointed at their device's expert slots while their split is submitted (kernel arguments
// are taken at submission), restored afterwards, so the graph keeps its own sources for the next compute
struct ggml_sched_pp_cache_swap {
    std::vector<struct ggml_tensor *> node, weight, ids;
    void add(struct ggml_tensor * n, struct ggml_tensor * slots, struct ggml_tensor * slot_ids) {
        const int w = ggml_sched_pp_expert_src(n);
        node.push_back(n); weight.push_back(n->src[w]); ids.push_back(n->src[2]);
        n->src[w] = slots;
        n->src[2] = slot_ids;
    }
    ~ggml_sched_pp_cache_swap() {
        for (size_t i = 0; i < node.size(); i++) {
            node[i]->src[ggml_sched_pp_expert_src(node[i])] = weight[i];
            node[i]->src[2] = ids[i];
        }
    }
};

// The life of a graph: the hooks in the order they run, each with its file ("-x": ggml-backend-pp-x.cpp, "pp":
// ggml-backend-pp.cpp, "base": ggml-backend-pp-base.cpp), named without their ggml_backend_sched_pp_ prefix;
// called from ggml-backend.cpp unless another caller is named
//
// llama_context, before the scheduler: llama_pp_overrides_allow_pp (GATE; llama-context.cpp) keeps pipelining
//   with host weights; llama_layer_major::group_size (LAYER_MAJOR; llama-layer-major.cpp)
// ggml_backend_sched_new: ggml_sched_pp_cfg_init (base: the switches), ggml_backend_sched_pp_scan_devices (pp: links,
//   DIRECT's devices, each device's gather - find_gather, -gather; EXPERT_CACHE's per-device values - cache_devices,
//   -cache), ggml_gallocr_pp_keep_plans
//   (ggml-alloc-pp-stable-reserve.c)
// ggml_backend_sched_reserve (llama's sched_reserve) and ggml_backend_sched_alloc_graph (each graph):
//   alloc_graph only, first: wait_input_events (-inputs)
//   ggml_backend_sched_split_graph:
//     pass 1, an op on a host weight: offload_owner (-owner), else cache_backend (-cache)
//     after pass 1: cache_plan (-cache), asking expert_path AT_SPLIT (-experts) for each op it may take
//     after pass 4: find_read_again (-layer-major)
//     pass 5: cache_split (-cache), first_read (-layer-major), transient_src (-gate), shared_input (-inputs)
//     the graph copy: pad_plan (-stable-reserve), find_early_copies and pool_copies (-overlap); per split
//       add_early_inputs (-overlap; add_again_inputs, -layer-major), early_lead (-overlap), add_pad
//       (-stable-reserve); the leafs: is_transient_copy (-gate)
//   reserve: find_shared_copies (-direct), ring_assign (-prefetch), reserve_without_early (-overlap: where the
//     reservation failed), save_layout (base)
//   alloc_graph: alloc_splits: find_shared_copies (-direct), ring_assign (-prefetch); where galloc cannot allocate:
//     alloc_kept_plan (-stable-reserve), else note_realloc, drain and save_layout (base) around the re-reservation
// ggml_backend_sched_graph_compute_async -> compute_splits:
//   graph_begin (pp; upload_inputs, -inputs)
//   each split: each input: early_input and wait_user_input (-inputs), is_transient_copy (-gate), wait_slot
//       (-inputs); a host expert weight: copy_experts (-experts: expert_path ON_TIME, then a gather (-gather), a
//       DIRECT swap (-direct) or uploads (-staging)); another host weight: upload_whole (-experts); any other
//       input: wait_source (-inputs)
//     early_wait_split and early_uploads (-overlap: expert_path EARLY for the next splits' copies;
//       again_uploads, -overlap), cache_prepare (-cache)
//     the split is submitted; then early_staged (-overlap), after_split (-prefetch), cache_after_split (-cache),
//       record_event (-inputs)
//   after the last split: stage_mark (-staging); a failed split: failed (pp)
// ggml_backend_sched_synchronize: drain (base)
// llama_context, between graphs: before a batch, reallocs_since_reserve (base): STABLE_RESERVE reserves again; a
//   LAYER_MAJOR group's graphs merged into one before alloc_graph (llama-layer-major.cpp:
//   ggml_backend_pp_layer_major_graph, -layer-major); resplit (-cache) before reusing a graph
// ggml_backend_sched_free: stage_free (-staging), early_free (-overlap), ring_free (-prefetch), cache_free (-cache)
// (an RPC server's scheduler, ggml-rpc-pp.cpp, hands its expert ops to the cache: cache_assigned, -cache)

// hooks: where the scheduler calls the extension, and what the extension's files share, by file

// The files call each other one way only: ggml-backend-pp-base.cpp calls none of the others; each mechanism's file
// calls the base and files of mechanisms below it; ggml-backend-pp-experts.cpp (the decision and the copy on time)
// calls the mechanisms it chooses between; -overlap (OVERLAP=2's early copies, which ask the decision) and -cache
// (whose plan asks it) call it; ggml-backend-pp.cpp (the hooks of a scheduler's life) is on top.

// ggml-backend-pp-base.cpp: the switches, the counters, a drain, the device's second stream (OVERLAP=2)
void ggml_sched_pp_cfg_init(ggml_sched_pp_cfg * cfg);
std::string ggml_sched_pp_params_json(void);
void ggml_backend_sched_pp_save_layout(ggml_backend_sched_t sched);
void ggml_backend_sched_pp_log_realloc(ggml_backend_sched_t sched);
void ggml_backend_sched_pp_note_realloc(ggml_backend_sched_t sched, bool backend_ids_changed);
void ggml_backend_sched_pp_drain(ggml_backend_sched_t sched);
ggml_sched_pp_early * ggml_backend_sched_pp_early_get(ggml_backend_sched_t sched, int backend_id);
void ggml_backend_sched_pp_early_wait(ggml_backend_sched_t sched, int backend_id, ggml_backend_t backend,
                                      const ggml_tensor * cpy);
// the layer and the rest of a weight's name ("blk.12.ffn_up_exps.weight": 12, "ffn_up_exps.weight"), or -1
int ggml_backend_sched_pp_weight_layer(const char * name, const char ** rest);

// ggml-backend-pp.cpp: the hooks of a scheduler's life
int ggml_backend_sched_pp_scan_devices(ggml_backend_sched_t sched, ggml_backend_t * backends, int n_backends);
void ggml_backend_sched_pp_graph_begin(ggml_backend_sched_t sched, ggml_sched_pp_graph * g);
enum ggml_status ggml_backend_sched_pp_failed(ggml_backend_sched_t sched, enum ggml_status ec);

// ggml-backend-pp-experts.cpp: how an expert op gets its weight on a device; the copy of a host expert tensor
ggml_sched_pp_path ggml_backend_sched_pp_expert_path(ggml_backend_sched_t sched, const ggml_sched_pp_expert_op & op);
bool ggml_backend_sched_pp_selective_if_read(ggml_backend_sched_t sched, int backend_id);
void ggml_backend_sched_pp_copy_experts(ggml_backend_sched_t sched, ggml_sched_pp_graph * g, int split_id, int input_id,
                                        ggml_backend_t input_backend, ggml_sched_pp_direct_swap * direct);
void ggml_backend_sched_pp_upload_whole(ggml_backend_sched_t sched, int backend_id, ggml_tensor * input,
                                        ggml_tensor * input_cpy, bool transient, ggml_backend_t via);
void ggml_backend_sched_pp_copy_used_experts(ggml_backend_sched_t sched, int backend_id, ggml_tensor * input,
                                             ggml_tensor * input_cpy, const std::vector<ggml_bitset_t> & used_ids,
                                             int64_t n_expert, size_t expert_size, bool transient, ggml_backend_t via);

// ggml-backend-pp-gate.cpp: GATE's transient copies
bool ggml_backend_sched_pp_transient_src(ggml_backend_sched_t sched, const struct ggml_tensor * src);
bool ggml_backend_sched_pp_is_transient_copy(ggml_backend_sched_t sched, const struct ggml_tensor * input_cpy);
bool ggml_backend_sched_pp_is_expert_copy(ggml_backend_sched_t sched, const struct ggml_tensor * node,
                                          const struct ggml_tensor * cpy);

// ggml-backend-pp-owner.cpp: OWNER_OFFLOAD
int ggml_backend_sched_pp_owner_backend(ggml_backend_sched_t sched, struct ggml_tensor * op, const struct ggml_tensor * weight);
int ggml_backend_sched_pp_offload_owner(ggml_backend_sched_t sched, struct ggml_tensor * tensor, const struct ggml_tensor * src);

// ggml-backend-pp-inputs.cpp: EARLY_INPUTS, copy-slot waits and events
bool ggml_backend_sched_pp_shared_input(ggml_backend_sched_t sched, const struct ggml_tensor * src, int backend_id);
void ggml_backend_sched_pp_wait_user_input(ggml_backend_sched_t sched, ggml_sched_pp_graph * g, int split_id,
                                           struct ggml_tensor * input);
void ggml_backend_sched_pp_wait_source(ggml_backend_sched_t sched, ggml_sched_pp_graph * g, int backend_id,
                                       ggml_backend_t input_backend);
bool ggml_backend_sched_pp_record_event(ggml_backend_sched_t sched, const ggml_sched_pp_graph * g, int split_id);
void ggml_backend_sched_pp_wait_input_events(ggml_backend_sched_t sched);
bool ggml_backend_sched_pp_early_input(ggml_backend_sched_t sched, int backend_id, const struct ggml_tensor * input);
void ggml_backend_sched_pp_upload_inputs(ggml_backend_sched_t sched);
bool ggml_backend_sched_pp_wait_slot(ggml_backend_sched_t sched, int backend_id, bool on_host, bool idle);

// ggml-backend-pp-upload-all.cpp: UPLOAD_ALL and the measured coverage
int64_t ggml_backend_sched_pp_upload_all_min(ggml_backend_sched_t sched, bool in_flight, int64_t n_expert);
double ggml_backend_sched_pp_coverage(ggml_backend_sched_t sched);
int64_t ggml_backend_sched_pp_measure_min(ggml_backend_sched_t sched, int64_t n_expert);
bool ggml_backend_sched_pp_upload_all(ggml_backend_sched_t sched, int64_t n_sel, int64_t n_expert);
bool ggml_backend_sched_pp_would_measure(ggml_backend_sched_t sched, int64_t n_sel, int64_t n_expert);
bool ggml_backend_sched_pp_measures_here(ggml_backend_sched_t sched, int64_t n_sel, int64_t n_expert);

// ggml-backend-pp-staging.cpp: STAGING
void ggml_backend_sched_pp_stage_free(ggml_backend_sched_t sched);
void ggml_backend_sched_pp_stage_mark(ggml_backend_sched_t sched);
// the staging copier's threads with the caller's (0: no copier yet)
int ggml_backend_sched_pp_stage_threads(ggml_backend_sched_t sched);
// the slots of a backend's staging ring (0: none made)
int ggml_backend_sched_pp_stage_slots_of(ggml_backend_sched_t sched, int backend_id);
bool ggml_backend_sched_pp_buffer_is_pinned(ggml_backend_sched_t sched, ggml_backend_buffer_t buf);
bool ggml_backend_sched_pp_stages(ggml_backend_sched_t sched, int backend_id, const struct ggml_tensor * weight);
void ggml_backend_sched_pp_upload(ggml_backend_sched_t sched, int backend_id, const struct ggml_tensor * weight,
                                  struct ggml_tensor * dst, const void * data, size_t offset, size_t size,
                                  ggml_backend_t via = nullptr);
// one upload of ggml_backend_sched_pp_upload_pieces: `size` bytes of host weight `weight` from `data` to dst at `offset`
struct ggml_sched_pp_piece {
    const struct ggml_tensor * weight;
    struct ggml_tensor *       dst;
    const void *               data;
    size_t                     offset;
    size_t                     size;
};
void ggml_backend_sched_pp_upload_pieces(ggml_backend_sched_t sched, int backend_id, const ggml_sched_pp_piece * pieces,
                                         size_t n_pieces, ggml_backend_t via = nullptr);

// ggml-backend-pp-stable-reserve.cpp: STABLE_RESERVE's kept plans and padding
int ggml_backend_sched_pp_alloc_kept_plan(ggml_backend_sched_t sched);
int ggml_backend_sched_pp_pad_plan(ggml_backend_sched_t sched, const struct ggml_cgraph * graph,
                                   const std::unordered_map<ggml_tensor *, std::vector<ggml_tensor *>> & alloc_deps,
                                   std::vector<int> & pad_after);
int ggml_backend_sched_pp_add_pad(ggml_backend_sched_t sched, const struct ggml_cgraph * graph, int j, int backend_id,
                                  const std::vector<int> & pad_after);

// ggml-backend-pp-direct.cpp: DIRECT
bool ggml_backend_sched_pp_direct_possible(ggml_backend_sched_t sched, int backend_id);
bool ggml_backend_sched_pp_direct_fits(ggml_backend_sched_t sched, int backend_id, struct ggml_tensor * input,
                                       bool transient, int64_t n_sel, int64_t n_expert);
void ggml_backend_sched_pp_find_shared_copies(ggml_backend_sched_t sched);

// ggml-backend-pp-overlap.cpp: OVERLAP=2
int ggml_backend_sched_pp_early_lead(ggml_backend_sched_t sched, const struct ggml_tensor * input_cpy);
void ggml_backend_sched_pp_add_early_inputs(ggml_backend_sched_t sched, int i);
bool ggml_backend_sched_pp_reserve_without_early(ggml_backend_sched_t sched, struct ggml_cgraph * measure_graph);
void ggml_backend_sched_pp_find_early_copies(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
void ggml_backend_sched_pp_pool_copies(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
void ggml_backend_sched_pp_early_wait_split(ggml_backend_sched_t sched, const ggml_backend_sched_split * split);
void ggml_backend_sched_pp_early_free(ggml_backend_sched_t sched);
void ggml_backend_sched_pp_early_uploads(ggml_backend_sched_t sched, int split_id,
                                         std::unordered_map<const ggml_tensor *, bool> & decided,
                                         std::unordered_set<const ggml_tensor *> & prefetched,
                                         const ggml_tensor * ids_read, const std::vector<ggml_bitset_t> & used_ids);
void ggml_backend_sched_pp_early_staged(ggml_backend_sched_t sched, int split_id);
void ggml_backend_sched_pp_early_copy(ggml_backend_sched_t sched, int b, ggml_tensor * input, ggml_tensor * cpy,
                                      bool selective, const std::vector<ggml_bitset_t> & used_ids);
void ggml_backend_sched_pp_again_uploads(ggml_backend_sched_t sched, int split_id,
                                         std::unordered_map<const ggml_tensor *, bool> & decided);

// ggml-backend-pp-gather.cpp: GATHER
ggml_backend_pp_gather_t ggml_backend_sched_pp_find_gather(ggml_backend_reg_t reg);
bool ggml_backend_sched_pp_gather_possible(ggml_backend_sched_t sched, int backend_id);
bool ggml_backend_sched_pp_gather_fits(ggml_backend_sched_t sched, int backend_id, const struct ggml_tensor * input,
                                       const struct ggml_tensor * ids, bool transient, bool ids_pending);
bool ggml_backend_sched_pp_gather(ggml_backend_sched_t sched, int backend_id, ggml_backend_t via,
                                  struct ggml_tensor * input, struct ggml_tensor * cpy, const struct ggml_tensor * ids,
                                  int mode = GGML_BACKEND_PP_GATHER_USED, bool chained = false);

// ggml-backend-pp-layer-major.cpp: LAYER_MAJOR
void ggml_backend_sched_pp_find_read_again(ggml_backend_sched_t sched, const struct ggml_cgraph * graph);
bool ggml_backend_sched_pp_read_again(ggml_backend_sched_t sched, const struct ggml_tensor * weight);
bool ggml_backend_sched_pp_first_read(ggml_backend_sched_t sched, const struct ggml_tensor * node, int backend_id);
int ggml_backend_sched_pp_again_lead(ggml_backend_sched_t sched, int split_id, struct ggml_tensor * input);
void ggml_backend_sched_pp_add_again_inputs(ggml_backend_sched_t sched, int i);

// ggml-backend-pp-prefetch.cpp: PREFETCH and PREFETCH=2's lanes
bool ggml_backend_sched_pp_prefetch_possible(ggml_backend_sched_t sched, int backend_id);
bool ggml_backend_sched_pp_prefetch2_on(ggml_backend_sched_t sched, int backend_id);
bool ggml_backend_sched_pp_prefetch2(ggml_backend_sched_t sched, int backend_id);
void ggml_backend_sched_pp_ring_free(ggml_backend_sched_t sched);
size_t ggml_backend_sched_pp_ring_bytes(ggml_backend_sched_t sched, int backend_id);
void ggml_backend_sched_pp_ring_assign(ggml_backend_sched_t sched);
int ggml_backend_sched_pp_last_user(ggml_backend_sched_t sched, int split_id, const ggml_tensor * cpy);
void ggml_backend_sched_pp_after_split(ggml_backend_sched_t sched, int split_id);
ggml_backend_event_t ggml_backend_sched_pp_after_event(ggml_backend_sched_t sched, const ggml_sched_pp_early * e, int split_id);

// ggml-backend-pp-cache.cpp: EXPERT_CACHE
void ggml_backend_sched_pp_cache_devices(ggml_backend_sched_t sched, ggml_backend_t * backends, int n_backends);
int  ggml_backend_sched_pp_cache_backend(ggml_backend_sched_t sched, struct ggml_tensor * op, const struct ggml_tensor * weight);
void ggml_backend_sched_pp_cache_plan(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
int  ggml_backend_sched_pp_cache_split(ggml_backend_sched_t sched, const struct ggml_tensor * node);
void ggml_backend_sched_pp_cache_prepare(ggml_backend_sched_t sched, int split_id, ggml_sched_pp_cache_swap * swap);
void ggml_backend_sched_pp_cache_after_split(ggml_backend_sched_t sched, int split_id);
int64_t ggml_backend_sched_pp_hybrid_link_share(int64_t misses, int64_t cpu_pct);
std::string ggml_backend_sched_pp_cache_json(ggml_backend_sched_t sched, int backend_id);
void ggml_backend_sched_pp_cache_free(ggml_backend_sched_t sched);
