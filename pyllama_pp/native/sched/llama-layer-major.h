#pragma once

// pyllama_pp: LAYER_MAJOR - the ubatches of one llama_decode in groups that run through each layer together, as one
// graph (ggml_backend_pp_layer_major_graph: a layer's nodes of ubatch 0, then of ubatch 1, ...). With the experts in
// host memory the scheduler uploads a layer's experts once per group instead of once per ubatch, so a prompt's
// bytes per token fall by the group size while each ubatch keeps the compute of its own size.

#include "ggml-backend-pp.h"
#include "llama-graph.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

struct llama_context;
struct llama_cparams;
struct llama_memory_i;
struct llama_model;
class  llama_kv_cache_context;

class llama_layer_major {
public:
    // builds the graph of `ubatch` into `res` (reset first), with `mctx` at that ubatch and n_outputs outputs
    using build_fn = std::function<ggml_cgraph * (llm_graph_result * res, const llama_ubatch & ubatch,
                                                  const llama_memory_context_i * mctx, uint32_t n_outputs)>;

    // ubatches per group: GGML_SCHED_PP_LAYER_MAJOR (1: all of a batch, N: at most N), at most n_batch / n_ubatch,
    // for a decoder with a KV cache whose layer weights are partly in host memory, op offload on, and no
    // embeddings, eval callback, backend samplers or training; 0 where no group forms (nothing changes then)
    static uint32_t group_size(const llama_model & model, const llama_cparams & cparams, const llama_memory_i * memory,
                               bool has_samplers);

    // the worst case to reserve for a prompt: group - 1 graphs of `ubatch` with one output each (a prompt's ubatches
    // before its last have none), then `gf` (the same ubatch with its outputs), merged - no more than the scheduler
    // has room for (its graph size); `gf` itself for group < 2 or a ubatch smaller than n_ubatch. The merged graph
    // and the graphs it adds live as long as this object.
    ggml_cgraph * reserve_graph(const llama_context & lctx, uint32_t group, ggml_cgraph * gf, const llama_ubatch & ubatch,
                                const llama_memory_context_i * mctx, const build_fn & build);

    llama_layer_major();
    // llama_decode's groups of up to `group` ubatches (0 or 1: none), outputs counted as llama_decode counts them
    llama_layer_major(llama_context & lctx, uint32_t group, uint32_t n_tokens_all, uint32_t n_outputs_all, build_fn build);
    ~llama_layer_major();

    // the ubatch llama_decode's `mctx` is at, computed in a group: the first of a group builds the graphs of the
    // group's ubatches (each with its KV cells applied, as llama_decode would), merges and allocates them, sets each
    // graph's inputs into that allocation and computes them; the others were computed with it. A group holds the
    // ubatches from this one on whose tokens follow those of the ubatches before them in each sequence. False: the ubatch is in no group, or its group's graph found
    // no room (then the group's KV cells are removed again, and no more groups form on this scheduler): llama_decode
    // processes it alone. True with res == nullptr: the group failed (status), and the KV cells of its ubatches after
    // this one are removed (llama_decode removes this one's).
    bool take(llama_memory_context_i * mctx, llm_graph_result * & res, ggml_status & status);

private:
    bool build_group(const llama_kv_cache_context & at, uint32_t n, ggml_status & status);
    ggml_cgraph * merge(uint32_t n);
    void forget(uint32_t first, uint32_t end);

    llama_context * lctx = nullptr;
    uint32_t group         = 0;
    uint32_t n_tokens_all  = 0;
    uint32_t n_outputs_all = 0;
    build_fn build;

    std::vector<llm_graph_result_ptr> res;          // one per ubatch of the group
    std::vector<llama_ubatch>         ubatches;
    std::vector<std::unique_ptr<llama_kv_cache_context>> walkers; // copies of llama_decode's memory context, walking the group
    ggml_context * ctx_merged = nullptr;            // the merged graph
    uint32_t n_group = 0; // ubatches in the current group
    uint32_t next    = 0; // the next of them llama_decode takes
};
