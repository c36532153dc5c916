// pyllama_pp: OVERLAP=2 - the next split's expert copy goes up on a second stream of the GPU while the split
// before computes (with GATHER and PREFETCH: the device's gathers and prefetches there).

#include "ggml-backend-pp-impl.h"

#include <assert.h>
#include <algorithm>
#include <functional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// OVERLAP=2: how many splits early a split-input copy is placed and uploaded (0: with its own split)
int ggml_backend_sched_pp_early_lead(ggml_backend_sched_t sched, const struct ggml_tensor * input_cpy) {
    const std::unordered_map<const ggml_tensor *, int> & early = *sched->pp_early_copies;
    if (early.empty()) {
        return 0;
    }
    const auto it = early.find(input_cpy);
    return it == early.end() ? 0 : it->second;
}

// OVERLAP=2 (and PREFETCH=2, two splits ahead): adds the early copies of the splits after split i to the scheduler's graph copy before split i's own
// inputs, so ggml-alloc keeps their memory apart from everything split i uses (as upstream adds a split's inputs)
void ggml_backend_sched_pp_add_early_inputs(ggml_backend_sched_t sched, int i) {
    struct ggml_cgraph * graph_copy = &sched->graph;
    ggml_backend_sched_pp_add_again_inputs(sched, i); // (LAYER_MAJOR's, placed a layer early)
    for (int lead = 1; lead <= 2; lead++) {
        if (i + lead >= sched->n_splits) {
            break;
        }
        const struct ggml_backend_sched_split * owner = &sched->splits[i + lead];
        for (int j = 0; j < owner->n_inputs; j++) {
            struct ggml_tensor * input = owner->inputs[j];
            const size_t input_id = hash_id(input);
            struct ggml_tensor * input_cpy = tensor_id_copy(input_id, owner->backend_id, sched->cur_copy);
            if (ggml_backend_sched_pp_early_lead(sched, input_cpy) != lead || ggml_backend_sched_pp_read_again(sched, input)) {
                continue; // not an early copy of that split (or LAYER_MAJOR's)
            }
            assert(graph_copy->size > (graph_copy->n_nodes + 1));

            // a dependency to the input source so that it is not freed before the copy is done
            struct ggml_tensor * input_dep = ggml_view_tensor(sched->ctx, input);
            input_dep->src[0] = input;
            sched->node_backend_ids[graph_copy->n_nodes] = sched->hv_tensor_backend_ids[input_id];
            graph_copy->nodes[graph_copy->n_nodes++] = input_dep;

            // a dependency to the input copy so that it is allocated here
            sched->node_backend_ids[graph_copy->n_nodes] = owner->backend_id;
            graph_copy->nodes[graph_copy->n_nodes++] = input_cpy;
        }
    }
}

// OVERLAP=2 (on by default) needs one more expert copy in the compute buffers: where the device has no room for it
// (a placement planned without it), this scheduler runs without early copies rather than fail - the caller's next
// fallback would be to give up pipelining altogether. The allocator starts over, so no buffer keeps the size of
// the attempt that failed. Returns whether the reservation without them succeeded (false: none to drop).
bool ggml_backend_sched_pp_reserve_without_early(ggml_backend_sched_t sched, struct ggml_cgraph * measure_graph) {
    if (sched->pp_early_copies == nullptr || sched->pp_early_copies->empty()) {
        return false;
    }
    GGML_LOG_WARN("%s: no room for OVERLAP=2's early expert copies in the compute buffers; "
                  "continuing without them (plan them with fit, or set GGML_SCHED_PP_OVERLAP=0)\n", "ggml_backend_sched_reserve");
    sched->pp_cfg.overlap = 0;
    sched->pp_overlap_dropped = true;
    ggml_gallocr_free(sched->galloc);
    sched->galloc = ggml_gallocr_new_n(sched->bufts, sched->n_backends);
    ggml_gallocr_pp_keep_plans(sched->galloc, 4);
    ggml_backend_sched_reset(sched);
    ggml_backend_sched_split_graph(sched, measure_graph);
    ggml_backend_sched_pp_find_shared_copies(sched);
    ggml_backend_sched_pp_ring_assign(sched);
    return ggml_gallocr_reserve_n(sched->galloc, &sched->graph, sched->node_backend_ids, sched->leaf_backend_ids);
}

static bool ggml_backend_sched_pp_read_only_by(const std::unordered_map<const ggml_tensor *, int> & reader,
                                              const ggml_tensor * t, int split_id) {
    const auto it = reader.find(t);
    return it != reader.end() && it->second == split_id;
}

// OVERLAP=2: the transient copy of a pinned host expert tensor that split i+1 reads first (its MUL_MAT_ID), where
// split i runs on the same GPU and no other split reads that copy. ggml-alloc places it before split i's nodes
// (split_graph), so its memory is apart from everything split i uses; while split i computes, a second stream of
// the device uploads it - a whole tensor, or a selective copy whose routing ids split i's own expert op already
// read back (other selective copies need ids that split i computes) - after an event on the compute stream behind
// everything queued before split i, i.e. after the last use of whatever that memory held before. No memory outside
// the compute buffers.
void ggml_backend_sched_pp_find_early_copies(ggml_backend_sched_t sched, struct ggml_cgraph * graph) {
    if (sched->pp_early_copies == nullptr) {
        sched->pp_early_copies = new std::unordered_map<const ggml_tensor *, int>();
    }
    std::unordered_map<const ggml_tensor *, int> & early = *sched->pp_early_copies;
    early.clear();
    sched->pp_prefetch2_graph = false;
    if (sched->n_copies < 2 || sched->pp_cfg.overlap != 2) {
        return;
    }
    const bool upload_all = sched->pp_cfg.upload_all != 0;
    // the split whose nodes read each tensor, or -1 when several do (a copy read again later must live until then);
    // and the graph's largest expert selection (tokens x experts used): the ubatch's. Placement follows it, not
    // each op's own: the last layer of an ubatch with outputs reads n_outputs rows, 0 in one without, so a
    // decision per op would order the copies of two graphs of one shape differently - two allocation plans, and a
    // plan switch (which drains the pipeline) at every prompt's last ubatch
    std::unordered_map<const ggml_tensor *, int> reader;
    int64_t n_sel_graph = 0;
    int64_t n_tokens_graph = 0; // (the ubatch's: the tokens the graph's largest expert op routes)
    for (int i = 0; i < sched->n_splits; i++) {
        const ggml_backend_sched_split * split = &sched->splits[i];
        for (int n = split->i_start; n < split->i_end; n++) {
            if (graph->nodes[n]->op == GGML_OP_MUL_MAT_ID) {
                n_sel_graph = std::max(n_sel_graph, graph->nodes[n]->src[2]->ne[0] * graph->nodes[n]->src[2]->ne[1]);
                n_tokens_graph = std::max(n_tokens_graph, graph->nodes[n]->src[2]->ne[1]);
            }
            for (int k = 0; k < GGML_MAX_SRC; k++) {
                const ggml_tensor * src = graph->nodes[n]->src[k];
                if (src != nullptr) {
                    auto it = reader.find(src);
                    if (it == reader.end()) {
                        reader[src] = i;
                    } else if (it->second != i) {
                        it->second = -1;
                    }
                }
            }
        }
    }
    // PREFETCH=2 pays where the link would wait for the router (large ubatches); below, where the link is busy
    // already, its mispredicted up experts only cost: PREFETCH=1 there
    sched->pp_prefetch2_graph = n_tokens_graph >= sched->pp_cfg.prefetch2_min_tokens;
    for (int i = 0; i + 1 < sched->n_splits; i++) {
        const ggml_backend_sched_split * split = &sched->splits[i + 1];
        const int b = split->backend_id;
        ggml_backend_dev_t dev = ggml_backend_get_device(sched->backends[b]);
        if (sched->splits[i].backend_id != b || dev == nullptr || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU ||
            split->i_start >= split->i_end) {
            continue;
        }
        const ggml_tensor * node = graph->nodes[split->i_start];
        // a selective copy goes up early only with the ids the split before read back, and not where DIRECT may
        // take the op (ggml_backend_sched_pp_selective_if_read)
        const ggml_tensor * prev = sched->splits[i].i_start < sched->splits[i].i_end ? graph->nodes[sched->splits[i].i_start] : nullptr;
        const bool same_ids = prev != nullptr && prev->op == GGML_OP_MUL_MAT_ID && node->op == GGML_OP_MUL_MAT_ID &&
                              prev->src[2] == node->src[2] && ggml_backend_sched_pp_selective_if_read(sched, b);
        // PREFETCH: a layer's first expert op (its ids are computed in the split before; not the same as its op's)
        const bool prefetch = !same_ids && node->op == GGML_OP_MUL_MAT_ID && ggml_backend_sched_pp_prefetch_possible(sched, b);
        // PREFETCH=2: an expert op routed as the split before's (up, down) goes two splits early, where split i-1
        // runs on the same GPU: up is prefetched beside the gate's prefetch and gathers its rest beside the gate,
        // down is gathered beside the gate
        const ggml_tensor * prev2 = i >= 1 && sched->splits[i - 1].backend_id == b && sched->splits[i - 1].i_start < sched->splits[i - 1].i_end ?
                                    graph->nodes[sched->splits[i - 1].i_start] : nullptr;
        // (placed so by the setting, not by whether PREFETCH=2 acts on this graph: graphs of a prompt whose last
        // ubatch is below PREFETCH2_MIN_TOKENS keep one layout - another would switch plans and drain the pipeline)
        const bool lead2 = prev2 != nullptr && prev != nullptr && prev->op == GGML_OP_MUL_MAT_ID && node->op == GGML_OP_MUL_MAT_ID &&
                           prev->src[2] == node->src[2] && ggml_backend_sched_pp_prefetch2_on(sched, b);
        for (int j = 0; j < split->n_inputs; j++) {
            ggml_tensor * input = split->inputs[j];
            const ggml_tensor * cpy = tensor_id_copy(hash_id(input), b, sched->cur_copy);
            if (ggml_backend_sched_pp_read_again(sched, input)) {
                // LAYER_MAJOR: a copy that later splits read too, placed where its layer's copies go up
                if (ggml_backend_sched_pp_is_expert_copy(sched, node, cpy) && input->buffer != nullptr &&
                    (ggml_backend_sched_pp_buffer_is_pinned(sched, input->buffer) || ggml_backend_sched_pp_stages(sched, b, input))) {
                    early[cpy] = ggml_backend_sched_pp_again_lead(sched, i + 1, input);
                }
                continue;
            }
            // (only where the copy can go up early: an upload-all, so an ubatch whose selections could reach the
            // lower upload-all bar, or a selective copy with the ids the split before already read back - the same
            // routing as its own expert op (up and down after gate); elsewhere placing it early only costs memory)
            // (PREFETCH's copies only from pinned memory: its gathers read host memory; a pageable weight goes up
            // through the staging slots, one split early)
            const bool whole = upload_all && n_sel_graph >= ggml_backend_sched_pp_upload_all_min(sched, true, input->ne[2]);
            const bool pinned = input->buffer != nullptr && ggml_backend_sched_pp_buffer_is_pinned(sched, input->buffer);
            if (ggml_backend_sched_pp_is_expert_copy(sched, node, cpy) && input->buffer != nullptr &&
                ((pinned && (lead2 || same_ids || prefetch || whole)) ||
                 (!pinned && (same_ids || whole) && ggml_backend_sched_pp_stages(sched, b, input))) &&
                ggml_backend_sched_pp_read_only_by(reader, cpy, i + 1)) {
                early[cpy] = pinned && lead2 ? 2 : 1;
            }
        }
    }
}

// OVERLAP=2: the transient expert copies of a graph (the weight of a split's first MUL_MAT_ID) are pooled in
// ggml-alloc: each is allocated with the size of its class - classes formed from the largest size down, each
// taking the sizes within 1% below it - so a copy placed early fits the block another copy of its class freed.
// CUDA pads a down projection's rows (768 values, not a multiple of 512) by one step but not a gate's or an up's;
// without pooling each down copy took fresh memory, and the compute buffers grew by far more than the one
// expert copy overlapping needs. Classes, not one pool: mixed quantizations (Q4_K_M keeps some down projections in Q6_K) pool within each
// type. Without early copies nothing is pooled.
void ggml_backend_sched_pp_pool_copies(ggml_backend_sched_t sched, struct ggml_cgraph * graph) {
    std::vector<size_t> sizes; // of the flagged copies
    if (sched->pp_early_copies != nullptr && !sched->pp_early_copies->empty()) {
        for (int i = 0; i < sched->n_splits; i++) {
            const ggml_backend_sched_split * split = &sched->splits[i];
            if (split->i_start >= split->i_end) {
                continue;
            }
            const ggml_tensor * node = graph->nodes[split->i_start];
            for (int j = 0; j < split->n_inputs; j++) {
                // (a transient copy is one tensor for every copy slot)
                ggml_tensor * cpy = tensor_id_copy(hash_id(split->inputs[j]), split->backend_id, sched->cur_copy);
                if (ggml_backend_sched_pp_is_expert_copy(sched, node, cpy)) {
                    cpy->flags |= GGML_TENSOR_FLAG_PP_POOLED; // a flagged size in no class stays as it is
                    sizes.push_back(ggml_backend_buft_get_alloc_size(sched->bufts[split->backend_id], cpy));
                }
            }
        }
    }
    std::sort(sizes.begin(), sizes.end(), std::greater<size_t>());
    std::vector<size_t> classes;
    for (size_t size : sizes) {
        if (classes.empty() || size < classes.back() - classes.back() / 100) {   // (the allocator keeps the first classes)
            classes.push_back(size);
        }
    }
    ggml_gallocr_pp_set_pool_sizes(sched->galloc, classes.data(), (int) classes.size());
}

// OVERLAP=2: record, on the upload stream, the event the split reading `cpy` waits for (behind what was queued
// for it so far: a prefetch and its rest share one); false where no event can be had (nothing recorded)
static bool ggml_backend_sched_pp_early_ready(ggml_backend_sched_t sched, int backend_id, ggml_sched_pp_early * e,
                                              const ggml_tensor * cpy) {
    auto it = e->ready.find(cpy);
    ggml_backend_event_t ev = it != e->ready.end() ? it->second : nullptr;
    if (ev == nullptr) {
        if (!e->spare.empty()) {
            ev = e->spare.back();
            e->spare.pop_back();
        } else if ((ev = ggml_backend_event_new(ggml_backend_get_device(sched->backends[backend_id]))) == nullptr) {
            return false;
        }
        e->ready[cpy] = ev;
    }
    ggml_backend_event_record(ev, e->up);
    return true;
}

// OVERLAP=2: the split waits for the early uploads of its own inputs
void ggml_backend_sched_pp_early_wait_split(ggml_backend_sched_t sched, const ggml_backend_sched_split * split) {
    ggml_sched_pp_early * e = sched->pp_early[split->backend_id];
    if (e == nullptr || e->ready.empty()) {
        return;
    }
    for (int j = 0; j < split->n_inputs; j++) {
        ggml_backend_sched_pp_early_wait(sched, split->backend_id, sched->backends[split->backend_id],
                                         tensor_copy(split->inputs[j], split->backend_id, sched->cur_copy));
    }
}

void ggml_backend_sched_pp_early_free(ggml_backend_sched_t sched) {
    for (int b = 0; b < GGML_SCHED_MAX_BACKENDS; b++) {
        ggml_sched_pp_early * e = sched->pp_early[b];
        if (e == nullptr) {
            continue;
        }
        if (e->up != nullptr) {
            ggml_backend_synchronize(e->up);
        }
        ggml_backend_event_free(e->ev_before);
        for (auto & r : e->ready) {
            ggml_backend_event_free(r.second);
        }
        for (ggml_backend_event_t ev : e->spare) {
            ggml_backend_event_free(ev);
        }
        for (ggml_backend_event_t ev : e->after_split) {
            ggml_backend_event_free(ev);
        }
        ggml_backend_free(e->up);
        delete e;
        sched->pp_early[b] = nullptr;
    }
    delete sched->pp_early_copies;
    sched->pp_early_copies = nullptr;
}

// OVERLAP=2: at split `split_id`, before it is queued, upload the early copies (find_early_copies) of the next
// split - and with PREFETCH=2 of the one after - on the device's second stream, once everything queued on the
// compute stream so far has run (a PREFETCH=2 prefetch: once the last split that used its memory has), by the path
// ggml_backend_sched_pp_expert_path chooses for each; `decided` keeps what was done here (true: the copy is up or
// gathered, false: the copy's split goes on without asking upload-all again). Each copy's split waits for that
// copy's uploads only.
void ggml_backend_sched_pp_early_uploads(ggml_backend_sched_t sched, int split_id,
                                         std::unordered_map<const ggml_tensor *, bool> & decided,
                                         std::unordered_set<const ggml_tensor *> & prefetched,
                                         const ggml_tensor * ids_read, const std::vector<ggml_bitset_t> & used_ids) {
    if (sched->pp_early_copies == nullptr || sched->pp_early_copies->empty()) {
        return;
    }
    ggml_backend_sched_pp_again_uploads(sched, split_id, decided); // (LAYER_MAJOR's, a layer early)
    const std::unordered_map<const ggml_tensor *, int> & early = *sched->pp_early_copies;
    const int b = sched->splits[split_id].backend_id;
    // the expert op this split starts with (its ids are computed before this split)
    const ggml_tensor * cur = sched->splits[split_id].graph.n_nodes > 0 ? sched->splits[split_id].graph.nodes[0] : nullptr;
    ggml_sched_pp_early * e = nullptr;
    bool before = false; // the second stream waits for everything queued on the compute stream so far
    auto wait_before = [&]() {
        if (!before) {
            ggml_backend_event_record(e->ev_before, sched->backends[b]);
            ggml_backend_event_wait(e->up, e->ev_before);
            before = true;
        }
    };
    // the copy's split waits for what was queued for it (no event: the host waits for it now)
    auto ready = [&](const ggml_tensor * cpy) {
        if (!ggml_backend_sched_pp_early_ready(sched, b, e, cpy)) {
            ggml_backend_synchronize(e->up);
        }
    };
    // a gather on the second stream that needs what the split stream had queued before split `pos` (with ids: the
    // ids it routes by, and the last reader of its memory; `mem`, a prefetch: only the compute of the splits before
    // `pos`, the last readers of its memory), which `wait` makes the second stream wait for. CHAIN: where an earlier
    // gather of the device in this graph waited for that already, the device queues it right behind its gathers
    // before, without waiting for the second stream (the CUDA gather's kernels then start where the last one's
    // leave the cores, before the compute kernel that waited for that copy takes them all)
    auto gather_after = [&](int pos, bool mem, const auto & wait, ggml_tensor * input, ggml_tensor * cpy,
                            const ggml_tensor * ids, int mode) {
        const int done = mem ? std::max(sched->pp_gather_pos[b], sched->pp_gather_pos_mem[b]) : sched->pp_gather_pos[b];
        if (done >= pos &&
            ggml_backend_sched_pp_gather(sched, b, e->up, input, cpy, ids, mode, /*chained =*/ true)) {
            return true;
        }
        wait();
        if (!ggml_backend_sched_pp_gather(sched, b, e->up, input, cpy, ids, mode)) {
            return false;
        }
        int & at = mem ? sched->pp_gather_pos_mem[b] : sched->pp_gather_pos[b];
        at = std::max(at, pos);
        return true;
    };
    // PREFETCH=2: the copy of split `t` placed two splits early (nullptr: none)
    auto lead2_copy = [&](int t) -> ggml_tensor * {
        if (t >= sched->n_splits || sched->splits[t].backend_id != b || sched->splits[t].graph.n_nodes == 0 ||
            sched->splits[t].graph.nodes[0]->op != GGML_OP_MUL_MAT_ID) {
            return nullptr;
        }
        const ggml_backend_sched_split * s2 = &sched->splits[t];
        for (int j = 0; j < s2->n_inputs; j++) {
            ggml_tensor * c = tensor_copy(s2->inputs[j], b, sched->cur_copy);
            const auto it = early.find(c);
            if (it != early.end() && it->second == 2 && s2->graph.nodes[0]->src[0] == c) {
                return c;
            }
        }
        return nullptr;
    };
    for (int lead = 1; lead <= 2; lead++) {
        const int t = split_id + lead;
        if (t >= sched->n_splits || sched->splits[t].backend_id != b || sched->splits[split_id + 1].backend_id != b) {
            return;
        }
        const ggml_backend_sched_split * next = &sched->splits[t];
        if (next->graph.n_nodes == 0 || next->graph.nodes[0]->op != GGML_OP_MUL_MAT_ID) {
            continue;
        }
        ggml_tensor * node = next->graph.nodes[0];
        for (int j = 0; j < next->n_inputs; j++) {
            ggml_tensor * input = next->inputs[j];
            ggml_tensor * cpy   = tensor_copy(input, b, sched->cur_copy);
            const auto it = early.find(cpy);
            if (it == early.end() || node->src[0] != cpy || ggml_nelements(node->src[2]) == 0 ||
                ggml_backend_sched_pp_read_again(sched, input)) {
                continue;
            }
            if (e == nullptr && (e = ggml_backend_sched_pp_early_get(sched, b)) == nullptr) {
                return; // no second stream: the next split uploads on its own stream, as without OVERLAP
            }
            if (lead == 2 && !ggml_backend_sched_pp_prefetch2(sched, b)) {
                continue; // a graph PREFETCH=2 does not act on: the copy goes up one split early (below)
            }
            if (it->second != lead && !(lead == 1 && it->second == 2)) {
                continue; // (PREFETCH=2's copies placed two splits early are asked again one split early)
            }
            ggml_sched_pp_expert_op op(GGML_SCHED_PP_EARLY, b, input, node->src[2], input->ne[2]);
            op.transient  = true; // (an early copy is: find_early_copies)
            op.ids_read   = ids_read != nullptr && node->src[2] == ids_read;
            op.ids_ready  = cur != nullptr && cur->op == GGML_OP_MUL_MAT_ID && cur->src[2] == node->src[2];
            const auto d  = decided.find(cpy);
            op.early_done = d != decided.end() && d->second;
            op.prefetched = prefetched.count(cpy) > 0;
            for (ggml_sched_pp_path path = ggml_backend_sched_pp_expert_path(sched, op);;
                 op.declined = path, path = ggml_backend_sched_pp_expert_path(sched, op)) {
                if (path == GGML_SCHED_PP_PATH_NONE) {
                    break;
                }
                if (path == GGML_SCHED_PP_PATH_LATER) {
                    decided[cpy] = false; // the copy's split goes on from "not upload-all" (GATHER, DIRECT or a readback)
                    break;
                }
                if (path == GGML_SCHED_PP_PATH_PREFETCH) {
                    // PREFETCH=2: only after the last split that used this memory (its ids are not needed). The gate's
                    // prefetch also waits for the last user of up's, prefetched right behind it (two splits on), so that
                    // one chains (CHAIN); both last users computed long before the link gets to these prefetches
                    int w = ggml_backend_sched_pp_prefetch2(sched, b) ? ggml_backend_sched_pp_last_user(sched, split_id, cpy) : -1;
                    const ggml_tensor * up2 = lead == 1 && w >= 0 &&
                                              ggml_backend_sched_pp_prefetch2(sched, b) ? lead2_copy(split_id + 2) : nullptr;
                    if (up2 != nullptr) {
                        const int w2 = ggml_backend_sched_pp_last_user(sched, split_id, up2);
                        w = w2 >= 0 ? std::max(w, w2) : w;
                    }
                    ggml_backend_event_t after = before ? nullptr : ggml_backend_sched_pp_after_event(sched, e, w);
                    const auto wait_after = [&]() { ggml_backend_event_wait(e->up, after); };
                    if (after != nullptr ? gather_after(w + 1, true, wait_after, input, cpy, nullptr, GGML_BACKEND_PP_GATHER_PREFETCH)
                                         : gather_after(split_id, false, wait_before, input, cpy, nullptr, GGML_BACKEND_PP_GATHER_PREFETCH)) {
                        decided[cpy] = false; // (the rest: a split later)
                        prefetched.insert(cpy);
                        ready(cpy);
                        break;
                    }
                    continue;
                }
                if (path == GGML_SCHED_PP_PATH_GATHER) {
                    // by the ids this split's own expert op routes by (computed before it); a prefetched copy: its rest
                    if (gather_after(split_id, false, wait_before, input, cpy, node->src[2],
                                     op.prefetched ? GGML_BACKEND_PP_GATHER_REST : GGML_BACKEND_PP_GATHER_USED)) {
                        decided[cpy] = true;
                        ready(cpy);
                        break;
                    }
                    continue;
                }
                // UPLOAD_ALL, or SELECTIVE with the ids this split's own expert op read back
                GGML_ASSERT(path == GGML_SCHED_PP_PATH_UPLOAD_ALL || path == GGML_SCHED_PP_PATH_SELECTIVE);
                const bool selective = path == GGML_SCHED_PP_PATH_SELECTIVE;
                wait_before();
                decided[cpy] = true;
                if (ggml_backend_sched_pp_stages(sched, b, input)) {
                    e->staged.push_back({ input, cpy, selective, selective ? used_ids : std::vector<ggml_bitset_t>() });
                    break;
                }
                ggml_backend_sched_pp_early_copy(sched, b, input, cpy, selective, used_ids);
                break;
            }
        }
    }
}

// an early copy on the second stream, and the event its split waits for
void ggml_backend_sched_pp_early_copy(ggml_backend_sched_t sched, int b, ggml_tensor * input, ggml_tensor * cpy,
                                      bool selective, const std::vector<ggml_bitset_t> & used_ids) {
    ggml_sched_pp_early * e = sched->pp_early[b];
    if (selective) {
        ggml_backend_sched_pp_copy_used_experts(sched, b, input, cpy, used_ids, input->ne[2], input->nb[2],
                                                /*transient =*/ true, e->up);
    } else {
        ggml_backend_sched_pp_upload_whole(sched, b, input, cpy, /*transient =*/ true, e->up);
        sched->pp.upload_all++;
    }
    if (!ggml_backend_sched_pp_early_ready(sched, b, e, cpy)) {
        ggml_backend_synchronize(e->up);
    }
}

// OVERLAP=2: once split `split_id` is queued, the early copies of pageable weights its early uploads left for now
// (they wait for what was queued before that split, as the others do)
void ggml_backend_sched_pp_early_staged(ggml_backend_sched_t sched, int split_id) {
    const int b = sched->splits[split_id].backend_id;
    ggml_sched_pp_early * e = sched->pp_early[b];
    if (e == nullptr || e->staged.empty()) {
        return;
    }
    for (const auto & c : e->staged) {
        ggml_backend_sched_pp_early_copy(sched, b, c.input, c.cpy, c.selective, c.used_ids);
    }
    e->staged.clear();
}

// OVERLAP=2 (early_uploads, at split `split_id` before it is queued): the copies placed here go up whole on the
// device's second stream, after everything queued on its compute stream so far (the last users of their memory);
// their first readers wait for them
void ggml_backend_sched_pp_again_uploads(ggml_backend_sched_t sched, int split_id,
                                         std::unordered_map<const ggml_tensor *, bool> & decided) {
    if (sched->pp_again == nullptr) {
        return;
    }
    bool before[GGML_SCHED_MAX_BACKENDS] = {};
    for (const ggml_sched_pp_again & a : *sched->pp_again) {
        const int b = sched->splits[a.owner].backend_id;
        ggml_sched_pp_early * e = a.at == split_id ? ggml_backend_sched_pp_early_get(sched, b) : nullptr;
        if (e == nullptr) {
            continue; // (no second stream: the reader's split uploads it)
        }
        ggml_tensor * cpy = tensor_copy(a.input, b, sched->cur_copy);
        if (!before[b]) {
            ggml_backend_event_record(e->ev_before, sched->backends[b]);
            ggml_backend_event_wait(e->up, e->ev_before);
            before[b] = true;
        }
        decided[cpy] = true;
        if (ggml_backend_sched_pp_stages(sched, b, a.input)) {
            e->staged.push_back({ a.input, cpy, false, std::vector<ggml_bitset_t>() });
            continue;
        }
        ggml_backend_sched_pp_early_copy(sched, b, a.input, cpy, false, std::vector<ggml_bitset_t>());
    }
}
