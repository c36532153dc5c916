// pyllama_pp: STABLE_RESERVE's allocator side - earlier allocation plans kept when a reservation replaces them,
// and a kept plan swapped in for a graph that fits it (ggml_gallocr_pp_keep_plans, ggml_gallocr_pp_use_kept_plan)

#include "ggml-alloc-impl.h"

#include <stdlib.h>
#include <string.h>

// pyllama_pp (PLANS): an allocation plan (the node and leaf assignments of one reservation) kept for reuse. A
// graph that does not fit the live plan but fits a kept one - same structure and wiring, every tensor in a buffer
// of the type it is assigned to now and no larger than planned, inside the buffers as they are now (a size-only
// pass may have freed them, a re-reservation may have reallocated them) - is allocated from it: no re-reservation.
struct ggml_gallocr_pp_plan {
    struct node_alloc * node_allocs; // NULL: empty slot
    struct leaf_alloc * leaf_allocs;
    int      n_nodes;
    int      n_leafs;
    uint64_t fp;
    uint64_t last_used;
};

// the op sequence and source pattern of a graph: graphs with the same counts but another structure differ here
// (NONE nodes count by their op only: the scheduler pads allocation-dependency nodes with stand-ins)
static uint64_t ggml_gallocr_pp_fingerprint(const struct ggml_cgraph * graph) {
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < graph->n_nodes; i++) {
        const struct ggml_tensor * node = graph->nodes[i];
        uint64_t v = (uint64_t) node->op;
        for (int j = 0; j < GGML_MAX_SRC && node->op != GGML_OP_NONE; j++) {
            v = v * 3 + (node->src[j] == NULL ? 0 : node->src[j]->view_src != NULL ? 1 : 2);
        }
        h = (h ^ v) * 1099511628211ULL;
    }
    return h;
}

void ggml_gallocr_pp_plans_free(ggml_gallocr_t galloc) {
    for (int i = 0; i < galloc->pp_n_plans_max; i++) {
        free(galloc->pp_plans[i].node_allocs);
        free(galloc->pp_plans[i].leaf_allocs);
    }
    free(galloc->pp_plans);
    galloc->pp_plans = NULL;
    galloc->pp_n_plans_max = 0;
}

void ggml_gallocr_pp_keep_plans(ggml_gallocr_t galloc, int n) {
    ggml_gallocr_pp_plans_free(galloc);
    if (n > 0) {
        galloc->pp_plans = calloc((size_t) n, sizeof(struct ggml_gallocr_pp_plan));
        GGML_ASSERT(galloc->pp_plans != NULL);
        galloc->pp_n_plans_max = n;
    }
}

// keep a copy of the live plan in the least recently used slot
static void ggml_gallocr_pp_keep_live(ggml_gallocr_t galloc) {
    if (galloc->pp_n_plans_max == 0 || galloc->n_nodes == 0) {
        return;
    }
    for (int i = 0; i < galloc->pp_n_plans_max; i++) { // kept already (llama reserves the same graph again and again)
        struct ggml_gallocr_pp_plan * p = &galloc->pp_plans[i];
        if (p->node_allocs != NULL && p->fp == galloc->pp_fp && p->n_nodes == galloc->n_nodes && p->n_leafs == galloc->n_leafs &&
            memcmp(p->node_allocs, galloc->node_allocs, sizeof(struct node_alloc) * (size_t) p->n_nodes) == 0 &&
            (p->n_leafs == 0 || memcmp(p->leaf_allocs, galloc->leaf_allocs, sizeof(struct leaf_alloc) * (size_t) p->n_leafs) == 0)) {
            p->last_used = ++galloc->pp_clock;
            return;
        }
    }
    struct ggml_gallocr_pp_plan * slot = &galloc->pp_plans[0];
    for (int i = 1; i < galloc->pp_n_plans_max; i++) {
        struct ggml_gallocr_pp_plan * p = &galloc->pp_plans[i];
        if (slot->node_allocs != NULL && (p->node_allocs == NULL || p->last_used < slot->last_used)) {
            slot = p;
        }
    }
    struct node_alloc * na = malloc(sizeof(struct node_alloc) * (size_t) galloc->n_nodes);
    struct leaf_alloc * la = malloc(sizeof(struct leaf_alloc) * (size_t) (galloc->n_leafs > 0 ? galloc->n_leafs : 1));
    if (na == NULL || la == NULL) { // keeping a plan is an optimization: without memory, keep none
        free(na);
        free(la);
        return;
    }
    memcpy(na, galloc->node_allocs, sizeof(struct node_alloc) * (size_t) galloc->n_nodes);
    if (galloc->n_leafs > 0) {
        memcpy(la, galloc->leaf_allocs, sizeof(struct leaf_alloc) * (size_t) galloc->n_leafs);
    }
    free(slot->node_allocs);
    free(slot->leaf_allocs);
    slot->node_allocs = na;
    slot->leaf_allocs = la;
    slot->n_nodes     = galloc->n_nodes;
    slot->n_leafs     = galloc->n_leafs;
    slot->fp          = galloc->pp_fp;
    slot->last_used   = ++galloc->pp_clock;
}

// before a reservation for `graph` replaces the live plan: keep the live plan, remember the new graph's structure
void ggml_gallocr_pp_stash_live(ggml_gallocr_t galloc, const struct ggml_cgraph * graph) {
    ggml_gallocr_pp_keep_live(galloc);
    galloc->pp_fp = galloc->pp_n_plans_max > 0 ? ggml_gallocr_pp_fingerprint(graph) : 0;
}

// PLANS: exchange the live plan with a kept one
static void ggml_gallocr_pp_swap_live(ggml_gallocr_t galloc, struct ggml_gallocr_pp_plan * p) {
    struct node_alloc * na = galloc->node_allocs; galloc->node_allocs = p->node_allocs; p->node_allocs = na;
    struct leaf_alloc * la = galloc->leaf_allocs; galloc->leaf_allocs = p->leaf_allocs; p->leaf_allocs = la;
    int nn = galloc->n_nodes; galloc->n_nodes = p->n_nodes; p->n_nodes = nn;
    int nl = galloc->n_leafs; galloc->n_leafs = p->n_leafs; p->n_leafs = nl;
    uint64_t fp = galloc->pp_fp; galloc->pp_fp = p->fp; p->fp = fp;
}

// the planned tensor lies inside the buffer as it is now (empty tensors too: they still get an address)
static bool ggml_gallocr_pp_in_buffers(ggml_gallocr_t galloc, const struct tensor_alloc * ta) {
    if (ta->buffer_id < 0) {
        return true;
    }
    struct vbuffer * buf = galloc->buffers[ta->buffer_id];
    return buf != NULL && ta->addr.chunk >= 0 && ta->addr.chunk < GGML_VBUFFER_MAX_CHUNKS &&
           buf->chunks[ta->addr.chunk] != NULL &&
           ta->addr.offset + ta->size_max <= ggml_backend_buffer_get_size(buf->chunks[ta->addr.chunk]);
}

static bool ggml_gallocr_pp_same_place(const struct tensor_alloc * a, const struct tensor_alloc * b) {
    return a->buffer_id == b->buffer_id && a->addr.chunk == b->addr.chunk && a->addr.offset == b->addr.offset;
}

// the graph is wired as the plan's graph was: every source that needs memory is planned where the plan put the node
// or leaf that produces it (a source that reads another tensor than in the plan's graph shows up here)
static bool ggml_gallocr_pp_same_wiring(ggml_gallocr_t galloc, struct ggml_cgraph * graph) {
    if (galloc->hash_set.size < (size_t) (graph->n_nodes + graph->n_leafs) + (size_t) (graph->n_nodes + graph->n_leafs) / 4) {
        return false; // no scratch room (the hash set is sized by reservations)
    }
    ggml_hash_set_reset(&galloc->hash_set);
    for (int i = 0; i < graph->n_leafs; i++) {
        const size_t h = ggml_hash_find_or_insert(&galloc->hash_set, graph->leafs[i]);
        galloc->hash_values[h].buffer_id = galloc->leaf_allocs[i].leaf.buffer_id;
        galloc->hash_values[h].addr      = galloc->leaf_allocs[i].leaf.addr;
    }
    for (int i = 0; i < graph->n_nodes; i++) {
        const size_t h = ggml_hash_find_or_insert(&galloc->hash_set, graph->nodes[i]);
        galloc->hash_values[h].buffer_id = galloc->node_allocs[i].dst.buffer_id;
        galloc->hash_values[h].addr      = galloc->node_allocs[i].dst.addr;
    }
    for (int i = 0; i < graph->n_nodes; i++) {
        const struct ggml_tensor * node = graph->nodes[i];
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            struct ggml_tensor * src = node->src[j];
            if (src == NULL || src->data != NULL || src->view_src != NULL || !ggml_hash_contains(&galloc->hash_set, src)) {
                continue;
            }
            const struct hash_node * hn = &galloc->hash_values[ggml_hash_find(&galloc->hash_set, src)];
            const struct tensor_alloc producer = { hn->buffer_id, hn->addr, 0 };
            if (!ggml_gallocr_pp_same_place(&galloc->node_allocs[i].src[j], &producer)) {
                return false;
            }
        }
    }
    return true;
}

// the tensor needs memory from galloc and its plan puts it in a buffer of another type than it is assigned to now
static bool ggml_gallocr_pp_wrong_buffer(ggml_gallocr_t galloc, const struct ggml_tensor * t, const struct tensor_alloc * ta,
                                         int assigned) {
    if (t->data != NULL || t->view_src != NULL) {
        return false;
    }
    return ta->buffer_id < 0 || galloc->bufts[ta->buffer_id] != galloc->bufts[assigned];
}

// the live plan (just swapped in) serves this graph with these buffer assignments
static bool ggml_gallocr_pp_live_fits(ggml_gallocr_t galloc, struct ggml_cgraph * graph, const int * node_buffer_ids,
                                      const int * leaf_buffer_ids) {
    if (ggml_gallocr_needs_realloc(galloc, graph) || !ggml_gallocr_pp_same_wiring(galloc, graph)) {
        return false;
    }
    for (int i = 0; i < graph->n_nodes; i++) {
        const struct node_alloc * na = &galloc->node_allocs[i];
        if (ggml_gallocr_pp_wrong_buffer(galloc, graph->nodes[i], &na->dst, node_buffer_ids ? node_buffer_ids[i] : 0) ||
            !ggml_gallocr_pp_in_buffers(galloc, &na->dst)) {
            return false;
        }
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (!ggml_gallocr_pp_in_buffers(galloc, &na->src[j])) {
                return false;
            }
        }
    }
    for (int i = 0; i < graph->n_leafs; i++) {
        const struct ggml_tensor * leaf = graph->leafs[i];
        const struct tensor_alloc * ta = &galloc->leaf_allocs[i].leaf;
        if (ggml_gallocr_pp_wrong_buffer(galloc, leaf, ta, leaf_buffer_ids ? leaf_buffer_ids[i] : 0) ||
            !ggml_gallocr_pp_in_buffers(galloc, ta) ||
            !ggml_gallocr_node_needs_realloc(galloc, (struct ggml_tensor *) leaf, (struct tensor_alloc *) ta)) { // (true: it fits)
            return false;
        }
    }
    return true;
}

bool ggml_gallocr_pp_use_kept_plan(ggml_gallocr_t galloc, struct ggml_cgraph * graph, const int * node_buffer_ids,
                                   const int * leaf_buffer_ids) {
    if (galloc->pp_n_plans_max == 0) {
        return false;
    }
    const uint64_t fp = ggml_gallocr_pp_fingerprint(graph);
    for (int i = 0; i < galloc->pp_n_plans_max; i++) {
        struct ggml_gallocr_pp_plan * p = &galloc->pp_plans[i];
        if (p->node_allocs == NULL || p->fp != fp || p->n_nodes != graph->n_nodes || p->n_leafs != graph->n_leafs) {
            continue;
        }
        ggml_gallocr_pp_swap_live(galloc, p);
        if (ggml_gallocr_pp_live_fits(galloc, graph, node_buffer_ids, leaf_buffer_ids)) {
            p->last_used = ++galloc->pp_clock; // the plan that was live until now
            return true;
        }
        ggml_gallocr_pp_swap_live(galloc, p);
    }
    return false;
}

