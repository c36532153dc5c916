// pyllama_pp: fit's spread placement (fit-pp.h): every device its share of the layers whose experts stay in system
// memory, the rest of it full layers.

#include "fit-pp.h"

#include "json.h"
#include "log.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdlib>
#include <utility>

bool common_fit_pp_spread(const common_fit_pp_spread_params & params,
                          std::vector<uint32_t> & n_full_out, std::vector<uint32_t> & n_host_out) {
    const std::vector<ggml_backend_dev_t> & devs = params.devs;
    const size_t nd = devs.size();

    std::vector<std::string> reasons; // why the spread placement is not taken
    const char * env_spread = getenv("LLAMA_FIT_SPREAD");
    if (env_spread != nullptr && std::string(env_spread) == "0") {
        reasons.push_back("LLAMA_FIT_SPREAD=0");
    }
    if (nd < 2) {
        reasons.push_back("only one device");
    }
    if (params.n_expert == 0) {
        reasons.push_back("not an MoE model");
    }
    if (params.mparams->split_mode != LLAMA_SPLIT_MODE_LAYER) {
        reasons.push_back("split mode is not layer");
    }
    if (!params.cparams->op_offload) {
        reasons.push_back("op offload is off");
    }
    if (!params.cparams->offload_kqv) {
        reasons.push_back("K/Q/V offload is off");
    }
    for (size_t id = 0; id < nd; id++) {
        ggml_backend_dev_props props;
        ggml_backend_dev_get_props(devs[id], &props);
        if (!props.caps.async || !props.caps.events) {
            reasons.push_back(std::string("device ") + ggml_backend_dev_name(devs[id]) + " lacks async compute or events");
        }
    }
    if (params.n_expert > 0 && params.surplus_cpu_moe <= 0) {
        reasons.push_back("the dense weights do not fit even with all experts in system memory");
    }
    // LLAMA_FIT_SPREAD_WEIGHTS=w0,w1,...: shares in proportion to these weights (e.g. each device's host link
    // bandwidth, so that every pipeline stage streams its experts in about the same time) instead of equal ones
    std::vector<double> weights;
    if (const char * env_w = getenv("LLAMA_FIT_SPREAD_WEIGHTS"); env_w != nullptr && *env_w != '\0') {
        std::string w = env_w;
        bool ok = true;
        for (size_t pos = 0; ok && pos <= w.size();) {
            const size_t end = std::min(w.find(',', pos), w.size());
            char * stop = nullptr;
            const std::string item = w.substr(pos, end - pos);
            const double x = std::strtod(item.c_str(), &stop);
            ok = !item.empty() && stop != nullptr && *stop == '\0' && x > 0.0;
            weights.push_back(x);
            pos = end + 1;
        }
        if (!ok || weights.size() != nd) {
            reasons.push_back("LLAMA_FIT_SPREAD_WEIGHTS must give one positive weight per device (" +
                              std::to_string(nd) + "), not '" + w + "'");
            weights.clear();
        }
    }
    double weight_sum = 0.0;
    for (double x : weights) {
        weight_sum += x;
    }

    const uint32_t n_rep = params.n_rep;
    std::vector<uint32_t> n_full(nd, 0);
    std::vector<uint32_t> n_host(nd, 0);
    uint32_t n_probes = 0;

    // each device's share of n layers: equal, the remainder on the trailing devices (the last layer of a
    // ubatch without outputs does no expert work); or by the weights, largest remainders first (ties: trailing)
    auto share_of = [&](size_t id, uint32_t n) {
        return weights.empty() ? double(n) / double(nd) : double(n) * weights[id] / weight_sum;
    };
    auto shares = [&](uint32_t n) {
        std::vector<uint32_t> ret(nd, 0);
        std::vector<std::pair<double, size_t>> rest;
        uint32_t given = 0;
        for (size_t id = 0; id < nd; id++) {
            const double x = share_of(id, n) + 1e-9;
            ret[id] = uint32_t(x);
            given += ret[id];
            rest.push_back({x - double(ret[id]), id});
        }
        std::stable_sort(rest.begin(), rest.end(), [](const auto & a, const auto & b) {
            return a.first > b.first + 1e-6 || (std::abs(a.first - b.first) <= 1e-6 && a.second > b.second);
        });
        for (size_t k = 0; given < n && k < rest.size(); k++, given++) {
            ret[rest[k].second]++;
        }
        return ret;
    };

    if (reasons.empty()) {
        // all experts in system memory, every device its share: the dense-only memory of each device
        const std::vector<uint32_t> all_host = shares(n_rep);
        const std::vector<llama_device_memory_data> dmds_host = params.device_memory(n_full, all_host);
        // the same layers with their experts: the expert bytes of a layer
        const std::vector<int64_t> mem_full = params.memory_for_layers(all_host, n_full);
        n_probes += 2;

        int64_t dense_per_layer  = 0; // device memory of a layer with its experts in system memory
        int64_t expert_per_layer = 0; // what its experts add
        for (size_t id = 0; id < nd; id++) {
            if (all_host[id] == 0) {
                continue;
            }
            const int64_t mem_host = dmds_host[id].mb.total();
            if (mem_host > params.targets[id]) {
                reasons.push_back(std::string("device ") + ggml_backend_dev_name(devs[id]) +
                    " cannot hold its share of the dense-only layers");
            }
            expert_per_layer = std::max(expert_per_layer, (mem_full[id] - mem_host) / int64_t(all_host[id]));
            if (id < nd - 1) { // the last device also holds the output layer
                dense_per_layer = std::max(dense_per_layer,
                    int64_t(dmds_host[id].mb.model + dmds_host[id].mb.context) / int64_t(all_host[id]));
            }
        }
        std::vector<int64_t> fixed(nd); // memory that does not depend on the number of layers
        for (size_t id = 0; id < nd; id++) {
            fixed[id] = dmds_host[id].mb.total() - int64_t(all_host[id]) * dense_per_layer;
        }

        // the fewest host-expert layers such that each device holds its share of them and enough full
        // layers fit on the devices for the rest; a device that went over its target in a check gets a cap
        std::vector<uint32_t> cap(nd, n_rep);
        bool fits = false;
        for (int iter = 0; reasons.empty() && iter < 2*int(nd) + 4 && !fits; iter++) {
            bool found = false;
            for (uint32_t n_host_total = 0; n_host_total <= n_rep && !found; n_host_total++) {
                const std::vector<uint32_t> nh = shares(n_host_total);
                std::vector<uint32_t> nf(nd, 0);
                uint32_t sum_nf = 0;
                bool room = true;
                for (size_t id = 0; id < nd; id++) {
                    const int64_t left = params.targets[id] - fixed[id] - int64_t(nh[id]) * dense_per_layer;
                    if (left < 0) {
                        room = false;
                        break;
                    }
                    nf[id] = std::min<int64_t>(cap[id], left / std::max<int64_t>(dense_per_layer + expert_per_layer, 1));
                    sum_nf += nf[id];
                }
                if (!room || sum_nf < n_rep - n_host_total) {
                    continue;
                }
                // hand back the full layers that are not needed, from the devices with the most
                for (uint32_t n_extra = sum_nf - (n_rep - n_host_total); n_extra > 0; n_extra--) {
                    size_t id_max = 0;
                    for (size_t id = 1; id < nd; id++) {
                        if (nf[id] >= nf[id_max]) {
                            id_max = id;
                        }
                    }
                    nf[id_max]--;
                }
                n_full = nf;
                n_host = nh;
                found  = true;
            }
            if (!found) {
                reasons.push_back("no share of host-expert layers per device fits the targets");
                break;
            }
            const std::vector<int64_t> mem_test = params.memory_for_layers(n_full, n_host);
            n_probes++;
            fits = true;
            for (size_t id = 0; id < nd; id++) {
                if (mem_test[id] > params.targets[id]) {
                    fits = false;
                    if (n_full[id] == 0) {
                        reasons.push_back(std::string("device ") + ggml_backend_dev_name(devs[id]) +
                            " is over its target without full layers");
                    }
                    cap[id] = n_full[id] > 0 ? n_full[id] - 1 : 0;
                }
            }
        }
        if (reasons.empty() && !fits) {
            reasons.push_back("no spread placement within the targets after " + std::to_string(n_probes) + " checks");
        }

        // check that the host experts are spread: every device within one layer of its share
        uint32_t n_host_total = 0;
        for (size_t id = 0; id < nd; id++) {
            n_host_total += n_host[id];
        }
        for (size_t id = 0; id < nd && reasons.empty(); id++) {
            if (std::abs(double(n_host[id]) - share_of(id, n_host_total)) > 1.0 + 1e-9) {
                reasons.push_back(std::string("device ") + ggml_backend_dev_name(devs[id]) +
                    " is more than one host-expert layer off its share");
            }
        }
    }

    const bool spread = reasons.empty();
    std::string why;
    for (const std::string & r : reasons) {
        why += (why.empty() ? "" : "; ") + r;
    }
    if (spread) {
        LOG_TRC("%s: host experts spread over %zu devices:\n", params.func, nd);
        for (size_t id = 0; id < nd; id++) {
            LOG_TRC("%s:   - %s: %2" PRIu32 " full layers, %2" PRIu32 " host-expert layers\n",
                params.func, params.dev_names[id].c_str(), n_full[id], n_host[id]);
        }
    } else {
        LOG_TRC("%s: host experts placed by steps 3 and 4: %s\n", params.func, why.c_str());
    }
    LOG_JSON("fit_placement", common_json({
        {"path",        spread ? "spread" : "upstream"},
        {"reasons",     reasons},
        {"full_layers", spread ? n_full : std::vector<uint32_t>()},
        {"host_layers", spread ? n_host : std::vector<uint32_t>()},
        {"probes",      n_probes},
        {"weights",     weights},
    }));
    if (spread) {
        n_full_out = n_full;
        n_host_out = n_host;
    }
    return spread;
}
