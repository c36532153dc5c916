// pyllama_pp: UPLOAD_ALL - whole host expert tensors uploaded above a coverage bar instead of a readback of the
// routing ids; the coverage those readbacks measure.

#include "ggml-backend-pp-impl.h"

#include <algorithm>

// expert selections (tokens x experts used) of a MUL_MAT_ID from which all experts are uploaded
int64_t ggml_backend_sched_pp_upload_all_min(ggml_backend_sched_t sched, bool in_flight, int64_t n_expert) {
    const int64_t min_sel = sched->pp_cfg.upload_all_min;
    return min_sel < 0 ? (in_flight ? 2 : 4) * n_expert : min_sel;
}

// the coverage measured so far, or all experts when nothing is measured yet (DIRECT's estimates)
double ggml_backend_sched_pp_coverage(ggml_backend_sched_t sched) {
    return sched->pp_cov_ema > 0 ? sched->pp_cov_ema : 1.0;
}

// the smallest selection whose measured coverage counts: one that could upload all (a one-row layer says little)
int64_t ggml_backend_sched_pp_measure_min(ggml_backend_sched_t sched, int64_t n_expert) {
    return std::max<int64_t>(n_expert, std::min(ggml_backend_sched_pp_upload_all_min(sched, false, n_expert),
                                                ggml_backend_sched_pp_upload_all_min(sched, true,  n_expert)));
}

// Whether to upload a whole host expert tensor instead of reading the routing ids (a host sync that
// drains the device, including a graph still in flight) and copying only the used experts.
// n_sel = tokens x experts used per token. Upload-all moves every expert, so it only pays when most
// experts are used: it is chosen at or above a threshold (lower while a previous graph is in flight,
// where the readback costs most) and only while the coverage measured by recent readbacks is high;
// one readback re-measures the coverage in every graph that starts with nothing in flight.
bool ggml_backend_sched_pp_upload_all(ggml_backend_sched_t sched, int64_t n_sel, int64_t n_expert) {
    if (sched->pp_cfg.upload_all == 0) {
        return false;
    }
    const bool in_flight = sched->pp_in_flight > 0;
    if (n_sel < ggml_backend_sched_pp_upload_all_min(sched, in_flight, n_expert)) {
        return false;
    }
    int64_t min_cov = sched->pp_cfg.upload_all_min_cov;
    if (min_cov < 0) {
        // auto: the selective copy reads ids back on the host layer by layer, so the pipeline stages do not
        // overlap and it costs about coverage x (sum of the stages); uploading all overlaps them and costs
        // about the slowest stage - if the stages upload over links of their own. Upload-all breaks even
        // near 1 / links: a margin above that. One shared link: 85%.
        min_cov = std::min<int64_t>(85, std::max<int64_t>(30, 110 / std::max(1, sched->pp_n_links)));
    }
    if (min_cov > 0) {
        if (sched->pp_cov_ema < 0 || sched->pp_cov_ema * 100.0 < (double) min_cov) {
            return false; // coverage unknown or low: the selective copy moves fewer bytes (and measures it)
        }
        // re-measure now and then with one readback, at the first upload-all decision of a graph that started
        // with nothing in flight: there the readback waits only for that
        // layer's own work. Anywhere later it would wait for every upload queued ahead of it, i.e. drain the
        // pipeline. At most once a graph: a graph that already read ids back has measured.
        if (sched->pp_in_flight == 0 && !sched->pp_graph_measured) { // the graph started with nothing in flight
            sched->pp_graph_measured = true;
            sched->pp_measure_now = true; // the selective copy, not DIRECT
            return false;
        }
    }
    return true;
}

// DIRECT and GATHER, which read no ids back: whether this expert op is to read them back instead, to measure the
// coverage - the first expert op of an idle graph, where the measurement counts (the coverage of a small selection
// says little about a prompt's). True also marks the graph as measuring (the selective copy clears it).
bool ggml_backend_sched_pp_would_measure(ggml_backend_sched_t sched, int64_t n_sel, int64_t n_expert) {
    return sched->pp_in_flight == 0 && !sched->pp_graph_measured && n_sel >= ggml_backend_sched_pp_measure_min(sched, n_expert);
}

bool ggml_backend_sched_pp_measures_here(ggml_backend_sched_t sched, int64_t n_sel, int64_t n_expert) {
    if (ggml_backend_sched_pp_would_measure(sched, n_sel, n_expert)) {
        sched->pp_graph_measured = true;
        sched->pp_measure_now    = true;
        return true;
    }
    return false;
}
