// pyllama_pp: the backend scheduler's host-weight pipeline extension (ggml-backend-pp.h): the hooks of a
// scheduler's life (created, a graph begins, fails) and the counters as JSON. The switch table, the counters' API
// and what every mechanism shares are in ggml-backend-pp-base.cpp; each mechanism has a file of its own
// (ggml-backend-pp-*.cpp); ggml-backend.cpp calls the hooks (ggml-backend-pp-impl.h).

#include "ggml-backend-pp-impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <string>
#include <unordered_set>
#include <vector>

static const char * ggml_sched_pp_wait_names[GGML_SCHED_PP_WAIT_COUNT] = {
    "user_input", "split_switch", "ids", "fallback", "realloc", "input_events", "upload",
};

// the pipeline stages of a new scheduler: one per GPU backend (ACCEL, e.g. BLAS, and CPU backends are not stages).
// LINKS (0: auto) - host links they upload over at once: GPUs that report the same PCI bus id share one -
// virtual devices of one GPU (GGML_CUDA_DEVICES) carry it with a "-v<N>" suffix; a GPU without an id counts as
// a link of its own. GPUs behind one PCIe switch uplink have different ids: set LINKS for them.
int ggml_backend_sched_pp_scan_devices(ggml_backend_sched_t sched, ggml_backend_t * backends, int n_backends) {
    ggml_backend_sched_pp_cache_devices(sched, backends, n_backends);
    int n_stages = 0;
    sched->pp_n_links = (int) sched->pp_cfg.links;
    const bool auto_links = sched->pp_n_links <= 0;
    std::vector<std::pair<int, std::string>> stage_links; // (backend, its link): the links and DIRECT's auto mode
    sched->pp_first_gpu = -1;
    for (int b = 0; b < n_backends; b++) {
        ggml_backend_dev_t dev = ggml_backend_get_device(backends[b]);
        const enum ggml_backend_dev_type t = dev ? ggml_backend_dev_type(dev) : GGML_BACKEND_DEVICE_TYPE_CPU;
        if (t == GGML_BACKEND_DEVICE_TYPE_GPU) {
            // DIRECT: backends known to run kernels on pinned host memory (CUDA: unified addressing; VDEV: host memory)
            const char * reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
            sched->pp_direct_dev[b] = reg != nullptr && (strcmp(reg, "CUDA") == 0 || strcmp(reg, "VDEV") == 0);
            sched->pp_gather[b] = ggml_backend_sched_pp_find_gather(ggml_backend_dev_backend_reg(dev));
            sched->pp_first_gpu = sched->pp_first_gpu < 0 ? b : sched->pp_first_gpu;
        }
        if (t != GGML_BACKEND_DEVICE_TYPE_GPU && t != GGML_BACKEND_DEVICE_TYPE_IGPU) {
            continue;
        }
        n_stages++;
        if (!auto_links) {
            continue;
        }
        ggml_backend_dev_props props;
        ggml_backend_dev_get_props(dev, &props);
        if (props.device_id == nullptr) {
            stage_links.emplace_back(b, "#" + std::to_string(b)); // a link of its own
            continue;
        }
        std::string id = props.device_id;
        const size_t v = id.rfind("-v");
        if (v != std::string::npos && v + 2 < id.size() && id.find_first_not_of("0123456789", v + 2) == std::string::npos) {
            id.resize(v);
        }
        stage_links.emplace_back(b, id);
    }
    if (auto_links) {
        std::unordered_set<std::string> links;
        for (const auto & [b, id] : stage_links) {
            links.insert(id);
        }
        sched->pp_n_links = (int) links.size();
        for (const auto & [b, id] : stage_links) {
            sched->pp_own_link[b] = std::count_if(stage_links.begin(), stage_links.end(),
                                                  [&](const auto & x) { return x.second == id; }) == 1;
        }
    } else {
        // LINKS set: which stage shares which link is not known; own links only if there are as many as stages
        for (int b = 0; b < n_backends; b++) {
            sched->pp_own_link[b] = sched->pp_n_links >= n_stages;
        }
    }
    return n_stages;
}

// the start of a graph's computation: the early input uploads, and what the waits and event records of its
// splits depend on
void ggml_backend_sched_pp_graph_begin(ggml_backend_sched_t sched, ggml_sched_pp_graph * g) {
    ggml_backend_sched_pp_upload_inputs(sched);

    sched->pp_graph_measured = false;
    sched->pp_measure_now    = false;
    sched->pp_graph_seq++;
    for (int b = 0; b < GGML_SCHED_MAX_BACKENDS; b++) {
        sched->pp_gather_pos[b]     = -1;
        sched->pp_gather_pos_mem[b] = -1;
    }
    // (no early upload of an earlier graph is left unwaited: a failed compute drains - ggml_backend_sched_pp_failed)

    g->last_events = sched->n_copies > 1;
    // nothing in flight (everything was synchronized since the last graph, as in decode): the copy slots of
    // this graph are free, and the events of older graphs have completed, so waiting on them is skipped
    g->idle = g->last_events && sched->pp_in_flight == 0;
    for (int b = 0; b < GGML_SCHED_MAX_BACKENDS; b++) {
        g->last_split[b] = -1;
    }
    for (int i = 0; i < sched->n_splits; i++) {
        g->last_split[sched->splits[i].backend_id] = i;
    }
}

// A graph failed part-way (e.g. aborted): splits already submitted may still run, and their events were not all
// recorded (LAST_EVENTS records at a backend's last split). Let them finish, so that the next graph may treat
// nothing as in flight.
enum ggml_status ggml_backend_sched_pp_failed(ggml_backend_sched_t sched, enum ggml_status ec) {
    if (sched->n_copies > 1) {
        ggml_backend_sched_synchronize(sched);
    }
    return ec;
}

size_t ggml_backend_sched_pp_stats_json(ggml_backend_sched_t sched, char * buf, size_t size) {
    GGML_ASSERT(sched);
    const ggml_sched_pp_stats & st = sched->pp;
    std::string out = "{";
    auto num = [&](const char * key, uint64_t v) {
        out += "\"" + std::string(key) + "\":" + std::to_string(v) + ",";
    };
    num("n_copies", sched->n_copies);
    num("n_splits", sched->n_splits);
    num("overlap", sched->pp_cfg.overlap);                // OVERLAP as this scheduler runs it
    num("overlap_dropped", sched->pp_overlap_dropped ? 1 : 0); // ... 0 because its copies did not fit
    num("transient_inputs", st.transient_inputs);
    num("upload_all", st.upload_all);
    num("selective", st.selective);
    num("direct", st.direct);
    num("gather", st.gather);
    num("prefetch", st.prefetch);
    num("chained", st.chained);
    num("id_readbacks", st.id_readbacks);
    num("experts_used", st.experts_used);
    num("experts_total", st.experts_total);
    num("input_host_waits", st.input_host_waits);
    num("input_device_waits", st.input_device_waits);
    num("input_early_uploads", st.input_early_uploads);
    num("input_event_syncs", st.input_event_syncs);
    num("fallback_syncs", st.fallback_syncs);
    num("graphs", st.graphs);
    num("reallocs", st.reallocs);
    num("reallocs_ids_changed", st.reallocs_ids_changed);
    num("plan_switches", st.plan_switches);
    num("plan_switch_drains", st.plan_switch_drains);
    num("offload_owner", st.offload_owner);
    num("layer_major_graphs", st.layer_major_graphs);
    num("layer_major_ubatches", st.layer_major_ubatches);
    num("read_again", st.read_again);
    num("compute_async_us", st.compute_async_us);
    num("alloc_us", st.alloc_us);
    num("synchronize_us", st.synchronize_us);
    num("stage_waits", st.stage_waits);
    num("stage_wait_us", st.stage_wait_us);
    num("stage_copy_us", st.stage_copy_us);
    num("stage_copies", st.stage_copies);
    num("stage_threads", ggml_backend_sched_pp_stage_threads(sched));
    out += "\"host_wait_us\":{";
    for (int w = 0; w < GGML_SCHED_PP_WAIT_COUNT; w++) {
        out += std::string(w ? "," : "") + "\"" + ggml_sched_pp_wait_names[w] + "\":" + std::to_string(st.host_wait_us[w]);
    }
    out += "},\"host_waits\":{";
    for (int w = 0; w < GGML_SCHED_PP_WAIT_COUNT; w++) {
        out += std::string(w ? "," : "") + "\"" + ggml_sched_pp_wait_names[w] + "\":" + std::to_string(st.host_wait_n[w]);
    }
    auto esc = [](const char * c) {
        std::string e;
        for (; *c; c++) {
            if (*c == '"' || *c == '\\') {
                e += '\\';
            }
            e += (unsigned char) *c < 0x20 ? ' ' : *c;
        }
        return "\"" + e + "\"";
    };
    out += "},\"last_realloc\":" + esc(st.last_realloc) + ",\"realloc_log\":[";
    for (int r = 0; r < st.realloc_log_n; r++) {
        out += std::string(r ? "," : "") + esc(st.realloc_log[r]);
    }
    out += "],\"graph_nodes_min\":" + std::to_string(st.graph_nodes_min) +
           ",\"graph_nodes_max\":" + std::to_string(st.graph_nodes_max) +
           ",\"links\":" + std::to_string(sched->pp_n_links);
    out += ",\"backends\":[";
    for (int b = 0; b < sched->n_backends; b++) {
        out += std::string(b ? "," : "") + "{\"name\":\"" + ggml_backend_name(sched->backends[b]) + "\"" +
               ",\"weight_bytes\":" + std::to_string(st.weight_bytes[b]) +
               ",\"weight_uploads\":" + std::to_string(st.weight_uploads[b]) +
               ",\"transient_bytes\":" + std::to_string(st.transient_bytes[b]) +
               ",\"submit_us\":" + std::to_string(st.submit_us[b]) +
               ",\"staged_bytes\":" + std::to_string(st.staged_bytes[b]) +
               ",\"stage_slots\":" + std::to_string(ggml_backend_sched_pp_stage_slots_of(sched, b)) +
               ",\"ring_bytes\":" + std::to_string(ggml_backend_sched_pp_ring_bytes(sched, b)) +
               ",\"overlap_uploads\":" + std::to_string(st.overlap_uploads[b]) +
               ",\"direct_bytes_est\":" + std::to_string(st.direct_bytes_est[b]) +
               ",\"gather_bytes_est\":" + std::to_string(st.gather_bytes_est[b]) +
               ggml_backend_sched_pp_cache_json(sched, b) + "}";
    }
    out += "],\"params\":" + ggml_sched_pp_params_json() + "}";
    if (buf != NULL && size > 0) {
        snprintf(buf, size, "%s", out.c_str());
    }
    return out.size();
}
