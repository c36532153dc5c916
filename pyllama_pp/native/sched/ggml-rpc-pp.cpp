// pyllama_pp: RPC_HOST (ggml-rpc-pp.h): host buffers per served device and their scheduler on the server, its
// commands, and the client's calls that use them.

#include "ggml-rpc-pp.h"
#include "ggml-rpc.h"
#include "ggml-backend-pp.h"
#include "ggml-backend-impl.h"
#include "ggml-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

static const char * RPC_HOST_DEBUG = std::getenv("GGML_RPC_DEBUG");   // (as ggml-rpc.cpp's LOG_DBG)

// --- the client's side -----------------------------------------------------------------------------------------------

// host memory on the server of an RPC device, one buffer type per device of a server of 7.1
static ggml_backend_buffer_type_t ggml_backend_rpc_host_buffer_type(const char * endpoint, uint32_t device) {
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    std::string buft_name = "RPC" + std::to_string(device) + "[" + std::string(endpoint) + "]_Host";
    // NOTE: buffer types are allocated and never freed, as ggml_backend_rpc_buffer_type's
    static std::unordered_map<std::string, ggml_backend_buffer_type_t> buft_map;
    auto it = buft_map.find(buft_name);
    if (it != buft_map.end()) {
        return it->second;
    }
    const rpc_host_conn conn = rpc_host_connect(endpoint);
    if (conn.server_minor < 1) {
        static std::unordered_set<std::string> warned;   // (once per server)
        if (!warned.insert(endpoint).second) {
            return nullptr;
        }
        GGML_LOG_WARN("%s: the RPC server at %s speaks protocol %d.%d, without host buffers (%d.1): host weights "
                      "stay on this host\n", __func__, endpoint, RPC_PROTO_MAJOR_VERSION, conn.server_minor,
                      RPC_PROTO_MAJOR_VERSION);
        return nullptr;
    }
    ggml_backend_buffer_type_t buft = rpc_host_buffer_type_new(endpoint, device, buft_name);
    buft_map[buft_name] = buft;
    return buft;
}

ggml_backend_buffer_type_t ggml_backend_rpc_dev_host_buffer_type(ggml_backend_dev_t dev) {
    std::string endpoint;
    uint32_t    device = 0;
    if (!rpc_host_dev_endpoint(dev, &endpoint, &device)) {
        return nullptr;
    }
    return ggml_backend_rpc_host_buffer_type(endpoint.c_str(), device);
}

// whether the server caches host experts (7.1.1)
static bool rpc_host_server_caches(const rpc_host_conn & conn) {
    return conn.server_minor > 1 || (conn.server_minor == 1 && conn.server_patch >= 1);
}

void rpc_host_send_switches(const char * endpoint) {
    const rpc_host_conn conn = rpc_host_connect(endpoint);
    if (!rpc_host_server_caches(conn)) {
        return;
    }
    for (const char * name : rpc_server_host_client_switches) {
        auto request = std::make_shared<rpc_host_msg_set_switch_req>();
        snprintf(request->name, sizeof(request->name), "%s", name);
        request->value = ggml_backend_sched_pp_param(name);
        rpc_host_msg_set_switch_rsp response;
        conn.send(RPC_HOST_CMD_SET_HOST_SWITCH, request, sizeof(*request), &response, sizeof(response));
        if (!response.result) {
            GGML_LOG_WARN("%s: the RPC server at %s refuses %s=%lld\n", __func__, endpoint, name, (long long) request->value);
        }
    }
}

// The cache's switches per device (EXPERT_CACHE, EXPERT_CACHE_MIN_HIT, EXPERT_HYBRID): the client's value for an RPC
// device goes to its server under "NAME@D" (D: the server's device), which the scheduler the server makes of that
// device takes over NAME; false where the server refuses it
static bool ggml_backend_rpc_pp_device_switch(ggml_backend_dev_t dev, const char * name, int64_t value) {
    std::string endpoint;
    uint32_t    device = 0;
    if (!rpc_host_dev_endpoint(dev, &endpoint, &device)) {
        return false;
    }
    const rpc_host_conn conn = rpc_host_connect(endpoint.c_str());
    if (!rpc_host_server_caches(conn)) {
        return true;   // (no cache there to set)
    }
    auto request = std::make_shared<rpc_host_msg_set_switch_req>();
    snprintf(request->name, sizeof(request->name), "%s@%u", name, device);
    request->value = value;
    rpc_host_msg_set_switch_rsp response;
    conn.send(RPC_HOST_CMD_SET_HOST_SWITCH, request, sizeof(*request), &response, sizeof(response));
    return response.result != 0;
}

bool ggml_backend_rpc_dev_host_memory(ggml_backend_dev_t dev, size_t * free, size_t * total) {
    std::string endpoint;
    uint32_t    device = 0;
    if (!rpc_host_dev_endpoint(dev, &endpoint, &device)) {
        return false;
    }
    const rpc_host_conn conn = rpc_host_connect(endpoint.c_str());
    if (conn.server_minor < 1) {
        return false;
    }
    auto request = std::make_shared<rpc_host_msg_device_req>();
    request->device = device;
    rpc_host_msg_memory_rsp response;
    conn.send(RPC_HOST_CMD_GET_HOST_MEMORY, request, sizeof(*request), &response, sizeof(response));
    *free  = response.free_mem;
    *total = response.total_mem;
    return true;
}

int64_t ggml_backend_rpc_host_weight_bytes(const char * endpoint, uint32_t device) {
    const rpc_host_conn conn = rpc_host_connect(endpoint);
    if (conn.server_minor < 1) {
        return -1;
    }
    auto request = std::make_shared<rpc_host_msg_device_req>();
    request->device = device;
    rpc_host_msg_weight_bytes_rsp response;
    conn.send(RPC_HOST_CMD_GET_HOST_WEIGHT_BYTES, request, sizeof(*request), &response, sizeof(response));
    return (int64_t) response.bytes;
}

bool ggml_backend_rpc_host_cache_counts(const char * endpoint, uint32_t device, ggml_backend_pp_cache_counts * counts) {
    const rpc_host_conn conn = rpc_host_connect(endpoint);
    if (!rpc_host_server_caches(conn)) {
        return false;
    }
    auto request = std::make_shared<rpc_host_msg_device_req>();
    request->device = device;
    rpc_host_msg_cache_counts_rsp response;
    conn.send(RPC_HOST_CMD_GET_HOST_CACHE_COUNTS, request, sizeof(*request), &response, sizeof(response));
    *counts = response.counts;
    return true;
}

// --- the server's side -----------------------------------------------------------------------------------------------

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

// EXPERT_CACHE: a server's device caches the experts of its own layers, and with EXPERT_HYBRID its own CPU takes a
// share of their misses (the schedulers that run a client's graphs take the client's values; a client of 7.1.0 leaves
// this process's)
const char * const rpc_server_host_client_switches[3] = { "EXPERT_CACHE", "EXPERT_CACHE_MIN_HIT", "EXPERT_HYBRID" };

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

bool rpc_server_host::serve(rpc_host_cmd cmd, const std::vector<ggml_backend_t> & devices,
                            std::unordered_set<ggml_backend_buffer_t> & server_buffers,
                            const std::function<bool(void * msg, size_t size)> & recv,
                            const std::function<bool(const void * msg, size_t size)> & send) {
    switch (cmd) {
        case RPC_HOST_CMD_ALLOC_HOST_BUFFER: {
            rpc_host_msg_alloc_req request;
            if (!recv(&request, sizeof(request))) {
                return false;
            }
            if (request.device >= devices.size()) {
                return false;
            }
            ggml_backend_buffer_t buffer = alloc(devices[request.device], request.size);
            rpc_host_msg_alloc_rsp response;
            response.remote_ptr  = reinterpret_cast<uint64_t>(buffer);
            response.remote_size = buffer != nullptr ? buffer->size : 0;
            if (buffer != nullptr) {
                server_buffers.insert(buffer);
            }
            if (RPC_HOST_DEBUG) {
                GGML_LOG_DEBUG("[%s] device: %d, size: %" PRIu64 " -> remote_ptr: %" PRIx64 "\n", "alloc_host_buffer",
                               request.device, request.size, response.remote_ptr);
            }
            return send(&response, sizeof(response));
        }
        case RPC_HOST_CMD_GET_HOST_MEMORY: {
            // the host memory its host buffers may still take: the host device's free memory, within the limit
            rpc_host_msg_device_req request;
            if (!recv(&request, sizeof(request)) || request.device >= devices.size()) {
                return false;
            }
            size_t free = 0, total = 0;
            memory(&free, &total);
            rpc_host_msg_memory_rsp response;
            response.free_mem  = free;
            response.total_mem = total;
            return send(&response, sizeof(response));
        }
        case RPC_HOST_CMD_GET_HOST_WEIGHT_BYTES: {
            // the host-weight bytes its schedulers moved to the device so far (the client counts none for these)
            rpc_host_msg_device_req request;
            if (!recv(&request, sizeof(request)) || request.device >= devices.size()) {
                return false;
            }
            rpc_host_msg_weight_bytes_rsp response;
            response.bytes = weight_bytes(devices, request.device);
            return send(&response, sizeof(response));
        }
        case RPC_HOST_CMD_SET_HOST_SWITCH: {
            // a switch of the client for the schedulers that run its graphs here (EXPERT_CACHE's)
            rpc_host_msg_set_switch_req request;
            if (!recv(&request, sizeof(request))) {
                return false;
            }
            const std::string name(request.name, strnlen(request.name, sizeof(request.name)));
            rpc_host_msg_set_switch_rsp response;
            response.result = set_switch(name.c_str(), request.value) ? 1 : 0;
            return send(&response, sizeof(response));
        }
        case RPC_HOST_CMD_GET_HOST_CACHE_COUNTS: {
            // the expert cache's counters of its schedulers for the device
            rpc_host_msg_device_req request;
            if (!recv(&request, sizeof(request)) || request.device >= devices.size()) {
                return false;
            }
            rpc_host_msg_cache_counts_rsp response;
            response.counts = cache_counts(devices, request.device);
            return send(&response, sizeof(response));
        }
        default:
            return false;
    }
}

void rpc_server_host::forget(ggml_backend_buffer_t buffer) {
    if (buffers.erase(buffer)) {
        bytes -= buffer->size;
        free_scheds();   // (their expert caches hold experts of the buffer, known by address)
    }
}

bool rpc_server_host::set_switch(const char * name, int64_t value) {
    // NAME, or NAME@D: NAME's value for the scheduler of device D only (a per-device EXPERT_CACHE, guard or split)
    const std::string full = name;
    const std::string base = full.substr(0, full.find('@'));
    char old[512];
    if (ggml_backend_sched_pp_get_param_text(base.c_str(), old, sizeof(old)) < 0) {
        return false;
    }
    if (ggml_backend_sched_pp_set_param(base.c_str(), value) != 0) {   // (a value it refuses is logged)
        return false;
    }
    ggml_backend_sched_pp_set_param_text(base.c_str(), old);
    bool changed = false;
    if (full == base) {   // (one value for every device: the per-device ones go)
        const size_t n = switches.size();
        switches.erase(std::remove_if(switches.begin(), switches.end(),
                                      [&](const auto & sw) { return sw.first.rfind(base + "@", 0) == 0; }), switches.end());
        changed = switches.size() != n;
    }
    auto it = std::find_if(switches.begin(), switches.end(), [&](const auto & sw) { return sw.first == full; });
    if (it == switches.end()) {
        switches.emplace_back(full, value);
        changed = changed || full != base;
    } else if (it->second != value) {
        it->second = value;
        changed = true;
    }
    if (changed) {
        free_scheds();   // (the next graph makes a scheduler with the new value)
    }
    return true;
}

// a scheduler over devices[device] and the host device, with the client's switches (NAME@device over NAME): a
// scheduler reads the switch table when it is made, so they are set around that (a server serves one client at a time)
// and set back
ggml_backend_sched_t rpc_server_host::new_sched(uint32_t device, size_t size) const {
    const std::string suffix = "@" + std::to_string(device);
    std::vector<std::pair<std::string, std::string>> own;   // (switch, its value before), in the order set
    for (size_t pass = 0; pass < 2; pass++) {   // (NAME first, then NAME@device over it)
        for (const auto & [name, value] : switches) {
            const size_t at = name.find('@');
            if ((pass == 0) != (at == std::string::npos) || (at != std::string::npos && name.substr(at) != suffix)) {
                continue;
            }
            char text[512];
            ggml_backend_sched_pp_get_param_text(name.substr(0, at).c_str(), text, sizeof(text));
            own.emplace_back(name.substr(0, at), text);
            ggml_backend_sched_pp_set_param(name.substr(0, at).c_str(), value);
        }
    }
    ggml_backend_t pair[2] = { sched_devices[device], backend };
    // (parallel: the series' mechanisms that act while pipelining - one transient copy per host weight, the
    // next split's copy beside compute - act on the server's own device as on a local one)
    ggml_backend_sched_t sched = ggml_backend_sched_new(pair, nullptr, 2, size, true, true);
    for (auto it = own.rbegin(); it != own.rend(); ++it) {   // (back in reverse: each to what was there before it)
        ggml_backend_sched_pp_set_param_text(it->first.c_str(), it->second.c_str());
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
        scheds[device] = new_sched(device, need);
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
    // EXPERT_CACHE: a small batch's expert ops on host weights read the device's slots of those experts (MUL_MAT_ID's
    // experts, src[0], and ADD_ID's expert biases, src[1]: gpt-oss)
    for (int i = 0; i < graph->n_nodes; i++) {
        ggml_tensor * node = graph->nodes[i];
        const int w = node->op == GGML_OP_MUL_MAT_ID ? 0 : node->op == GGML_OP_ADD_ID ? 1 : -1;
        if (w >= 0 && node->src[w] != nullptr && buffers.count(node->src[w]->buffer)) {
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

// --- the registry ----------------------------------------------------------------------------------------------------

void * rpc_host_proc_address(const char * name) {
    if (std::strcmp(name, "ggml_backend_rpc_dev_host_buffer_type") == 0) {
        return (void *)ggml_backend_rpc_dev_host_buffer_type;
    }
    if (std::strcmp(name, "ggml_backend_rpc_server_set_host_device") == 0) {
        return (void *)ggml_backend_rpc_server_set_host_device;
    }
    if (std::strcmp(name, "ggml_backend_rpc_server_set_host_memory_limit") == 0) {
        return (void *)ggml_backend_rpc_server_set_host_memory_limit;
    }
    if (std::strcmp(name, "ggml_backend_rpc_dev_host_memory") == 0) {
        return (void *)ggml_backend_rpc_dev_host_memory;
    }
    if (std::strcmp(name, "ggml_backend_rpc_host_weight_bytes") == 0) {
        return (void *)ggml_backend_rpc_host_weight_bytes;
    }
    if (std::strcmp(name, "ggml_backend_rpc_host_cache_counts") == 0) {
        return (void *)ggml_backend_rpc_host_cache_counts;
    }
    if (std::strcmp(name, "ggml_backend_rpc_pp_device_switch") == 0) {
        return (void *)ggml_backend_rpc_pp_device_switch;
    }
    return NULL;
}
