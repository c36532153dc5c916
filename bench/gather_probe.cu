// Probe of pyllama_pp's CUDA gather kernels (pyllama_pp/native/gather_cuda_kernels.cuh) on one GPU, no model:
// does a gather run beside compute on another stream, or does it take the SMs while it waits on the link?
//
// One expert tensor of the 30B preset (128 experts of 2048 x 768 Q8_0: 1671168 bytes each) in pinned host memory,
// 47 of them used (37%, the skewed rows of docs/RESULTS.md 2g), copied into device memory by
//   - copy_used (the default grid: kBlocksPerExpert blocks per expert), and
//   - copy_used_few with N blocks in all (PYLLAMA_PP_GATHER_BLOCKS=N), for several N;
// each alone, then started together with a compute kernel (FMA loops on every SM, about as long as the gather) on a
// normal-priority stream, the gather on a high-priority one, as the library runs it. Printed per variant: GB/s
// alone, compute alone (ms), both together (ms), and the overlap: 1 - (together - max) / min (1 = fully hidden,
// 0 = serial). Last, "ce-graph": the copy engine driven from the device - the library's gather graph
// (PYLLAMA_PP_GATHER_MODE=graph: conditional memcpy nodes whose conditions a kernel sets from the ids), where the
// CUDA version allows it.
//
//   nvcc -O3 -arch=sm_90 -I pyllama_pp/native bench/gather_probe.cu -o /tmp/gather_probe && /tmp/gather_probe

#include "gather_cuda_kernels.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace pp_gather;

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__global__ void burn(float * out, int iters) {
    float a = threadIdx.x * 1e-3f, b = 1.0001f;
    for (int i = 0; i < iters; i++) {
        a = fmaf(a, b, 1e-7f);
        b = fmaf(b, 0.9999f, 1e-7f);
    }
    if (a == 12345.0f) {
        out[blockIdx.x] = a + b;   // never: keeps the loop
    }
}

struct timer {
    cudaEvent_t a, b;
    timer() { CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b)); }
    float ms() { float t; CHECK(cudaEventElapsedTime(&t, a, b)); return t; }
};

int main(int argc, char ** argv) {
    const size_t expert   = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1671168;
    const int    n_expert = 128;
    const int    n_used   = argc > 2 ? atoi(argv[2]) : 47;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

    char * src = nullptr;
    char * dst = nullptr;
    int *  used = nullptr;
    float * sink = nullptr;
    CHECK(cudaMallocHost((void **) &src, expert * n_expert));
    CHECK(cudaMalloc((void **) &dst, expert * n_expert));
    CHECK(cudaMalloc((void **) &used, n_expert * sizeof(int)));
    CHECK(cudaMalloc((void **) &sink, 65536 * sizeof(float)));
    for (size_t i = 0; i < expert * n_expert; i += 4096) {
        src[i] = (char) i;
    }
    std::vector<int> flags(n_expert, 0);
    size_t bytes = 0;
    for (int k = 0; k < n_used; k++) {
        const int e = (int) ((long long) k * n_expert / n_used);
        flags[e] = 1;
    }
    for (int e = 0; e < n_expert; e++) {
        bytes += flags[e] ? expert + (e < n_expert - 1 ? (expert < (size_t) kTail ? expert : (size_t) kTail) : 0) : 0;
    }
    CHECK(cudaMemcpy(used, flags.data(), n_expert * sizeof(int), cudaMemcpyHostToDevice));

    int least = 0, greatest = 0;
    CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t sg, sc;
    CHECK(cudaStreamCreateWithPriority(&sg, cudaStreamNonBlocking, greatest));
    CHECK(cudaStreamCreateWithPriority(&sc, cudaStreamNonBlocking, least));

    auto gather = [&](int blocks, cudaStream_t s) {
        if (blocks == 0) {
            copy_used<<<dim3(kBlocksPerExpert, n_expert), kThreads, 0, s>>>(dst, src, expert, n_expert, used);
        } else {
            copy_used_few<<<blocks, kThreads, 0, s>>>(dst, src, expert, n_expert, used);
        }
    };
    const int burn_blocks = sms * 8;
    auto compute = [&](int iters, cudaStream_t s) { burn<<<burn_blocks, 256, 0, s>>>(sink, iters); };

    timer t;
    // the copy engine's rate for the same bytes, one copy per used expert
    CHECK(cudaEventRecord(t.a, sg));
    for (int e = 0; e < n_expert; e++) {
        if (flags[e]) {
            CHECK(cudaMemcpyAsync(dst + e * expert, src + e * expert, expert, cudaMemcpyHostToDevice, sg));
        }
    }
    CHECK(cudaEventRecord(t.b, sg));
    CHECK(cudaStreamSynchronize(sg));
    printf("copy engine: %.1f GB/s (%zu bytes)\n", bytes / (t.ms() * 1e6), bytes);

    // calibrate the compute kernel to about the default gather's time
    gather(0, sg);
    CHECK(cudaStreamSynchronize(sg));
    CHECK(cudaEventRecord(t.a, sg));
    gather(0, sg);
    CHECK(cudaEventRecord(t.b, sg));
    CHECK(cudaStreamSynchronize(sg));
    const float g0 = t.ms();
    int iters = 1 << 12;
    float c_ms = 0;
    for (int k = 0; k < 12; k++) {
        CHECK(cudaEventRecord(t.a, sc));
        compute(iters, sc);
        CHECK(cudaEventRecord(t.b, sc));
        CHECK(cudaStreamSynchronize(sc));
        c_ms = t.ms();
        if (c_ms >= g0) {
            break;
        }
        iters *= 2;
    }
    printf("SMs %d; compute kernel: %d blocks x 256 threads, %d iterations, %.2f ms alone\n", sms, burn_blocks, iters, c_ms);
    printf("%-10s %10s %10s %12s %10s\n", "blocks", "GB/s", "alone ms", "together ms", "overlap");
    // the library's gather graph (PYLLAMA_PP_GATHER_MODE=graph), with ids listing the used experts
    std::vector<int> id_list;
    for (int e = 0; e < n_expert; e++) {
        if (flags[e]) {
            id_list.push_back(e);
        }
    }
    int * ids = nullptr;
    CHECK(cudaMalloc((void **) &ids, id_list.size() * sizeof(int)));
    CHECK(cudaMemcpy(ids, id_list.data(), id_list.size() * sizeof(int), cudaMemcpyHostToDevice));
    gather_graph gg;
    const cudaError_t gerr = build_gather_graph(dst, src, expert, n_expert, (const char *) ids, (int64_t) id_list.size(), 1,
                                                sizeof(int), id_list.size() * sizeof(int), gg);
    if (gerr != cudaSuccess) {
        printf("copy engine from the device (conditional graph): not available: %s\n", cudaGetErrorString(gerr));
    }
    cudaGraphExec_t ce = gerr == cudaSuccess ? gg.exec : nullptr;
    const int variants[] = { 0, 8, 16, 32, 48, 64, 128, 264, -1 };   // 0: the grid per expert; -1: the graph
    for (int blocks : variants) {
        if (blocks < 0 && ce == nullptr) {
            continue;
        }
        auto run = [&](cudaStream_t s) {
            if (blocks < 0) {
                CHECK(cudaGraphLaunch(ce, s));
            } else {
                gather(blocks, s);
            }
        };
        CHECK(cudaMemset(dst, 0, expert * n_expert));
        float alone = 0;
        for (int rep = 0; rep < 3; rep++) {   // best of 3
            CHECK(cudaEventRecord(t.a, sg));
            run(sg);
            CHECK(cudaEventRecord(t.b, sg));
            CHECK(cudaStreamSynchronize(sg));
            alone = rep == 0 ? t.ms() : std::min(alone, t.ms());
        }
        // together: both streams start after one event on the compute stream
        cudaEvent_t go, end_g, end_c;
        CHECK(cudaEventCreate(&go));
        CHECK(cudaEventCreate(&end_g));
        CHECK(cudaEventCreate(&end_c));
        CHECK(cudaEventRecord(t.a, sc));
        CHECK(cudaEventRecord(go, sc));
        CHECK(cudaStreamWaitEvent(sg, go, 0));
        compute(iters, sc);
        run(sg);
        CHECK(cudaEventRecord(end_g, sg));
        CHECK(cudaStreamWaitEvent(sc, end_g, 0));
        CHECK(cudaEventRecord(t.b, sc));
        CHECK(cudaStreamSynchronize(sc));
        const float both = t.ms();
        const float lo = std::min(alone, c_ms), hi = std::max(alone, c_ms);
        printf("%-10s %10.1f %10.2f %12.2f %10.2f\n",
               blocks == 0 ? "per-expert" : blocks < 0 ? "ce-graph" : std::to_string(blocks).c_str(),
               bytes / (alone * 1e6), alone, both, 1.0f - (both - hi) / lo);
        // each variant's bytes: the used experts equal the source (sampled)
        std::vector<char> back(expert);
        for (int e = 0; e < n_expert; e++) {
            if (flags[e]) {
                CHECK(cudaMemcpy(back.data(), dst + e * expert, expert, cudaMemcpyDeviceToHost));
                for (size_t i = 0; i < expert; i += 4096) {
                    if (back[i] != src[e * expert + i]) {
                        printf("MISMATCH: %d blocks, expert %d byte %zu\n", blocks, e, i);
                        return 1;
                    }
                }
            }
        }
        CHECK(cudaEventDestroy(go));
        CHECK(cudaEventDestroy(end_g));
        CHECK(cudaEventDestroy(end_c));
    }
    printf("every variant's gathered bytes match the source (sampled every 4 KiB)\n");
    return 0;
}
