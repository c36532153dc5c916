// pyllama_pp: DIRECT - a GPU kernel reads the used experts from pinned host memory itself.

#include "ggml-backend-pp-impl.h"

#include <unordered_map>
#include <unordered_set>

// DIRECT on a backend: the switch (2: on), or with -1 (auto) on where no other stage shares the backend's host
// link - on a shared link the kernels' slow reads take link time from the other stages' copies
static bool ggml_backend_sched_pp_direct_on(ggml_backend_sched_t sched, int backend_id) {
    const int64_t mode = sched->pp_cfg.direct;
    return mode >= 0 ? mode > 0 : sched->pp_own_link[backend_id];
}

// DIRECT may take an expert op of this backend (its other conditions are decided per op). Not on the first GPU
// (the first stage): it keeps the selective copy - its readbacks block the host only while the later stages work
// through what is already queued for them, and the copy engine reads faster
bool ggml_backend_sched_pp_direct_possible(ggml_backend_sched_t sched, int backend_id) {
    return sched->pp_direct_dev[backend_id] && ggml_backend_sched_pp_direct_on(sched, backend_id) &&
           backend_id != sched->pp_first_gpu;
}

// DIRECT: instead of reading the routing ids back on the host (a sync that stops the pipeline) and copying the
// used experts, let the kernel on the device read the used experts itself from pinned host memory (a GPU maps
// its host buffer type into its address space; the CUDA backend already computes on it for integrated GPUs).
// Only for a transient MUL_MAT_ID copy that no later split reads (so every copy slot is the same tensor), on a
// GPU of a backend known to run kernels on pinned host memory (CUDA: unified addressing; VDEV: host memory)
// whose own host buffer type holds the weight, while pipelining, in a graph split for this compute (a reused
// graph may replay a CUDA graph captured with the other pointer), and never where the graph should measure the
// coverage (upload-all's refresh here; the first expert op with nothing in flight: ggml_backend_sched_pp_expert_path
// asks after this), which the selective copy does: the coverage still steers upload-all.
// Kernels may read past a row into the padding the device's buffer type adds (CUDA's MMQ steps through rows 256
// values at a time, 512 for FP4 types): past the last expert that is whatever follows in host memory. DIRECT
// takes tensors the device pads with nothing, and rows of a whole number of such steps.
// (A debug build of the CUDA backend asserts that sources are in its own buffers: release builds only.)
bool ggml_backend_sched_pp_direct_fits(ggml_backend_sched_t sched, int backend_id, struct ggml_tensor * input,
                                       bool transient, int64_t n_sel, int64_t n_expert) {
    // (transient copies exist only while pipelining; the caller has read the weight's buffer)
    if (!transient || !sched->pp_graph_fresh || sched->pp_measure_now || !ggml_backend_sched_pp_direct_possible(sched, backend_id)) {
        return false;
    }
    if (sched->pp_shared_copies != nullptr && sched->pp_shared_copies->count(tensor_copy(input, backend_id, 0))) {
        return false;
    }
    const bool no_padding = ggml_backend_buft_get_alloc_size(sched->bufts[backend_id], input) <= ggml_nbytes(input);
    const int64_t step = input->type == GGML_TYPE_MXFP4 || input->type == GGML_TYPE_NVFP4 ? 512 : 256;
    if (!no_padding && input->ne[0] % step != 0) {
        return false;
    }
    if (ggml_backend_dev_host_buffer_type(ggml_backend_get_device(sched->backends[backend_id])) != ggml_backend_buffer_get_type(input->buffer)) {
        return false;
    }
    // a kernel reads an expert's weights once per tile of tokens (CUDA's MMQ: up to 128): with more tokens per
    // used expert than that, reading host memory again costs more than the readback it saves
    const int64_t max_tokens = 128;
    const double  cov        = ggml_backend_sched_pp_coverage(sched);
    return (double) n_sel <= (double) max_tokens * cov * (double) n_expert;
}

// after the splits are known (OVERLAP, DIRECT): the split-input copies (of copy slot 0) that a node of a later
// split reads too. A copy is made once per backend and graph, at its first split; a node of a later split on the
// same backend may read it too (a weight used twice): such a copy must live until its last use - ggml-alloc's job -
// and hold the data, so it can neither take a lane nor be skipped by a direct read.
void ggml_backend_sched_pp_find_shared_copies(ggml_backend_sched_t sched) {
    if (sched->pp_shared_copies == nullptr) {
        sched->pp_shared_copies = new std::unordered_set<const ggml_tensor *>();
    }
    std::unordered_set<const ggml_tensor *> & shared = *sched->pp_shared_copies;
    shared.clear();
    bool direct = false;
    for (int b = 0; b < sched->n_backends; b++) {
        direct = direct || ggml_backend_sched_pp_direct_possible(sched, b);
    }
    if (sched->n_copies < 2 || (sched->pp_cfg.overlap == 0 && !direct)) {
        return;
    }
    std::unordered_map<const ggml_tensor *, int> owner;
    for (int i = 0; i < sched->n_splits; i++) {
        const ggml_backend_sched_split * split = &sched->splits[i];
        for (int j = 0; j < split->n_inputs; j++) {
            const ggml_tensor * cpy = tensor_copy(split->inputs[j], split->backend_id, 0);
            if (ggml_backend_sched_pp_is_transient_copy(sched, cpy)) { // (both readers ask about transient copies only)
                owner[cpy] = i;
            }
        }
    }
    for (int i = 0; i < sched->n_splits; i++) {
        const ggml_backend_sched_split * split = &sched->splits[i];
        for (int n = 0; n < split->graph.n_nodes; n++) {
            for (int k = 0; k < GGML_MAX_SRC; k++) {
                const ggml_tensor * src = split->graph.nodes[n]->src[k];
                auto it = src != nullptr ? owner.find(src) : owner.end();
                if (it != owner.end() && it->second != i) {
                    shared.insert(src);
                }
            }
        }
    }
}
