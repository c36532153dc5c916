// pyllama_pp: OVERLAP=2's allocator side - the pool classes of transient expert copies
// (ggml_gallocr_pp_set_pool_sizes)

#include "ggml-alloc-impl.h"

// a tensor flagged GGML_TENSOR_FLAG_PP_POOLED (a transient expert copy) takes the size of
// its pool class (ggml_gallocr_pp_set_pool_sizes): the smallest class at least its own size and at most 1% above
// it, so the copies of a graph rotate through blocks of a few sizes - CUDA pads some of them (a row past the end
// where the rows are not a multiple of 512 values): a down projection's copy would not fit the block a gate's
// copy freed, and each would take fresh memory. A pure function of the tensor's own size: alloc and free agree.
size_t ggml_gallocr_pp_alloc_size(ggml_gallocr_t galloc, ggml_backend_buffer_type_t buft, const struct ggml_tensor * t) {
    const size_t size = ggml_backend_buft_get_alloc_size(buft, t);
    if (t->flags & GGML_TENSOR_FLAG_PP_POOLED) {
        for (int i = 0; i < galloc->pp_n_pool; i++) {
            const size_t c = galloc->pp_pool_sizes[i];
            if (c >= size && size >= c - c / 100) {
                return c;
            }
        }
    }
    return size;
}

void ggml_gallocr_pp_set_pool_sizes(ggml_gallocr_t galloc, const size_t * sizes, int n) {
    galloc->pp_n_pool = 0;
    for (int i = 0; i < n && i < GGML_PP_POOL_CLASSES; i++) {
        galloc->pp_pool_sizes[galloc->pp_n_pool++] = sizes[i];
    }
}
