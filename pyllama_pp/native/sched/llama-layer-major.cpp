// pyllama_pp: LAYER_MAJOR - the ubatches of one llama_decode in groups that run through each layer together
// (llama-layer-major.h). llama-context.cpp asks for a group at each ubatch of a batch and reserves the group's
// worst case; everything else is here.

#include "llama-layer-major.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <map>
#include <thread>

uint32_t llama_layer_major::group_size(const llama_model & model, const llama_cparams & cparams,
                                       const llama_memory_i * memory, bool has_samplers) {
    const int64_t v = ggml_backend_sched_pp_param("LAYER_MAJOR");
    if (v <= 0 || cparams.n_ubatch >= cparams.n_batch) {
        return 0;
    }
    const uint32_t per_batch = (cparams.n_batch + cparams.n_ubatch - 1) / cparams.n_ubatch;
    const uint32_t group     = v == 1 ? per_batch : std::min<uint32_t>(per_batch, (uint32_t) v);
    // (embeddings: every token is an output, pooled per sequence; an eval callback - a trace - sees the nodes in
    // the order they run; recurrent, hybrid and sliding-window memories keep state a copy of their context cannot)
    if (group < 2 || cparams.embeddings || cparams.embeddings_nextn || cparams.cb_eval != nullptr || has_samplers ||
        cparams.training || !cparams.causal_attn || !cparams.op_offload || model.n_devices() == 0 ||
        llama_model_has_encoder(&model) || dynamic_cast<const llama_kv_cache *>(memory) == nullptr) {
        return 0;
    }
    // layer weights in host memory, which op offload uploads to the device that computes them (per ubatch)
    for (const auto & [name, t] : model.tensors_by_name) {
        if (t->buffer != nullptr && ggml_backend_buffer_is_host(t->buffer) && name.rfind("blk.", 0) == 0) {
            return group;
        }
    }
    return 0;
}

// the graphs of a group as one, in a context of its own (the one before freed: its graph is computed or dropped)
static ggml_cgraph * llama_layer_major_merge(ggml_context * & ctx, std::vector<ggml_cgraph *> & graphs) {
    if (ctx != nullptr) {
        ggml_free(ctx);
    }
    const size_t size = ggml_backend_pp_layer_major_size(graphs.data(), (int) graphs.size());
    ggml_init_params params = {
        /*.mem_size   =*/ ggml_graph_overhead_custom(size, false),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ctx = ggml_init(params);
    return ctx == nullptr ? nullptr : ggml_backend_pp_layer_major_graph(ctx, graphs.data(), (int) graphs.size());
}

ggml_cgraph * llama_layer_major::reserve_graph(const llama_context & lctx, uint32_t group, ggml_cgraph * gf,
                                               const llama_ubatch & ubatch, const llama_memory_context_i * mctx,
                                               const build_fn & build) {
    const llama_cparams & cparams = lctx.get_cparams();
    const uint32_t max_nodes = lctx.graph_max_nodes(std::min(cparams.n_ctx, cparams.n_ubatch));
    group = std::min<uint32_t>(group, (uint32_t) ggml_backend_sched_pp_max_group(lctx.get_sched(), max_nodes));
    if (group < 2 || gf == nullptr || ubatch.n_tokens < std::min(cparams.n_ctx, cparams.n_ubatch)) {
        return gf;
    }
    std::vector<ggml_cgraph *> graphs;
    res.clear();
    for (uint32_t k = 0; k + 1 < group; k++) {
        res.push_back(std::make_unique<llm_graph_result>(max_nodes));
        ggml_cgraph * g = build(res.back().get(), ubatch, mctx, 1);
        if (g == nullptr) {
            return nullptr;
        }
        graphs.push_back(g);
    }
    graphs.push_back(gf);
    return llama_layer_major_merge(ctx_merged, graphs);
}

llama_layer_major::llama_layer_major() = default;

llama_layer_major::llama_layer_major(llama_context & lctx, uint32_t group, uint32_t n_tokens_all, uint32_t n_outputs_all,
                                     build_fn build)
    : lctx(&lctx), n_tokens_all(n_tokens_all), n_outputs_all(n_outputs_all), build(std::move(build)) {
    // no larger than the scheduler was made for (its graph size: LAYER_MAJOR as it was at the last reservation)
    const llama_cparams & cparams = lctx.get_cparams();
    const uint32_t max_nodes = lctx.graph_max_nodes(std::min(cparams.n_ctx, cparams.n_ubatch));
    const int fits = lctx.get_sched() != nullptr ? ggml_backend_sched_pp_max_group(lctx.get_sched(), max_nodes) : 1;
    this->group = std::min<uint32_t>(group, (uint32_t) fits);
}

llama_layer_major::~llama_layer_major() {
    if (ctx_merged != nullptr) {
        ggml_free(ctx_merged);
    }
}

// whether every token of `ubatch` comes after the tokens of the ubatches before it in a group, in each of its
// sequences (pos_max: each sequence's last position in those, updated with this ubatch's). Then the KV cells of a
// group's later ubatches are the future for every token of an earlier one: its KQ mask masks them, and is the same
// with them in the cache as without (build_group sets a group's inputs once all of its cells are in).
static bool llama_layer_major_follows(const llama_ubatch & ubatch, std::vector<llama_pos> & pos_max) {
    for (uint32_t t = 0; t < ubatch.n_tokens; t++) {
        for (int32_t s = 0; s < ubatch.n_seq_id[t]; s++) {
            if (ubatch.pos[t] <= pos_max[ubatch.seq_id[t][s]]) {
                return false;
            }
        }
    }
    for (uint32_t t = 0; t < ubatch.n_tokens; t++) {
        for (int32_t s = 0; s < ubatch.n_seq_id[t]; s++) {
            llama_pos & p = pos_max[ubatch.seq_id[t][s]];
            p = std::max(p, ubatch.pos[t]);
        }
    }
    return true;
}

// a memory context `k` ubatches on
static bool llama_layer_major_advance(llama_kv_cache_context & walker, uint32_t k) {
    for (uint32_t j = 0; j < k; j++) {
        if (!walker.next()) {
            return false;
        }
    }
    return true;
}

bool llama_layer_major::take(llama_memory_context_i * mctx, llm_graph_result * & r, ggml_status & status) {
    if (next < n_group) { // computed with the first of its group
        r = res[next++].get();
        status = GGML_STATUS_SUCCESS;
        return true;
    }
    n_group = next = 0;
    auto * kv = group >= 2 ? dynamic_cast<llama_kv_cache_context *>(mctx) : nullptr;
    if (kv == nullptr) {
        return false;
    }
    llama_kv_cache_context probe(*kv);
    std::vector<llama_pos> pos_max(LLAMA_MAX_SEQ, std::numeric_limits<llama_pos>::min());
    llama_layer_major_follows(probe.get_ubatch(), pos_max);
    uint32_t n = 1;
    while (n < group && probe.next() && llama_layer_major_follows(probe.get_ubatch(), pos_max)) {
        n++;
    }
    if (n < 2) {
        return false; // the batch's last ubatch, alone
    }
    if (!build_group(*kv, n, status)) {
        if (status == GGML_STATUS_ALLOC_FAILED) {
            return false; // (no room for the group's graph: llama_decode processes its ubatches one by one)
        }
        r = nullptr;
        return true;
    }
    n_group = n;
    next    = 1;
    r       = res[0].get();
    return true;
}

bool llama_layer_major::build_group(const llama_kv_cache_context & at, uint32_t n, ggml_status & status) {
    llama_context & lc = *lctx;
    ggml_backend_sched_t sched = lc.get_sched();
    const llama_cparams & cparams = lc.get_cparams();
    const uint32_t max_nodes = lc.graph_max_nodes(std::min(cparams.n_ctx, cparams.n_ubatch));
    while (res.size() < n) {
        res.push_back(std::make_unique<llm_graph_result>(max_nodes));
    }
    // one walker (the memory context a graph's inputs read) per thread that sets inputs below, ubatch i on walker
    // i % n_walkers: the masks of later ubatches are larger (n_kv grows), so each thread takes every n_walkers-th
    const uint32_t n_walkers = std::max<uint32_t>(1, std::min<uint32_t>(n, (uint32_t) cparams.n_threads_batch));
    walkers.clear();
    for (uint32_t w = 0; w < n_walkers; w++) {
        walkers.push_back(std::make_unique<llama_kv_cache_context>(at));
    }
    ubatches.clear();
    ubatches.reserve(n);

    ggml_backend_sched_reset(sched);
    ggml_backend_sched_set_eval_callback(sched, cparams.cb_eval, cparams.cb_eval_user_data);

    // each ubatch as llama_decode takes it: its KV cells applied and its graph built
    std::vector<ggml_cgraph *> graphs;
    for (uint32_t i = 0; i < n; i++) {
        llama_kv_cache_context * walker = walkers[i % n_walkers].get();
        if (!llama_layer_major_advance(*walker, i >= n_walkers ? n_walkers : i) || !walker->apply()) {
            LLAMA_LOG_ERROR("%s: failed to apply the memory context of ubatch %u of a group\n", __func__, i);
            forget(1, i);
            status = GGML_STATUS_FAILED;
            return false;
        }
        ubatches.push_back(walker->get_ubatch());
        const llama_ubatch & ubatch = ubatches.back();
        uint32_t n_outputs = 0;
        if (n_outputs_all == n_tokens_all) {
            n_outputs = ubatch.n_tokens;
        } else {
            for (uint32_t t = 0; t < ubatch.n_tokens; t++) {
                n_outputs += ubatch.output[t] != 0 ? 1 : 0;
            }
        }
        ggml_cgraph * gf = build(res[i].get(), ubatch, walker, n_outputs);
        if (gf == nullptr) {
            LLAMA_LOG_ERROR("%s: failed to build the graph of ubatch %u of a group\n", __func__, i);
            forget(1, i + 1);
            status = GGML_STATUS_FAILED;
            return false;
        }
        graphs.push_back(gf);
    }

    ggml_cgraph * merged = llama_layer_major_merge(ctx_merged, graphs);
    if (merged == nullptr || !ggml_backend_sched_alloc_graph(sched, merged)) {
        // no room for it (a group whose ubatches before the last have outputs needs more than the reserved worst
        // case): its KV cells go, and the ubatches run one by one, as do later ones on this scheduler
        LLAMA_LOG_WARN("%s: no room for the graph of a group of %u ubatches: running them one by one\n", __func__, n);
        forget(0, n);
        ggml_backend_sched_pp_note_layer_major(sched, 0);
        group  = 0;
        status = GGML_STATUS_ALLOC_FAILED;
        return false;
    }
    // each ubatch's inputs, straight into the merged graph's memory, on n_walkers threads: with its walker at that
    // ubatch again and the cells of the whole group in the cache, which its KQ mask masks as the future (take()
    // groups only ubatches that follow each other in each sequence). Nothing computes before the last mask is set,
    // so the group's masks (n_kv x n_ubatch each) are filled side by side.
    std::vector<std::exception_ptr> failed(n_walkers);
    auto set_inputs = [&](uint32_t w) {
        try {
            *walkers[w] = at;
            for (uint32_t i = w; i < n; i += n_walkers) {
                llama_layer_major_advance(*walkers[w], i == w ? w : n_walkers);
                res[i]->set_inputs(&ubatches[i]);
            }
        } catch (...) {
            failed[w] = std::current_exception(); // (an abort callback that throws: rethrown on this thread)
        }
    };
    std::vector<std::thread> threads;
    for (uint32_t w = 1; w < n_walkers; w++) {
        threads.emplace_back(set_inputs, w);
    }
    set_inputs(0);
    for (std::thread & t : threads) {
        t.join();
    }
    for (const std::exception_ptr & e : failed) {
        if (e) {
            std::rethrow_exception(e);
        }
    }
    ggml_backend_sched_pp_note_layer_major(sched, (int) n);

    status = lc.graph_compute(merged, true);
    if (status != GGML_STATUS_SUCCESS) {
        LLAMA_LOG_ERROR("%s: failed to compute the graph of a group, compute status: %d\n", __func__, status);
        forget(1, n);
        return false;
    }
    return true;
}

// a group that failed (llama_decode removes its first ubatch's cells) or found no room: the KV cells of its ubatches
// [first, end) go, from each sequence's first position in them on, as llama_decode does for a failed ubatch
void llama_layer_major::forget(uint32_t first, uint32_t end) {
    std::map<llama_seq_id, llama_pos> pos_min;
    for (uint32_t u = first; u < end && u < ubatches.size(); u++) {
        const llama_ubatch & ubatch = ubatches[u];
        for (uint32_t i = 0; i < ubatch.n_tokens; i++) {
            const llama_seq_id s = ubatch.seq_id[i][0];
            const auto it = pos_min.find(s);
            pos_min[s] = it == pos_min.end() ? ubatch.pos[i] : std::min(it->second, ubatch.pos[i]);
        }
    }
    for (const auto & [s, p] : pos_min) {
        LLAMA_LOG_DEBUG("%s: removing memory module entries for seq_id = %d, pos = [%d, +inf)\n", __func__, s, p);
        lctx->get_memory()->seq_rm(s, p, -1);
    }
}
