// pyllama_pp: LAYER_MAJOR - the ubatches of one batch run through each layer in turn, as one graph, so that a
// layer's host experts go up once for all of them: the merged graph and the scheduler's side (a copy that several
// splits read holds every expert).

#include "ggml-backend-pp-impl.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <climits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// the layer a node's name gives ("ffn_moe_gate-12": 12; llama names a layer's nodes "<name>-<layer>"), or -1
static int ggml_backend_pp_name_layer(const char * name) {
    const char * dash = strrchr(name, '-');
    if (dash == nullptr || dash[1] == '\0') {
        return -1;
    }
    for (const char * c = dash + 1; *c != '\0'; c++) {
        if (!isdigit((unsigned char) *c)) {
            return -1;
        }
    }
    return atoi(dash + 1);
}

// each node's layer: the one its name gives or the largest of its sources', whichever is larger (so no node comes
// before a source); a node with neither (a view of the KV cache, a cast of an input) takes the smallest layer of
// the nodes that read it (so it comes before them), or -1 (the nodes before the first layer)
static std::vector<int> ggml_backend_pp_node_layers(const struct ggml_cgraph * graph) {
    const int n = graph->n_nodes;
    std::unordered_map<const ggml_tensor *, int> index;
    index.reserve((size_t) n * 2);
    for (int i = 0; i < n; i++) {
        index.emplace(graph->nodes[i], i);
    }
    std::vector<int> layer((size_t) n, -1);
    for (int i = 0; i < n; i++) {
        const ggml_tensor * node = graph->nodes[i];
        int l = ggml_backend_pp_name_layer(node->name);
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            const auto it = node->src[s] != nullptr ? index.find(node->src[s]) : index.end();
            if (it != index.end()) {
                l = std::max(l, layer[(size_t) it->second]);
            }
        }
        layer[(size_t) i] = l;
    }
    std::vector<int> first_reader((size_t) n, INT_MAX);
    for (int i = n - 1; i >= 0; i--) {
        if (layer[(size_t) i] < 0 && first_reader[(size_t) i] != INT_MAX) {
            layer[(size_t) i] = first_reader[(size_t) i];
        }
        const ggml_tensor * node = graph->nodes[i];
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            const auto it = node->src[s] != nullptr ? index.find(node->src[s]) : index.end();
            if (it != index.end()) {
                int & r = first_reader[(size_t) it->second];
                r = std::min(r, layer[(size_t) i]);
            }
        }
    }
    return layer;
}

size_t ggml_backend_pp_layer_major_size(struct ggml_cgraph ** graphs, int n) {
    size_t size = 0;
    for (int k = 0; k < n; k++) {
        size += (size_t) std::max(graphs[k]->n_nodes, graphs[k]->n_leafs);
    }
    return size;
}

// a tensor's use count in the graph it comes from (backends fuse ops by it)
static int32_t ggml_backend_pp_use_count(const struct ggml_cgraph * graph, const ggml_tensor * t) {
    const size_t h = ggml_hash_find(&graph->visited_hash_set, t);
    return h != GGML_HASHSET_FULL && ggml_bitset_get(graph->visited_hash_set.used, h) ? graph->use_counts[h] : 0;
}

struct ggml_cgraph * ggml_backend_pp_layer_major_graph(struct ggml_context * ctx, struct ggml_cgraph ** graphs, int n) {
    struct ggml_cgraph * merged = ggml_new_graph_custom(ctx, ggml_backend_pp_layer_major_size(graphs, n), false);

    struct entry {
        int layer;
        int graph;
        int node;
    };
    std::vector<entry> order;
    for (int k = 0; k < n; k++) {
        const std::vector<int> layer = ggml_backend_pp_node_layers(graphs[k]);
        for (int i = 0; i < graphs[k]->n_nodes; i++) {
            order.push_back({ layer[(size_t) i], k, i });
        }
    }
    // by layer, then graph; each graph's nodes of a layer in their own order
    std::stable_sort(order.begin(), order.end(), [](const entry & a, const entry & b) {
        return a.layer != b.layer ? a.layer < b.layer : a.graph < b.graph;
    });

    for (const entry & e : order) {
        struct ggml_tensor * node = graphs[e.graph]->nodes[e.node];
        if (ggml_hash_contains(&merged->visited_hash_set, node)) {
            continue; // a node two graphs share runs once
        }
        ggml_hash_insert(&merged->visited_hash_set, node);
        merged->use_counts[ggml_hash_find(&merged->visited_hash_set, node)] = ggml_backend_pp_use_count(graphs[e.graph], node);
        merged->nodes[merged->n_nodes++] = node;
    }
    for (int k = 0; k < n; k++) {
        for (int i = 0; i < graphs[k]->n_leafs; i++) {
            struct ggml_tensor * leaf = graphs[k]->leafs[i];
            const int32_t uses = ggml_backend_pp_use_count(graphs[k], leaf);
            if (ggml_hash_contains(&merged->visited_hash_set, leaf)) {
                merged->use_counts[ggml_hash_find(&merged->visited_hash_set, leaf)] += uses; // a weight every graph reads
                continue;
            }
            ggml_hash_insert(&merged->visited_hash_set, leaf);
            merged->use_counts[ggml_hash_find(&merged->visited_hash_set, leaf)] = uses;
            merged->leafs[merged->n_leafs++] = leaf;
        }
    }
    return merged;
}

int ggml_backend_sched_pp_max_group(ggml_backend_sched_t sched, size_t graph_nodes) {
    return sched->pp_no_groups || graph_nodes == 0 ? 1 : (int) (sched->hash_set.size / graph_nodes);
}

void ggml_backend_sched_pp_note_layer_major(ggml_backend_sched_t sched, int n_ubatches) {
    if (n_ubatches <= 0) {
        sched->pp_no_groups = true;
        return;
    }
    sched->pp.layer_major_graphs++;
    sched->pp.layer_major_ubatches += (uint64_t) n_ubatches;
}

// The scheduler's side. A layer-major graph's expert ops of a layer read the copy of its host expert weight that the
// first of them uploads: the weight is read again. Such a copy must hold every expert any of them uses, which no
// selection made for the first op holds (a selective copy, a gather, a direct read): it is uploaded whole
// (ggml-backend-pp-experts.cpp). Its first reader starts a split (pass 5), so that with OVERLAP=2 the copy goes up
// on the device's second stream while the layer before computes (placed where that layer's copy of the same weight
// was: the ubatches of that layer hide the upload). Graphs of one ubatch read no weight again: none of this acts.

// before pass 5 of split_graph: the host weights that several expert ops read
void ggml_backend_sched_pp_find_read_again(ggml_backend_sched_t sched, const struct ggml_cgraph * graph) {
    if (sched->pp_read_again == nullptr) {
        sched->pp_read_again = new std::unordered_set<const ggml_tensor *>();
        sched->pp_again      = new std::vector<ggml_sched_pp_again>();
    }
    std::unordered_set<const ggml_tensor *> & again = *sched->pp_read_again;
    again.clear();
    sched->pp_again->clear();
    std::unordered_set<const ggml_tensor *> read;
    for (int i = 0; i < graph->n_nodes; i++) {
        const ggml_tensor * node = graph->nodes[i];
        const ggml_tensor * w    = node->src[0];
        if (node->op == GGML_OP_MUL_MAT_ID && w != nullptr && w->buffer != nullptr &&
            ggml_backend_buffer_get_usage(w->buffer) == GGML_BACKEND_BUFFER_USAGE_WEIGHTS &&
            ggml_backend_buffer_is_host(w->buffer) && !read.insert(w).second) {
            again.insert(w);
        }
    }
}

bool ggml_backend_sched_pp_read_again(ggml_backend_sched_t sched, const struct ggml_tensor * weight) {
    return sched->pp_read_again != nullptr && !sched->pp_read_again->empty() && sched->pp_read_again->count(weight) > 0;
}

// pass 5: `node` is the first expert op on `backend_id` to read a weight read again, which that backend copies
// (the split it starts has the copy as its input, its first node reads it: OVERLAP=2 can place it early)
bool ggml_backend_sched_pp_first_read(ggml_backend_sched_t sched, const struct ggml_tensor * node, int backend_id) {
    ggml_tensor * w = node->src[0];
    return node->op == GGML_OP_MUL_MAT_ID && ggml_backend_sched_pp_read_again(sched, w) &&
           tensor_copy(w, backend_id, 0) == nullptr && tensor_backend_id(w) != backend_id &&
           !ggml_backend_supports_buft(sched->backends[backend_id], ggml_backend_buffer_get_type(w->buffer));
}

// OVERLAP=2 (find_early_copies): the split a copy read again (`input` of split `split_id`, its first reader, whose
// split before runs on the same backend) is placed and uploaded at, as a lead (splits before its reader): where the
// previous layer's copy of the same weight was read first on that backend, so its upload overlaps that layer's
// ubatches; else the split before
int ggml_backend_sched_pp_again_lead(ggml_backend_sched_t sched, int split_id, struct ggml_tensor * input) {
    const int b = sched->splits[split_id].backend_id;
    int at = split_id - 1;
    const char * rest = nullptr;
    const int il = ggml_backend_sched_pp_weight_layer(input->name, &rest);
    for (int s = split_id - 1; il > 0 && s >= 0 && at == split_id - 1; s--) {
        const ggml_backend_sched_split * split = &sched->splits[s];
        for (int j = 0; j < split->n_inputs && split->backend_id == b; j++) {
            const char * rest_j = nullptr;
            if (ggml_backend_sched_pp_read_again(sched, split->inputs[j]) &&
                ggml_backend_sched_pp_weight_layer(split->inputs[j]->name, &rest_j) == il - 1 && strcmp(rest_j, rest) == 0) {
                at = s;
                break;
            }
        }
    }
    sched->pp_again->push_back({ at, split_id, input });
    return split_id - at;
}

// split_graph: the copies placed at split i, before its nodes (as add_early_inputs does)
void ggml_backend_sched_pp_add_again_inputs(ggml_backend_sched_t sched, int i) {
    if (sched->pp_again == nullptr) {
        return;
    }
    struct ggml_cgraph * graph_copy = &sched->graph;
    for (const ggml_sched_pp_again & a : *sched->pp_again) {
        if (a.at != i) {
            continue;
        }
        const int b = sched->splits[a.owner].backend_id;
        const size_t input_id = hash_id(a.input);
        // a dependency to the input source so that it is not freed before the copy is done, then the copy
        struct ggml_tensor * input_dep = ggml_view_tensor(sched->ctx, a.input);
        input_dep->src[0] = a.input;
        sched->node_backend_ids[graph_copy->n_nodes] = sched->hv_tensor_backend_ids[input_id];
        graph_copy->nodes[graph_copy->n_nodes++] = input_dep;
        sched->node_backend_ids[graph_copy->n_nodes] = b;
        graph_copy->nodes[graph_copy->n_nodes++] = tensor_id_copy(input_id, b, sched->cur_copy);
    }
}
