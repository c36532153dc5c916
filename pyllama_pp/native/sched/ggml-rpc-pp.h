// pyllama_pp: RPC_HOST on the server (protocol 7.1) - host buffers per served device, and the scheduler that
// computes a graph that reads them on its device, copying the host weights in as a local scheduler does.
// rpc_server (ggml-rpc.cpp) holds one rpc_server_host and calls it where a command needs it.
#pragma once

#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// the server's n_threads, for the host device's backend
void rpc_server_host_set_threads(size_t n_threads);

struct rpc_server_host {
    // host buffers (ALLOC_HOST_BUFFER): a graph that reads one runs through a scheduler over its device and the
    // host device, which copies host weights in for the device's ops
    std::unordered_set<ggml_backend_buffer_t> buffers;
    size_t bytes = 0;   // what they hold together
    ggml_backend_t backend = nullptr;   // the host device's
    std::vector<ggml_backend_sched_t> scheds;
    std::vector<size_t> sched_sizes;
    std::vector<uint64_t> sched_bytes_before;   // host-weight bytes moved to each device by its schedulers freed so far

    ~rpc_server_host();

    // a host buffer of `size` bytes for `device`, marked as weights (nullptr: refused, logged)
    ggml_backend_buffer_t alloc(ggml_backend_t device, uint64_t size);
    // before a buffer of the server is freed
    void forget(ggml_backend_buffer_t buffer);
    // whether a graph with these tensors reads a host buffer
    bool reads(const std::unordered_map<uint64_t, ggml_tensor *> & tensors) const;
    // compute such a graph on devices[device] (n_tensors: the tensors of its message)
    bool compute(const std::vector<ggml_backend_t> & devices, uint32_t device, ggml_cgraph * graph, size_t n_tensors);
    // the host-weight bytes its schedulers moved to devices[device] so far
    uint64_t weight_bytes(const std::vector<ggml_backend_t> & devices, uint32_t device) const;
    // the host memory its host buffers may still take, and their total
    void memory(size_t * free, size_t * total) const;
    // the schedulers (before the buffers they read)
    void free_scheds();
};
