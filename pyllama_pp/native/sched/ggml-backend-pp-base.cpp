// pyllama_pp: the base of the backend scheduler's host-weight pipeline extension (ggml-backend-pp.h), what the
// mechanisms' files (ggml-backend-pp-*.cpp) and the hooks (ggml-backend-pp.cpp) build on: the switch table and
// its API, the counters and the diagnostics of re-reservations, a drain of everything in flight, and the device's
// second stream and the events of its early uploads (OVERLAP=2; PREFETCH=2's lanes and the copy on time wait for
// them too). It calls no other file of the extension.

#include "ggml-backend-pp-impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <string>
#include <unordered_set>
#include <vector>

// diagnostics of re-reservations: the node names of the graph the buffers were reserved for, so that a graph
// with a different node count can be compared with it
#define GGML_SCHED_PP_NAME_LEN 96

static void ggml_backend_sched_pp_node_label(const struct ggml_tensor * t, char * buf) {
    snprintf(buf, GGML_SCHED_PP_NAME_LEN, "%s [%s]", t->name, ggml_op_desc(t));
}

void ggml_backend_sched_pp_save_layout(ggml_backend_sched_t sched) {
    const int n = sched->graph.n_nodes;
    if (n > sched->pp_layout_cap) {
        char * p = (char *) realloc(sched->pp_layout_names, (size_t) n * GGML_SCHED_PP_NAME_LEN);
        if (p == NULL) {
            return;
        }
        sched->pp_layout_names = p;
        sched->pp_layout_cap = n;
    }
    for (int i = 0; i < n; i++) {
        ggml_backend_sched_pp_node_label(sched->graph.nodes[i], sched->pp_layout_names + (size_t) i * GGML_SCHED_PP_NAME_LEN);
    }
    sched->pp_layout_n = n;
}

void ggml_backend_sched_pp_log_realloc(ggml_backend_sched_t sched) {
    ggml_sched_pp_stats & st = sched->pp;
    const int n = sched->graph.n_nodes;
    if (n != sched->pp_layout_n && sched->pp_layout_names != NULL) {
        char cur[GGML_SCHED_PP_NAME_LEN];
        for (int i = 0; i < std::max(n, sched->pp_layout_n); i++) {
            const char * old = i < sched->pp_layout_n ? sched->pp_layout_names + (size_t) i * GGML_SCHED_PP_NAME_LEN : "(none)";
            if (i < n) {
                ggml_backend_sched_pp_node_label(sched->graph.nodes[i], cur);
            } else {
                snprintf(cur, sizeof(cur), "(none)");
            }
            if (strcmp(cur, old) != 0) {
                const size_t len = strlen(st.last_realloc);
                snprintf(st.last_realloc + len, sizeof(st.last_realloc) - len, "; first difference at node %d: %s, reserved %s",
                         i, cur, old);
                break;
            }
        }
    }
    if (st.realloc_log_n < 4) {
        memcpy(st.realloc_log[st.realloc_log_n++], st.last_realloc, sizeof(st.last_realloc));
    }
}

// counts a re-reservation of the graph buffers and records why it happened (ggml_sched_pp_stats::last_realloc)
void ggml_backend_sched_pp_note_realloc(ggml_backend_sched_t sched, bool backend_ids_changed) {
    sched->pp.reallocs++;
    sched->pp.reallocs_ids_changed += backend_ids_changed ? 1 : 0;
    if (backend_ids_changed) {
        // the first node, else leaf, whose backend changed to one with another buffer type
        const struct ggml_tensor * changed = nullptr;
        int changed_from = -1, changed_to = -1;
        for (int i = 0; i < sched->graph.n_nodes && changed == nullptr; i++) {
            if (sched->node_backend_ids[i] != sched->prev_node_backend_ids[i] &&
                sched->bufts[sched->node_backend_ids[i]] != sched->bufts[sched->prev_node_backend_ids[i]]) {
                changed = sched->graph.nodes[i];
                changed_from = sched->prev_node_backend_ids[i];
                changed_to = sched->node_backend_ids[i];
            }
        }
        for (int i = 0; i < sched->graph.n_leafs && changed == nullptr; i++) {
            if (sched->leaf_backend_ids[i] != sched->prev_leaf_backend_ids[i] &&
                sched->bufts[sched->leaf_backend_ids[i]] != sched->bufts[sched->prev_leaf_backend_ids[i]]) {
                changed = sched->graph.leafs[i];
                changed_from = sched->prev_leaf_backend_ids[i];
                changed_to = sched->leaf_backend_ids[i];
            }
        }
        snprintf(sched->pp.last_realloc, sizeof(sched->pp.last_realloc), "backend of %s (%s) changed: %d -> %d",
                 changed->name, ggml_op_desc(changed), changed_from, changed_to);
    } else {
        ggml_gallocr_pp_realloc_reason(sched->galloc, &sched->graph, sched->pp.last_realloc, sizeof(sched->pp.last_realloc));
    }
    ggml_backend_sched_pp_log_realloc(sched);
    sched->pp_reallocs_since_reserve++;
}

// every backend and early-upload stream has finished: nothing is in flight any more (a re-reservation
// or plan switch drains like this without ggml_backend_sched_synchronize, which would also reset the copy index)
void ggml_backend_sched_pp_drain(ggml_backend_sched_t sched) {
    for (int i = 0; i < sched->n_backends; i++) {
        ggml_backend_synchronize(sched->backends[i]);
        if (sched->pp_early[i] != nullptr && sched->pp_early[i]->up != nullptr) {
            // (an early upload a failed graph queued for a split it never reached is done too, and not waited for;
            // one it left for later is dropped)
            sched->pp_early[i]->staged.clear();
            ggml_backend_synchronize(sched->pp_early[i]->up);
            ggml_backend_sched_pp_early_wait(sched, i, nullptr, nullptr);
        }
    }
    sched->pp_in_flight = 0;
    memset(sched->input_events_pending, 0, sizeof(sched->input_events_pending)); // all uploads are done
}

// OVERLAP=2: a second backend of a GPU backend's device - another stream - that takes async uploads and waits for
// events, for a GPU whose backend records and waits for events; nullptr where there is none
static ggml_backend_t ggml_backend_sched_pp_second_stream(ggml_backend_sched_t sched, int backend_id) {
    ggml_backend_t backend = sched->backends[backend_id];
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    if (dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU ||
        backend->iface.event_wait == nullptr || backend->iface.event_record == nullptr) {
        return nullptr;
    }
    ggml_backend_t up = ggml_backend_dev_init(dev, nullptr);
    if (up != nullptr && (up->iface.set_tensor_async == nullptr || up->iface.event_wait == nullptr)) {
        ggml_backend_free(up);
        return nullptr;
    }
    return up;
}

ggml_sched_pp_early * ggml_backend_sched_pp_early_get(ggml_backend_sched_t sched, int backend_id) {
    ggml_sched_pp_early * e = sched->pp_early[backend_id];
    if (e == nullptr) {
        e = new ggml_sched_pp_early();
        sched->pp_early[backend_id] = e;
        ggml_backend_dev_t dev = ggml_backend_get_device(sched->backends[backend_id]);
        e->unusable = true;
        e->up = ggml_backend_sched_pp_second_stream(sched, backend_id);
        if (e->up == nullptr) {
            return nullptr;
        }
        e->ev_before = ggml_backend_event_new(dev);
        if (e->ev_before == nullptr) {
            return nullptr;
        }
        e->unusable = false;
    }
    return e->unusable ? nullptr : e;
}

// OVERLAP=2: order what `backend` (the compute stream of `backend_id`) does next after the early uploads of `cpy`
// (nullptr: of every copy), if any are pending (`backend` nullptr: the uploads are known to be done, none waits)
void ggml_backend_sched_pp_early_wait(ggml_backend_sched_t sched, int backend_id, ggml_backend_t backend,
                                      const ggml_tensor * cpy) {
    ggml_sched_pp_early * e = sched->pp_early[backend_id];
    if (e == nullptr) {
        return;
    }
    for (auto it = e->ready.begin(); it != e->ready.end();) {
        if (cpy == nullptr || it->first == cpy) {
            if (backend != nullptr) {
                ggml_backend_event_wait(backend, it->second);
            }
            e->spare.push_back(it->second);
            it = e->ready.erase(it);
        } else {
            ++it;
        }
    }
}

// a switch's type: bool (0 or 1), int, or ints - one int for every device, or a comma list of one per device of the
// scheduler in its order (each entry in the switch's range; devices past the list take 0)
enum ggml_sched_pp_type { GGML_SCHED_PP_BOOL, GGML_SCHED_PP_INT, GGML_SCHED_PP_INTS };

struct ggml_sched_pp_param {
    const char *         name;    // GGML_SCHED_PP_<name>
    ggml_sched_pp_type   type;    // bool: 0 or 1
    int64_t              def;     // default: the best measured path
    int64_t              min;     // accepted range [min, max] ...
    int64_t              max;
    const char *         values;  // ... and, where not every value in it is accepted, the accepted ones ("0,2")
    int64_t ggml_sched_pp_cfg::* field; // where a scheduler reads it (nullptr: llama reads it by name; ints: the first
                                        // device's value that is not 0, else 0)
    const char *         help;    // one line: what it does
    int64_t              value;   // current value (environment, then ggml_backend_sched_pp_set_param; ints: of every
                                  // device, 0 while a list is set)
    int64_t (ggml_sched_pp_cfg::* per_device)[GGML_SCHED_MAX_BACKENDS]; // ints: where a scheduler reads each device's
    int                  n_list;  // ints: entries of the list set (0: `value` for every device)
    int64_t              list[GGML_SCHED_MAX_BACKENDS];
};

#define GGML_SCHED_PP_ROW(name, type, def, min, max, values, field, help) \
    { name, type, def, min, max, values, field, help, def, nullptr, 0, {} }
#define GGML_SCHED_PP_INTS_ROW(name, def, min, max, field, per_device, help) \
    { name, GGML_SCHED_PP_INTS, def, min, max, nullptr, field, help, def, per_device, 0, {} }

// The switch table: one off-switch per mechanism and the tuning knobs. Defaults: every patched behaviour on, except
// the opt-in PREFETCH=2 and LAYER_MAJOR (off until measured on a GPU). Thresholds in tokens x experts used per token
// of a MUL_MAT_ID.
// Each mechanism's patch adds its rows; the last row ends the table.
static ggml_sched_pp_param ggml_sched_pp_params[] = {
    GGML_SCHED_PP_ROW("GATE", GGML_SCHED_PP_BOOL, 1, 0, 1, nullptr, nullptr,
        "keep pipeline parallelism with host-only tensor overrides, host weights as one transient device copy per split; with one device too, whose graphs upstream never pipelines (llama; weights in pageable memory (mmap) only with STAGING)"),
    GGML_SCHED_PP_ROW("OWNER_OFFLOAD", GGML_SCHED_PP_BOOL, 1, 0, 1, nullptr, &ggml_sched_pp_cfg::owner_offload,
        "offloaded host-weight ops run on the backend that owns the layer, not on the first one"),
    GGML_SCHED_PP_ROW("EARLY_INPUTS", GGML_SCHED_PP_BOOL, 1, 0, 1, nullptr, &ggml_sched_pp_cfg::early_inputs,
        "while pipelining, upload the user inputs of all splits at graph start, one device copy for all graphs in flight; devices wait, not the host"),
    GGML_SCHED_PP_ROW("UPLOAD_ALL", GGML_SCHED_PP_BOOL, 1, 0, 1, nullptr, &ggml_sched_pp_cfg::upload_all,
        "upload whole expert tensors above the thresholds instead of reading the routing ids back"),
    GGML_SCHED_PP_ROW("UPLOAD_ALL_MIN", GGML_SCHED_PP_INT, -1, -1, INT32_MAX, nullptr, &ggml_sched_pp_cfg::upload_all_min,
        "tokens x experts used at or above which all experts are uploaded (-1: 4 x n_expert, 2 x n_expert while a graph is in flight)"),
    GGML_SCHED_PP_ROW("UPLOAD_ALL_MIN_COV", GGML_SCHED_PP_INT, -1, -1, 100, nullptr, &ggml_sched_pp_cfg::upload_all_min_cov,
        "upload all only while the measured expert coverage is at least this percent (0: ignore coverage; -1: 110 / LINKS within 30..85)"),
    GGML_SCHED_PP_ROW("LINKS", GGML_SCHED_PP_INT, 0, 0, GGML_SCHED_MAX_BACKENDS, nullptr, &ggml_sched_pp_cfg::links,
        "host links the GPUs upload over at once (0: GPUs with distinct PCI bus ids; set 1 when GPUs share a PCIe switch uplink)"),
    GGML_SCHED_PP_ROW("STAGING", GGML_SCHED_PP_INT, 1, 0, 64, nullptr, &ggml_sched_pp_cfg::staging,
        "while pipelining, upload host weights from pageable memory (mmap) through pinned staging slots filled by helper threads (1: three quarters of the cores, at most 16; N >= 2: N threads; 0: off)"),
    GGML_SCHED_PP_ROW("STABLE_RESERVE", GGML_SCHED_PP_BOOL, 1, 0, 1, nullptr, nullptr,
        "while pipelining, reserve the worst-case graph again before a batch after one that re-reserved (llama)"),
    GGML_SCHED_PP_ROW("DIRECT", GGML_SCHED_PP_INT, -1, -1, 2, "-1,0,2", &ggml_sched_pp_cfg::direct,
        "while pipelining, below the upload-all bar a GPU kernel reads the used experts from pinned host memory (not on the first GPU); -1: on a GPU whose host link no other stage shares; 0: off; 2: on every GPU but the first"),
    GGML_SCHED_PP_ROW("OVERLAP", GGML_SCHED_PP_INT, 2, 0, 2, "0,2", &ggml_sched_pp_cfg::overlap,
        "2: while pipelining, upload the next split's host expert copy on a second stream of the GPU while the split before computes (one more expert copy in the compute buffers; without room for it a scheduler runs as with 0); 0: off"),
    GGML_SCHED_PP_ROW("GATHER", GGML_SCHED_PP_INT, -1, -1, 1, nullptr, &ggml_sched_pp_cfg::gather,
        "while pipelining, below the upload-all bar a device with a gather (VDEV; CUDA with pyllama_pp's library) copies the experts its routing ids select itself (-1 or 1: wherever a gather exists; 0: off)"),
    GGML_SCHED_PP_ROW("PREFETCH", GGML_SCHED_PP_INT, 1, 0, 2, nullptr, &ggml_sched_pp_cfg::prefetch,
        "with OVERLAP=2 and GATHER: 1: a layer's gate copy is placed a split early and prefetched with the experts used last time; 2: also up and down, two splits early (one more expert copy)"),
    GGML_SCHED_PP_ROW("PREFETCH2_MIN_TOKENS", GGML_SCHED_PP_INT, 1024, 0, INT32_MAX, nullptr, &ggml_sched_pp_cfg::prefetch2_min_tokens,
        "PREFETCH=2 acts only on graphs whose largest expert op routes at least this many tokens (below: PREFETCH=1)"),
    GGML_SCHED_PP_ROW("RPC_HOST", GGML_SCHED_PP_BOOL, 1, 0, 1, nullptr, nullptr,
        "host weights of a layer on an RPC device are kept in its server's host memory and copied in by its device there (llama; a server of the patched protocol 7.1); 0: in this host's RAM, as upstream"),
    GGML_SCHED_PP_INTS_ROW("EXPERT_CACHE", 0, -65536, INT32_MAX, &ggml_sched_pp_cfg::expert_cache, &ggml_sched_pp_cfg::expert_cache_dev,
        "MiB of expert slots per device (-N: N slots per layer; a comma list: one value per device, in the scheduler's order, e.g. -2,-4): an expert op on host weights below op offload's threshold (decode) runs on its layer's device, reading the experts from a per-layer LRU of slots there, not on the CPU (0: off)"),
    GGML_SCHED_PP_INTS_ROW("EXPERT_CACHE_MIN_HIT", 30, 0, 100, &ggml_sched_pp_cfg::expert_cache_min_hit, &ggml_sched_pp_cfg::expert_cache_min_hit_dev,
        "with EXPERT_CACHE: percent of hits below which a layer's expert ops go back to the CPU, judged by a shadow of its slots over its last 32 tokens, until it hits this + 10 again (0: never; a comma list: one value per device, in the scheduler's order, e.g. 25,100)"),
    GGML_SCHED_PP_INTS_ROW("EXPERT_HYBRID", 0, 0, 100000, &ggml_sched_pp_cfg::expert_hybrid, &ggml_sched_pp_cfg::expert_hybrid_dev,
        "with EXPERT_CACHE: the host CPU's expert rate in percent of the device link's (N = 100 x R_cpu / R_link); a cached layer's misses are split so that both finish together: the link takes ceil(m x 100 / (100 + N)) of a token's m misses (into slots, as without it), the host CPU computes the layer's FFN for the rest from host memory while the device computes the hits (0: off, every miss over the link; a comma list: one value per device, in the scheduler's order)"),
    GGML_SCHED_PP_ROW("EXPERT_REFILL", GGML_SCHED_PP_INT, 0, 0, 8, nullptr, &ggml_sched_pp_cfg::expert_refill,
        "with EXPERT_HYBRID on a device: a decoded token's misses all go to the host CPU (none waits for the link before the device computes), and N of them (the first in top-k order) are copied into slots after the CPU's share, for later tokens - from pageable memory (mmap) by the CPU's own threads beside its matmuls, into pinned memory (0: off, the hybrid's split)"),
    GGML_SCHED_PP_ROW("LAYER_MAJOR", GGML_SCHED_PP_INT, 0, 0, 64, nullptr, nullptr,
        "run the ubatches of a batch through each layer together, as one graph, so a layer's host experts go up once for all of them (llama; 1: all the ubatches of a batch, N >= 2: at most N per graph; 0: off); their activations stay in the compute buffers"),
    GGML_SCHED_PP_ROW(nullptr, GGML_SCHED_PP_INT, 0, 0, 0, nullptr, nullptr, nullptr),
};

static const int ggml_sched_pp_n_params = (int) (sizeof(ggml_sched_pp_params) / sizeof(ggml_sched_pp_params[0])) - 1;

// whether v is an accepted value of p
static bool ggml_sched_pp_accepts(const ggml_sched_pp_param & p, int64_t v) {
    if (v < p.min || v > p.max) {
        return false;
    }
    if (p.values == nullptr) {
        return true;
    }
    for (const char * c = p.values; *c != '\0'; ) {
        char * end = nullptr;
        const long long a = strtoll(c, &end, 10);
        if (end == c) {
            break;
        }
        if (a == v) {
            return true;
        }
        c = *end == ',' ? end + 1 : end;
    }
    return false;
}

// what p accepts, for messages: "0 or 1", "0..100", "one of -1,0,2"
static std::string ggml_sched_pp_accepted(const ggml_sched_pp_param & p) {
    if (p.values != nullptr) {
        return std::string("one of ") + p.values;
    }
    if (p.type == GGML_SCHED_PP_BOOL) {
        return "0 or 1";
    }
    const std::string range = std::to_string(p.min) + ".." + std::to_string(p.max);
    return p.type == GGML_SCHED_PP_INTS ? range + ", or a comma list of those, one per device (at most " +
                                          std::to_string(GGML_SCHED_MAX_BACKENDS - 1) + ")" : range;
}

// A switch's value as text: an integer, or for ints a comma list too. False with why (e.g. "out of range") where p
// does not accept it; else the value, and for a list of two or more entries the entries.
static bool ggml_sched_pp_parse(const ggml_sched_pp_param & p, const char * text, int64_t * value,
                                std::vector<int64_t> * list, std::string * why) {
    list->clear();
    const char * c = text;
    for (;;) {
        char * end = nullptr;
        errno = 0;
        const long long x = strtoll(c, &end, 10);
        while (end != nullptr && (*end == ' ' || *end == '\t')) {
            end++;
        }
        if (*c == '\0' || end == c || errno != 0 || (*end != '\0' && *end != ',')) {
            *why = p.type == GGML_SCHED_PP_INTS ? "not an integer or a comma list of integers" : "not an integer";
            return false;
        }
        if (!ggml_sched_pp_accepts(p, x)) {
            *why = "out of range";
            return false;
        }
        list->push_back(x);
        if (*end == '\0') {
            break;
        }
        if (p.type != GGML_SCHED_PP_INTS) {
            *why = "not an integer";
            return false;
        }
        c = end + 1;
    }
    if (list->size() > GGML_SCHED_MAX_BACKENDS - 1) {
        *why = "more values than devices a scheduler takes";
        return false;
    }
    *value = list->size() == 1 ? list->front() : 0;
    if (list->size() == 1) {
        list->clear();
    }
    return true;
}

// sets an accepted value: one for every device (an empty list), or one per device
static void ggml_sched_pp_assign(ggml_sched_pp_param & p, int64_t value, const std::vector<int64_t> & list) {
    p.value  = value;
    p.n_list = (int) list.size();
    std::copy(list.begin(), list.end(), p.list);
}

// a switch's current value as text (ints: the list where one is set)
static std::string ggml_sched_pp_text(const ggml_sched_pp_param & p) {
    if (p.n_list == 0) {
        return std::to_string(p.value);
    }
    std::string out;
    for (int i = 0; i < p.n_list; i++) {
        out += (i ? "," : "") + std::to_string(p.list[i]);
    }
    return out;
}

static ggml_sched_pp_param * ggml_sched_pp_lookup(const char * name) {
    for (int i = 0; name != nullptr && i < ggml_sched_pp_n_params; i++) {
        if (strcmp(ggml_sched_pp_params[i].name, name) == 0) {
            return &ggml_sched_pp_params[i];
        }
    }
    return nullptr;
}

#ifdef _WIN32
#define environ _environ
#else
extern char ** environ;
#endif

// Problems with the GGML_SCHED_PP_* variables of the environment, one message each: a name not in the table, a
// value that is not an integer or not accepted. With `apply`, accepted values are set (the others keep the default).
static std::vector<std::string> ggml_sched_pp_scan_env(bool apply) {
    static const char prefix[] = "GGML_SCHED_PP_";
    std::vector<std::string> problems;
    for (char ** e = environ; e != nullptr && *e != nullptr; e++) {
        if (strncmp(*e, prefix, sizeof(prefix) - 1) != 0) {
            continue;
        }
        const char * eq = strchr(*e, '=');
        if (eq == nullptr) {
            continue;
        }
        const char * n0 = *e + sizeof(prefix) - 1;
        const std::string name(n0, (size_t) (eq - n0));
        const char * v = eq + 1;
        ggml_sched_pp_param * p = ggml_sched_pp_lookup(name.c_str());
        if (p == nullptr) {
            std::string known;
            for (int i = 0; i < ggml_sched_pp_n_params; i++) {
                known += std::string(i ? ", " : "") + ggml_sched_pp_params[i].name;
            }
            problems.push_back(std::string(prefix) + name + "=" + v + ": no such switch (known: " + known + ")");
            continue;
        }
        int64_t x = 0;
        std::vector<int64_t> list;
        std::string why;
        if (!ggml_sched_pp_parse(*p, v, &x, &list, &why)) {
            problems.push_back(std::string(prefix) + name + "=" + v + ": " + why +
                               "; accepted: " + ggml_sched_pp_accepted(*p) + " (using the default, " + std::to_string(p->def) + ")");
            continue;
        }
        if (apply) {
            ggml_sched_pp_assign(*p, x, list);
        }
    }
    return problems;
}

// each problem is logged once per process (at the first parse, or when a scheduler is created and it is new)
static void ggml_sched_pp_log_problems(const std::vector<std::string> & problems) {
    static std::vector<std::string> logged;
    for (const auto & m : problems) {
        if (std::find(logged.begin(), logged.end(), m) == logged.end()) {
            GGML_LOG_ERROR("ggml_backend_sched: %s\n", m.c_str());
            logged.push_back(m);
        }
    }
}

// the environment is parsed once per process, at the first use of the table
static void ggml_sched_pp_params_init(void) {
    static bool done = false;
    if (done) {
        return;
    }
    done = true;
    ggml_sched_pp_log_problems(ggml_sched_pp_scan_env(/*apply =*/ true));
}

static ggml_sched_pp_param * ggml_sched_pp_find(const char * name) {
    ggml_sched_pp_params_init();
    return ggml_sched_pp_lookup(name);
}

// a scheduler's copy of the switches (ggml_backend_sched_new); problems in the environment are reported again
void ggml_sched_pp_cfg_init(ggml_sched_pp_cfg * cfg) {
    ggml_sched_pp_params_init();
    ggml_sched_pp_log_problems(ggml_sched_pp_scan_env(/*apply =*/ false));
    for (int i = 0; i < ggml_sched_pp_n_params; i++) {
        const ggml_sched_pp_param & p = ggml_sched_pp_params[i];
        int64_t value = p.value;
        if (p.per_device != nullptr) {
            for (int b = 0; b < GGML_SCHED_MAX_BACKENDS; b++) {
                (cfg->*(p.per_device))[b] = p.n_list == 0 ? p.value : b < p.n_list ? p.list[b] : 0;
            }
            for (int b = p.n_list - 1; b >= 0; b--) {
                value = p.list[b] != 0 ? p.list[b] : value;
            }
        }
        if (p.field != nullptr) {
            cfg->*(p.field) = value;
        }
    }
}

int ggml_backend_sched_pp_ext_version(void) {
    return GGML_SCHED_PP_EXT_VERSION;
}

int ggml_backend_sched_pp_set_param(const char * name, int64_t value) {
    ggml_sched_pp_param * p = ggml_sched_pp_find(name);
    if (p == NULL) {
        GGML_LOG_ERROR("%s: no switch %s\n", __func__, name ? name : "(null)");
        return -1;
    }
    if (!ggml_sched_pp_accepts(*p, value)) {
        GGML_LOG_ERROR("%s: %s=%lld is out of range; accepted: %s\n", __func__, name, (long long) value,
                       ggml_sched_pp_accepted(*p).c_str());
        return -2;
    }
    ggml_sched_pp_assign(*p, value, {});
    return 0;
}

int ggml_backend_sched_pp_set_param_text(const char * name, const char * text) {
    ggml_sched_pp_param * p = ggml_sched_pp_find(name);
    if (p == NULL) {
        GGML_LOG_ERROR("%s: no switch %s\n", __func__, name ? name : "(null)");
        return -1;
    }
    int64_t value = 0;
    std::vector<int64_t> list;
    std::string why;
    if (text == NULL || !ggml_sched_pp_parse(*p, text, &value, &list, &why)) {
        GGML_LOG_ERROR("%s: %s=%s is %s; accepted: %s\n", __func__, name, text ? text : "(null)",
                       text ? why.c_str() : "missing", ggml_sched_pp_accepted(*p).c_str());
        return -2;
    }
    ggml_sched_pp_assign(*p, value, list);
    return 0;
}

int ggml_backend_sched_pp_get_param_text(const char * name, char * buf, size_t size) {
    ggml_sched_pp_param * p = ggml_sched_pp_find(name);
    if (p == NULL) {
        return -1;
    }
    return snprintf(buf, size, "%s", ggml_sched_pp_text(*p).c_str());
}

int ggml_backend_sched_pp_get_param(const char * name, int64_t * value) {
    ggml_sched_pp_param * p = ggml_sched_pp_find(name);
    if (p == NULL || value == NULL) {
        return -1;
    }
    *value = p->value;
    return 0;
}

int64_t ggml_backend_sched_pp_param(const char * name) {
    ggml_sched_pp_param * p = ggml_sched_pp_find(name);
    if (p == NULL) {
        GGML_LOG_ERROR("%s: no switch %s (reads as 0)\n", __func__, name ? name : "(null)");
        return 0;
    }
    return p->value;
}

int ggml_backend_sched_pp_env_problems(char * buf, size_t size) {
    ggml_sched_pp_params_init();
    const std::vector<std::string> problems = ggml_sched_pp_scan_env(/*apply =*/ false);
    std::string out;
    for (const auto & m : problems) {
        out += m + "\n";
    }
    if (buf != NULL && size > 0) {
        snprintf(buf, size, "%s", out.c_str());
    }
    return (int) problems.size();
}

uint64_t ggml_backend_sched_pp_reallocs_since_reserve(ggml_backend_sched_t sched) {
    GGML_ASSERT(sched);
    return sched->pp_reallocs_since_reserve;
}

void ggml_backend_sched_pp_reset_stats(ggml_backend_sched_t sched) {
    GGML_ASSERT(sched);
    memset(&sched->pp, 0, sizeof(sched->pp));
}

const char * ggml_backend_sched_pp_param_info(int i, int64_t * value, const char ** description) {
    ggml_sched_pp_params_init();
    if (i < 0 || i >= ggml_sched_pp_n_params) {
        return NULL;
    }
    if (value != NULL) {
        *value = ggml_sched_pp_params[i].value;
    }
    if (description != NULL) {
        *description = ggml_sched_pp_params[i].help;
    }
    return ggml_sched_pp_params[i].name;
}

const char * ggml_backend_sched_pp_param_spec(int i, const char ** type, int64_t * def, int64_t * min, int64_t * max,
                                              const char ** values) {
    if (i < 0 || i >= ggml_sched_pp_n_params) {
        return NULL;
    }
    const ggml_sched_pp_param & p = ggml_sched_pp_params[i];
    if (type   != NULL) { *type   = p.type == GGML_SCHED_PP_BOOL ? "bool" : p.type == GGML_SCHED_PP_INTS ? "ints" : "int"; }
    if (def    != NULL) { *def    = p.def; }
    if (min    != NULL) { *min    = p.min; }
    if (max    != NULL) { *max    = p.max; }
    if (values != NULL) { *values = p.values; }
    return p.name;
}

uint64_t ggml_backend_sched_pp_host_weight_bytes(ggml_backend_sched_t sched, ggml_backend_t backend) {
    for (int b = 0; b < sched->n_backends; b++) {
        if (sched->backends[b] == backend) {
            return sched->pp.weight_bytes[b] + sched->pp.direct_bytes_est[b] + sched->pp.gather_bytes_est[b];
        }
    }
    return 0;
}

// the switches' values as a JSON object (ggml_backend_sched_pp_stats_json's "params")
std::string ggml_sched_pp_params_json(void) {
    std::string out = "{";
    bool first = true;
    for (int i = 0; i < ggml_sched_pp_n_params; i++) {
        const ggml_sched_pp_param & p = ggml_sched_pp_params[i];
        // (a list: as a string of its entries)
        const std::string v = p.n_list ? "\"" + ggml_sched_pp_text(p) + "\"" : std::to_string(p.value);
        out += std::string(first ? "" : ",") + "\"" + p.name + "\":" + v;
        first = false;
    }
    out += "}";
    return out;
}

// the layer and the rest of a weight's name ("blk.12.ffn_up_exps.weight": 12, "ffn_up_exps.weight"), or -1
int ggml_backend_sched_pp_weight_layer(const char * name, const char ** rest) {
    int il = -1;
    int n  = 0;
    if (sscanf(name, "blk.%d.%n", &il, &n) != 1 || n == 0) {
        return -1;
    }
    *rest = name + n;
    return il;
}
