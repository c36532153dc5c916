// pyllama_pp shim, expert trace: the experts each MoE layer chose for each token, read through llama's eval
// callback from the tensors "ffn_moe_topk-<layer>" (ids [n_expert_used, n_tokens], i32). Works the same in both
// variants: it only asks llama for those tensors and reads them; policy (which tokens, what the ids mean) is Python's.
// Used by `pyllama-pp trace` and the expert-cache simulator (pyllama_pp/expert_cache_sim.py). On request it also keeps
// f32 tensors named "<prefix>-<layer>" (hidden states: bench/prefetch_accuracy.py predicts a layer's experts from them).
#include "trace.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

// one captured prefix: its name with the "-" and the values it may still keep
struct pp_trace_capture_spec {
    std::string prefix;
    int64_t max_values = 0;
    int64_t n_values = 0;
};

struct pp_trace {
    std::mutex mutex;
    int64_t max_ids = 0;
    int64_t dropped = 0;                      // records not kept: past max_ids
    std::vector<pp_trace_record> records;
    std::vector<int32_t> ids;
    std::vector<pp_trace_capture_spec> captures;
    int64_t tensors_dropped = 0;              // tensors not kept: past their prefix's max_values
    std::vector<pp_trace_tensor> tensors;
    std::vector<float> values;
};

#define PP_TRACE_EXPORT extern "C" __attribute__((visibility("default")))

static const char kTopk[] = "ffn_moe_topk-";

// the captured prefix that names t ("<prefix>-<layer>", f32, 2-d at most), or -1
static int capture_of(const pp_trace * tr, const struct ggml_tensor * t) {
    if (t->type != GGML_TYPE_F32 || t->ne[2] != 1 || t->ne[3] != 1) {
        return -1;
    }
    for (size_t i = 0; i < tr->captures.size(); i++) {
        const std::string & p = tr->captures[i].prefix;
        if (strncmp(t->name, p.c_str(), p.size()) != 0) {
            continue;
        }
        const char * d = t->name + p.size();   // exactly "<prefix>-<digits>" (not a view named "... (view)")
        while (*d >= '0' && *d <= '9') {
            d++;
        }
        if (d > t->name + p.size() && *d == '\0') {
            return (int) i;
        }
    }
    return -1;
}

static void capture_tensor(pp_trace * tr, int which, const struct ggml_tensor * t) {
    const int64_t width = t->ne[0], n_tok = t->ne[1];
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    std::lock_guard<std::mutex> lock(tr->mutex);
    pp_trace_capture_spec & c = tr->captures[which];
    if (c.n_values + width * n_tok > c.max_values) {
        tr->tensors_dropped++;
        return;
    }
    c.n_values += width * n_tok;
    tr->tensors.push_back({ which, atoi(t->name + c.prefix.size()), (int32_t) n_tok, (int32_t) width,
                            (int64_t) tr->values.size() });
    for (int64_t i1 = 0; i1 < n_tok; i1++) {
        for (int64_t i0 = 0; i0 < width; i0++) {
            float v;
            memcpy(&v, raw.data() + i1 * t->nb[1] + i0 * t->nb[0], sizeof(v));
            tr->values.push_back(v);
        }
    }
}

bool pp_trace_eval_cb(struct ggml_tensor * t, bool ask, void * user) {
    auto * tr = (pp_trace *) user;
    if (strncmp(t->name, kTopk, sizeof(kTopk) - 1) != 0 || t->type != GGML_TYPE_I32) {
        const int which = capture_of(tr, t);   // (the prefixes are set before any decode: read without the lock)
        if (which < 0) {
            return !ask;   // (asked: not this one; computed: go on)
        }
        if (!ask) {
            capture_tensor(tr, which, t);
        }
        return true;
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
        tr->tensors.clear();
        tr->values.clear();
        tr->tensors_dropped = 0;
        for (auto & c : tr->captures) {
            c.n_values = 0;
        }
    }
}

PP_TRACE_EXPORT int pp_trace_capture(pp_trace * tr, const char * prefix, int64_t max_values) {
    if (!tr || !prefix || !*prefix || max_values <= 0) {
        return pp_shim_fail(PP_ERR_ARG, "a capture needs a trace, a non-empty prefix and max_values > 0");
    }
    std::lock_guard<std::mutex> lock(tr->mutex);
    if (tr->captures.size() >= PP_TRACE_MAX_CAPTURES) {
        return pp_shim_fail(PP_ERR_ARG, "too many captured prefixes (PP_TRACE_MAX_CAPTURES)");
    }
    try {
        pp_trace_capture_spec c;
        c.prefix = std::string(prefix) + "-";
        c.max_values = max_values;
        tr->captures.push_back(c);
    } catch (const std::exception & e) {
        return pp_shim_fail(PP_ERR_MEMORY, e.what());
    }
    return PP_OK;
}

PP_TRACE_EXPORT int pp_trace_tensors_size(pp_trace * tr, int64_t * n_records, int64_t * n_values,
                                          int64_t * n_dropped) {
    if (!tr || !n_records || !n_values || !n_dropped) {
        return pp_shim_fail(PP_ERR_ARG, "null argument");
    }
    std::lock_guard<std::mutex> lock(tr->mutex);
    *n_records = (int64_t) tr->tensors.size();
    *n_values  = (int64_t) tr->values.size();
    *n_dropped = tr->tensors_dropped;
    return PP_OK;
}

PP_TRACE_EXPORT int pp_trace_tensors_get(pp_trace * tr, pp_trace_tensor * records, int64_t max_records,
                                         float * values, int64_t max_values) {
    if (!tr || (!records && max_records > 0) || (!values && max_values > 0)) {
        return pp_shim_fail(PP_ERR_ARG, "null argument");
    }
    std::lock_guard<std::mutex> lock(tr->mutex);
    if (max_records < (int64_t) tr->tensors.size() || max_values < (int64_t) tr->values.size()) {
        return pp_shim_fail(PP_ERR_ARG, "the buffers are smaller than the captured tensors (ask pp_trace_tensors_size "
                                        "first)");
    }
    if (!tr->tensors.empty()) {
        memcpy(records, tr->tensors.data(), sizeof(pp_trace_tensor) * tr->tensors.size());
    }
    if (!tr->values.empty()) {
        memcpy(values, tr->values.data(), sizeof(float) * tr->values.size());
    }
    return PP_OK;
}
