// pyllama_pp: RPC_HOST on the server (ggml-rpc-pp.h): host buffers per served device and their scheduler.

#include "ggml-rpc-pp.h"
#include "ggml-rpc.h"
#include "ggml-backend-pp.h"
#include "ggml-backend-impl.h"
#include "ggml-impl.h"

#include <algorithm>
#include <cinttypes>

// what a server runs beside its devices for graphs that read its host buffers (the CPU device), and its threads
static ggml_backend_dev_t rpc_server_host_dev     = nullptr;
static size_t             rpc_server_host_threads = 1;
// the most host memory its host buffers may hold together (0: no limit of its own; allocations fail where the host
// has no more)
static size_t             rpc_server_host_limit   = 0;

void ggml_backend_rpc_server_set_host_device(ggml_backend_dev_t dev) {
    rpc_server_host_dev = dev;
}

void ggml_backend_rpc_server_set_host_memory_limit(size_t bytes) {
    rpc_server_host_limit = bytes;
}

void rpc_server_host_set_threads(size_t n_threads) {
    rpc_server_host_threads = n_threads;
}

// EXPERT_CACHE: a server's device caches the experts of its own layers (the schedulers that run a client's graphs
// take the client's values; a client of 7.1.0 leaves this process's)
const char * const rpc_server_host_client_switches[2] = { "EXPERT_CACHE", "EXPERT_CACHE_MIN_HIT" };

ggml_backend_buffer_t rpc_server_host::alloc(ggml_backend_t device, uint64_t size) {
    if (backend == nullptr && rpc_server_host_dev != nullptr) {
        backend = ggml_backend_dev_init(rpc_server_host_dev, nullptr);
        ggml_backend_reg_t reg = backend ? ggml_backend_dev_backend_reg(rpc_server_host_dev) : nullptr;
        auto set_n_threads = reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads") : nullptr;
        if (set_n_threads) {
            set_n_threads(backend, (int) rpc_server_host_threads);
        }
    }
    if (backend == nullptr) {
        GGML_LOG_ERROR("[%s] this server has no host device (ggml_backend_rpc_server_set_host_device)\n", "alloc_host_buffer");
        return nullptr;   // (the client's allocation fails with a message)
    }
    // the device's own host buffer type (pinned memory) where it has one, else plain host memory
    ggml_backend_buffer_type_t buft = ggml_backend_dev_host_buffer_type(ggml_backend_get_device(device));
    if (buft == nullptr) {
        buft = ggml_backend_dev_buffer_type(rpc_server_host_dev);
    }
    // the client aligns tensors to the device's alignment from this buffer's base, which is only host-aligned:
    // room for that much more
    const size_t align = ggml_backend_buft_get_alignment(ggml_backend_get_default_buffer_type(device));
    if (rpc_server_host_limit > 0 &&
        (size > rpc_server_host_limit || bytes + align > rpc_server_host_limit - size)) {
        GGML_LOG_ERROR("[%s] %" PRIu64 " bytes more host memory would pass this server's limit (%zu of %zu bytes in "
                       "use)\n", "alloc_host_buffer", size, bytes, rpc_server_host_limit);
        return nullptr;   // (the client's allocation fails)
    }
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(buft, size + align);
    if (buffer != nullptr) {
        bytes += buffer->size;
        ggml_backend_buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        buffers.insert(buffer);
    }
    return buffer;
}

void rpc_server_host::forget(ggml_backend_buffer_t buffer) {
    if (buffers.erase(buffer)) {
        bytes -= buffer->size;
        free_scheds();   // (their expert caches hold experts of the buffer, known by address)
    }
}

bool rpc_server_host::set_switch(const char * name, int64_t value) {
    int64_t old = 0;
    if (ggml_backend_sched_pp_get_param(name, &old) != 0) {
        return false;
    }
    if (ggml_backend_sched_pp_set_param(name, value) != 0) {   // (a value it refuses is logged)
        return false;
    }
    ggml_backend_sched_pp_set_param(name, old);
    auto it = std::find_if(switches.begin(), switches.end(), [&](const auto & sw) { return sw.first == name; });
    if (it == switches.end()) {
        switches.emplace_back(name, value);
    } else if (it->second != value) {
        it->second = value;
        free_scheds();   // (the next graph makes a scheduler with the new value)
    }
    return true;
}

// a scheduler over the device and the host device, with the client's switches: a scheduler reads the switch table
// when it is made, so they are set around that (a server serves one client at a time) and set back
ggml_backend_sched_t rpc_server_host::new_sched(ggml_backend_t device, size_t size) const {
    std::vector<int64_t> own(switches.size());
    for (size_t i = 0; i < switches.size(); i++) {
        ggml_backend_sched_pp_get_param(switches[i].first.c_str(), &own[i]);
        ggml_backend_sched_pp_set_param(switches[i].first.c_str(), switches[i].second);
    }
    ggml_backend_t pair[2] = { device, backend };
    // (parallel: the series' mechanisms that act while pipelining - one transient copy per host weight, the
    // next split's copy beside compute - act on the server's own device as on a local one)
    ggml_backend_sched_t sched = ggml_backend_sched_new(pair, nullptr, 2, size, true, true);
    for (size_t i = 0; i < switches.size(); i++) {
        ggml_backend_sched_pp_set_param(switches[i].first.c_str(), own[i]);
    }
    return sched;
}

// a scheduler freed, its counters kept
void rpc_server_host::retire(uint32_t device) {
    ggml_backend_sched_t sched = scheds[device];
    sched_bytes_before[device] += ggml_backend_sched_pp_host_weight_bytes(sched, sched_devices[device]);
    ggml_backend_pp_cache_counts n;
    ggml_backend_sched_pp_cache_counts(sched, sched_devices[device], &n);
    ggml_backend_pp_cache_counts & before = sched_cache_before[device];
    before.ops       += n.ops;
    before.hits      += n.hits;
    before.misses    += n.misses;
    before.evictions += n.evictions;
    before.bytes     += n.bytes;
    ggml_backend_sched_synchronize(sched);   // (nothing may still read its expert slots)
    ggml_backend_sched_free(sched);
    scheds[device] = nullptr;
}

bool rpc_server_host::reads(const std::unordered_map<uint64_t, ggml_tensor *> & tensors) const {
    bool reads_host = false;
    for (const auto & [id, t] : tensors) {
        reads_host = reads_host || (t->buffer != nullptr && buffers.count(t->buffer) > 0);
    }
    return reads_host;
}

bool rpc_server_host::compute(const std::vector<ggml_backend_t> & devices, uint32_t device, ggml_cgraph * graph,
                              size_t n_tensors) {
    // a scheduler over the device and the host device: it keeps every op on the device that holds its result (the
    // client allocated them there) and copies the host weights they read in, as a local scheduler does
    if (scheds.size() < devices.size()) {
        scheds.resize(devices.size(), nullptr);
        sched_sizes.resize(devices.size(), 0);
        sched_bytes_before.resize(devices.size(), 0);
        sched_cache_before.resize(devices.size(), ggml_backend_pp_cache_counts{});
        sched_devices = devices;
    }
    const size_t need = graph->n_nodes + n_tensors;
    if (scheds[device] == nullptr || sched_sizes[device] < need) {
        if (scheds[device] != nullptr) {
            retire(device);
        }
        scheds[device] = new_sched(devices[device], need);
        sched_sizes[device] = need;
    }
    ggml_backend_sched_reset(scheds[device]);
    // every tensor the graph reads stays where the client put it: host buffers on the host device, the rest on the
    // device (assigned here, not looked up by op: a sub-graph that an eval callback cut out of a split carries
    // views whose own sources it does not hold)
    auto assign = [&](ggml_tensor * t) {
        ggml_backend_buffer_t buf = t->view_src ? t->view_src->buffer : t->buffer;
        if (buf != nullptr) {
            ggml_backend_sched_set_tensor_backend(scheds[device], t, buffers.count(buf) ? backend : devices[device]);
        }
    };
    for (int i = 0; i < graph->n_nodes; i++) {
        assign(graph->nodes[i]);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (graph->nodes[i]->src[j] != nullptr) {
                assign(graph->nodes[i]->src[j]);
            }
        }
    }
    // EXPERT_CACHE: a small batch's expert ops on host weights read the device's slots of those experts
    for (int i = 0; i < graph->n_nodes; i++) {
        ggml_tensor * node = graph->nodes[i];
        if (node->op == GGML_OP_MUL_MAT_ID && node->src[0] != nullptr && buffers.count(node->src[0]->buffer)) {
            ggml_backend_sched_pp_cache_assigned(scheds[device], node, devices[device]);
        }
    }
    // (allocated here: graph_compute would reset a scheduler that holds assignments and is not allocated)
    return ggml_backend_sched_alloc_graph(scheds[device], graph) &&
           ggml_backend_sched_graph_compute(scheds[device], graph) == GGML_STATUS_SUCCESS;
}

// the host-weight bytes its schedulers moved to the device so far (the client counts none for host weights kept here)
uint64_t rpc_server_host::weight_bytes(const std::vector<ggml_backend_t> & devices, uint32_t device) const {
    if (device >= scheds.size()) {
        return 0;
    }
    return sched_bytes_before[device] +
           (scheds[device] ? ggml_backend_sched_pp_host_weight_bytes(scheds[device], devices[device]) : 0);
}

ggml_backend_pp_cache_counts rpc_server_host::cache_counts(const std::vector<ggml_backend_t> & devices, uint32_t device) const {
    ggml_backend_pp_cache_counts n = {};
    if (device >= scheds.size()) {
        return n;
    }
    if (scheds[device] != nullptr) {
        ggml_backend_sched_pp_cache_counts(scheds[device], devices[device], &n);
    }
    const ggml_backend_pp_cache_counts & before = sched_cache_before[device];
    n.ops       += before.ops;
    n.hits      += before.hits;
    n.misses    += before.misses;
    n.evictions += before.evictions;
    n.bytes     += before.bytes;
    return n;
}

// the host memory its host buffers may still take: the host device's free memory, within the limit if one is set
void rpc_server_host::memory(size_t * free, size_t * total) const {
    *free  = 0;
    *total = 0;
    if (rpc_server_host_dev != nullptr) {
        ggml_backend_dev_memory(rpc_server_host_dev, free, total);
    }
    if (rpc_server_host_limit > 0) {
        *total = std::min(*total, rpc_server_host_limit);
        *free  = std::min(*free, rpc_server_host_limit - std::min(bytes, rpc_server_host_limit));
    }
}

void rpc_server_host::free_scheds() {
    for (uint32_t device = 0; device < scheds.size(); device++) {
        if (scheds[device] != nullptr) {
            retire(device);
        }
    }
}

rpc_server_host::~rpc_server_host() {
    free_scheds();
    if (backend != nullptr) {
        ggml_backend_free(backend);
    }
}
