// pyllama_pp: OWNER_OFFLOAD - an offloaded host-weight op runs on the backend that owns its layer.

#include "ggml-backend-pp-impl.h"

// The backend that owns the layer of an op on a host weight: the first non-CPU backend already assigned
// to one of its other sources, following views and first sources a few steps (the activation comes
// from the layer's norm or from the previous expert op). -1 if none is known yet.
int ggml_backend_sched_pp_owner_backend(ggml_backend_sched_t sched, struct ggml_tensor * op, const struct ggml_tensor * weight) {
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        struct ggml_tensor * t = op->src[i];
        if (t == NULL || t == weight) {
            continue;
        }
        for (int depth = 0; t != NULL && depth < 8; depth++) {
            if (t->buffer != NULL && ggml_backend_buffer_get_usage(t->buffer) == GGML_BACKEND_BUFFER_USAGE_WEIGHTS) {
                break; // another weight: no owner information
            }
            const int id = tensor_backend_id(t);
            if (id != -1) {
                if (id < sched->n_backends - 1) {
                    return id;
                }
                break;
            }
            t = t->view_src != NULL ? t->view_src : t->src[0];
        }
    }
    return -1;
}

// OWNER_OFFLOAD: the backend an op on a host weight is offloaded to when it is the layer's owner, else -1
// (the first backend that wants it, as upstream)
int ggml_backend_sched_pp_offload_owner(ggml_backend_sched_t sched, struct ggml_tensor * tensor, const struct ggml_tensor * src) {
    if (sched->pp_cfg.owner_offload == 0) {
        return -1;
    }
    const int b = ggml_backend_sched_pp_owner_backend(sched, tensor, src);
    // an empty op (no rows: the last layer of a ubatch without outputs) also stays with the
    // owner: on the CPU it would force a host sync on the owner every ubatch, for nothing
    const bool empty = ggml_nelements(tensor) == 0;
    // while pipelining, an op too small to offload (the output rows of the last layer)
    // stays with its owner when the graph offloads the others: node backends then stay
    // those of the reserved graph, so the output ubatch does not re-reserve (a full drain)
    // (expert ops only: a dense host weight would be uploaded whole for a few rows)
    const bool tail = sched->n_copies > 1 && sched->pp_graph_offloads && tensor->op == GGML_OP_MUL_MAT_ID;
    if (b != -1 && ggml_backend_supports_op(sched->backends[b], tensor)) {
        const bool want = ggml_backend_offload_op(sched->backends[b], tensor);
        sched->pp_graph_offloads |= want && !empty;
        if (want || empty || tail) {
            sched->pp.offload_owner++;
            return b;
        }
    }
    return -1;
}
