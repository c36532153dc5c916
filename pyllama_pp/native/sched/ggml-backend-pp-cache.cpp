// pyllama_pp: EXPERT_CACHE - host-resident experts cached in device memory for small batches (decode).
//
// Below op offload's threshold (a batch the owning device does not want: CUDA and VDEV take 32 tokens and more) an
// expert op on a host weight runs on the host CPU, so a generated token runs at the CPU's expert-matmul speed. With
// EXPERT_CACHE=MiB the op runs on the device that owns its layer instead, reading the experts from slots in that
// device's memory: per layer, a slot map shared by the layer's expert weights (gate, up, down: the ops that route by
// one ids tensor), per weight a tensor of n_slots experts. A model's expert biases are such weights too (gpt-oss:
// ADD_ID adds row ids[k] of a host [n, n_expert] bias to each selection, routed by the same ids): their ADD_ID ops
// read the layer's slots as its MUL_MAT_IDs do (a bias's rows uploaded with the missed experts into a slot tensor of
// [n, n_slots], the slot numbers as their ids), so the layer's whole expert FFN runs on its device - left on the CPU,
// they would cost two copies of the activations a bias and split the FFN. Before the op's split is submitted the
// scheduler reads the routing ids back, looks each id up in the layer's slots, uploads the missed experts' bytes from
// the host weight into their slots on the device's own stream (so a slot is rewritten only after every graph queued
// before has read it), writes the slot numbers as the op's ids and points the op at the slots - no copy of the whole
// weight. Only the generic backend API is used (async sets, a readback), so CUDA, VDEV and RPC devices work alike.
//
// An RPC server's scheduler (ggml-rpc-pp.cpp) keeps every op on the device that holds its result, so its expert ops
// on the host weights it keeps never reach pass 1: it hands them over (ggml_backend_sched_pp_cache_assigned), and one
// the slots cannot serve stays on the device with its weight copied in. A weight is known by its data, as the server
// makes a graph's tensors anew for each graph.
//
// The slots come from the device's buffer type, outside the graph allocator: EXPERT_CACHE=N gives each device N MiB,
// split evenly over the layers whose expert ops it takes (as many slots per layer as fit, at most n_expert);
// EXPERT_CACHE=-N gives each such layer N slots (at most n_expert), whatever memory that takes. A comma list gives each
// device of the scheduler its own value in its order (EXPERT_CACHE=-2,-4: the first device 2 slots a layer, the second
// 4; 0 or a device past the list: none there): unequal devices (memory, links, layers) each take their own. An RPC
// device's value goes to its server (ggml_backend_sched_pp_cache_devices), whose scheduler of that device takes it.
// An op whose batch
// could use more experts than its layer has slots (tokens x experts per token, at most n_expert) stays on the CPU, as
// does every op where the device has no room.
//
// Replacement, per layer: a least-recently-used list with the rule of pyllama_pp/expert_cache_sim.py's "lru" (a
// simulator that follows it gets the same counts). The routing ids are looked up once per layer and graph (the
// layer's later expert ops use the first op's lookups), token by token; a token's ids (in top-k order) form a step.
// A lookup is a hit when its expert is cached at the start of the step. The step then touches its hits in top-k
// order, then inserts its misses in top-k order; each touch or insertion makes the expert the most recently used. An
// insertion takes an empty slot while there is one (the lowest first), else evicts the least recently used expert
// (an eviction) - never one of the step's own: an op uses at most as many experts as its layer has slots.
// Counters per device (ggml_sched_pp_stats: cache_hits, cache_misses, cache_evictions, cache_bytes, cache_ops).
//
// The hit-rate guard (EXPERT_CACHE_MIN_HIT=P percent; 0: off; a comma list: each device its own P, in the scheduler's
// order, as its layers' link and costs are its own): a layer whose cache does not pay goes back to the host CPU path,
// and comes back when it would pay. Each layer keeps a shadow of its slots - an LRU of as many experts
// with the same rule - that follows every token its expert ops route, wherever they run: on the device from the ids
// read back for the lookups, on the CPU from the ids the CPU's split already holds in host memory (the router's ids
// are an input of that split, copied there synchronously: the CPU backend has no async copy), read after the split,
// so the CPU path gains no host wait. The shadow's hits over the layer's last GUARD_WINDOW tokens decide, once per
// graph after the layer's lookups, as soon as it has seen as many tokens whose step began with every slot of the
// shadow full (a cold cache's misses only fill it): below P% of their lookups the layer's ops run on the CPU in the
// graphs split from then on (exactly the path without the cache), at P + GUARD_MARGIN % or more they read the slots
// again. A decision that changes the placement of a graph llama would reuse makes llama split it again
// (ggml_backend_sched_pp_resplit). The slots keep what they hold while their layer is on the CPU; only the shadow
// follows its tokens. Counters per device: cache_cpu_ops, cache_leaves, cache_returns, cache_shadow_hits/misses.
//
// The hybrid (EXPERT_HYBRID=N; 0: off; a comma list: each device its own N, its own CPU and link rates): a cached
// token's misses need not all cross the link one after the other while the host CPU idles. Per layer and token the link takes k = ceil(m x 100 / (100 + N)) of its m misses (the first k in
// top-k order: copied into slots as above, kept for later tokens) and the host CPU the other m - k, computed from the
// host weights where they live: N is the CPU's expert rate in percent of the link's, so both finish together (the
// rounding to the link: one miss alone goes up; ggml_backend_sched_pp_hybrid_link_share). The CPU's misses are not
// cached (the LRU steps over its hits and the link's misses only). The CPU computes the layer's whole FFN for them,
// not op by op (one round trip a layer): the plan (after pass 1) takes the graph's nodes from the layer's first expert
// op to its last that the last depends on, where nothing else reads them but the last's readers and a node that is not
// a view follows it; that node starts a split (pass 5), so the FFN is one split on the device. Its first expert op's
// readback of the ids (the device idle then) also copies what the FFN reads from device memory (its input) into host
// memory; a clone of the FFN for the CPU (its expert ops on the host weights and the CPU's ids; at decode only the
// CPU's selections, in a batch every selection, the others on one of its experts and not written) is computed on the
// host's CPU backend after the split is submitted, beside the device's hits and the link's copies; the device computes
// the CPU's selections too, from a slot the token reads anyway, and the CPU's rows of the last expert op (one per
// (token, selection): nothing to sum) are then written over them on the device's stream, token-major, in top-k order,
// before the next split reads them. The rest of the layer (routing weights, the sum over the selections) runs on the
// device as without it. Where the FFN is not one split on its device (an ADD_ID that op offload takes - its rows are
// tokens x selections: gpt-oss's from 8 tokens - runs there with its bias copied in, which starts a split) or an eval
// callback runs the splits in parts, the layer keeps the cache alone. On an RPC server the host CPU is the server's
// (its scheduler's host backend, beside the host weights it keeps): the client sends each RPC device's N as
// EXPERT_HYBRID@D with the other per-device switches. Counters per device: cache_cpu_misses (misses the CPU computed;
// the link's are cache_misses less these), cache_hybrid_layers.
//
// The refill (EXPERT_REFILL=N, with EXPERT_HYBRID; 0: off): where a miss costs the host more to copy than to compute
// (an mmap-ed model: its bytes reach the link through the staging copy, which the host's threads make while the token
// waits), a decoded token's misses all go to the host CPU - nothing waits for the link before the device computes the
// hits - and the slots follow the routing behind it: the first N of the token's misses in top-k order are inserted
// into the LRU (its rule above, as the link's misses would be) and their bytes go into their slots after the CPU's
// share, on the device's stream before any later split reads them. From pageable memory the CPU's own graph copies
// each such expert into its (pinned) memory beside the FFN's matmuls, with the same threads - no other threads that
// would contend with them - and it goes up from there; from pinned memory it goes up directly. Counter per device:
// cache_refills (a refill's misses are the CPU's too: cache_cpu_misses counts them).

#include "ggml-backend-pp-impl.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// tokens an op may route at most (the ids the device holds per layer: n_expert_used x this)
#define GGML_SCHED_PP_CACHE_MAX_TOKENS 64
// the guard: the tokens whose shadow hits decide, and the points above EXPERT_CACHE_MIN_HIT at which a layer returns
// (pyllama_pp/expert_cache_sim.py's GUARD_WINDOW and GUARD_MARGIN)
#define GGML_SCHED_PP_CACHE_GUARD_WINDOW 32
#define GGML_SCHED_PP_CACHE_GUARD_MARGIN 10

// a least-recently-used set of a layer's experts in n_slots slots (the replacement rule above): the layer's slots,
// and the guard's shadow of them
struct ggml_sched_pp_cache_lru {
    std::vector<int32_t>  slot_expert;   // per slot: its expert (-1: empty)
    std::vector<int32_t>  expert_slot;   // per expert: its slot (-1: not held)
    std::vector<uint64_t> last_use;      // per slot: the lookup that last used it (0: never)
    int                   held = 0;      // slots that hold an expert

    void init(int n_slots, int64_t n_expert) {
        slot_expert.assign(n_slots, -1);
        expert_slot.assign(n_expert, -1);
        last_use.assign(n_slots, 0);
        held = 0;
    }

    // a missed expert into the slots: its slot
    int32_t insert(int32_t e, uint64_t & clock, uint64_t & evictions) {
        const int32_t s = (int32_t) (std::min_element(last_use.begin(), last_use.end()) - last_use.begin());
        if (slot_expert[s] >= 0) {
            expert_slot[slot_expert[s]] = -1;
            evictions++;
        } else {
            held++;
        }
        slot_expert[s] = e;
        expert_slot[e] = s;
        last_use[s]    = ++clock;
        return s;
    }

    // one token's step over its n ids (top-k order): its hits (held at the step's start) are touched, then its misses
    // inserted; slot[k]: the slot of ids[k]. With cpu_pct > 0 (EXPERT_HYBRID) only the first
    // ggml_backend_sched_pp_hybrid_link_share(misses, cpu_pct) misses in top-k order are inserted (the link's); the
    // others keep slot -1 (the host CPU's: not cached). With `refill` (EXPERT_REFILL: not null) the link takes none and
    // the first n_refill misses in top-k order are inserted but keep slot -1 (the CPU computes them this step; their
    // bytes go into their slots after it): (k, slot) of each into *refill. Returns the hits.
    int step(const int32_t * ids, int64_t n, int32_t * slot, uint64_t & clock, uint64_t & evictions, int64_t cpu_pct = 0,
             std::vector<std::pair<int32_t, int32_t>> * refill = nullptr, size_t n_refill = 0) {
        int hits = 0;
        for (int64_t k = 0; k < n; k++) {
            slot[k] = expert_slot[ids[k]];
            if (slot[k] >= 0) {
                hits++;
                last_use[slot[k]] = ++clock;
            }
        }
        if (refill != nullptr) {
            for (int64_t k = 0; k < n && refill->size() < n_refill; k++) {
                if (slot[k] < 0) {
                    refill->push_back({ (int32_t) k, expert_slot[ids[k]] >= 0 ? expert_slot[ids[k]] : insert(ids[k], clock, evictions) });
                }
            }
            return hits;
        }
        int64_t up = cpu_pct > 0 ? ggml_backend_sched_pp_hybrid_link_share(n - hits, cpu_pct) : n - hits;
        for (int64_t k = 0; k < n; k++) {
            if (slot[k] < 0 && up > 0) {
                slot[k] = expert_slot[ids[k]] >= 0 ? expert_slot[ids[k]] : insert(ids[k], clock, evictions);
                up--;
            }
        }
        return hits;
    }
};

// one host expert weight and its slots on the device
struct ggml_sched_pp_cache_weight {
    const ggml_tensor *  host  = nullptr;  // the host weight [.., .., n_expert] (as the graph planned last holds it)
    int                  dim   = 2;        // its dimension of experts (1: expert biases [.., n_expert], ADD_ID's)
    ggml_tensor *        slots = nullptr;  // its experts on the device, n_slots in dimension dim (nullptr: no room)
    std::vector<int32_t> content;          // the expert each slot of `slots` holds (-1: none yet)
};

// EXPERT_REFILL: one expert of a pageable host weight copied by the CPU's graph into its (pinned) memory
struct ggml_sched_pp_hybrid_copy {
    ggml_sched_pp_cache_weight * w;
    size_t                       j;     // the graph's refill it copies (l->hy.refill[j])
    ggml_tensor *                view;  // the expert in the host weight (its view_offs set before each compute)
    ggml_tensor *                dup;   // ... its copy
};

// EXPERT_HYBRID: a layer's FFN cloned for the host CPU, for n_sel selections a token and n_ref refills
// (ggml_sched_pp_hybrid_build)
struct ggml_sched_pp_hybrid_clone {
    ggml_context * ctx = nullptr;
    ggml_cgraph *  gf  = nullptr;
    ggml_tensor *  ids = nullptr;  // int32 [n_sel, n_tokens]: the CPU's experts
    ggml_tensor *  out = nullptr;  // the clone of the last expert op: the CPU's rows
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> inputs; // (a tensor of device memory the FFN reads, its host copy)
    std::vector<ggml_sched_pp_hybrid_copy> copies;               // EXPERT_REFILL: the refills' pageable experts
    uint64_t       built = 0;      // the plan (ggml_sched_pp_cache::plan_gen) it was made for (0: none)

    void free() {
        if (ctx != nullptr) {
            ggml_free(ctx);
        }
        *this = ggml_sched_pp_hybrid_clone();
    }
};

// EXPERT_HYBRID: a layer's FFN as the host CPU computes it for its share of the misses - the graph's nodes from the
// layer's first expert op to its last that the last one depends on (the plan: per graph split), cloned for the CPU
struct ggml_sched_pp_hybrid {
    bool                       on = false;   // this graph's plan: the CPU takes misses of the layer
    std::vector<ggml_tensor *> nodes;        // the FFN, graph order (its last: the last expert op)
    ggml_tensor *              last = nullptr;
    int                        i_after = -1; // the first node after the last expert op that is not a view: a split
    int                        split = -1;   // the split that holds the FFN (-1: not checked; -2: it does not)
    std::vector<ggml_sched_pp_hybrid_clone> clones; // by n_sel + (n_used + 1) x n_ref (selections a token, refills)
    ggml_sched_pp_hybrid_clone * cur = nullptr;     // ... this graph's
    std::vector<int32_t>       cpu_ids;      // this graph's CPU experts [n_used x n_tokens] (-1: not the CPU's)
    std::vector<std::pair<int32_t, int32_t>> pairs; // ... its (token, selection) rows the CPU computes, in order
    bool                       pending = false; // the CPU's rows are to be computed after the split is submitted
    // EXPERT_REFILL: this graph's (expert, slot) of the CPU's misses that go into slots after its share, and their
    // uploads (each weight's bytes: from the clone's copy where the host weight is pageable, else from the weight)
    std::vector<std::pair<int32_t, int32_t>> refill, refill_k;
    std::vector<ggml_sched_pp_piece>         refill_up;

    void free_clones() {
        for (auto & x : clones) {
            x.free();
        }
        cur = nullptr;
    }
    ~ggml_sched_pp_hybrid() { free_clones(); }
};

// the slot map of one layer, shared by the layer's expert weights
struct ggml_sched_pp_cache_layer {
    int     backend_id = -1;
    int64_t n_expert   = 0;
    int64_t n_used     = 0;       // routing ids per token
    int     n_slots    = 0;       // 0: not cached (no room)
    bool    guarded    = false;   // the guard may send its ops to the CPU (they would run there without the cache)
    ggml_sched_pp_cache_lru lru;         // what the slots hold
    ggml_tensor *              remap = nullptr; // int32 [n_used x MAX_TOKENS] on the device: the ops' slot numbers
    std::vector<ggml_tensor *> views;           // ... viewed as [n_used, n_tokens], by n_tokens (made on first use)
    ggml_context *             views_ctx = nullptr;
    // the ids read back and the slot numbers sent up, in pinned host memory where the device has a host buffer type
    // (an async copy from pageable memory makes the host wait; one layer's are reused only after its next readback,
    // which waits for the copies queued before)
    int32_t *            ids_host   = nullptr;   // [ids_cap]
    int32_t *            remap_host = nullptr;   // [n_used x MAX_TOKENS]
    size_t               ids_cap    = 0;
    std::vector<int32_t> ids_own, remap_own;     // (where the device has no pinned memory)
    std::vector<int32_t> ids_more;               // (ids that take more than ids_cap)
    std::vector<std::pair<int32_t, int32_t>> used; // (expert, slot) pairs of the last lookup
    uint64_t           lookup_seq = 0;              // the graph (pp_graph_seq) and ids of the last lookup
    const ggml_tensor * lookup_ids = nullptr;
    std::vector<int32_t> token;                     // (one token's ids, and their slots)
    std::vector<int32_t> token_slot;
    // the guard (EXPERT_CACHE_MIN_HIT)
    ggml_sched_pp_cache_lru shadow;                 // the slots as every token's lookup would have left them
    uint8_t window[GGML_SCHED_PP_CACHE_GUARD_WINDOW] = {}; // the shadow's hits of the layer's last tokens (a ring)
    uint64_t window_n   = 0;                        // tokens it has seen (since the shadow was full)
    int     window_hits = 0;                        // the hits of those it holds
    bool    to_cpu      = false;                    // the guard's decision for the graphs split from now: the CPU
    bool    on_cpu      = false;                    // where the ops of the graph split last run
    ggml_sched_pp_hybrid hy;                        // EXPERT_HYBRID
};

// an expert op of the graph being computed that reads its device's slots (or, in cpu_ops, that the guard runs on the CPU)
struct ggml_sched_pp_cache_op {
    ggml_tensor *                node;
    int                          index;  // in the graph (its split: the one whose node range holds it)
    int                          split;  // -1: not known yet
    bool                         first;  // the first op of its layer in the graph: starts a split, reads the ids back
    ggml_sched_pp_cache_weight * weight;
    ggml_sched_pp_cache_layer *  layer;
};

struct ggml_sched_pp_cache {
    std::vector<std::unique_ptr<ggml_sched_pp_cache_layer>> layers;
    // by the host weight's data (an RPC server makes a graph's tensors anew for each graph; the bytes stay put)
    std::unordered_map<const void *, std::unique_ptr<ggml_sched_pp_cache_weight>> weights;
    std::unordered_map<const void *, ggml_sched_pp_cache_layer *> layer_of;
    std::vector<ggml_context *>         ctxs;
    std::vector<ggml_backend_buffer_t>  bufs;
    size_t   bytes[GGML_SCHED_MAX_BACKENDS] = {};   // device memory the slots take, per backend
    uint64_t clock = 0;                             // lookups so far (the LRU's time)

    // expert ops given to their owner: in pass 1, or assigned by the scheduler's caller (op -> owner, and the backend
    // the op runs on where the slots cannot serve it: the CPU, or for an assigned op its owner, the weight copied in)
    std::vector<std::pair<ggml_tensor *, std::pair<int, int>>> candidates;
    std::vector<ggml_sched_pp_cache_op>          ops;        // the graph's ops that read the slots, in graph order
    std::unordered_map<const ggml_tensor *, int> op_of;      // node -> index in ops
    std::vector<ggml_sched_pp_cache_op>          cpu_ops;    // the graph's ops the guard gave to the CPU, in graph order
    std::vector<ggml_sched_pp_cache_layer *>     planned;    // the layers of both
    bool     splits_known = false;
    uint64_t plan_gen     = 0;   // plans made (each split of a graph)
    std::unordered_set<const ggml_tensor *> hybrid_after;    // EXPERT_HYBRID: nodes that start a split (after an FFN)
    ggml_gallocr_t hybrid_galloc[GGML_SCHED_MAX_BACKENDS] = {}; // ... per device, the memory of its layers' clones
    uint64_t seq          = 0;   // the graph computed last (pp_graph_seq) ...
    size_t   next         = 0;   // ... its first op not prepared yet
    size_t   next_cpu     = 0;   // ... and its first CPU op whose split has not run
    std::vector<ggml_sched_pp_piece> misses;   // a split's missed experts, uploaded together (cache_prepare)
};

// the host weight of an expert op the cache may take (MUL_MAT_ID's experts, ADD_ID's expert biases)
static ggml_tensor * ggml_sched_pp_cache_weight_of(const ggml_tensor * op) {
    return op->src[ggml_sched_pp_expert_src(op)];
}

// whether the cache may take an expert op on `weight` run by backend `owner` (below op offload's threshold)
static bool ggml_sched_pp_cache_may_take(ggml_backend_sched_t sched, const ggml_tensor * op, const ggml_tensor * weight, int owner) {
    const int src = ggml_sched_pp_expert_src(op);
    if (owner < 0 || sched->pp_cfg.expert_cache_dev[owner] == 0 || src < 0 || op->src[src] != weight ||
        weight->view_src != nullptr || weight->data == nullptr || !ggml_is_contiguous(weight) ||
        op->src[2] == nullptr || op->src[2]->type != GGML_TYPE_I32 || ggml_nelements(op) == 0) {
        return false; // (no data: a dry run that only measures)
    }
    return owner != -1 && ggml_backend_supports_op(sched->backends[owner], op) &&
           !ggml_backend_offload_op(sched->backends[owner], op);
}

// the cache's switches that take one value per device (type ints), where each backend reads its own; `exact`: a list
// must name every device (a guard or a split read as 0 past the list would be silently off there)
static const struct {
    const char * name;
    int64_t (ggml_sched_pp_cfg::* dev)[GGML_SCHED_MAX_BACKENDS];
    bool exact;
} ggml_sched_pp_cache_lists[] = {
    { "EXPERT_CACHE",         &ggml_sched_pp_cfg::expert_cache_dev,         false },
    { "EXPERT_CACHE_MIN_HIT", &ggml_sched_pp_cfg::expert_cache_min_hit_dev, true  },
    { "EXPERT_HYBRID",        &ggml_sched_pp_cfg::expert_hybrid_dev,        true  },
};

// A new scheduler's devices (ggml_backend_sched_new, after the switches), for each of the cache's per-device switches
// set as a list: a list longer than its devices is an error (logged; the extra values are ignored), and so is a guard's
// or a split's shorter one (the devices past it read 0); each RPC device's value goes to its server as NAME@D for the
// scheduler it makes of that device (a list only: one value for every device goes with the backend,
// rpc_host_send_switches)
void ggml_backend_sched_pp_cache_devices(ggml_backend_sched_t sched, ggml_backend_t * backends, int n_backends) {
    for (const auto & sw : ggml_sched_pp_cache_lists) {
        char text[512];
        if (ggml_backend_sched_pp_get_param_text(sw.name, text, sizeof(text)) < 0 || strchr(text, ',') == nullptr) {
            continue;
        }
        const int n_values = 1 + (int) std::count(text, text + strlen(text), ',');
        if (n_values > n_backends - 1) {
            GGML_LOG_ERROR("%s: %s=%s has %d values for the scheduler's %d devices: those past its last device are "
                           "ignored\n", __func__, sw.name, text, n_values, n_backends - 1);
        } else if (sw.exact && n_values < n_backends - 1) {
            GGML_LOG_ERROR("%s: %s=%s has %d values for the scheduler's %d devices: the devices past the list read 0 "
                           "(give one value for every device, or one per device)\n", __func__, sw.name, text, n_values,
                           n_backends - 1);
        }
        for (int b = 0; b < n_backends - 1; b++) {
            ggml_backend_dev_t dev = ggml_backend_get_device(backends[b]);
            ggml_backend_reg_t reg = dev != nullptr ? ggml_backend_dev_backend_reg(dev) : nullptr;
            auto send = reg != nullptr ? (bool (*)(ggml_backend_dev_t, const char *, int64_t))
                ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_pp_device_switch") : nullptr;
            if (send != nullptr && !send(dev, sw.name, (sched->pp_cfg.*(sw.dev))[b])) {
                GGML_LOG_WARN("%s: the server of %s takes no per-device %s (an older one): its device takes the "
                              "value it had\n", __func__, ggml_backend_dev_name(dev), sw.name);
            }
        }
    }
}

static void ggml_sched_pp_cache_candidate(ggml_backend_sched_t sched, ggml_tensor * op, int owner, int fallback) {
    if (sched->pp_cache == nullptr) {
        sched->pp_cache = new ggml_sched_pp_cache();
    }
    sched->pp_cache->candidates.push_back({ op, { owner, fallback } });
}

// Pass 1 of split_graph, for an expert op on a host weight that no device wants (below op offload's threshold):
// the backend that owns its layer if the cache may take it (decided for good after pass 1, by
// ggml_backend_sched_pp_cache_plan), else -1
int ggml_backend_sched_pp_cache_backend(ggml_backend_sched_t sched, struct ggml_tensor * op, const struct ggml_tensor * weight) {
    const int owner = ggml_backend_sched_pp_owner_backend(sched, op, weight);
    if (!ggml_sched_pp_cache_may_take(sched, op, weight, owner)) {
        return -1;
    }
    ggml_sched_pp_cache_candidate(sched, op, owner, sched->n_backends - 1);
    return owner;
}

// An expert op the scheduler's caller assigned to a backend (an RPC server's scheduler: each op stays on the device
// that holds its result): the cache takes it there where it may; else, as where the slots cannot serve it, it stays
// there with its weight copied in. The guard keeps away from such layers: their ops have no CPU path to go back to,
// and the copy they would go back to moves no fewer bytes than the misses.
void ggml_backend_sched_pp_cache_assigned(ggml_backend_sched_t sched, struct ggml_tensor * op, ggml_backend_t backend) {
    for (int b = 0; b < sched->n_backends - 1; b++) {
        if (sched->backends[b] == backend && ggml_sched_pp_expert_src(op) >= 0 &&
            ggml_sched_pp_cache_may_take(sched, op, op->src[ggml_sched_pp_expert_src(op)], b)) {
            ggml_sched_pp_cache_candidate(sched, op, b, b);
        }
    }
}

// the host side of the layers' ids: per layer room for the ids of MAX_TOKENS tokens as the router lays them out (a
// view of the sorted experts: up to n_expert a token) and the slot numbers, pinned where the device can
static void ggml_sched_pp_cache_host_ids(ggml_backend_sched_t sched, int b, const std::vector<ggml_sched_pp_cache_layer *> & layers) {
    ggml_sched_pp_cache * c = sched->pp_cache;
    size_t need = 0;
    for (const auto * l : layers) {
        need += (size_t) (l->n_expert + l->n_used) * GGML_SCHED_PP_CACHE_MAX_TOKENS;
    }
    ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(ggml_backend_get_device(sched->backends[b]));
    ggml_backend_buffer_t hbuf = need > 0 && host_buft != nullptr ?
        ggml_backend_buft_alloc_buffer(host_buft, need * sizeof(int32_t)) : nullptr;
    int32_t * p = hbuf != nullptr ? (int32_t *) ggml_backend_buffer_get_base(hbuf) : nullptr;
    if (hbuf != nullptr) {
        c->bufs.push_back(hbuf);
    }
    for (auto * l : layers) {
        l->ids_cap = (size_t) l->n_expert * GGML_SCHED_PP_CACHE_MAX_TOKENS;
        const size_t n_remap = (size_t) l->n_used * GGML_SCHED_PP_CACHE_MAX_TOKENS;
        if (p != nullptr) {
            l->ids_host   = p;
            l->remap_host = p + l->ids_cap;
            p += l->ids_cap + n_remap;
        } else {
            l->ids_own.resize(l->ids_cap);
            l->remap_own.resize(n_remap);
            l->ids_host   = l->ids_own.data();
            l->remap_host = l->remap_own.data();
        }
    }
}

// the slots of `layers` (new, all on backend b, with their new `weights`) and of the new `joining` weights of layers
// that have slots already: one buffer of the backend's buffer type; false where it does not fit
static bool ggml_sched_pp_cache_alloc(ggml_backend_sched_t sched, int b, const std::vector<ggml_sched_pp_cache_layer *> & layers,
                                      const std::vector<ggml_sched_pp_cache_weight *> & weights) {
    ggml_sched_pp_cache * c = sched->pp_cache;
    ggml_backend_buffer_type_t buft = sched->bufts[b];
    const int64_t cfg    = sched->pp_cfg.expert_cache_dev[b];
    const size_t  budget = cfg > 0 ? (size_t) cfg * 1024 * 1024 : SIZE_MAX; // (-N: N slots a layer, whatever they take)
    const size_t  left   = budget > c->bytes[b] ? budget - c->bytes[b] : 0;

    // bytes of one slot of every new layer, and what else the buffer holds (ids, alignment, padding)
    size_t per_slot = 0, other = 0;
    int64_t max_slots = 0;
    for (const auto * w : weights) {
        const ggml_sched_pp_cache_layer * l = c->layer_of.at(w->host->data);
        if (l->n_slots == 0) {
            per_slot += w->host->nb[w->dim];
        }
        other += ggml_backend_buft_get_alignment(buft) + GGML_BACKEND_PP_GATHER_TAIL;
    }
    for (const auto * l : layers) {
        other += ggml_backend_buft_get_alignment(buft) + (size_t) l->n_used * GGML_SCHED_PP_CACHE_MAX_TOKENS * sizeof(int32_t);
        max_slots = std::max(max_slots, l->n_expert);
    }
    int64_t n_slots = cfg < 0 ? -cfg : per_slot > 0 && left > other ? (int64_t) ((left - other) / per_slot) : 0;
    n_slots = std::min(n_slots, max_slots);

    // the tensors: a few tries, with fewer slots where the padding the buffer type adds went past the budget
    for (int attempt = 0; attempt < 4; attempt++) {
        for (auto * l : layers) {
            l->n_slots = (int) std::min(n_slots, l->n_expert);
        }
        if (!layers.empty() && n_slots < 1) {
            for (auto * l : layers) {
                l->n_slots = 0;
            }
            return false;
        }
        const size_t n_tensors = weights.size() + layers.size() * (1 + GGML_SCHED_PP_CACHE_MAX_TOKENS);
        ggml_init_params params = { n_tensors * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
        ggml_context * ctx = ggml_init(params);
        if (ctx == nullptr) {
            return false;
        }
        for (auto * w : weights) {
            const ggml_sched_pp_cache_layer * l = c->layer_of.at(w->host->data);
            int64_t ne[GGML_MAX_DIMS];
            memcpy(ne, w->host->ne, sizeof(ne));
            ne[w->dim] = l->n_slots;
            w->slots = ggml_new_tensor(ctx, w->host->type, w->dim + 1, ne);
            ggml_format_name(w->slots, "%s (cache)", w->host->name);
            GGML_ASSERT(w->slots->nb[w->dim] == w->host->nb[w->dim]);
        }
        for (auto * l : layers) {
            l->remap = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, l->n_used * GGML_SCHED_PP_CACHE_MAX_TOKENS);
            ggml_set_name(l->remap, "expert cache ids");
        }
        const size_t need = ggml_backend_alloc_ctx_tensors_from_buft_size(ctx, buft);
        if (need > left && !layers.empty() && n_slots > 1 && attempt < 3) {
            ggml_free(ctx);
            n_slots = std::max<int64_t>(1, n_slots - (int64_t) ((need - left + per_slot - 1) / per_slot));
            continue;
        }
        // (not past the device's free memory: an allocation that fails there is logged as an error by some backends)
        size_t free_mem = 0, total_mem = 0;
        ggml_backend_dev_memory(ggml_backend_get_device(sched->backends[b]), &free_mem, &total_mem);
        const bool fits = (need <= left || layers.empty()) && (total_mem == 0 || need <= free_mem);
        ggml_backend_buffer_t buf = fits ? ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft) : nullptr;
        if (buf == nullptr) {
            GGML_LOG_WARN("%s: no room for %zu bytes of expert slots on %s (EXPERT_CACHE=%lld): its expert ops stay on the CPU\n",
                          __func__, need, ggml_backend_name(sched->backends[b]), (long long) cfg);
            ggml_free(ctx);
            for (auto * w : weights) {
                w->slots = nullptr;
            }
            for (auto * l : layers) {
                l->n_slots = 0;
                l->remap   = nullptr;
            }
            return false;
        }
        ggml_backend_buffer_clear(buf, 0); // every byte a number: kernels may read past an expert's last row
        c->ctxs.push_back(ctx);
        c->bufs.push_back(buf);
        c->bytes[b] += ggml_backend_buffer_get_size(buf);
        ggml_sched_pp_cache_host_ids(sched, b, layers);
        for (auto * w : weights) {
            w->content.assign(c->layer_of.at(w->host->data)->n_slots, -1);
        }
        for (auto * l : layers) {
            l->lru.init(l->n_slots, l->n_expert);
            l->shadow.init(l->n_slots, l->n_expert);
            l->views.assign(GGML_SCHED_PP_CACHE_MAX_TOKENS + 1, nullptr);
            l->views_ctx = ctx;
        }
        return true;
    }
    return false;
}

// EXPERT_HYBRID: the split of a token's m misses: k of them go over the link into slots, the host CPU computes the
// other m - k from host memory. Per missed expert the link moves its bytes at R_link, the CPU reads them at R_cpu;
// both finish together at k / R_link = (m - k) / R_cpu, k = m R_link / (R_link + R_cpu) = m 100 / (100 + cpu_pct)
// with cpu_pct = 100 R_cpu / R_link, rounded up: the link takes at least one of a token's misses - a token with one
// miss sends it up, the CPU is asked only where the link would take longer than one miss, and the slots keep
// following the routing however fast the CPU is (the CPU's misses are not cached: rounded to the nearest, a CPU much
// faster than the link would take every miss and the slots would never fill).
int64_t ggml_backend_sched_pp_hybrid_link_share(int64_t misses, int64_t cpu_pct) {
    if (misses <= 0) {
        return 0;
    }
    if (cpu_pct <= 0) {
        return misses;
    }
    return (misses * 100 + 100 + cpu_pct - 1) / (100 + cpu_pct);
}

static bool ggml_sched_pp_is_view_op(enum ggml_op op) {
    return op == GGML_OP_VIEW || op == GGML_OP_RESHAPE || op == GGML_OP_PERMUTE || op == GGML_OP_TRANSPOSE;
}

// EXPERT_HYBRID, after pass 1: the layers whose FFN the host CPU can compute for its misses (each layer's `hy` plan).
// A layer's FFN: the nodes from its first expert op to its last (`ops`, graph order) that the last one depends on;
// it fits where every expert op of the layer is among them, nothing outside reads any of them but the last (whose
// rows the CPU overwrites) and a node that is not a view follows the last one (a split starts there: the CPU's rows
// are written between the two splits). Where the FFN runs is checked when it is computed (one split on the owner).
static std::unordered_set<ggml_sched_pp_cache_layer *> ggml_sched_pp_hybrid_plan(
        ggml_backend_sched_t sched, const ggml_cgraph * graph,
        const std::unordered_map<ggml_sched_pp_cache_layer *, std::vector<int>> & ops) {
    std::unordered_set<ggml_sched_pp_cache_layer *> fits;
    std::unordered_map<const ggml_tensor *, ggml_sched_pp_cache_layer *> member;
    for (const auto & [l, idx] : ops) {
        ggml_sched_pp_hybrid & h = l->hy;
        h.nodes.clear();
        h.last    = nullptr;
        h.i_after = -1;
        if (sched->pp_cfg.expert_hybrid_dev[l->backend_id] <= 0 || idx.empty()) {
            continue; // (its device does not split: every miss over its link)
        }
        const int i_first = idx.front(), i_last = idx.back();
        std::unordered_set<const ggml_tensor *> need = { graph->nodes[i_last] };
        for (int i = i_last; i >= i_first; i--) {
            ggml_tensor * n = graph->nodes[i];
            if (!need.count(n)) {
                continue;
            }
            h.nodes.push_back(n);
            for (int j = 0; j < GGML_MAX_SRC; j++) {
                if (n->src[j] != nullptr) {
                    need.insert(n->src[j]);
                }
            }
            if (n->view_src != nullptr) {
                need.insert(n->view_src);
            }
        }
        std::reverse(h.nodes.begin(), h.nodes.end());
        bool ok = true;
        for (int i : idx) {
            ok = ok && need.count(graph->nodes[i]) > 0;
        }
        for (int i = i_last + 1; i < graph->n_nodes && h.i_after < 0; i++) {
            if (!ggml_sched_pp_is_view_op(graph->nodes[i]->op)) {
                h.i_after = i;
            }
        }
        h.last = graph->nodes[i_last];
        for (const ggml_tensor * n : h.nodes) {
            ok = ok && (n == h.last || !(n->flags & GGML_TENSOR_FLAG_OUTPUT));
        }
        if (ok && h.i_after >= 0) {
            fits.insert(l);
            for (const ggml_tensor * n : h.nodes) {
                member[n] = l;
            }
        }
    }
    // nothing outside a layer's FFN reads a node of it but its last
    for (int i = 0; i < graph->n_nodes && !fits.empty(); i++) {
        const ggml_tensor * n = graph->nodes[i];
        const auto self = member.find(n);
        for (int j = 0; j <= GGML_MAX_SRC; j++) {
            const ggml_tensor * src = j < GGML_MAX_SRC ? n->src[j] : n->view_src;
            const auto it = src != nullptr ? member.find(src) : member.end();
            if (it != member.end() && src != it->second->hy.last && (self == member.end() || self->second != it->second)) {
                fits.erase(it->second);
            }
        }
    }
    (void) sched;
    return fits;
}

// After pass 1 of split_graph: which of the expert ops pass 1 gave to their owner read the owner's slots (the slots
// of layers met for the first time are allocated here); the others go back to the CPU, where upstream puts them
void ggml_backend_sched_pp_cache_plan(ggml_backend_sched_t sched, struct ggml_cgraph * graph) {
    ggml_sched_pp_cache * c = sched->pp_cache;
    if (c == nullptr) {
        return;
    }
    c->ops.clear();
    c->op_of.clear();
    c->cpu_ops.clear();
    c->planned.clear();
    c->splits_known = false;
    c->plan_gen++;
    c->hybrid_after.clear();
    for (auto & l : c->layers) {
        l->hy.on      = false;
        l->hy.split   = -1;
        l->hy.pending = false;
        l->hy.cur     = nullptr;
    }
    if (c->candidates.empty()) {
        return;
    }
    std::unordered_map<const ggml_tensor *, std::pair<int, int>> owner_of(c->candidates.begin(), c->candidates.end());
    c->candidates.clear();

    std::vector<std::pair<int, ggml_tensor *>> cands; // (graph index, op) in graph order
    for (int i = 0; i < graph->n_nodes; i++) {
        if (owner_of.count(graph->nodes[i])) {
            cands.emplace_back(i, graph->nodes[i]);
        }
    }

    // the layer of each op: its weight's, else that of the ops routed by the same ids, else a new one
    std::unordered_map<const ggml_tensor *, ggml_sched_pp_cache_layer *> layer_of_ids;
    for (const auto & [i, op] : cands) {
        const auto it = c->layer_of.find(ggml_sched_pp_cache_weight_of(op)->data);
        if (it != c->layer_of.end()) {
            layer_of_ids.emplace(op->src[2], it->second);
        }
    }
    std::vector<ggml_sched_pp_cache_layer *>  new_layers[GGML_SCHED_MAX_BACKENDS];
    std::vector<ggml_sched_pp_cache_weight *> new_weights[GGML_SCHED_MAX_BACKENDS];
    for (const auto & [i, op] : cands) {
        const ggml_tensor * w = ggml_sched_pp_cache_weight_of(op);
        if (c->layer_of.count(w->data)) {
            continue;
        }
        ggml_sched_pp_cache_layer *& l = layer_of_ids[op->src[2]];
        if (l == nullptr) {
            c->layers.emplace_back(new ggml_sched_pp_cache_layer());
            l = c->layers.back().get();
            l->backend_id = owner_of.at(op).first;
            l->guarded    = owner_of.at(op).second == sched->n_backends - 1;
            l->n_expert   = w->ne[ggml_sched_pp_expert_dim(op)];
            l->n_used     = op->src[2]->ne[0];
            new_layers[l->backend_id].push_back(l);
        }
        c->layer_of[w->data] = l;
        auto & cw = c->weights[w->data];
        cw.reset(new ggml_sched_pp_cache_weight());
        cw->host = w;
        cw->dim  = ggml_sched_pp_expert_dim(op);
        if (l->n_slots > 0 || std::find(new_layers[l->backend_id].begin(), new_layers[l->backend_id].end(), l) != new_layers[l->backend_id].end()) {
            new_weights[l->backend_id].push_back(cw.get());
        }
    }
    for (int b = 0; b < sched->n_backends; b++) {
        if (!new_weights[b].empty()) {
            ggml_sched_pp_cache_alloc(sched, b, new_layers[b], new_weights[b]);
        }
    }

    // EXPERT_HYBRID: the layers whose FFN the host CPU can compute
    std::unordered_set<ggml_sched_pp_cache_layer *> hybrid_fits;
    if (sched->pp_cfg.expert_hybrid > 0) {   // (some device splits: each layer by its own device's value)
        std::unordered_map<ggml_sched_pp_cache_layer *, std::vector<int>> layer_ops;
        for (const auto & [i, op] : cands) {
            layer_ops[c->layer_of.at(ggml_sched_pp_cache_weight_of(op)->data)].push_back(i);
        }
        hybrid_fits = ggml_sched_pp_hybrid_plan(sched, graph, layer_ops);
    }

    // the ops whose layer has slots enough for every expert the batch could use
    std::unordered_set<const ggml_tensor *> ids_seen;
    std::unordered_set<ggml_sched_pp_cache_layer *> not_hybrid; // (a layer with an op that does not read the slots)
    for (const auto & [i, op] : cands) {
        ggml_tensor *                wt = ggml_sched_pp_cache_weight_of(op);
        ggml_sched_pp_cache_layer *  l  = c->layer_of.at(wt->data);
        ggml_sched_pp_cache_weight * w  = c->weights.at(wt->data).get();
        w->host = wt;
        const ggml_tensor * ids = op->src[2];
        const int64_t need = std::min(ids->ne[0] * ids->ne[1], l->n_expert);
        const auto [owner, fallback] = owner_of.at(op);
        ggml_sched_pp_expert_op x(GGML_SCHED_PP_AT_SPLIT, owner, wt, ids, w->host->ne[w->dim]);
        x.cache_fits         = w->slots != nullptr && l->n_slots >= need && l->backend_id == owner && ids->ne[0] == l->n_used &&
                               ids->ne[1] <= GGML_SCHED_PP_CACHE_MAX_TOKENS && ids->ne[2] == 1 && ids->ne[3] == 1 &&
                               w->host->ne[w->dim] == l->n_expert;
        x.cache_to_cpu       = l->to_cpu;
        x.cache_fallback_cpu = fallback == sched->n_backends - 1;
        x.cache_hybrid_fits  = hybrid_fits.count(l) > 0;
        const ggml_sched_pp_path path = ggml_backend_sched_pp_expert_path(sched, x);
        if (path != GGML_SCHED_PP_PATH_HYBRID) {
            not_hybrid.insert(l);
        }
        if (!x.cache_fits) {
            tensor_backend_id(op) = fallback; // (no slots for it: HOST_CPU, or LATER - its owner copies the weight in)
            continue;
        }
        if (std::find(c->planned.begin(), c->planned.end(), l) == c->planned.end()) {
            c->planned.push_back(l);
        }
        l->on_cpu = path == GGML_SCHED_PP_PATH_HOST_CPU;
        if (l->on_cpu) {
            // the guard: this layer's cache does not pay; its ops run on the CPU, where its shadow follows them
            tensor_backend_id(op) = sched->n_backends - 1;
            c->cpu_ops.push_back({ op, i, -1, false, w, l });
            continue;
        }
        GGML_ASSERT(path == GGML_SCHED_PP_PATH_CACHE || path == GGML_SCHED_PP_PATH_HYBRID);
        const bool first = ids_seen.insert(ids).second;
        c->op_of[op] = (int) c->ops.size();
        c->ops.push_back({ op, i, -1, first, w, l });
    }
    // EXPERT_HYBRID: a layer whose every op took the path; a split starts after its FFN
    for (auto * l : hybrid_fits) {
        if (!not_hybrid.count(l)) {
            l->hy.on = true;
            c->hybrid_after.insert(graph->nodes[l->hy.i_after]);
        }
    }
}

bool ggml_backend_sched_pp_resplit(ggml_backend_sched_t sched) {
    const ggml_sched_pp_cache * c = sched->pp_cache;
    if (c == nullptr) {
        return false;
    }
    for (const auto * l : c->planned) {
        if (l->to_cpu != l->on_cpu) {
            return true;
        }
    }
    return false;
}

// Pass 5 of split_graph: -1 for a node that does not read the slots; else whether it starts a split of its own (the
// first expert op of its layer: its ids are read back before the split is submitted, so they come from an earlier one);
// 2 for a node that does not read them but starts a split (EXPERT_HYBRID: the first after a layer's FFN, where the
// host CPU's rows are written)
int ggml_backend_sched_pp_cache_split(ggml_backend_sched_t sched, const struct ggml_tensor * node) {
    const ggml_sched_pp_cache * c = sched->pp_cache;
    if (c == nullptr || c->ops.empty()) {
        return -1;
    }
    const auto it = c->op_of.find(node);
    if (it == c->op_of.end()) {
        return c->hybrid_after.count(node) ? 2 : -1; // (2: EXPERT_HYBRID, the node after a layer's FFN starts a split)
    }
    return c->ops[it->second].first ? 1 : 0;
}

// the guard's part of a token's lookup: its ids into the layer's shadow, and the shadow's hits into the window where
// every slot of the shadow held an expert at the step's start (a cold cache's misses only fill it)
static void ggml_sched_pp_cache_shadow_step(ggml_backend_sched_t sched, ggml_sched_pp_cache_layer * l) {
    const int b = l->backend_id;
    uint64_t evictions = 0;
    const int64_t n = (int64_t) l->token.size();
    const bool full = l->shadow.held == l->n_slots;
    const int hits = l->shadow.step(l->token.data(), n, l->token_slot.data(), sched->pp_cache->clock, evictions);
    sched->pp.cache_shadow_hits[b]   += hits;
    sched->pp.cache_shadow_misses[b] += n - hits;
    if (!full) {
        return;
    }
    uint8_t & oldest = l->window[l->window_n % GGML_SCHED_PP_CACHE_GUARD_WINDOW];
    l->window_hits += hits - (l->window_n >= GGML_SCHED_PP_CACHE_GUARD_WINDOW ? oldest : 0);
    oldest = (uint8_t) hits;
    l->window_n++;
}

// the guard's decision after a layer's lookups of a graph: where its ops run in the graphs split from now
static void ggml_sched_pp_cache_decide(ggml_backend_sched_t sched, ggml_sched_pp_cache_layer * l) {
    if (l->window_n < GGML_SCHED_PP_CACHE_GUARD_WINDOW) {
        return;
    }
    const int64_t floor   = sched->pp_cfg.expert_cache_min_hit_dev[l->backend_id];
    const int64_t lookups = GGML_SCHED_PP_CACHE_GUARD_WINDOW * l->n_used;
    if (!l->to_cpu && l->window_hits * 100 < floor * lookups) {
        l->to_cpu = true;
        sched->pp.cache_leaves[l->backend_id]++;
    } else if (l->to_cpu && l->window_hits * 100 >= (floor + GGML_SCHED_PP_CACHE_GUARD_MARGIN) * lookups) {
        l->to_cpu = false;
        sched->pp.cache_returns[l->backend_id]++;
    }
}

// token t's ids (of n_used) from ids laid out as `ids` in the host memory at `base`, into l->token
static void ggml_sched_pp_cache_token(ggml_sched_pp_cache_layer * l, const ggml_tensor * ids, const int32_t * base, int64_t t) {
    const int64_t n_used = ids->ne[0];
    l->token.resize(n_used);
    l->token_slot.resize(n_used);
    for (int64_t k = 0; k < n_used; k++) {
        const int32_t e = base[(t * ids->nb[1] + k * ids->nb[0]) / sizeof(int32_t)];
        GGML_ASSERT(e >= 0 && e < l->n_expert);
        l->token[k] = e;
    }
}

// the layer's lookups for the ids of `op` (read back from the device): the slot numbers go up to the device; with
// `hybrid` (EXPERT_HYBRID) the misses the link does not take are the CPU's (l->hy.pairs, l->hy.cpu_ids); with
// EXPERT_REFILL=N too, a decoded token's misses are all the CPU's and the first N go into slots after it (l->hy.refill)
static void ggml_sched_pp_cache_look_up(ggml_backend_sched_t sched, ggml_sched_pp_cache_layer * l, const ggml_tensor * ids,
                                        bool hybrid) {
    ggml_backend_t backend = sched->backends[l->backend_id];
    int32_t * ids_host = l->ids_host;
    if (ggml_nbytes(ids) > l->ids_cap * sizeof(int32_t)) {
        l->ids_more.resize(ggml_nbytes(ids) / sizeof(int32_t) + 1);
        ids_host = l->ids_more.data();
    }
    {
        GGML_SCHED_PP_WAIT(sched, GGML_SCHED_PP_WAIT_IDS);
        if (ids->buffer != nullptr && ggml_backend_buffer_get_type(ids->buffer) == sched->bufts[l->backend_id]) {
            ggml_backend_tensor_get_async(backend, ids, ids_host, 0, ggml_nbytes(ids));
            ggml_backend_synchronize(backend);
        } else {
            ggml_backend_synchronize(backend);
            ggml_backend_tensor_get(ids, ids_host, 0, ggml_nbytes(ids));
        }
    }
    sched->pp.id_readbacks++;

    const int b = l->backend_id;
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    const bool guard = sched->pp_cfg.expert_cache_min_hit_dev[b] > 0 && l->guarded;
    const int64_t cpu_pct = hybrid ? sched->pp_cfg.expert_hybrid_dev[b] : 0;
    const size_t  n_refill = hybrid && n_tokens == 1 ? (size_t) sched->pp_cfg.expert_refill : 0;
    l->used.clear();
    l->hy.pairs.clear();
    l->hy.refill.clear();
    l->hy.refill_k.clear();
    l->hy.refill_up.clear();
    l->hy.cpu_ids.assign((size_t) (n_used * n_tokens), -1);
    for (int64_t t = 0; t < n_tokens; t++) {
        int32_t * slot = l->remap_host + t * n_used;
        ggml_sched_pp_cache_token(l, ids, ids_host, t);
        // a step: the token's hits (cached at its start) are touched, then its misses inserted, each in top-k order
        // (EXPERT_HYBRID: the link's share of them; the rest the CPU computes)
        const int hits = l->lru.step(l->token.data(), n_used, slot, sched->pp_cache->clock, sched->pp.cache_evictions[b], cpu_pct,
                                     n_refill > 0 ? &l->hy.refill_k : nullptr, n_refill);
        sched->pp.cache_hits[b]   += hits;
        sched->pp.cache_misses[b] += n_used - hits;
        // the CPU's rows on the device are computed from a slot the token reads anyway or one that a refill of it
        // takes (the link takes at least one miss of a token with misses, else a refill takes it), then overwritten
        int32_t fill = *std::max_element(slot, slot + n_used);
        for (const auto & [k, s] : l->hy.refill_k) {
            fill = std::max(fill, s);
            l->hy.refill.push_back({ l->token[k], s });
        }
        sched->pp.cache_refills[b] += l->hy.refill_k.size();
        for (int64_t k = 0; k < n_used; k++) {
            if (slot[k] < 0) {
                l->hy.pairs.push_back({ (int32_t) t, (int32_t) k });
                l->hy.cpu_ids[t * n_used + k] = l->token[k];
                slot[k] = fill;
                GGML_ASSERT(slot[k] >= 0);
                continue;
            }
            const auto es = std::make_pair(l->token[k], slot[k]);
            if (std::find(l->used.begin(), l->used.end(), es) == l->used.end()) {
                l->used.push_back(es);
            }
        }
        if (guard) {
            ggml_sched_pp_cache_shadow_step(sched, l);
        }
    }
    if (guard) {
        ggml_sched_pp_cache_decide(sched, l);
    }
    ggml_backend_tensor_set_async(backend, l->remap, l->remap_host, 0, (size_t) (n_used * n_tokens) * sizeof(int32_t));
}

// the remapped ids of a layer as an op with n_tokens reads them: [n_used, n_tokens], contiguous
static ggml_tensor * ggml_sched_pp_cache_ids_view(ggml_sched_pp_cache_layer * l, int64_t n_tokens) {
    ggml_tensor *& v = l->views[n_tokens];
    if (v == nullptr) {
        v = ggml_view_2d(l->views_ctx, l->remap, l->n_used, n_tokens, l->n_used * sizeof(int32_t), 0);
        v->data = nullptr; // (ggml_backend_view_init sets data and buffer)
        GGML_ASSERT(ggml_backend_view_init(v) == GGML_STATUS_SUCCESS);
    }
    return v;
}

// EXPERT_HYBRID: whether the layer's FFN is computed as its plan says - one split on the layer's device that ends
// where the plan starts one, and no eval callback (which would run the split in parts) - checked once per plan
static bool ggml_sched_pp_hybrid_ready(ggml_backend_sched_t sched, ggml_sched_pp_cache_layer * l) {
    ggml_sched_pp_hybrid & h = l->hy;
    if (!h.on || sched->callback_eval != nullptr) {
        return false;
    }
    if (h.split == -1) {
        int s = -1;
        bool ok = true;
        for (const auto & op : sched->pp_cache->ops) {
            if (op.layer == l) {
                ok = ok && (s < 0 || op.split == s);
                s = op.split;
            }
        }
        ok = ok && s >= 0 && s < sched->n_splits && sched->splits[s].i_end == h.i_after &&
             sched->splits[s].backend_id == l->backend_id;
        h.split = ok ? s : -2;
    }
    return h.split >= 0;
}

// a graph node for the CPU: the same op and parameters; its shape with ne[1] = n_sel where it is n_used (a token's
// selections; decode computes only the CPU's); a view keeps its strides (a row's, nb[1], does not change with the
// selections: decode's ne[2] and ne[3] are 1), other nodes are contiguous; sources set by the caller
static ggml_tensor * ggml_sched_pp_hybrid_node(ggml_context * ctx, const ggml_tensor * n, int64_t n_used, int64_t n_sel) {
    int64_t ne[GGML_MAX_DIMS];
    memcpy(ne, n->ne, sizeof(ne));
    if (n_sel != n_used && ne[1] == n_used) {
        ne[1] = n_sel;
    }
    ggml_tensor * t = ggml_new_tensor(ctx, n->type, GGML_MAX_DIMS, ne);
    if (n->view_src != nullptr) {
        memcpy(t->nb, n->nb, sizeof(t->nb));
    }
    t->op = n->op;
    memcpy(t->op_params, n->op_params, sizeof(t->op_params));
    ggml_format_name(t, "%s (cpu)", n->name);
    return t;
}

// the layer's FFN cloned for the CPU with n_sel selections a token (at the first compute of a plan, when the graph's
// sources are final): its expert ops read the host weights and the CPU's ids; a tensor it reads from device memory is
// copied into host memory after the ids are read back (the device has computed it then); host memory is read where it
// is. n_sel below n_used (decode: the CPU's misses alone) only where no such copy has a selection dimension; false:
// not with that n_sel. With n_ref refills (EXPERT_REFILL) the graph also copies one expert of each pageable host weight
// of the layer per refill into its own memory (pinned: it goes up from there), beside the FFN, by the same threads
static bool ggml_sched_pp_hybrid_build(ggml_backend_sched_t sched, ggml_sched_pp_cache_layer * l, int64_t n_sel, int64_t n_ref) {
    ggml_sched_pp_cache * c = sched->pp_cache;
    ggml_sched_pp_hybrid & h = l->hy;
    ggml_sched_pp_hybrid_clone & x = h.clones[n_sel + (l->n_used + 1) * n_ref];
    x.free();
    const int64_t n_used = l->n_used;
    std::vector<ggml_sched_pp_cache_weight *> pageable;   // the layer's weights the refills' copies read
    for (const auto & op : c->ops) {
        if (op.layer == l && std::find(pageable.begin(), pageable.end(), op.weight) == pageable.end() &&
            !ggml_backend_sched_pp_buffer_is_pinned(sched, op.weight->host->buffer)) {
            pageable.push_back(op.weight);
        }
    }
    const size_t n_max = h.nodes.size() * (GGML_MAX_SRC + 1) + 2 * pageable.size() * (size_t) n_ref + 1;
    ggml_init_params params = { n_max * ggml_tensor_overhead() + ggml_graph_overhead_custom(n_max, false), nullptr, true };
    x.ctx = ggml_init(params);
    if (x.ctx == nullptr) {
        return false;
    }
    std::unordered_map<const ggml_tensor *, ggml_tensor *> map;
    for (const auto & op : c->ops) {
        if (op.layer == l) {
            if (x.ids == nullptr) {
                x.ids = ggml_new_tensor_2d(x.ctx, GGML_TYPE_I32, n_sel, op.node->src[2]->ne[1]);
                ggml_set_name(x.ids, "expert ids (cpu)");
                ggml_set_input(x.ids);
            }
            map[ggml_sched_pp_cache_weight_of(op.node)] = const_cast<ggml_tensor *>(op.weight->host); // (read only)
            map[op.node->src[2]] = x.ids;
        }
    }
    bool ok = true;
    auto source = [&](ggml_tensor * src) -> ggml_tensor * {
        if (src == nullptr) {
            return nullptr;
        }
        const auto it = map.find(src);
        if (it != map.end()) {
            return it->second;
        }
        ggml_tensor * t = src;
        if (src->buffer == nullptr || !ggml_backend_buffer_is_host(src->buffer)) {
            ok = ok && (n_sel == n_used || src->ne[1] != n_used);
            t = ggml_sched_pp_hybrid_node(x.ctx, src, n_used, n_used);
            memcpy(t->nb, src->nb, sizeof(t->nb)); // (its bytes as they are)
            t->op = GGML_OP_NONE;
            memset(t->op_params, 0, sizeof(t->op_params));
            ggml_set_input(t);
            x.inputs.push_back({ src, t });
        }
        map[src] = t;
        return t;
    };
    for (ggml_tensor * n : h.nodes) {
        ggml_tensor * t = ggml_sched_pp_hybrid_node(x.ctx, n, n_used, n_sel);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            t->src[j] = source(n->src[j]);
        }
        if (n->view_src != nullptr) {
            t->view_src  = source(n->view_src);
            t->view_offs = n->view_offs;
        }
        map[n] = t;
    }
    x.out = map.at(h.last);
    if (!ok || x.out->ne[1] != n_sel) {
        x.free();
        return false;
    }
    ggml_set_output(x.out);
    x.gf = ggml_new_graph_custom(x.ctx, n_max, false);
    ggml_build_forward_expand(x.gf, x.out);
    for (int64_t j = 0; j < n_ref; j++) {
        for (auto * w : pageable) {
            ggml_tensor * host = const_cast<ggml_tensor *>(w->host);   // (read only)
            int64_t ne[GGML_MAX_DIMS];
            memcpy(ne, host->ne, sizeof(ne));
            ne[w->dim] = 1;
            ggml_tensor * v = ggml_view_4d(x.ctx, host, ne[0], ne[1], ne[2], ne[3], host->nb[1], host->nb[2], host->nb[3], 0);
            ggml_tensor * d = ggml_dup(x.ctx, v);
            ggml_set_output(d);
            ggml_build_forward_expand(x.gf, d);
            x.copies.push_back({ w, (size_t) j, v, d });
        }
    }
    x.built = c->plan_gen;
    return true;
}

// after the layer's lookups: the CPU's share ready to compute - a clone for it (decode: the CPU's selections alone;
// a batch of tokens: all of them, the others computed with one of the CPU's experts and not written), allocated in
// host memory (pinned where the device has a host buffer type: its rows go up from there), the tensors it reads from
// device memory copied in, its ids set. false: the CPU cannot
static bool ggml_sched_pp_hybrid_inputs(ggml_backend_sched_t sched, ggml_sched_pp_cache_layer * l, int64_t n_tokens) {
    ggml_sched_pp_cache * c = sched->pp_cache;
    ggml_sched_pp_hybrid & h = l->hy;
    const int b = l->backend_id;
    const int64_t n_used = l->n_used;
    const int64_t n_ref  = (int64_t) h.refill.size();
    h.clones.resize((size_t) ((n_used + 1) * (sched->pp_cfg.expert_refill + 1)));
    int64_t n_sel = n_tokens == 1 ? (int64_t) h.pairs.size() : n_used;
    auto clone = [&](int64_t sel) -> ggml_sched_pp_hybrid_clone & { return h.clones[sel + (n_used + 1) * n_ref]; };
    if (clone(n_sel).built != c->plan_gen && !ggml_sched_pp_hybrid_build(sched, l, n_sel, n_ref)) {
        n_sel = n_used;
        if (clone(n_sel).built != c->plan_gen && !ggml_sched_pp_hybrid_build(sched, l, n_sel, n_ref)) {
            return false;
        }
    }
    ggml_sched_pp_hybrid_clone & x = clone(n_sel);
    h.cur = &x;
    if (c->hybrid_galloc[b] == nullptr) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_host_buffer_type(ggml_backend_get_device(sched->backends[b]));
        if (buft == nullptr) {
            buft = ggml_backend_get_default_buffer_type(sched->backends[sched->n_backends - 1]);
        }
        c->hybrid_galloc[b] = ggml_gallocr_new(buft);
    }
    // (the device has finished what it was given - the ids were read back - so no row copy still reads this memory;
    // the clone's tensors are placed anew: the device's layers share the allocator, which may have moved its buffer)
    for (ggml_tensor * t = ggml_get_first_tensor(x.ctx); t != nullptr; t = ggml_get_next_tensor(x.ctx, t)) {
        t->data   = nullptr;
        t->buffer = nullptr;
    }
    for (auto & cp : x.copies) {   // (EXPERT_REFILL: each copy's expert)
        cp.view->view_offs = (size_t) h.refill[cp.j].first * cp.w->host->nb[cp.w->dim];
    }
    if (!ggml_gallocr_alloc_graph(c->hybrid_galloc[b], x.gf)) {
        return false;
    }
    for (const auto & [src, cpy] : x.inputs) {
        ggml_backend_tensor_get(src, cpy->data, 0, ggml_nbytes(src));
    }
    int32_t * ids = (int32_t *) x.ids->data;
    if (n_sel < n_used) {
        for (size_t j = 0; j < h.pairs.size(); j++) {
            ids[j] = h.cpu_ids[h.pairs[j].second];
        }
    } else {
        const int32_t fill = h.cpu_ids[h.pairs.front().first * n_used + h.pairs.front().second];
        for (size_t i = 0; i < h.cpu_ids.size(); i++) {
            ids[i] = h.cpu_ids[i] >= 0 ? h.cpu_ids[i] : fill;
        }
    }
    return true;
}

// EXPERT_HYBRID, after the split that holds a layer's FFN is submitted (the device computes the hits and the link's
// misses meanwhile): the CPU computes the FFN for its misses, and each of its (token, selection) rows of the last
// expert op is written over the device's row of it on the device's stream, in token-major, top-k order, before the
// next split reads it - no sum: a row of a MUL_MAT_ID belongs to one (token, selection), so the device's later ops
// (the routing weights, the sum over the selections) run as without it, in the same order
static void ggml_sched_pp_hybrid_compute(ggml_backend_sched_t sched, ggml_sched_pp_cache_layer * l) {
    ggml_sched_pp_hybrid & h = l->hy;
    const ggml_sched_pp_hybrid_clone & x = *h.cur;
    h.pending = false;
    const enum ggml_status st = ggml_backend_graph_compute(sched->backends[sched->n_backends - 1], x.gf);
    GGML_ASSERT(st == GGML_STATUS_SUCCESS);
    ggml_backend_t backend = sched->backends[l->backend_id];
    const size_t row = ggml_row_size(h.last->type, h.last->ne[0]);
    const bool   all = x.out->ne[1] == h.last->ne[1]; // (the clone's rows where the device's are; else one per pair)
    size_t run_src = 0, run_dst = 0, run_len = 0;
    for (size_t j = 0; j < h.pairs.size(); j++) {
        const auto [t, k] = h.pairs[j];
        const size_t dst = (size_t) k * h.last->nb[1] + (size_t) t * h.last->nb[2];
        const size_t src = all ? dst : j * x.out->nb[1];
        if (run_len > 0 && run_dst + run_len == dst && run_src + run_len == src) {
            run_len += row;
            continue;
        }
        if (run_len > 0) {
            ggml_backend_tensor_set_async(backend, h.last, (const char *) x.out->data + run_src, run_dst, run_len);
        }
        run_src = src;
        run_dst = dst;
        run_len = row;
    }
    ggml_backend_tensor_set_async(backend, h.last, (const char *) x.out->data + run_src, run_dst, run_len);
    sched->pp.cache_cpu_misses[l->backend_id]    += h.pairs.size();
    sched->pp.cache_hybrid_layers[l->backend_id] += 1;
}

// Before split_id is submitted: the lookups of its expert ops that read slots, the missed experts uploaded into their
// slots and the slot numbers as the ops' ids, all on the device's stream; the ops pointed at the slots until `swap`
// ends (after the submission)
void ggml_backend_sched_pp_cache_prepare(ggml_backend_sched_t sched, int split_id, ggml_sched_pp_cache_swap * swap) {
    ggml_sched_pp_cache * c = sched->pp_cache;
    if (c == nullptr || (c->ops.empty() && c->cpu_ops.empty())) {
        return;
    }
    if (!c->splits_known) {
        for (auto * list : { &c->ops, &c->cpu_ops }) {
            int s = 0;
            for (auto & op : *list) {
                while (s < sched->n_splits && op.index >= sched->splits[s].i_end) {
                    s++;
                }
                op.split = s;
            }
        }
        c->splits_known = true;
    }
    if (c->seq != sched->pp_graph_seq) {
        c->seq      = sched->pp_graph_seq;
        c->next     = 0;
        c->next_cpu = 0;
    }
    std::vector<ggml_sched_pp_piece> & misses = c->misses;   // (kept between calls: its memory reused)
    misses.clear();
    int misses_backend = -1;
    for (; c->next < c->ops.size() && c->ops[c->next].split <= split_id; c->next++) {
        const ggml_sched_pp_cache_op & op = c->ops[c->next];
        if (op.split < split_id) {
            continue; // (a split not computed: an eval callback stopped the graph)
        }
        ggml_sched_pp_cache_layer *  l = op.layer;
        ggml_sched_pp_cache_weight * w = op.weight;
        const ggml_tensor * ids = op.node->src[2];
        if (l->lookup_seq != sched->pp_graph_seq || l->lookup_ids != ids) {
            const bool hybrid = ggml_sched_pp_hybrid_ready(sched, l);
            ggml_sched_pp_cache_look_up(sched, l, ids, hybrid);
            l->lookup_seq = sched->pp_graph_seq;
            l->lookup_ids = ids;
            l->hy.pending = hybrid && !l->hy.pairs.empty();
            if (l->hy.pending && !ggml_sched_pp_hybrid_inputs(sched, l, ids->ne[1])) {
                GGML_ABORT("%s: no host memory for the CPU's share of a layer's misses (EXPERT_HYBRID)", __func__);
            }
        }
        const size_t expert_size = w->host->nb[w->dim];
        if (!misses.empty() && l->backend_id != misses_backend) {
            ggml_backend_sched_pp_upload_pieces(sched, misses_backend, misses.data(), misses.size());
            misses.clear();
        }
        misses_backend = l->backend_id;
        for (const auto & [e, s] : l->used) {
            if (w->content[s] != e) {
                misses.push_back({ w->host, w->slots, (const char *) w->host->data + e * expert_size,
                                   (size_t) s * expert_size, expert_size });
                w->content[s] = e;
                sched->pp.cache_bytes[l->backend_id]  += expert_size;
                sched->pp.weight_bytes[l->backend_id] += expert_size;
            }
        }
        // EXPERT_REFILL: the refills' bytes go up after the CPU's share (cache_after_split), from the clone's copy
        // where the host weight is pageable
        for (size_t j = 0; j < l->hy.refill.size(); j++) {
            const auto [e, s] = l->hy.refill[j];
            if (w->content[s] == e) {
                continue;
            }
            w->content[s] = e;
            sched->pp.cache_bytes[l->backend_id]  += expert_size;
            sched->pp.weight_bytes[l->backend_id] += expert_size;
            const ggml_tensor * from = nullptr;
            for (const auto & cp : l->hy.cur->copies) {
                from = cp.w == w && cp.j == j ? cp.dup : from;
            }
            l->hy.refill_up.push_back(from != nullptr
                ? ggml_sched_pp_piece { from, w->slots, from->data, (size_t) s * expert_size, expert_size }
                : ggml_sched_pp_piece { w->host, w->slots, (const char *) w->host->data + e * expert_size, (size_t) s * expert_size, expert_size });
        }
        sched->pp.cache_ops[l->backend_id]++;
        swap->add(op.node, w->slots, ggml_sched_pp_cache_ids_view(l, ids->ne[1]));
    }
    // the split's misses uploaded into their slots at once (from pageable memory, an mmap-ed model, the staging copies
    // them together: STAGING)
    if (!misses.empty()) {
        ggml_backend_sched_pp_upload_pieces(sched, misses_backend, misses.data(), misses.size());
    }
}

// After split_id ran (was submitted): the host CPU's share of the misses of a layer whose FFN it holds (EXPERT_HYBRID);
// the guard's lookups of its expert ops that the guard gave to the CPU. Their ids are the CPU's
// copy of the router's ids, an input of a CPU split (that split or one before), which the CPU backend, having no
// async copy, fills synchronously before the split runs: in host memory already, without another wait.
void ggml_backend_sched_pp_cache_after_split(ggml_backend_sched_t sched, int split_id) {
    ggml_sched_pp_cache * c = sched->pp_cache;
    if (c == nullptr || c->seq != sched->pp_graph_seq) {
        return;
    }
    // EXPERT_HYBRID: the CPU's share of the misses of a layer whose FFN this split holds
    for (auto * l : c->planned) {
        if (l->hy.pending && l->hy.split == split_id) {
            ggml_sched_pp_hybrid_compute(sched, l);
            // EXPERT_REFILL: the refills into their slots, after the rows, before any later split reads them
            if (!l->hy.refill_up.empty()) {
                ggml_backend_sched_pp_upload_pieces(sched, l->backend_id, l->hy.refill_up.data(), l->hy.refill_up.size());
                l->hy.refill_up.clear();
            }
        }
    }
    for (; c->next_cpu < c->cpu_ops.size() && c->cpu_ops[c->next_cpu].split <= split_id; c->next_cpu++) {
        const ggml_sched_pp_cache_op & op = c->cpu_ops[c->next_cpu];
        if (op.split < split_id) {
            continue; // (a split not computed: an eval callback stopped the graph)
        }
        ggml_sched_pp_cache_layer * l = op.layer;
        sched->pp.cache_cpu_ops[l->backend_id]++;
        const ggml_tensor * ids = op.node->src[2];
        if (l->lookup_seq == sched->pp_graph_seq && l->lookup_ids == ids) {
            continue; // (the layer's ids of this graph are counted)
        }
        l->lookup_seq = sched->pp_graph_seq;
        l->lookup_ids = ids;
        const int32_t * base = (const int32_t *) ids->data;
        if (ids->buffer == nullptr || !ggml_backend_buffer_is_host(ids->buffer)) {
            l->ids_more.resize(ggml_nbytes(ids) / sizeof(int32_t) + 1);   // (not the CPU's copy: read it back)
            ggml_backend_tensor_get(ids, l->ids_more.data(), 0, ggml_nbytes(ids));
            base = l->ids_more.data();
        }
        for (int64_t t = 0; t < ids->ne[1]; t++) {
            ggml_sched_pp_cache_token(l, ids, base, t);
            ggml_sched_pp_cache_shadow_step(sched, l);
        }
        ggml_sched_pp_cache_decide(sched, l);
    }
}

// the cache's counters of a backend, and the slots it holds there
static ggml_backend_pp_cache_counts ggml_sched_pp_cache_counts(ggml_backend_sched_t sched, int backend_id) {
    const ggml_sched_pp_stats & st = sched->pp;
    const ggml_sched_pp_cache * c = sched->pp_cache;
    ggml_backend_pp_cache_counts n = {};
    n.ops       = st.cache_ops[backend_id];
    n.hits      = st.cache_hits[backend_id];
    n.misses    = st.cache_misses[backend_id];
    n.evictions = st.cache_evictions[backend_id];
    n.bytes     = st.cache_bytes[backend_id];
    if (c != nullptr) {
        n.buffer_bytes = c->bytes[backend_id];
        for (const auto & l : c->layers) {
            if (l->backend_id == backend_id && l->n_slots > 0) {
                n.slots = n.layers == 0 ? l->n_slots : std::min<uint64_t>(n.slots, l->n_slots);
                n.layers++;
            }
        }
    }
    return n;
}

void ggml_backend_sched_pp_cache_counts(ggml_backend_sched_t sched, ggml_backend_t backend, ggml_backend_pp_cache_counts * out) {
    *out = {};
    for (int b = 0; b < sched->n_backends; b++) {
        if (sched->backends[b] == backend) {
            *out = ggml_sched_pp_cache_counts(sched, b);
        }
    }
}

// the cache's counters of a backend for the stats JSON (",\"key\":value" each), and the slots it holds
std::string ggml_backend_sched_pp_cache_json(ggml_backend_sched_t sched, int backend_id) {
    const ggml_sched_pp_stats & st = sched->pp;
    const ggml_sched_pp_cache * c = sched->pp_cache;
    const ggml_backend_pp_cache_counts n = ggml_sched_pp_cache_counts(sched, backend_id);
    int cpu_layers = 0;
    if (c != nullptr) {
        for (const auto & l : c->layers) {
            cpu_layers += l->backend_id == backend_id && l->n_slots > 0 && l->to_cpu ? 1 : 0;
        }
    }
    return ",\"cache_ops\":" + std::to_string(n.ops) +
           ",\"cache_hits\":" + std::to_string(n.hits) +
           ",\"cache_misses\":" + std::to_string(n.misses) +
           ",\"cache_evictions\":" + std::to_string(n.evictions) +
           ",\"cache_bytes\":" + std::to_string(n.bytes) +
           ",\"cache_buffer_bytes\":" + std::to_string(n.buffer_bytes) +
           ",\"cache_layers\":" + std::to_string(n.layers) +
           ",\"cache_slots\":" + std::to_string(n.slots) +
           ",\"cache_cpu_ops\":" + std::to_string(st.cache_cpu_ops[backend_id]) +
           ",\"cache_leaves\":" + std::to_string(st.cache_leaves[backend_id]) +
           ",\"cache_returns\":" + std::to_string(st.cache_returns[backend_id]) +
           ",\"cache_shadow_hits\":" + std::to_string(st.cache_shadow_hits[backend_id]) +
           ",\"cache_shadow_misses\":" + std::to_string(st.cache_shadow_misses[backend_id]) +
           ",\"cache_cpu_layers\":" + std::to_string(cpu_layers) +
           ",\"cache_cpu_misses\":" + std::to_string(st.cache_cpu_misses[backend_id]) +
           ",\"cache_hybrid_layers\":" + std::to_string(st.cache_hybrid_layers[backend_id]) +
           ",\"cache_refills\":" + std::to_string(st.cache_refills[backend_id]);
}

void ggml_backend_sched_pp_cache_free(ggml_backend_sched_t sched) {
    ggml_sched_pp_cache * c = sched->pp_cache;
    if (c == nullptr) {
        return;
    }
    // (the caller has synchronized: no graph still reads the slots; the backends may be gone already)
    for (auto & l : c->layers) {
        l->hy.free_clones();
    }
    for (auto * galloc : c->hybrid_galloc) {
        if (galloc != nullptr) {
            ggml_gallocr_free(galloc);
        }
    }
    for (auto * buf : c->bufs) {
        ggml_backend_buffer_free(buf);
    }
    for (auto * ctx : c->ctxs) {
        ggml_free(ctx);
    }
    delete c;
    sched->pp_cache = nullptr;
}
