// pyllama_pp: RPC_HOST on the server (protocol 7.1) - host buffers per served device, and the scheduler that
// computes a graph that reads them on its device, copying the host weights in as a local scheduler does.
// rpc_server (ggml-rpc.cpp) holds one rpc_server_host and calls it where a command needs it. Its devices cache the
// experts of their own layers (EXPERT_CACHE) with the client's switches (protocol 7.1.1).
#pragma once

#include "ggml-backend.h"
#include "ggml-backend-pp.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// the server's n_threads, for the host device's backend
void rpc_server_host_set_threads(size_t n_threads);

// the client's switches that the schedulers running its graphs on a server take (7.1.1, RPC_CMD_SET_HOST_SWITCH)
extern const char * const rpc_server_host_client_switches[2];

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
    // the client's switches (RPC_CMD_SET_HOST_SWITCH) over this process's, for the schedulers made from now
    std::vector<std::pair<std::string, int64_t>> switches;

    ~rpc_server_host();

    // a host buffer of `size` bytes for `device`, marked as weights (nullptr: refused, logged)
    ggml_backend_buffer_t alloc(ggml_backend_t device, uint64_t size);
    // before a buffer of the server is freed (a host buffer's: the schedulers go first, whose caches hold its experts)
    void forget(ggml_backend_buffer_t buffer);
    // a switch of the client for the schedulers made from now (those made before go where its value changes); false
    // for a name or value the switch table refuses
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
    ggml_backend_sched_t new_sched(ggml_backend_t device, size_t size) const;
    void retire(uint32_t device);
    std::vector<ggml_backend_t> sched_devices;   // the device of each scheduler
};
