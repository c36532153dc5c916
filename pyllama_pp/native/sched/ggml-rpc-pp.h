// pyllama_pp: RPC_HOST (protocol 7.1) - host buffers per served device, and the scheduler that computes a graph that
// reads them on its device, copying the host weights in as a local scheduler does; and the client's calls that use
// them. rpc_server (ggml-rpc.cpp) holds one rpc_server_host and calls it where a command needs it, and hands it the
// commands of RPC_HOST; the client's calls here reach a server through ggml-rpc.cpp's dispatcher
// (rpc_host_connect). Its devices cache the experts of their own layers (EXPERT_CACHE) with the client's switches
// (protocol 7.1.1).
#pragma once

#include "ggml-backend.h"
#include "ggml-backend-pp.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// RPC_HOST's commands, in the order of their entries in ggml-rpc.cpp's enum rpc_cmd (from RPC_CMD_ALLOC_HOST_BUFFER)
enum rpc_host_cmd {
    RPC_HOST_CMD_ALLOC_HOST_BUFFER,       // 7.1
    RPC_HOST_CMD_GET_HOST_MEMORY,         // 7.1
    RPC_HOST_CMD_GET_HOST_WEIGHT_BYTES,   // 7.1
    RPC_HOST_CMD_SET_HOST_SWITCH,         // 7.1.1
    RPC_HOST_CMD_GET_HOST_CACHE_COUNTS,   // 7.1.1
    RPC_HOST_CMD_COUNT,
};

// their messages (packed, as ggml-rpc.cpp's)
#pragma pack(push, 1)

// ALLOC_HOST_BUFFER: ALLOC_BUFFER's messages (the client's alloc_buffer sends either)
struct rpc_host_msg_alloc_req {
    uint32_t device;
    uint64_t size;
};

struct rpc_host_msg_alloc_rsp {
    uint64_t remote_ptr;
    uint64_t remote_size;
};

// GET_HOST_MEMORY, GET_HOST_WEIGHT_BYTES, GET_HOST_CACHE_COUNTS: a served device
struct rpc_host_msg_device_req {
    uint32_t device;
};

struct rpc_host_msg_memory_rsp {
    uint64_t free_mem;
    uint64_t total_mem;
};

struct rpc_host_msg_weight_bytes_rsp {
    uint64_t bytes;
};

struct rpc_host_msg_set_switch_req {
    char    name[32];
    int64_t value;
};

struct rpc_host_msg_set_switch_rsp {
    uint8_t result;   // 0: the server's switch table refuses it
};

struct rpc_host_msg_cache_counts_rsp {
    ggml_backend_pp_cache_counts counts;
};

#pragma pack(pop)

// the client's side: a server as RPC_HOST's calls see it (ggml-rpc.cpp: its dispatcher)
struct rpc_host_conn {
    uint8_t server_minor;   // its protocol minor version (1: host buffers)
    uint8_t server_patch;   // ... and patch version (7.1.1: expert caches)
    // sends a command and waits for its response
    std::function<void(rpc_host_cmd cmd, std::shared_ptr<const void> input, size_t input_size, void * output,
                       size_t output_size)> send;
};

// in ggml-rpc.cpp: the connection to the server at endpoint; a new host buffer type of that server for its device;
// the endpoint and device of an RPC device (false for another device)
rpc_host_conn rpc_host_connect(const char * endpoint);
ggml_backend_buffer_type_t rpc_host_buffer_type_new(const char * endpoint, uint32_t device, const std::string & name);
bool rpc_host_dev_endpoint(ggml_backend_dev_t dev, std::string * endpoint, uint32_t * device);

// EXPERT_CACHE: the client's cache switches to the server at endpoint, for the schedulers that run its graphs there
// (7.1.1; when a backend of its device is made)
void rpc_host_send_switches(const char * endpoint);
// RPC_HOST's functions of the RPC registry by name (ggml_backend_rpc_dev_host_buffer_type, ...); NULL for another
void * rpc_host_proc_address(const char * name);

// the server's side
// the server's n_threads, for the host device's backend
void rpc_server_host_set_threads(size_t n_threads);

// the client's switches that the schedulers running its graphs on a server take (7.1.1, RPC_CMD_SET_HOST_SWITCH)
extern const char * const rpc_server_host_client_switches[3];

struct rpc_server_host {
    // host buffers (ALLOC_HOST_BUFFER): a graph that reads one runs through a scheduler over its device and the
    // host device, which copies host weights in for the device's ops
    std::unordered_set<ggml_backend_buffer_t> buffers;
    size_t bytes = 0;   // what they hold together
    ggml_backend_t backend = nullptr;   // the host device's
    std::vector<ggml_backend_sched_t> scheds;
    std::vector<size_t> sched_sizes;
    std::vector<uint64_t> sched_bytes_before;   // host-weight bytes moved to each device by its schedulers freed so far
    std::vector<ggml_backend_pp_cache_counts> sched_cache_before;   // ... and their expert caches' counters
    // the client's switches (RPC_CMD_SET_HOST_SWITCH) over this process's, for the schedulers made from now (NAME@D:
    // device D's over NAME)
    std::vector<std::pair<std::string, int64_t>> switches;

    ~rpc_server_host();

    // serves a command of RPC_HOST: recv reads its request, send writes its response; server_buffers are the
    // server's (a host buffer is one of them too); false ends the connection
    bool serve(rpc_host_cmd cmd, const std::vector<ggml_backend_t> & devices,
               std::unordered_set<ggml_backend_buffer_t> & server_buffers,
               const std::function<bool(void * msg, size_t size)> & recv,
               const std::function<bool(const void * msg, size_t size)> & send);

    // a host buffer of `size` bytes for `device`, marked as weights (nullptr: refused, logged)
    ggml_backend_buffer_t alloc(ggml_backend_t device, uint64_t size);
    // before a buffer of the server is freed (a host buffer's: the schedulers go first, whose caches hold its experts)
    void forget(ggml_backend_buffer_t buffer);
    // a switch of the client for the schedulers made from now (those made before go where its value changes): NAME for
    // every device (its per-device values go), or NAME@D for device D's only (the cache's lists); false for a name
    // or value the switch table refuses
    bool set_switch(const char * name, int64_t value);
    // whether a graph with these tensors reads a host buffer
    bool reads(const std::unordered_map<uint64_t, ggml_tensor *> & tensors) const;
    // compute such a graph on devices[device] (n_tensors: the tensors of its message)
    bool compute(const std::vector<ggml_backend_t> & devices, uint32_t device, ggml_cgraph * graph, size_t n_tensors);
    // the host-weight bytes its schedulers moved to devices[device] so far
    uint64_t weight_bytes(const std::vector<ggml_backend_t> & devices, uint32_t device) const;
    // the expert cache's counters of its schedulers for devices[device] (EXPERT_CACHE; levels: the live one's)
    ggml_backend_pp_cache_counts cache_counts(const std::vector<ggml_backend_t> & devices, uint32_t device) const;
    // the host memory its host buffers may still take, and their total
    void memory(size_t * free, size_t * total) const;
    // the schedulers (before the buffers they read), their counters kept
    void free_scheds();

private:
    ggml_backend_sched_t new_sched(uint32_t device, size_t size) const;
    void retire(uint32_t device);
    std::vector<ggml_backend_t> sched_devices;   // the device of each scheduler
};
