// pyllama_pp: PREFETCH - expert copies filled a split early with the experts used last time; PREFETCH=2's lanes.

#include "ggml-backend-pp-impl.h"

#include <algorithm>
#include <unordered_set>
#include <vector>

// PREFETCH: with OVERLAP=2, an expert op whose ids are computed in its own split (a layer's first, gate) may have
// its copy placed one split early and filled there by the device with the experts the same weight used last time
// (while the split before computes); its own split then gathers only the rest
bool ggml_backend_sched_pp_prefetch_possible(ggml_backend_sched_t sched, int backend_id) {
    return ggml_backend_sched_pp_gather_possible(sched, backend_id) && sched->pp_cfg.prefetch != 0;
}

// PREFETCH=2: as PREFETCH, and a layer's later expert ops (up, down; routed as the op before) have their copies
// placed two splits early: up is prefetched beside the gate's prefetch, and its rest and down's gather go up
// beside the gate. Each split then waits only for its own copies, and a prefetch only for the last split that
// used its memory (not for everything queued before), so the link need not wait for the router while the down
// projection, the attention and the router compute. One more expert copy per GPU.
bool ggml_backend_sched_pp_prefetch2_on(ggml_backend_sched_t sched, int backend_id) {
    return ggml_backend_sched_pp_gather_possible(sched, backend_id) && sched->pp_cfg.prefetch == 2;
}

// ... and it acts on this graph (PREFETCH2_MIN_TOKENS; in a graph below, the copies stay in the lanes - one layout
// for every ubatch size, so no graph makes the compute buffers grow - and go up as with PREFETCH=1)
bool ggml_backend_sched_pp_prefetch2(ggml_backend_sched_t sched, int backend_id) {
    return ggml_backend_sched_pp_prefetch2_on(sched, backend_id) && sched->pp_prefetch2_graph;
}

// PREFETCH=2's lanes: a GPU's transient copies of the weights of its splits' first expert ops live in a ring of
// three slots in a buffer of its own (VRAM outside the compute buffers), one slot per split in turn, filled by the
// early uploads (OVERLAP=2's second stream), so a copy can go up two splits early.
struct ggml_sched_pp_ring {
    ggml_backend_buffer_t buf = nullptr;   // n_slots slots of slot_size bytes
    size_t                slot_size = 0;
    int                   n_slots   = 3;
    bool                  unusable = false;
};

static void ggml_backend_sched_pp_ring_release(ggml_sched_pp_ring * r) {
    ggml_backend_buffer_free(r->buf);
    r->buf = nullptr;
    r->slot_size = 0;
}

void ggml_backend_sched_pp_ring_free(ggml_backend_sched_t sched) {
    for (int b = 0; b < GGML_SCHED_MAX_BACKENDS; b++) {
        ggml_sched_pp_ring * r = sched->pp_ring[b];
        if (r == nullptr) {
            continue;
        }
        ggml_backend_sched_pp_ring_release(r);
        delete r;
        sched->pp_ring[b] = nullptr;
    }
}

// the bytes of a backend's lanes (the counters' ring_bytes)
size_t ggml_backend_sched_pp_ring_bytes(ggml_backend_sched_t sched, int backend_id) {
    const ggml_sched_pp_ring * r = sched->pp_ring[backend_id];
    return r != nullptr && r->buf != nullptr ? ggml_backend_buffer_get_size(r->buf) : 0;
}

// the lanes of a backend with slots of at least `need` bytes (nullptr: none, the copies are left to ggml-alloc);
// only where the early uploads that fill them have a stream
static ggml_sched_pp_ring * ggml_backend_sched_pp_ring_get(ggml_backend_sched_t sched, int backend_id, size_t need) {
    ggml_sched_pp_ring * r = sched->pp_ring[backend_id];
    if (r == nullptr) {
        r = new ggml_sched_pp_ring();
        sched->pp_ring[backend_id] = r;
        r->unusable = ggml_backend_sched_pp_early_get(sched, backend_id) == nullptr;
    }
    if (r->unusable) {
        return nullptr;
    }
    if (r->slot_size < need) {
        // (re)allocate: graphs in flight may still use the old slots
        if (r->buf != nullptr) {
            ggml_backend_synchronize(sched->backends[backend_id]);
            ggml_backend_sched_pp_drain(sched); // (the lanes are written on the early-upload stream)
            ggml_backend_sched_pp_ring_release(r);
        }
        const size_t align = ggml_backend_buft_get_alignment(sched->bufts[backend_id]);
        const size_t slot  = GGML_PAD(need, align);
        r->buf = ggml_backend_buft_alloc_buffer(sched->bufts[backend_id], (size_t) r->n_slots * slot);
        if (r->buf == nullptr) {
            GGML_LOG_WARN("%s: no memory for the prefetch lanes of %s (%d x %zu bytes): the copies stay in the compute buffer\n",
                          __func__, ggml_backend_name(sched->backends[backend_id]), r->n_slots, slot);
            r->unusable = true; // not again for every graph
            return nullptr;
        }
        ggml_backend_buffer_set_usage(r->buf, GGML_BACKEND_BUFFER_USAGE_COMPUTE);
        r->slot_size = slot;
    }
    return r;
}

// PREFETCH=2's lanes, after the splits are known (ggml-alloc leaves tensors that already have memory alone): the
// transient expert copies of each GPU (the weight of a split's first MUL_MAT_ID, pinned, one per split) take three
// slots in turn - gate, up, down of a layer - so that each copy reuses the memory of the copy three before it: a
// prefetch two splits early then waits only for the split that read that one (with ggml-alloc's placement the
// copies took other copies' blocks, or blocks of tensors of the split just before, and one copy's worth of memory
// more). Three expert copies per GPU, outside the compute buffer, which then holds none. The early uploads fill them.
void ggml_backend_sched_pp_ring_assign(ggml_backend_sched_t sched) {
    if (sched->n_copies < 2 || sched->pp_cfg.overlap != 2 || sched->pp_cfg.prefetch != 2) {
        return;
    }
    std::vector<size_t> need(sched->n_backends, 0);
    const std::unordered_set<const ggml_tensor *> & shared_by_splits = *sched->pp_shared_copies;
    auto ring_input = [&](const ggml_backend_sched_split * split, int j, ggml_tensor ** cpy) {
        ggml_tensor * input = split->inputs[j];
        *cpy = tensor_copy(input, split->backend_id, 0);
        if (!ggml_backend_sched_pp_is_transient_copy(sched, *cpy) || input->buffer == nullptr ||
            !ggml_backend_sched_pp_buffer_is_pinned(sched, input->buffer) || shared_by_splits.count(*cpy)) {
            return false;
        }
        ggml_backend_dev_t dev = ggml_backend_get_device(sched->backends[split->backend_id]);
        return split->graph.n_nodes > 0 && dev != nullptr && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU &&
               ggml_backend_sched_pp_is_expert_copy(sched, split->graph.nodes[0], *cpy) &&
               ggml_backend_sched_pp_prefetch2_on(sched, split->backend_id);
    };
    for (int i = 0; i < sched->n_splits; i++) {
        const ggml_backend_sched_split * split = &sched->splits[i];
        const size_t align = ggml_backend_buft_get_alignment(sched->bufts[split->backend_id]);
        size_t bytes = 0;
        for (int j = 0; j < split->n_inputs; j++) {
            ggml_tensor * cpy;
            if (ring_input(split, j, &cpy)) {
                bytes += GGML_PAD(ggml_backend_buft_get_alloc_size(sched->bufts[split->backend_id], cpy), align);
            }
        }
        need[split->backend_id] = std::max(need[split->backend_id], bytes);
    }
    std::vector<int> n_ring_splits(sched->n_backends, 0);
    for (int i = 0; i < sched->n_splits; i++) {
        const ggml_backend_sched_split * split = &sched->splits[i];
        const int b = split->backend_id;
        if (need[b] == 0) {
            continue;
        }
        ggml_sched_pp_ring * r = ggml_backend_sched_pp_ring_get(sched, b, need[b]);
        if (r == nullptr) {
            continue;
        }
        const size_t align = ggml_backend_buft_get_alignment(sched->bufts[b]);
        const int slot = n_ring_splits[b] % r->n_slots;
        size_t off = 0;
        bool any = false;
        for (int j = 0; j < split->n_inputs; j++) {
            ggml_tensor * cpy;
            if (ring_input(split, j, &cpy) && cpy->data == nullptr && cpy->buffer == nullptr) {
                uint8_t * base = (uint8_t *) ggml_backend_buffer_get_base(r->buf) + (size_t) slot * r->slot_size;
                if (ggml_backend_tensor_alloc(r->buf, cpy, base + off) != GGML_STATUS_SUCCESS) {
                    continue; // left to ggml-alloc
                }
                off += GGML_PAD(ggml_backend_buft_get_alloc_size(sched->bufts[b], cpy), align);
                any = true;
            }
        }
        n_ring_splits[b] += any ? 1 : 0;
    }
}

// PREFETCH=2: the last split before `split_id` on the same backend, among the few before it, whose tensors overlap
// the memory of `cpy`, placed at `split_id` (in a lane, or by ggml-alloc): its prefetch need not wait for the
// splits after that one. -1 where none is found so (another backend's split or the graph's start comes first): then everything
// queued before `split_id`. Where the few splits do not touch it, the earliest of them (the ones before are done
// once it is)
int ggml_backend_sched_pp_last_user(ggml_backend_sched_t sched, int split_id, const ggml_tensor * cpy) {
    const int depth = 6;
    const int b = sched->splits[split_id].backend_id;
    if (cpy->data == nullptr) {
        return -1;
    }
    const uint8_t * lo = (const uint8_t *) cpy->data;
    const uint8_t * hi = lo + ggml_nbytes(cpy); // (what an upload writes; not the padding after it)
    auto overlaps = [&](const ggml_tensor * t) {
        if (t == nullptr || t->data == nullptr) {
            return false;
        }
        const uint8_t * p = (const uint8_t *) t->data;
        return p < hi && lo < p + std::max<size_t>(ggml_nbytes(t), 1);
    };
    for (int s = split_id - 1; s >= split_id - depth; s--) {
        if (s < 0 || sched->splits[s].backend_id != b) {
            return -1;
        }
        const ggml_backend_sched_split * split = &sched->splits[s];
        for (int n = 0; n < split->graph.n_nodes; n++) {
            const ggml_tensor * node = split->graph.nodes[n];
            if (overlaps(node)) {
                return s;
            }
            for (int k = 0; k < GGML_MAX_SRC; k++) {
                if (overlaps(node->src[k])) {
                    return s;
                }
            }
        }
        for (int j = 0; j < split->n_inputs; j++) {
            if (overlaps(tensor_copy(split->inputs[j], b, sched->cur_copy))) {
                return s;
            }
        }
    }
    return split_id - depth;
}

// PREFETCH=2: record, behind split `split_id` on its compute stream, the event a later prefetch may wait for
void ggml_backend_sched_pp_after_split(ggml_backend_sched_t sched, int split_id) {
    const int b = sched->splits[split_id].backend_id;
    ggml_sched_pp_early * e = sched->pp_early[b];
    if (e == nullptr || e->unusable || sched->pp_early_copies == nullptr || sched->pp_early_copies->empty() ||
        !ggml_backend_sched_pp_prefetch2(sched, b)) {
        return;
    }
    if ((int) e->after_split.size() < sched->n_splits) {
        e->after_split.resize(sched->n_splits, nullptr);
        e->after_graph.resize(sched->n_splits, UINT64_MAX);
    }
    if (e->after_split[split_id] == nullptr) {
        e->after_split[split_id] = ggml_backend_event_new(ggml_backend_get_device(sched->backends[b]));
    }
    if (e->after_split[split_id] != nullptr) {
        ggml_backend_event_record(e->after_split[split_id], sched->backends[b]);
        e->after_graph[split_id] = sched->pp_graph_seq;
    }
}

// PREFETCH=2: the event behind split `split_id` of this graph, if it was recorded (nullptr: none)
ggml_backend_event_t ggml_backend_sched_pp_after_event(ggml_backend_sched_t sched, const ggml_sched_pp_early * e, int split_id) {
    if (split_id < 0 || split_id >= (int) e->after_split.size() || e->after_graph[split_id] != sched->pp_graph_seq) {
        return nullptr;
    }
    return e->after_split[split_id];
}
