// pyllama_pp: STABLE_RESERVE's scheduler side - kept allocation plans instead of re-reservations, and graphs
// padded to the dependency nodes seen before.

#include "ggml-backend-pp-impl.h"

#include <assert.h>
#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

// PLANS: allocates the graph from a kept plan that fits (the decode graph after a prompt, and back) instead of
// re-reserving: 1 if it did, 0 if no plan fits, -1 if the allocation failed. Tensors get other addresses than in
// the graphs in flight, so those finish before anything is allocated (nothing is in flight between llama_decode
// calls that read their outputs).
int ggml_backend_sched_pp_alloc_kept_plan(ggml_backend_sched_t sched) {
    if (!ggml_gallocr_pp_use_kept_plan(sched->galloc, &sched->graph, sched->node_backend_ids, sched->leaf_backend_ids)) {
        return 0;
    }
    sched->pp.plan_switches++;
    if (sched->pp_in_flight > 0) {
        sched->pp.plan_switch_drains++;
        GGML_SCHED_PP_WAIT(sched, GGML_SCHED_PP_WAIT_REALLOC);
        ggml_backend_sched_pp_drain(sched);
    }
    ggml_backend_sched_pp_save_layout(sched);
    if (!ggml_gallocr_alloc_graph(sched->galloc, &sched->graph)) {
        GGML_LOG_ERROR("%s: failed to allocate graph from a kept plan\n", __func__);
        return -1;
    }
    return 1;
}

// STABLE_DEPS: while pipelining, keep the number of dependency nodes after each named node at the most seen so far:
// a backend adds them only where its fusions apply, and e.g. CUDA's top-k MoE fusion does not apply to an empty
// op - the last layer of a ubatch without outputs. Without padding, such a graph has fewer nodes than the reserved
// one, so it re-reserves (a full drain), and so does every following ubatch (longer KV ranges). Padding nodes are
// views without sources: they allocate nothing. Returns the padding nodes the graph gets, pad_after: per node.
int ggml_backend_sched_pp_pad_plan(ggml_backend_sched_t sched, const struct ggml_cgraph * graph,
                                   const std::unordered_map<ggml_tensor *, std::vector<ggml_tensor *>> & alloc_deps,
                                   std::vector<int> & pad_after) {
    auto dep_nodes_of = [&](ggml_tensor * node) -> int {
        auto it = alloc_deps.find(node);
        return it == alloc_deps.end() ? 0 : (int) ((it->second.size() + GGML_MAX_SRC - 1) / GGML_MAX_SRC);
    };
    const bool stable_deps = sched->n_copies > 1;
    int n_pad_nodes = 0;
    if (stable_deps) {
        if (sched->pp_dep_counts == nullptr) {
            sched->pp_dep_counts = new std::unordered_map<std::string, int>();
        }
        auto & known = *sched->pp_dep_counts;
        for (const auto & it : alloc_deps) {
            if (it.first->name[0] != '\0') {
                int & k = known[it.first->name];
                k = std::max(k, dep_nodes_of(it.first));
            }
        }
        if (!known.empty()) {
            pad_after.assign(graph->n_nodes, 0);
            for (int j = 0; j < graph->n_nodes; j++) {
                if (graph->nodes[j]->name[0] == '\0') {
                    continue;
                }
                auto it = known.find(graph->nodes[j]->name);
                if (it != known.end()) {
                    pad_after[j] = std::max(0, it->second - dep_nodes_of(graph->nodes[j]));
                    n_pad_nodes += pad_after[j];
                }
            }
        }
    }
    return n_pad_nodes;
}

// STABLE_DEPS: adds the padding nodes after node j of graph to the scheduler's graph copy; returns how many
int ggml_backend_sched_pp_add_pad(ggml_backend_sched_t sched, const struct ggml_cgraph * graph, int j, int backend_id,
                                  const std::vector<int> & pad_after) {
    struct ggml_cgraph * graph_copy = &sched->graph;
    int n = 0;
    for (int k = 0; !pad_after.empty() && k < pad_after[j]; k++) {
        struct ggml_tensor * pad = ggml_view_tensor(sched->ctx, graph->nodes[j]);
        ggml_format_name(pad, "%s (pp pad)", graph->nodes[j]->name);
        assert(graph_copy->size > graph_copy->n_nodes);
        sched->node_backend_ids[graph_copy->n_nodes] = backend_id;
        graph_copy->nodes[graph_copy->n_nodes++] = pad;
        n++;
    }
    return n;
}
