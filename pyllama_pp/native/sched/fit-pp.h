#pragma once

// pyllama_pp: fit's spread placement - with pipeline parallelism each device streams the experts of its own
// host-expert layers over its own link, so the slowest stage sets the throughput; upstream's steps 3 and 4 pile the
// host experts onto the trailing devices instead. common_fit_pp_spread gives every device its share of them (equal,
// or weighted by LLAMA_FIT_SPREAD_WEIGHTS) and fills the rest of each device with full layers.
// common_params_fit_impl (fit.cpp) calls it before step 3 with what it measured and its dry runs; everything else is
// here.

#include "llama.h"
#include "../src/llama-ext.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

struct common_fit_pp_spread_params {
    const char * func;                            // the caller's name, for its log lines
    const llama_model_params   * mparams;
    const llama_context_params * cparams;
    const std::vector<ggml_backend_dev_t> & devs;
    const std::vector<std::string> & dev_names;   // as the caller logs them
    uint32_t n_rep;                               // repeating layers (the last device also holds the output layer)
    uint32_t n_expert;
    int64_t  surplus_cpu_moe;                     // memory left over the targets with every expert in system memory
    const std::vector<int64_t> & targets;         // the most memory each device may use

    // dry runs of a placement - per device, the full layers and the layers with their experts in system memory:
    // every device's memory data (nd + 1 entries, the host last), and each device's total
    std::function<std::vector<llama_device_memory_data>(
        const std::vector<uint32_t> & n_full, const std::vector<uint32_t> & n_host)> device_memory;
    std::function<std::vector<int64_t>(
        const std::vector<uint32_t> & n_full, const std::vector<uint32_t> & n_host)> memory_for_layers;
};

// the spread placement (true: n_full, n_host per device), or false where a precondition does not hold or no spread
// placement fits the targets (the caller then takes steps 3 and 4); LLAMA_FIT_SPREAD=0 turns it off. The decision
// and its reasons are logged, and emitted as the LOG_JSON record "fit_placement".
bool common_fit_pp_spread(const common_fit_pp_spread_params & params,
                          std::vector<uint32_t> & n_full, std::vector<uint32_t> & n_host);
