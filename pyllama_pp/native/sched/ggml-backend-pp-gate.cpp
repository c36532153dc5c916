// pyllama_pp: GATE - while pipelining, a host weight is consumed as one transient device copy per split.

#include "ggml-backend-pp-impl.h"

// A host-resident weight consumed by another backend while pipelining: it gets one transient copy slot
// (a plain node, reused once consumed) instead of n_copies persistent ones.
bool ggml_backend_sched_pp_transient_src(ggml_backend_sched_t sched, const struct ggml_tensor * src) {
    return sched->n_copies > 1 &&
           src->buffer != NULL && ggml_backend_buffer_get_usage(src->buffer) == GGML_BACKEND_BUFFER_USAGE_WEIGHTS &&
           ggml_backend_buffer_is_host(src->buffer);
}

// persistent copies are flagged INPUT|OUTPUT when pipelining; a transient copy is not
bool ggml_backend_sched_pp_is_transient_copy(ggml_backend_sched_t sched, const struct ggml_tensor * input_cpy) {
    return sched->n_copies > 1 && (input_cpy->flags & GGML_TENSOR_FLAG_OUTPUT) == 0;
}

// the transient copy of a host expert tensor that `node` (a split's first node) reads as its weights (split_graph
// has pointed the node's sources at the split-input copies by then)
bool ggml_backend_sched_pp_is_expert_copy(ggml_backend_sched_t sched, const struct ggml_tensor * node,
                                          const struct ggml_tensor * cpy) {
    return node->op == GGML_OP_MUL_MAT_ID && node->src[0] == cpy && ggml_backend_sched_pp_is_transient_copy(sched, cpy);
}
