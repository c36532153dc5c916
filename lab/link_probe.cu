// Probe: how fast can one GPU read a set of experts out of pinned host memory, by method? (The gather
// kernels read at 48-51 GB/s while a large cudaMemcpy moves 55 GB/s over the same link; at low coverage the link
// is the bottleneck, so that gap is the gap to 85% of the bound).
//
// One expert tensor of the 30B preset (128 experts of 1671168 bytes, Q8_0 2048 x 768) in pinned host memory, n_used
// of them used (spread evenly), each copied with the 512-byte tail after it, as the gather does. Methods:
//   - memcpy: cudaMemcpyAsync of the whole tensor (the link's reference rate), then one copy per used expert on 1, 2
//     or 4 streams (round robin), then copies of a fixed size (the rate per copy size);
//   - kernel: pyllama_pp's gather kernel (copy_used_few, N blocks) and one with 8 loads in flight per thread;
//   - bulk: Hopper's bulk copy (cp.async.bulk global -> shared -> global, one thread per block, `stages` chunks of
//     `chunk` bytes in flight per block), N blocks.
// Every method's copy is checked byte for byte against the source for the used experts. Rates are bytes / time of
// the best of 5 (events on the stream).
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -I pyllama_pp/native lab/link_probe.cu -o /tmp/link_probe && /tmp/link_probe [n_used] [device]

#include "gather_cuda_kernels.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

using namespace pp_gather;

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

// 8 loads of 16 bytes in flight per thread (copy_range has 4)
__device__ inline void copy_range8(char * d, const char * s, size_t n, size_t t0, size_t stride) {
    const uint4 * s4 = (const uint4 *) s;
    uint4 *       d4 = (uint4 *) d;
    const size_t  n4 = n / 16;
    size_t i = t0;
    for (; i + 7 * stride < n4; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            v[k] = s4[i + k * stride];
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            d4[i + k * stride] = v[k];
        }
    }
    for (; i < n4; i += stride) {
        d4[i] = s4[i];
    }
}

__global__ void copy_used_few8(char * dst, const char * src, size_t expert, int n_expert, const int * used) {
    const size_t t0     = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t) gridDim.x * blockDim.x;
    for (int e = 0; e < n_expert; e++) {
        if (used[e]) {
            const size_t begin = (size_t) e * expert;
            copy_range8(dst + begin, src + begin, expert_span(e, expert, n_expert), t0, stride);
        }
    }
}


// the used spans as one index space of 16-byte words: a thread's loads run on from one expert into the next, so no
// thread drains its loads at an expert's end (copy_used_few walks the experts one after the other)
__global__ void copy_used_flat(char * dst, const char * src, size_t expert, int n_expert, const int * used) {
    constexpr int kMax = 1024;   // (the probe's tensor has 128)
    __shared__ int          list[kMax];
    __shared__ unsigned long long pre[kMax + 1];
    __shared__ int          n_list;
    __shared__ int          fl[kMax];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        fl[e] = used[e];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int n = 0;
        pre[0] = 0;
        for (int e = 0; e < n_expert; e++) {
            if (fl[e]) {
                list[n] = e;
                pre[n + 1] = pre[n] + expert_span(e, expert, n_expert) / 16;
                n++;
            }
        }
        n_list = n;
    }
    __syncthreads();
    const int    n      = n_list;
    const unsigned long long total = pre[n];
    const size_t t0     = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t) gridDim.x * blockDim.x;
    int c[4] = {0, 0, 0, 0};
    for (size_t i = t0; i < total; i += 4 * stride) {
        uint4 v[4];
        size_t at[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const size_t w = i + k * stride;
            if (w < total) {
                while (pre[c[k] + 1] <= w) {
                    c[k]++;
                }
                at[k] = (size_t) list[c[k]] * (expert / 16) + (w - pre[c[k]]);
                v[k] = ((const uint4 *) src)[at[k]];
            }
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (i + k * stride < total) {
                ((uint4 *) dst)[at[k]] = v[k];
            }
        }
    }
}

__device__ inline unsigned smem_addr(const void * p) {
    return (unsigned) __cvta_generic_to_shared(p);
}

// one thread per block: the used experts' spans cut into chunks of `chunk` bytes, chunk k to block k % gridDim.x;
// each block keeps `stages` loads (host -> shared memory) in flight, and writes each chunk back with a bulk store
__global__ void copy_used_bulk(char * dst, const char * src, size_t expert, int n_expert, const int * used,
                               unsigned chunk, int stages) {
    extern __shared__ __align__(128) unsigned char buf[];
    __shared__ __align__(8) unsigned long long bar[8];
    if (threadIdx.x != 0) {
        return;
    }
    for (int s = 0; s < stages; s++) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bar[s])));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // my chunks, in order: walk the used experts
    struct piece { size_t off; unsigned len; };
    const size_t G = gridDim.x;
    size_t k = 0;            // global chunk index
    int e = 0;
    size_t pos = 0;          // within expert e's span
    auto next = [&](piece & p) -> bool {   // the next chunk of this block
        for (;;) {
            while (e < n_expert && !used[e]) {
                e++;
            }
            if (e >= n_expert) {
                return false;
            }
            const size_t span = expert_span(e, expert, n_expert);
            const unsigned len = (unsigned) (span - pos < chunk ? span - pos : chunk);
            const size_t off = (size_t) e * expert + pos;
            const bool mine = k % G == blockIdx.x;
            k++;
            pos += len;
            if (pos >= span) {
                pos = 0;
                e++;
            }
            if (mine) {
                p = { off, len };
                return true;
            }
        }
    };
    piece inflight[8];
    bool  live[8]  = {false};
    unsigned phase[8] = {0};
    auto issue = [&](int s) {
        const unsigned b = smem_addr(&bar[s]);
        asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" :: "r"(b),
                     "r"(inflight[s].len) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_addr(buf + (size_t) s * chunk)), "l"(src + inflight[s].off), "r"(inflight[s].len),
                        "r"(b) : "memory");
    };
    int n_in = 0;
    for (int s = 0; s < stages; s++) {
        live[s] = next(inflight[s]);
        if (live[s]) {
            issue(s);
            n_in++;
        }
    }
    for (int s = 0; n_in > 0; s = (s + 1) % stages) {
        if (!live[s]) {
            continue;
        }
        const unsigned b = smem_addr(&bar[s]);
        unsigned done = 0;
        while (!done) {
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(b), "r"(phase[s]) : "memory");
        }
        phase[s] ^= 1;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(dst + inflight[s].off), "r"(smem_addr(buf + (size_t) s * chunk)), "r"(inflight[s].len)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");   // stage s's buffer is free again
        live[s] = next(inflight[s]);
        if (live[s]) {
            issue(s);
        } else {
            n_in--;
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

static size_t host_span(int e, size_t expert, int n_expert) {   // expert_span on the host
    return expert + (e < n_expert - 1 ? std::min(expert, (size_t) kTail) : 0);
}

static unsigned char pattern(size_t i) {
    return (unsigned char) (((i * 2654435761ull) >> 24) | 1);
}

int main(int argc, char ** argv) {
    setvbuf(stdout, nullptr, _IONBF, 0);
    const int    n_used   = argc > 1 ? atoi(argv[1]) : 51;    // 40% of 128: the low-coverage rows
    const int    dev      = argc > 2 ? atoi(argv[2]) : 0;
    const size_t expert   = 1671168;
    const int    n_expert = 128;
    CHECK(cudaSetDevice(dev));
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const size_t total = expert * n_expert;
    unsigned char * src = nullptr;
    char * dst = nullptr;
    int * used = nullptr;
    CHECK(cudaMallocHost((void **) &src, total));
    CHECK(cudaMalloc((void **) &dst, total));
    CHECK(cudaMalloc((void **) &used, n_expert * sizeof(int)));
    for (size_t i = 0; i < total; i++) {
        src[i] = pattern(i);
    }
    std::vector<int> flags(n_expert, 0);
    for (int k = 0; k < n_used; k++) {
        flags[(int) ((long long) k * n_expert / n_used)] = 1;
    }
    size_t bytes = 0;
    for (int e = 0; e < n_expert; e++) {
        if (flags[e]) {
            bytes += expert + (e < n_expert - 1 ? std::min(expert, (size_t) kTail) : 0);
        }
    }
    CHECK(cudaMemcpy(used, flags.data(), n_expert * sizeof(int), cudaMemcpyHostToDevice));
    cudaStream_t st[4];
    for (auto & s : st) {
        CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    }
    cudaEvent_t a, b, j[4];
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (auto & x : j) {
        CHECK(cudaEventCreate(&x));
    }
    std::vector<unsigned char> back(total);
    printf("device %d, %d SMs; %d of %d experts of %zu bytes, %zu bytes a gather\n", dev, sms, n_used, n_expert, expert, bytes);
    printf("%-34s %8s %9s %s\n", "method", "GB/s", "ms", "check");

    // time `body` (queued on st[0], which may fork to other streams and join back): best of 5; check the used spans
    auto measure = [&](const std::string & name, size_t nbytes, bool check, const std::function<void()> & body) {
        float best = 1e30f;
        for (int rep = 0; rep < 6; rep++) {
            if (rep == 1) {
                CHECK(cudaMemsetAsync(dst, 0, total, st[0]));
            }
            CHECK(cudaEventRecord(a, st[0]));
            body();
            CHECK(cudaGetLastError());
            CHECK(cudaEventRecord(b, st[0]));
            CHECK(cudaStreamSynchronize(st[0]));
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, a, b));
            if (rep > 0) {
                best = std::min(best, ms);
            }
        }
        size_t bad = 0;
        if (check) {
            CHECK(cudaMemcpy(back.data(), dst, total, cudaMemcpyDeviceToHost));
            for (int e = 0; e < n_expert; e++) {
                if (flags[e]) {
                    const size_t begin = (size_t) e * expert, span = host_span(e, expert, n_expert);
                    for (size_t i = 0; i < span; i++) {
                        bad += back[begin + i] != src[begin + i];
                    }
                }
            }
        }
        printf("%-34s %8.1f %9.3f %s\n", name.c_str(), nbytes / (best * 1e6), best,
               check ? (bad ? ("WRONG " + std::to_string(bad)).c_str() : "ok") : "-");
    };
    auto fork = [&](int n) {
        CHECK(cudaEventRecord(j[0], st[0]));
        for (int i = 1; i < n; i++) {
            CHECK(cudaStreamWaitEvent(st[i], j[0], 0));
        }
    };
    auto join = [&](int n) {
        for (int i = 1; i < n; i++) {
            CHECK(cudaEventRecord(j[i], st[i]));
            CHECK(cudaStreamWaitEvent(st[0], j[i], 0));
        }
    };

    measure("memcpy whole tensor", total, false, [&] {
        CHECK(cudaMemcpyAsync(dst, src, total, cudaMemcpyHostToDevice, st[0]));
    });
    for (int ns : {1, 2, 4}) {
        measure("memcpy per expert, " + std::to_string(ns) + " stream(s)", bytes, true, [&] {
            fork(ns);
            int k = 0;
            for (int e = 0; e < n_expert; e++) {
                if (flags[e]) {
                    const size_t off = (size_t) e * expert;
                    CHECK(cudaMemcpyAsync(dst + off, src + off, host_span(e, expert, n_expert),
                                          cudaMemcpyHostToDevice, st[k++ % ns]));
                }
            }
            join(ns);
        });
    }
    for (size_t sz : {(size_t) 65536, (size_t) 262144, (size_t) 1 << 20, (size_t) 1671168, (size_t) 4 << 20, (size_t) 16 << 20}) {
        const size_t n = std::min(total / sz, (size_t) 64);
        measure("memcpy " + std::to_string(n) + " x " + std::to_string(sz >> 10) + " KiB, 1 stream", n * sz, false, [&] {
            for (size_t i = 0; i < n; i++) {
                CHECK(cudaMemcpyAsync(dst + i * sz, src + i * sz, sz, cudaMemcpyHostToDevice, st[0]));
            }
        });
    }
    for (int blocks : {16, 32, 66, 132, 264}) {
        measure("kernel 4 in flight, " + std::to_string(blocks) + " blocks", bytes, true, [&] {
            launch_copy(blocks, st[0], dst, (const char *) src, expert, n_expert, used);
        });
        measure("kernel 8 in flight, " + std::to_string(blocks) + " blocks", bytes, true, [&] {
            copy_used_few8<<<blocks, kThreads, 0, st[0]>>>(dst, (const char *) src, expert, n_expert, used);
        });
    }
    for (int blocks : {16, 32, 132}) {
        measure("flat kernel, " + std::to_string(blocks) + " blocks", bytes, true, [&] {
            copy_used_flat<<<blocks, kThreads, 0, st[0]>>>(dst, (const char *) src, expert, n_expert, used);
        });
    }
    int max_smem = 0;
    CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    CHECK(cudaFuncSetAttribute(copy_used_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem - 1024));
    for (unsigned chunk : {8192u, 16384u, 32768u}) {
        for (int stages : {2, 4, 6}) {
            if ((size_t) chunk * stages > (size_t) max_smem - 1024) {
                continue;
            }
            for (int blocks : {16, 32, 66, 132}) {
                measure("bulk " + std::to_string(chunk >> 10) + " KiB x " + std::to_string(stages) + ", " +
                        std::to_string(blocks) + " blocks", bytes, true, [&] {
                    copy_used_bulk<<<blocks, 32, (size_t) chunk * stages, st[0]>>>(dst, (const char *) src, expert,
                                                                                  n_expert, used, chunk, stages);
                });
            }
        }
    }
    return 0;
}
