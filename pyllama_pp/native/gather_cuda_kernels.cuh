// The kernels of pyllama_pp's CUDA gather (gather_cuda.cu), shared with its probe (bench/gather_probe.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pp_gather {

constexpr int kTail            = 512;   // GGML_BACKEND_PP_GATHER_TAIL: bytes after an expert that must be numbers
constexpr int kMaxExperts      = 4096;  // flags in shared memory (16 KiB)
constexpr int kThreads         = 256;
constexpr int kBlocksPerExpert = 32;    // copy_used: enough loads in flight to fill a PCIe 5 link with a few experts

// the threads of one block: flags[e] = 1 (shared memory) for each expert e one of the int32 ids names, else 0
__device__ inline void mark_flags(int * flags, const char * ids, int64_t n_col, int64_t n_row, size_t nb0, size_t nb1,
                                  int n_expert) {
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) {
        flags[i] = 0;
    }
    __syncthreads();
    const int64_t n = n_col * n_row;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
        const int64_t r = k / n_col;
        const int64_t c = k - r * n_col;
        const int     e = *(const int *) (ids + r * nb1 + c * nb0);
        if (e >= 0 && e < n_expert) {
            flags[e] = 1;
        }
    }
    __syncthreads();
}

// one block: used[e] = 1 for each expert e one of the int32 ids names, else 0
__global__ void mark_used(const char * ids, int64_t n_col, int64_t n_row, size_t nb0, size_t nb1, int n_expert, int * used) {
    extern __shared__ int flags[];
    mark_flags(flags, ids, n_col, n_row, nb0, nb1, n_expert);
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) {
        used[i] = flags[i];
    }
}

// the bytes of expert e to copy: the expert and, unless it is the last, the tail after it
__device__ inline size_t expert_span(int e, size_t expert, int n_expert) {
    return expert + (e < n_expert - 1 ? (expert < (size_t) kTail ? expert : (size_t) kTail) : 0);
}

// threads t0, t0 + stride, ... of a grid copy n bytes: 16 bytes at a time, four loads in flight per thread, where
// source, destination and size allow; else byte by byte
__device__ inline void copy_range(char * d, const char * s, size_t n, size_t t0, size_t stride) {
    if ((((uintptr_t) s | (uintptr_t) d | n) & 15) == 0) {
        const uint4 * s4 = (const uint4 *) s;
        uint4 *       d4 = (uint4 *) d;
        const size_t  n4 = n / 16;
        size_t i = t0;
        for (; i + 3 * stride < n4; i += 4 * stride) {
            const uint4 a = s4[i];
            const uint4 b = s4[i + stride];
            const uint4 c = s4[i + 2 * stride];
            const uint4 q = s4[i + 3 * stride];
            d4[i]              = a;
            d4[i + stride]     = b;
            d4[i + 2 * stride] = c;
            d4[i + 3 * stride] = q;
        }
        for (; i < n4; i += stride) {
            d4[i] = s4[i];
        }
    } else {
        for (size_t i = t0; i < n; i += stride) {
            d[i] = s[i];
        }
    }
}

// grid (kBlocksPerExpert, n_expert): the blocks of an unused expert return at once
__global__ void copy_used(char * dst, const char * src, size_t expert, int n_expert, const int * used) {
    const int e = blockIdx.y;
    if (!used[e]) {
        return;
    }
    const size_t begin = (size_t) e * expert;
    copy_range(dst + begin, src + begin, expert_span(e, expert, n_expert),
               (size_t) blockIdx.x * blockDim.x + threadIdx.x, (size_t) gridDim.x * blockDim.x);
}

// grid (N): every block walks every used expert. copy_used's grid (about 1500 blocks of 256 threads for 47 used
// experts) fills every SM while it waits on the link, so compute on another stream cannot run beside it (2 x H200,
// runs 22-25: GATHER's rows sit at transfer + compute, and OVERLAP=2 gained nothing); a few blocks keep enough loads
// in flight for the link and leave the SMs to compute. Experimental (PYLLAMA_PP_GATHER_BLOCKS).
__global__ void copy_used_few(char * dst, const char * src, size_t expert, int n_expert, const int * used) {
    const size_t t0     = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t) gridDim.x * blockDim.x;
    for (int e = 0; e < n_expert; e++) {
        if (used[e]) {
            const size_t begin = (size_t) e * expert;
            copy_range(dst + begin, src + begin, expert_span(e, expert, n_expert), t0, stride);
        }
    }
}

// ---- the copy engine driven from the device (experimental, PYLLAMA_PP_GATHER_MODE=graph) ----------------------
// A CUDA graph per (copy, weight, ids): a kernel node marks the used experts and sets one condition per expert; one
// conditional node per expert holds a memcpy of that expert (and its tail) from pinned host memory. The bytes move
// on the copy engine - no SM waits on the link - and the host still never reads the ids.

// one block: the conditions of a gather graph (1: the expert is used)
__global__ void set_used_conditionals(const char * ids, int64_t n_col, int64_t n_row, size_t nb0, size_t nb1, int n_expert,
                                      const cudaGraphConditionalHandle * handles) {
    extern __shared__ int flags[];
    mark_flags(flags, ids, n_col, n_row, nb0, nb1, n_expert);
    if (threadIdx.x == 0) {   // one thread: concurrent calls of cudaGraphSetConditional are undefined
        for (int i = 0; i < n_expert; i++) {
            cudaGraphSetConditional(handles[i], flags[i] ? 1u : 0u);
        }
    }
}

struct gather_graph {
    cudaGraph_t                  graph   = nullptr;
    cudaGraphExec_t              exec    = nullptr;
    cudaGraphNode_t              set     = nullptr;   // the kernel node: its ids are set before each launch
    cudaGraphConditionalHandle * handles = nullptr;   // n_expert, in device memory (the kernel node reads them)
    int                          n_expert = 0;
};

// the kernel node's parameters for these ids (`args` must outlive the call that uses the result)
inline cudaKernelNodeParams set_node_params(void ** args, int n_expert) {
    cudaKernelNodeParams kp = {};
    kp.func           = (void *) set_used_conditionals;
    kp.gridDim        = dim3(1);
    kp.blockDim       = dim3(1024);
    kp.sharedMemBytes = n_expert * sizeof(int);
    kp.kernelParams   = args;
    return kp;
}

// point the graph's kernel node at these ids (takes effect at the next launch; earlier launches are not affected)
inline cudaError_t set_gather_graph_ids(gather_graph & g, const char * ids, int64_t n_col, int64_t n_row, size_t nb0, size_t nb1) {
    const cudaGraphConditionalHandle * handles = g.handles;
    void * args[] = { (void *) &ids, (void *) &n_col, (void *) &n_row, (void *) &nb0, (void *) &nb1, (void *) &g.n_expert,
                      (void *) &handles };
    const cudaKernelNodeParams kp = set_node_params(args, g.n_expert);
    return cudaGraphExecKernelNodeSetParams(g.exec, g.set, &kp);
}

inline void free_gather_graph(gather_graph & g) {
    if (g.exec != nullptr) { cudaGraphExecDestroy(g.exec); }
    if (g.graph != nullptr) { cudaGraphDestroy(g.graph); }
    if (g.handles != nullptr) { cudaFree(g.handles); }
    g = gather_graph();
}

// the gather graph of (dst, src) on the current device, its kernel node pointed at `ids` (set_gather_graph_ids
// points it at others): cudaSuccess and `out`, or the first error (nothing kept)
inline cudaError_t build_gather_graph(char * dst, const char * src, size_t expert, int n_expert, const char * ids,
                                      int64_t n_col, int64_t n_row, size_t nb0, size_t nb1, gather_graph & out) {
    gather_graph g;
    cudaError_t err = cudaGraphCreate(&g.graph, 0);
    std::vector<cudaGraphConditionalHandle> h((size_t) n_expert);
    for (int e = 0; e < n_expert && err == cudaSuccess; e++) {
        err = cudaGraphConditionalHandleCreate(&h[e], g.graph, 0, cudaGraphCondAssignDefault);
    }
    if (err == cudaSuccess) {
        err = cudaMalloc((void **) &g.handles, n_expert * sizeof(cudaGraphConditionalHandle));
    }
    if (err == cudaSuccess) {
        err = cudaMemcpy(g.handles, h.data(), n_expert * sizeof(cudaGraphConditionalHandle), cudaMemcpyHostToDevice);
    }
    g.n_expert = n_expert;
    if (err == cudaSuccess) {
        const cudaGraphConditionalHandle * handles = g.handles;
        void * args[] = { (void *) &ids, (void *) &n_col, (void *) &n_row, (void *) &nb0, (void *) &nb1, (void *) &n_expert,
                          (void *) &handles };
        const cudaKernelNodeParams kp = set_node_params(args, n_expert);
        err = cudaGraphAddKernelNode(&g.set, g.graph, nullptr, 0, &kp);
    }
    for (int e = 0; e < n_expert && err == cudaSuccess; e++) {
        cudaGraphNodeParams cp = {};
        cp.type               = cudaGraphNodeTypeConditional;
        cp.conditional.handle = h[e];
        cp.conditional.type   = cudaGraphCondTypeIf;
        cp.conditional.size   = 1;
        cudaGraphNode_t node = nullptr;
        err = cudaGraphAddNode(&node, g.graph, &g.set, nullptr, 1, &cp);
        if (err == cudaSuccess) {
            const size_t span = expert + (e < n_expert - 1 ? (expert < (size_t) kTail ? expert : (size_t) kTail) : 0);
            cudaGraphNode_t copy = nullptr;
            err = cudaGraphAddMemcpyNode1D(&copy, cp.conditional.phGraph_out[0], nullptr, 0, dst + (size_t) e * expert,
                                           src + (size_t) e * expert, span, cudaMemcpyHostToDevice);
        }
    }
    if (err == cudaSuccess) {
        err = cudaGraphInstantiate(&g.exec, g.graph, 0);
    }
    if (err != cudaSuccess) {
        (void) cudaGetLastError();
        free_gather_graph(g);
        return err;
    }
    out = g;
    return cudaSuccess;
}

}  // namespace pp_gather
