// pyllama_pp: how a MUL_MAT_ID on a host expert weight gets its experts on a device - the one decision between
// upload-all, a device gather or prefetch, a direct read, a readback of the routing ids and a copy of the used
// experts (upstream's selective copy, with its counters), the expert cache and the host CPU - and the copy on time.

#include "ggml-backend-pp-impl.h"

#include <algorithm>
#include <vector>

// How an expert op (a MUL_MAT_ID on a host expert weight) gets its weight's experts on a device: the one decision,
// asked at three moments (op.when):
//  - AT_SPLIT (ggml_backend_sched_pp_cache_plan), for an op below op offload's threshold that pass 1 gave to its
//    layer's owner for the expert cache: CACHE where the layer has slots for every expert the batch could use, else
//    HOST_CPU, as where the cache's guard sent the layer to the CPU (an RPC server's op has no CPU path: LATER, its
//    weight copied in); with EXPERT_HYBRID, HYBRID instead of CACHE where the host CPU can compute the layer's FFN
//    for its share of the misses. An op above the threshold runs on a device with a copy, decided at the next two
//    moments.
//  - EARLY (OVERLAP=2, ggml_backend_sched_pp_early_uploads), a split or two before the op's own, for its copy
//    placed early: UPLOAD_ALL, or SELECTIVE by ids read back already, now; GATHER (ids computed) or PREFETCH (ids
//    not yet) on the device's second stream; else LATER.
//  - ON_TIME (ggml_backend_sched_pp_copy_experts), with the inputs of the op's split: what the early path left.
// Besides op it reads the switches (sched->pp_cfg), whether a graph is in flight, the coverage measured so far
// (upload-all's bar) and whether this graph measures it: the first expert op of a graph that started idle reads
// its ids back to measure (pp_measure_now; ggml_backend_sched_pp_measures_here marks the graph where it answers
// true, so each check runs only where those before it passed). The order is the order of preference.
// `op.declined`: a path the caller could not take (the device declined its gather or prefetch, DIRECT had no
// room) - the paths after it are asked.
ggml_sched_pp_path ggml_backend_sched_pp_expert_path(ggml_backend_sched_t sched, const ggml_sched_pp_expert_op & op) {
    if (op.when == GGML_SCHED_PP_AT_SPLIT) {
        // EXPERT_CACHE
        if (!op.cache_fits) {
            return op.cache_fallback_cpu ? GGML_SCHED_PP_PATH_HOST_CPU : GGML_SCHED_PP_PATH_LATER;
        }
        if (op.cache_to_cpu) {
            return GGML_SCHED_PP_PATH_HOST_CPU;
        }
        // EXPERT_HYBRID: the misses split between the link and the host CPU, where the CPU can compute the layer's FFN
        return sched->pp_cfg.expert_hybrid_dev[op.backend_id] > 0 && op.cache_hybrid_fits ? GGML_SCHED_PP_PATH_HYBRID
                                                                                          : GGML_SCHED_PP_PATH_CACHE;
    }
    const bool early = op.when == GGML_SCHED_PP_EARLY;
    const int  b     = op.backend_id;
    // GATHER (and PREFETCH, which needs no ids) may take the op on this device
    auto gather_fits = [&]() {
        return ggml_backend_sched_pp_gather_fits(sched, b, op.input, op.ids, op.transient, /*ids_pending =*/ false);
    };
    // GATHER: the device gathers the used experts by the ids in its memory, computed before; on time the first
    // expert op of a graph that started idle reads its ids back instead, to measure (early, the op before that
    // routes by the same ids was that op)
    auto gather = [&]() {
        return !sched->pp_measure_now && op.ids_ready && gather_fits() &&
               (early || !ggml_backend_sched_pp_measures_here(sched, op.n_sel, op.n_expert));
    };

    if (op.declined == GGML_SCHED_PP_PATH_NONE) {
        if (op.early_done) {
            return GGML_SCHED_PP_PATH_NONE;       // uploaded (or gathered) early
        }
        if (op.read_again) {
            // LAYER_MAJOR: later expert ops read the copy too, with ids of their own (early: its own early upload,
            // ggml_backend_sched_pp_again_uploads)
            return early ? GGML_SCHED_PP_PATH_NONE : GGML_SCHED_PP_PATH_UPLOAD_ALL;
        }
        if (ggml_nelements(op.ids) == 0) {
            return GGML_SCHED_PP_PATH_NONE;       // an empty op
        }
        if (early && op.prefetched) {
            // PREFETCH=2's copy, prefetched two splits early: its rest now, by the ids the op before routes by
            return gather() ? GGML_SCHED_PP_PATH_GATHER : GGML_SCHED_PP_PATH_LATER;
        }
        // UPLOAD_ALL: selections enough (n_sel against the bar, lower while a graph is in flight) and a measured
        // coverage above UPLOAD_ALL_MIN_COV; not asked again on time where the early path asked
        if (!op.early_decided && ggml_backend_sched_pp_upload_all(sched, op.n_sel, op.n_expert)) {
            return GGML_SCHED_PP_PATH_UPLOAD_ALL;
        }
        // the ids are on the host already (an op before read them back): the selective copy without a readback
        if (op.ids_read && ggml_backend_sched_pp_selective_if_read(sched, b)) {
            return GGML_SCHED_PP_PATH_SELECTIVE;
        }
        if (gather()) {
            return GGML_SCHED_PP_PATH_GATHER;
        }
        // PREFETCH: ids not computed yet - the experts this weight used last time now, the rest on time (not where
        // the op will read its ids back to measure)
        if (early && !sched->pp_measure_now && ggml_backend_sched_pp_prefetch_possible(sched, b) &&
            !ggml_backend_sched_pp_would_measure(sched, op.n_sel, op.n_expert) && gather_fits()) {
            return GGML_SCHED_PP_PATH_PREFETCH;
        }
    }
    if (early) {
        return GGML_SCHED_PP_PATH_LATER;
    }
    // DIRECT: the kernel reads the used experts from pinned host memory (not where the op measures)
    if (op.declined != GGML_SCHED_PP_PATH_DIRECT &&
        ggml_backend_sched_pp_direct_fits(sched, b, op.input, op.transient, op.n_sel, op.n_expert) &&
        !ggml_backend_sched_pp_measures_here(sched, op.n_sel, op.n_expert)) {
        return GGML_SCHED_PP_PATH_DIRECT;
    }
    // upstream's selective copy: the ids read back (where they are not on the host yet), the used experts copied
    return GGML_SCHED_PP_PATH_SELECTIVE;
}

// Whether an op whose ids are on the host already takes the selective copy: unless DIRECT may take it (a device
// without a gather), which decides only on time (it measures). OVERLAP=2 places such a copy early
// (ggml_backend_sched_pp_find_early_copies) only where this holds: elsewhere its early place would cost memory for
// nothing.
bool ggml_backend_sched_pp_selective_if_read(ggml_backend_sched_t sched, int backend_id) {
    return ggml_backend_sched_pp_gather_possible(sched, backend_id) || !ggml_backend_sched_pp_direct_possible(sched, backend_id);
}

// the selective copy's readback: the routing ids read back on the host (a sync that waits for everything queued
// on ids_backend), the experts they use into g->used_ids, and the coverage measured
static void ggml_backend_sched_pp_read_ids(ggml_backend_sched_t sched, ggml_sched_pp_graph * g, ggml_tensor * ids_tensor,
                                           ggml_backend_t ids_backend, int64_t n_expert) {
    std::vector<int32_t> & ids = g->ids;
    std::vector<ggml_bitset_t> & used_ids = g->used_ids;
    ids.resize(ggml_nbytes(ids_tensor) / sizeof(int32_t));
    {
        GGML_SCHED_PP_WAIT(sched, GGML_SCHED_PP_WAIT_IDS);
        ggml_backend_tensor_get_async(ids_backend, ids_tensor, ids.data(), 0, ggml_nbytes(ids_tensor));
        ggml_backend_synchronize(ids_backend);
    }
    sched->pp.id_readbacks++;

    // find the used experts
    used_ids.clear();
    used_ids.resize(ggml_bitset_size(n_expert));
    for (int64_t i1 = 0; i1 < ids_tensor->ne[1]; i1++) {
        for (int64_t i0 = 0; i0 < ids_tensor->ne[0]; i0++) {
            int32_t id = ids[i1 * ids_tensor->nb[1]/sizeof(int32_t) + i0 * ids_tensor->nb[0]/sizeof(int32_t)];
            GGML_ASSERT(id >= 0 && id < n_expert);
            ggml_bitset_set(used_ids.data(), id);
        }
    }

    g->prev_ids_tensor = ids_tensor;
    sched->pp_measure_now = false;

    int64_t n_used = 0;
    for (int64_t e = 0; e < n_expert; e++) {
        n_used += ggml_bitset_get(used_ids.data(), e) ? 1 : 0;
    }
    sched->pp.experts_used  += n_used;
    sched->pp.experts_total += n_expert;
    // coverage grows with the ubatch: only ubatches that could upload all count (the one-row
    // last layer of a prompt's output ubatch would otherwise pull the estimate down, and the
    // next prompt would read ids back layer after layer until it recovers)
    if (ids_tensor->ne[0] * ids_tensor->ne[1] >= ggml_backend_sched_pp_measure_min(sched, n_expert)) {
        const double cov = (double) n_used / (double) n_expert;
        sched->pp_cov_ema = sched->pp_cov_ema < 0 ? cov : 0.5*sched->pp_cov_ema + 0.5*cov;
        sched->pp_graph_measured = true;
    }
}

// the experts a MUL_MAT_ID reads from a host weight (split input input_id of split split_id), on time: by the path
// ggml_backend_sched_pp_expert_path chooses (upstream's selective copy, with its counters, is the last)
void ggml_backend_sched_pp_copy_experts(ggml_backend_sched_t sched, ggml_sched_pp_graph * g, int split_id, int input_id,
                                        ggml_backend_t input_backend, ggml_sched_pp_direct_swap * direct) {
    struct ggml_backend_sched_split * split = &sched->splits[split_id];
    const int split_backend_id = split->backend_id;
    ggml_backend_t split_backend = sched->backends[split_backend_id];
    struct ggml_tensor * input = split->inputs[input_id];
    struct ggml_tensor * input_cpy = tensor_copy(input, split_backend_id, sched->cur_copy);
    ggml_tensor * node = split->graph.nodes[0];
    const bool transient = ggml_backend_sched_pp_is_transient_copy(sched, input_cpy);

    const int64_t n_expert   = node->op == GGML_OP_MUL_MAT_ID ? input->ne[2] : input->ne[1];
    const size_t expert_size = node->op == GGML_OP_MUL_MAT_ID ? input->nb[2] : input->nb[1];

    ggml_backend_synchronize(input_backend);

    ggml_tensor * ids_tensor = node->src[2];
    ggml_backend_t ids_backend = split_backend;

    // if the ids tensor is also an input of the split, it may not have been copied yet to the split backend
    // in that case, we use the original ids tensor (and GATHER, which needs the ids on the device first, cannot)
    int ids_input = -1;
    for (int i = input_id + 1; i < split->n_inputs && ids_input < 0; i++) {
        if (ids_tensor == tensor_copy(split->inputs[i], split_backend_id, sched->cur_copy)) {
            ids_input = i;
        }
    }

    const auto early_it = g->early_decided.find(input_cpy);
    ggml_sched_pp_expert_op op(GGML_SCHED_PP_ON_TIME, split_backend_id, input, ids_tensor, n_expert);
    op.transient     = transient;
    op.read_again    = ggml_backend_sched_pp_read_again(sched, input);
    op.ids_read      = ids_tensor == g->prev_ids_tensor;
    op.ids_ready     = ids_input < 0;
    op.early_decided = early_it != g->early_decided.end();
    op.early_done    = op.early_decided && early_it->second; // (counted where it went up)
    op.prefetched    = g->prefetched.count(input_cpy) > 0;

    ggml_sched_pp_path path = ggml_backend_sched_pp_expert_path(sched, op);
    if (path == GGML_SCHED_PP_PATH_NONE) {
        return;
    }
    // PREFETCH: whatever fills the rest of this copy on this stream (a gather, a readback's selective
    // copy) goes after the prefetch (on the device's second stream) - no two writers at once
    if (op.prefetched) {
        ggml_backend_sched_pp_early_wait(sched, split_backend_id, split_backend, input_cpy);
    }
    for (;; op.declined = path, path = ggml_backend_sched_pp_expert_path(sched, op)) {
        if (path == GGML_SCHED_PP_PATH_UPLOAD_ALL) {
            ggml_backend_sched_pp_upload_whole(sched, split_backend_id, input, input_cpy, transient, nullptr);
            sched->pp.upload_all++;
            return;
        }
        if (path == GGML_SCHED_PP_PATH_GATHER) {
            // on the split backend's stream, queued after everything on it so far: the splits before this one
            if (ggml_backend_sched_pp_gather(sched, split_backend_id, split_backend, input, input_cpy, ids_tensor,
                                             op.prefetched ? GGML_BACKEND_PP_GATHER_REST : GGML_BACKEND_PP_GATHER_USED)) {
                sched->pp_gather_pos[split_backend_id] = std::max(sched->pp_gather_pos[split_backend_id], split_id);
                return;
            }
            continue;
        }
        if (path == GGML_SCHED_PP_PATH_DIRECT) {
            if (direct->add(input_cpy, input)) {
                sched->pp.direct++;
                sched->pp.direct_bytes_est[split_backend_id] += (uint64_t) (ggml_backend_sched_pp_coverage(sched) * (double) ggml_nbytes(input));
                return;
            }
            continue;
        }
        GGML_ASSERT(path == GGML_SCHED_PP_PATH_SELECTIVE);
        break;
    }

    if (ids_input >= 0) {
        ids_tensor = split->inputs[ids_input];
        ids_backend = ggml_backend_sched_get_tensor_backend(sched, split->inputs[ids_input]);
    }

    if (ids_tensor != g->prev_ids_tensor) {
        ggml_backend_sched_pp_read_ids(sched, g, ids_tensor, ids_backend, n_expert);
    }
    ggml_backend_sched_pp_copy_used_experts(sched, split_backend_id, input, input_cpy, g->used_ids, n_expert,
                                            expert_size, transient, nullptr);
}

// a whole host weight uploaded into its copy, counted (via: an OVERLAP upload stream, or nullptr: the split backend)
void ggml_backend_sched_pp_upload_whole(ggml_backend_sched_t sched, int backend_id, ggml_tensor * input,
                                        ggml_tensor * input_cpy, bool transient, ggml_backend_t via) {
    {
        GGML_SCHED_PP_WAIT(sched, GGML_SCHED_PP_WAIT_UPLOAD);
        ggml_backend_sched_pp_upload(sched, backend_id, input, input_cpy, input->data, 0, ggml_nbytes(input), via);
    }
    sched->pp.weight_bytes[backend_id] += ggml_nbytes(input);
    sched->pp.weight_uploads[backend_id]++;
    if (transient) {
        sched->pp.transient_bytes[backend_id] += ggml_nbytes(input);
    }
    sched->pp.read_again += ggml_backend_sched_pp_read_again(sched, input) ? 1 : 0;
}

// the selective copy: the experts the routing ids use, grouped into runs of consecutive ids, uploaded into the
// copy (via: OVERLAP's upload stream, or nullptr: the split backend's own)
void ggml_backend_sched_pp_copy_used_experts(ggml_backend_sched_t sched, int backend_id, ggml_tensor * input,
                                             ggml_tensor * input_cpy, const std::vector<ggml_bitset_t> & used_ids,
                                             int64_t n_expert, size_t expert_size, bool transient, ggml_backend_t via) {
    GGML_ASSERT((size_t) ggml_bitset_size(n_expert) <= used_ids.size());
    sched->pp.selective++;
    sched->pp.weight_uploads[backend_id]++;

    // group consecutive experts and copy them together
    auto copy_experts = [&](int32_t first_id, int32_t last_id) {
        const size_t expert_offset = first_id * expert_size;
        const size_t expert_size_copy =  (last_id - first_id + 1) * expert_size;
        const size_t padding = std::min<size_t>(expert_size, 512);
        const size_t padding_end = last_id < n_expert - 1 ? padding : 0;

        GGML_SCHED_PP_WAIT(sched, GGML_SCHED_PP_WAIT_UPLOAD);
        ggml_backend_sched_pp_upload(sched, backend_id, input,
            input_cpy,
            (const uint8_t *)input->data + expert_offset, expert_offset,
            // copy a bit extra at the to ensure there are no NaNs in the padding of the last expert
            // this is necessary for MMQ in the CUDA backend
            expert_size_copy + padding_end, via);
        sched->pp.weight_bytes[backend_id] += expert_size_copy + padding_end;
        if (transient) {
            sched->pp.transient_bytes[backend_id] += expert_size_copy + padding_end;
        }
    };

    int id = 0;
    while (!ggml_bitset_get(used_ids.data(), id)) {
        id++;
    }
    int32_t first_id = id;
    int32_t last_id = first_id;

    for (++id; id < n_expert; ++id) {
        if (!ggml_bitset_get(used_ids.data(), id)) {
            continue;
        }

        if (id == last_id + 1) {
            last_id = id;
            continue;
        }

        copy_experts(first_id, last_id);

        first_id = id;
        last_id = id;
    }
    copy_experts(first_id, last_id);
}
