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
    }
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
    }
    const size_t need = graph->n_nodes + n_tensors;
    if (scheds[device] == nullptr || sched_sizes[device] < need) {
        if (scheds[device] != nullptr) {
            sched_bytes_before[device] += ggml_backend_sched_pp_host_weight_bytes(scheds[device], devices[device]);
            ggml_backend_sched_free(scheds[device]);
        }
        ggml_backend_t pair[2] = { devices[device], backend };
        // (parallel: the series' mechanisms that act while pipelining - one transient copy per host weight, the
        // next split's copy beside compute - act on the server's own device as on a local one)
        scheds[device] = ggml_backend_sched_new(pair, nullptr, 2, need, true, true);
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
    for (auto sched : scheds) {
        if (sched != nullptr) {
            ggml_backend_sched_free(sched);
        }
    }
    scheds.clear();
}

rpc_server_host::~rpc_server_host() {
    free_scheds();
    if (backend != nullptr) {
        ggml_backend_free(backend);
    }
}
