// pyllama_pp: GATHER - a device copies the experts its routing ids select itself (ggml_backend_pp_gather_t).

#include "ggml-backend-pp-impl.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

// GATHER: gathers registered for a backend registry by name (a library of their own: CUDA's is pyllama_pp's, not
// the backend's), else the registry's own "ggml_backend_pp_gather_v4" (the name of extension version 4: with a mode)
static std::mutex ggml_sched_pp_gather_mutex;

static std::vector<std::pair<std::string, ggml_backend_pp_gather_t>> ggml_sched_pp_gathers;

void ggml_backend_sched_pp_set_gather(const char * reg_name, ggml_backend_pp_gather_t fn) {
    if (reg_name == nullptr) {
        return;
    }
    std::lock_guard<std::mutex> lock(ggml_sched_pp_gather_mutex);
    auto & v = ggml_sched_pp_gathers;
    v.erase(std::remove_if(v.begin(), v.end(), [&](const auto & g) { return g.first == reg_name; }), v.end());
    if (fn != nullptr) {
        v.emplace_back(reg_name, fn);
    }
}

ggml_backend_pp_gather_t ggml_backend_sched_pp_find_gather(ggml_backend_reg_t reg) {
    if (reg == nullptr) {
        return nullptr;
    }
    {
        std::lock_guard<std::mutex> lock(ggml_sched_pp_gather_mutex);
        for (const auto & g : ggml_sched_pp_gathers) {
            if (g.first == ggml_backend_reg_name(reg)) {
                return g.second;
            }
        }
    }
    return (ggml_backend_pp_gather_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_pp_gather_v4");
}

// GATHER may take the expert ops of this backend: it has a gather and the switch is on
bool ggml_backend_sched_pp_gather_possible(ggml_backend_sched_t sched, int backend_id) {
    return sched->pp_gather[backend_id] != nullptr && sched->pp_cfg.gather != 0;
}

// GATHER for the transient copy `cpy` of the pinned host expert tensor `input`, whose op routes by `ids`: the
// device's own host buffer type holds the weight (a kernel can read it), and the ids are int32 in the backend's
// own memory, computed there (`ids_pending`: they are an input of the split not copied yet - then not)
bool ggml_backend_sched_pp_gather_fits(ggml_backend_sched_t sched, int backend_id, const struct ggml_tensor * input,
                                       const struct ggml_tensor * ids, bool transient, bool ids_pending) {
    if (!transient || ids_pending || !ggml_backend_sched_pp_gather_possible(sched, backend_id) || ids->type != GGML_TYPE_I32 ||
        ids->buffer == nullptr || ggml_backend_buffer_get_type(ids->buffer) != sched->bufts[backend_id] ||
        input->buffer == nullptr) {
        return false;
    }
    return ggml_backend_dev_host_buffer_type(ggml_backend_get_device(sched->backends[backend_id])) == ggml_backend_buffer_get_type(input->buffer);
}

// GATHER: queue the device's gather of the experts `ids` selects from `input` into `cpy`, ordered on `via` (the
// split backend, or OVERLAP=2's second stream of its device); false: the gather declined, nothing was queued.
// A PREFETCH (`ids` NULL) counts as a prefetch only; the op counts as a gather where its REST does (its bytes are
// estimated once: experts a prefetch brought in vain are not counted; VDEV's links count them). With OVERLAP=2
// every gather is flagged BESIDE - its early gathers run beside compute, and the flag goes on all of them: the
// CUDA gather's few-block copy pays with OVERLAP=2 and only there (docs/RESULTS.md)
bool ggml_backend_sched_pp_gather(ggml_backend_sched_t sched, int backend_id, ggml_backend_t via,
                                  struct ggml_tensor * input, struct ggml_tensor * cpy, const struct ggml_tensor * ids,
                                  int mode, bool chained) {
    const int beside = sched->pp_cfg.overlap == 2 ? GGML_BACKEND_PP_GATHER_BESIDE : 0;
    const int chain  = chained ? GGML_BACKEND_PP_GATHER_CHAINED : 0;
    ggml_backend_pp_gather_t fn = sched->pp_gather[backend_id];
    // (a device that does not know BESIDE declines it: asked again without; one that declines CHAINED is asked
    // again by the caller, after `via` waited)
    if (!fn(via, cpy, input, ids, mode | beside | chain) && (beside == 0 || !fn(via, cpy, input, ids, mode | chain))) {
        return false;
    }
    if (chained) {
        sched->pp.chained++;
    }
    if (via != sched->backends[backend_id]) {
        sched->pp.overlap_uploads[backend_id]++;
    }
    if (mode == GGML_BACKEND_PP_GATHER_PREFETCH) {
        sched->pp.prefetch++;
        return true;
    }
    sched->pp.gather++;
    sched->pp.weight_uploads[backend_id]++;
    sched->pp.gather_bytes_est[backend_id] += (uint64_t) (ggml_backend_sched_pp_coverage(sched) * (double) ggml_nbytes(input));
    return true;
}
