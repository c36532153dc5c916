// The kernels of pyllama_pp's CUDA gather (gather_cuda.cu), shared with its probe (lab/gather_probe.cu).
#pragma once

#include "gather_abi.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pp_gather {

using pp_gather_abi::kTail;
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

// the bytes of expert e to copy: the expert and, unless it is the last, the tail after it
__device__ inline size_t expert_span(int e, size_t expert, int n_expert) {
    return expert + (e < n_expert - 1 ? (expert < (size_t) kTail ? expert : (size_t) kTail) : 0);
}

// one thread: add the bytes the copy of the experts flagged in `sel` reads over the link to *counted (host memory
// mapped into the device, read by the host once the copies are done; if `counted`), and store them in *rec (the
// gather's timeline record, PYLLAMA_PP_GATHER_TIMELINE; if `rec`)
__device__ inline void count_bytes(unsigned long long * counted, unsigned long long * rec, const int * sel, size_t expert,
                                   int n_expert) {
    if (counted == nullptr && rec == nullptr) {
        return;
    }
    unsigned long long sum = 0;
    for (int i = 0; i < n_expert; i++) {
        sum += sel[i] ? (unsigned long long) expert_span(i, expert, n_expert) : 0ull;
    }
    if (counted != nullptr) {
        *(volatile unsigned long long *) counted += sum;   // (one stream per GPU: its kernels never overlap)
    }
    if (rec != nullptr) {
        *(volatile unsigned long long *) rec = sum;
    }
}

// one thread: *at = the device's global timer (ns), where the stream reaches it (PYLLAMA_PP_GATHER_TIMELINE)
__global__ void stamp(unsigned long long * at) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    *(volatile unsigned long long *) at = t;
}

// one block, for every gather with ids: with the flags of the experts the int32 ids name, need[i] = flag and not
// pref[i] (without `pref`: the flag; with it, the experts a prefetch did not bring) and last[i] = flag (the weight's
// last used set, for the next prefetch; if `last`)
__global__ void mark_rest(const char * ids, int64_t n_col, int64_t n_row, size_t nb0, size_t nb1, int n_expert,
                          const int * pref, int * need, int * last, size_t expert, unsigned long long * counted,
                          unsigned long long * rec) {
    extern __shared__ int flags[];
    mark_flags(flags, ids, n_col, n_row, nb0, nb1, n_expert);
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) {
        if (last != nullptr) {
            last[i] = flags[i];
        }
        need[i] = flags[i] && !(pref != nullptr && pref[i]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        count_bytes(counted, rec, need, expert, n_expert);
    }
}

// a prefetch (one block): pref = last (the set it copies, kept for the rest after it)
__global__ void copy_flags(int * dst, const int * src, int n, size_t expert, unsigned long long * counted,
                           unsigned long long * rec) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        dst[i] = src[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        count_bytes(counted, rec, dst, expert, n);
    }
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

// grid (N): every block walks every used expert (PYLLAMA_PP_GATHER_BLOCKS=N). copy_used's grid takes every SM while
// it waits on the link, so compute on another stream barely overlaps it; a few blocks in all move the same bytes and
// leave the SMs to that compute (lab/gather_probe.cu measures both). That pays only where a gather has compute beside
// it (OVERLAP=2's early gathers of up and down); without it a gather waits for its own routing ids and its op waits
// for it, and the grid is a little faster (the measurements: docs/results/history-2026-11.md, section 2h).
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

// queue the copy of the experts flagged in `used` on `stream`: `blocks` blocks in all (copy_used_few), or with 0 the
// grid of kBlocksPerExpert blocks per expert (copy_used)
inline void launch_copy(int blocks, cudaStream_t stream, char * dst, const char * src, size_t expert, int n_expert,
                        const int * used) {
    if (blocks > 0) {
        copy_used_few<<<blocks, kThreads, 0, stream>>>(dst, src, expert, n_expert, used);
    } else {
        copy_used<<<dim3(kBlocksPerExpert, n_expert), kThreads, 0, stream>>>(dst, src, expert, n_expert, used);
    }
}

}  // namespace pp_gather
