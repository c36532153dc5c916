// pyllama_pp: the copy of a host expert tensor that a MUL_MAT_ID reads (upstream's selective copy, with its
// counters): which mechanism moves its bytes - upload-all, a device gather, a direct read, or a readback of the
// routing ids and a copy of the used experts.

#include "ggml-backend-pp-impl.h"

#include <algorithm>
#include <vector>

// the experts a MUL_MAT_ID reads from a host weight (split input input_id of split split_id): only the used ones
// are uploaded (upstream's selective copy, with its counters)
void ggml_backend_sched_pp_copy_experts(ggml_backend_sched_t sched, ggml_sched_pp_graph * g, int split_id, int input_id,
                                        ggml_backend_t input_backend, ggml_sched_pp_direct_swap * direct) {
    struct ggml_backend_sched_split * split = &sched->splits[split_id];
    const int split_backend_id = split->backend_id;
    ggml_backend_t split_backend = sched->backends[split_backend_id];
    struct ggml_tensor * input = split->inputs[input_id];
    struct ggml_tensor * input_cpy = tensor_copy(input, split_backend_id, sched->cur_copy);
    ggml_tensor * node = split->graph.nodes[0];
    ggml_tensor * & prev_ids_tensor = g->prev_ids_tensor;
    std::vector<int32_t> & ids = g->ids;
    std::vector<ggml_bitset_t> & used_ids = g->used_ids;
    const bool transient = ggml_backend_sched_pp_is_transient_copy(sched, input_cpy);

    const int64_t n_expert   = node->op == GGML_OP_MUL_MAT_ID ? input->ne[2] : input->ne[1];
    const size_t expert_size = node->op == GGML_OP_MUL_MAT_ID ? input->nb[2] : input->nb[1];

    ggml_backend_synchronize(input_backend);

    const auto early_it = g->early_decided.find(input_cpy);
    if (early_it != g->early_decided.end() && early_it->second) {
        return; // uploaded while the split before computed (OVERLAP=2), counted there
    }

    // LAYER_MAJOR: later expert ops read this copy too (with ids of their own, maybe where this op has none)
    if (ggml_backend_sched_pp_read_again(sched, input)) {
        ggml_backend_sched_pp_upload_whole(sched, split_backend_id, input, input_cpy, transient, nullptr);
        sched->pp.upload_all++;
        return;
    }

    // get the ids
    ggml_tensor * ids_tensor = node->src[2];
    ggml_backend_t ids_backend = split_backend;

    if (ggml_nelements(ids_tensor) == 0) {
        return;
    }

    // PREFETCH: whatever fills the rest of this copy on this stream (a gather, a readback's selective
    // copy) goes after the prefetch (on the device's second stream) - no two writers at once
    const bool rest = g->prefetched.count(input_cpy) > 0;
    if (rest) {
        ggml_backend_sched_pp_early_wait(sched, split_backend_id, split_backend, input_cpy);
    }
    if (early_it == g->early_decided.end() &&
        ggml_backend_sched_pp_upload_all(sched, ids_tensor->ne[0] * ids_tensor->ne[1], n_expert)) {
        ggml_backend_sched_pp_upload_whole(sched, split_backend_id, input, input_cpy, transient, nullptr);
        sched->pp.upload_all++;
        return;
    }

    // if the ids tensor is also an input of the split, it may not have been copied yet to the split backend
    // in that case, we use the original ids tensor (below: GATHER needs the ids on the device first)
    int ids_input = -1;
    for (int i = input_id + 1; i < split->n_inputs && ids_input < 0; i++) {
        if (ids_tensor == tensor_copy(split->inputs[i], split_backend_id, sched->cur_copy)) {
            ids_input = i;
        }
    }

    // GATHER: the device copies the experts the ids select itself, on the split backend's stream; ids an
    // op before read back (the measuring op's, for up and down) go on to the selective copy, with no
    // readback (as OVERLAP=2's early copies do)
    if (!sched->pp_measure_now && ids_tensor != prev_ids_tensor &&
        ggml_backend_sched_pp_gather_fits(sched, split_backend_id, input, ids_tensor, transient, ids_input >= 0) &&
        !ggml_backend_sched_pp_measures_here(sched, ids_tensor->ne[0] * ids_tensor->ne[1], n_expert)) {
        if (ggml_backend_sched_pp_gather(sched, split_backend_id, split_backend, input, input_cpy, ids_tensor,
                                         rest ? GGML_BACKEND_PP_GATHER_REST : GGML_BACKEND_PP_GATHER_USED)) {
            // (queued after everything on the split's stream so far: the splits before this one)
            sched->pp_gather_pos[split_backend_id] = std::max(sched->pp_gather_pos[split_backend_id], split_id);
            return;
        }
    }

    // (where a gather exists, ids already on the host go to the selective copy, DIRECT or not)
    if (!(ids_tensor == prev_ids_tensor && ggml_backend_sched_pp_gather_possible(sched, split_backend_id)) &&
        ggml_backend_sched_pp_direct(sched, split_backend_id, input, transient,
                                     ids_tensor->ne[0] * ids_tensor->ne[1], n_expert) &&
        direct->add(input_cpy, input)) {
        sched->pp.direct++;
        sched->pp.direct_bytes_est[split_backend_id] += (uint64_t) (ggml_backend_sched_pp_coverage(sched) * (double) ggml_nbytes(input));
        return;
    }

    if (ids_input >= 0) {
        ids_tensor = split->inputs[ids_input];
        ids_backend = ggml_backend_sched_get_tensor_backend(sched, split->inputs[ids_input]);
    }

    if (ids_tensor != prev_ids_tensor) {
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

        prev_ids_tensor = ids_tensor;
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
    ggml_backend_sched_pp_copy_used_experts(sched, split_backend_id, input, input_cpy, used_ids, n_expert,
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
