// pyllama_pp shim, expert trace: the experts each MoE layer chose for each token, read through llama's eval
// callback from the tensors "ffn_moe_topk-<layer>" (ids [n_expert_used, n_tokens], i32). Works the same in both
// variants: it only asks llama for those tensors and reads them; policy (which tokens, what the ids mean) is Python's.
// Used by `pyllama-pp trace` and the expert-cache simulator (pyllama_pp/expert_cache_sim.py).
#include "trace.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <vector>

struct pp_trace {
    std::mutex mutex;
    int64_t max_ids = 0;
    int64_t dropped = 0;                      // records not kept: past max_ids
    std::vector<pp_trace_record> records;
    std::vector<int32_t> ids;
};

#define PP_TRACE_EXPORT extern "C" __attribute__((visibility("default")))

static const char kTopk[] = "ffn_moe_topk-";

bool pp_trace_eval_cb(struct ggml_tensor * t, bool ask, void * user) {
    auto * tr = (pp_trace *) user;
    if (strncmp(t->name, kTopk, sizeof(kTopk) - 1) != 0 || t->type != GGML_TYPE_I32) {
        return !ask;   // (asked: not this one; computed: go on)
    }
    if (ask) {
        return true;
    }
    // the top-k ids are usually a strided view of the argsort result: read its bytes, index by strides
    const int64_t k = t->ne[0], n_tok = t->ne[1];
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    std::lock_guard<std::mutex> lock(tr->mutex);
    if ((int64_t) tr->ids.size() + k * n_tok > tr->max_ids) {
        tr->dropped++;
        return true;
    }
    tr->records.push_back({ atoi(t->name + sizeof(kTopk) - 1), (int32_t) n_tok, (int32_t) k, (int64_t) tr->ids.size() });
    for (int64_t i1 = 0; i1 < n_tok; i1++) {
        for (int64_t i0 = 0; i0 < k; i0++) {
            int32_t id;
            memcpy(&id, raw.data() + i1 * t->nb[1] + i0 * t->nb[0], sizeof(id));
            tr->ids.push_back(id);
        }
    }
    return true;
}

PP_TRACE_EXPORT pp_trace * pp_trace_new(int64_t max_ids) {
    if (max_ids <= 0) {
        pp_shim_fail(PP_ERR_ARG, "a trace needs max_ids > 0");
        return nullptr;
    }
    try {
        auto * tr = new pp_trace();
        tr->max_ids = max_ids;
        return tr;
    } catch (const std::exception & e) {
        pp_shim_fail(PP_ERR_MEMORY, e.what());
        return nullptr;
    }
}

PP_TRACE_EXPORT void pp_trace_free(pp_trace * tr) {
    delete tr;
}

PP_TRACE_EXPORT int pp_trace_size(pp_trace * tr, int64_t * n_records, int64_t * n_ids,
                                                         int64_t * n_dropped) {
    if (!tr || !n_records || !n_ids || !n_dropped) {
        return pp_shim_fail(PP_ERR_ARG, "null argument");
    }
    std::lock_guard<std::mutex> lock(tr->mutex);
    *n_records = (int64_t) tr->records.size();
    *n_ids     = (int64_t) tr->ids.size();
    *n_dropped = tr->dropped;
    return PP_OK;
}

PP_TRACE_EXPORT int pp_trace_get(pp_trace * tr, pp_trace_record * records, int64_t max_records,
                                                        int32_t * ids, int64_t max_ids) {
    if (!tr || (!records && max_records > 0) || (!ids && max_ids > 0)) {
        return pp_shim_fail(PP_ERR_ARG, "null argument");
    }
    std::lock_guard<std::mutex> lock(tr->mutex);
    if (max_records < (int64_t) tr->records.size() || max_ids < (int64_t) tr->ids.size()) {
        return pp_shim_fail(PP_ERR_ARG, "the buffers are smaller than the trace (ask pp_trace_size first)");
    }
    if (!tr->records.empty()) {
        memcpy(records, tr->records.data(), sizeof(pp_trace_record) * tr->records.size());
    }
    if (!tr->ids.empty()) {
        memcpy(ids, tr->ids.data(), sizeof(int32_t) * tr->ids.size());
    }
    return PP_OK;
}

PP_TRACE_EXPORT void pp_trace_clear(pp_trace * tr) {
    if (tr) {
        std::lock_guard<std::mutex> lock(tr->mutex);
        tr->records.clear();
        tr->ids.clear();
        tr->dropped = 0;
    }
}
