// pyllama_pp: the graph allocator's private structs, shared by ggml-alloc.c and the extension's allocator files
// (ggml-alloc-pp-stable-reserve.c: the kept allocation plans; ggml-alloc-pp-overlap.c: the pool classes)
#pragma once

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-backend-pp.h"
#include "ggml-impl.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef  __cplusplus
extern "C" {
#endif

#define GGML_VBUFFER_MAX_CHUNKS 16

// relative memory address within an allocation that can be split into multiple buffers (chunks)
struct buffer_address {
    int chunk;     // index of a backend buffer
    size_t offset; // local memory offset within the buffer
};

struct ggml_dyn_tallocr;

// virtual buffer with contiguous memory range, split into multiple backend buffers (chunks)

struct vbuffer {
    ggml_backend_buffer_t chunks[GGML_VBUFFER_MAX_CHUNKS];
};

// graph allocator

struct hash_node {
    int n_children;
    int n_views;
    int buffer_id;
    struct buffer_address addr;
    bool allocated;
};

struct tensor_alloc {
    int buffer_id;
    struct buffer_address addr;
    size_t size_max; // 0 = pre-allocated, unused, or view
};

struct leaf_alloc {
    struct tensor_alloc leaf;
};

struct node_alloc {
    struct tensor_alloc dst;
    struct tensor_alloc src[GGML_MAX_SRC];
};

struct ggml_gallocr {
    ggml_backend_buffer_type_t * bufts; // [n_buffers]
    struct vbuffer ** buffers; // [n_buffers]
    struct ggml_dyn_tallocr ** buf_tallocs; // [n_buffers]
    int n_buffers;

    struct ggml_hash_set hash_set;
    struct hash_node * hash_values; // [hash_set.size]

    struct node_alloc * node_allocs; // [n_nodes]
    int n_nodes;

    struct leaf_alloc * leaf_allocs; // [n_leafs]
    int n_leafs;

    // pyllama_pp (PLANS): earlier allocation plans kept for graphs of another shape (ggml_gallocr_pp_keep_plans)
    struct ggml_gallocr_pp_plan * pp_plans; // [pp_n_plans_max]
    int      pp_n_plans_max;
    uint64_t pp_fp;                         // structure fingerprint of the graph the live plan was made for
    uint64_t pp_clock;
    size_t   pp_pool_sizes[GGML_PP_POOL_CLASSES]; // size classes of tensors flagged GGML_TENSOR_FLAG_PP_POOLED
    int      pp_n_pool;
};

// ggml-alloc.c
bool ggml_gallocr_node_needs_realloc(ggml_gallocr_t galloc, struct ggml_tensor * node, struct tensor_alloc * talloc);
bool ggml_gallocr_needs_realloc(ggml_gallocr_t galloc, struct ggml_cgraph * graph);

// ggml-alloc-pp-stable-reserve.c (PLANS)
void ggml_gallocr_pp_plans_free(ggml_gallocr_t galloc);
void ggml_gallocr_pp_stash_live(ggml_gallocr_t galloc, const struct ggml_cgraph * graph);

// ggml-alloc-pp-overlap.c (OVERLAP=2): the size galloc plans for the tensor in a buffer of this type
size_t ggml_gallocr_pp_alloc_size(ggml_gallocr_t galloc, ggml_backend_buffer_type_t buft, const struct ggml_tensor * t);

#ifdef  __cplusplus
}
#endif
