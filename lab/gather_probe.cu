// Probe of pyllama_pp's CUDA gather (pyllama_pp/native/gather_cuda_kernels.cuh) on one GPU, no model: does a gather
// run beside compute on another stream, or does it take the SMs while it waits on the link?
//
// One expert tensor of the 30B preset (128 experts of 2048 x 768 Q8_0: 1671168 bytes each) in pinned host memory,
// 47 of them used (37%, the coverage of the low-coverage rows), copied into device memory by
//   - copy_used (the default grid: kBlocksPerExpert blocks per expert),
//   - copy_used_few with N blocks in all (PYLLAMA_PP_GATHER_BLOCKS=N), for
//     several N;
// each alone, then together with a compute kernel on a normal-priority stream (the gather on a high-priority one,
// as the library runs it). The compute kernel is many short passes of FMA blocks, so it refills SM slots as they
// free up, as a tiled matmul does; both start behind one event. Printed per variant: GB/s alone, the gather alone
// (ms), compute alone (ms), both together (ms: the median of 5, with the fastest and slowest), and the overlap: 1 - (together - max) / min (1: the shorter one is
// fully hidden; 0: serial) from the median. Each variant's copy is checked byte for byte (used experts and their tails; unused
// experts stay zero past the tail of the expert before).
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -I pyllama_pp/native lab/gather_probe.cu -o /tmp/gather_probe && /tmp/gather_probe

#include "gather_cuda_kernels.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

__global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

struct timer {
    cudaEvent_t a, b;
    timer() { CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b)); }
    float ms() { float t; CHECK(cudaEventElapsedTime(&t, a, b)); return t; }
};

static unsigned char pattern(size_t i) {
    return (unsigned char) (((i * 2654435761ull) >> 24) | 1);   // never 0
}

int main(int argc, char ** argv) {
    setvbuf(stdout, nullptr, _IONBF, 0);   // every row out at once, even if a later one hangs
    const size_t expert   = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1671168;
    const int    n_expert = 128;
    const int    n_used   = argc > 2 ? atoi(argv[2]) : 47;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

    const size_t total = expert * n_expert;
    unsigned char * src = nullptr;
    char * dst = nullptr;
    int *  used = nullptr;
    float * sink = nullptr;
    CHECK(cudaMallocHost((void **) &src, total));
    CHECK(cudaMalloc((void **) &dst, total));
    CHECK(cudaMalloc((void **) &used, n_expert * sizeof(int)));
    CHECK(cudaMalloc((void **) &sink, 1 << 22));
    for (size_t i = 0; i < total; i++) {
        src[i] = pattern(i);
    }
    std::vector<int> flags(n_expert, 0);
    for (int k = 0; k < n_used; k++) {
        flags[(int) ((long long) k * n_expert / n_used)] = 1;
    }
    std::vector<int> id_list;
    size_t bytes = 0;
    for (int e = 0; e < n_expert; e++) {
        if (flags[e]) {
            id_list.push_back(e);
            bytes += expert + (e < n_expert - 1 ? std::min(expert, (size_t) kTail) : 0);
        }
    }
    CHECK(cudaMemcpy(used, flags.data(), n_expert * sizeof(int), cudaMemcpyHostToDevice));
    int * ids = nullptr;
    CHECK(cudaMalloc((void **) &ids, id_list.size() * sizeof(int)));
    CHECK(cudaMemcpy(ids, id_list.data(), id_list.size() * sizeof(int), cudaMemcpyHostToDevice));

    int least = 0, greatest = 0;
    CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t sg, sc, s0;
    CHECK(cudaStreamCreateWithPriority(&sg, cudaStreamNonBlocking, greatest));
    CHECK(cudaStreamCreateWithPriority(&sc, cudaStreamNonBlocking, least));
    CHECK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));

    timer t;
    // the copy engine's rate for the same bytes, host-driven: one copy per used expert and its tail (warmed up)
    for (int rep = 0; rep < 2; rep++) {
        CHECK(cudaEventRecord(t.a, sg));
        for (int e : id_list) {
            const size_t span = expert + (e < n_expert - 1 ? std::min(expert, (size_t) kTail) : 0);
            CHECK(cudaMemcpyAsync(dst + e * expert, src + e * expert, span, cudaMemcpyHostToDevice, sg));
        }
        CHECK(cudaEventRecord(t.b, sg));
        CHECK(cudaStreamSynchronize(sg));
    }
    printf("copy engine, host-driven: %.1f GB/s (%zu bytes, %d of %d experts)\n", bytes / (t.ms() * 1e6), bytes, n_used, n_expert);

    auto gather = [&](int blocks, cudaStream_t s) {   // 0: the grid per expert
        launch_copy(blocks, s, dst, (const char *) src, expert, n_expert, used);
        CHECK(cudaGetLastError());
    };
    const int burn_blocks = sms * 8 * 32;   // 32 passes of a full GPU: slots free up and refill all along
    auto compute = [&](int iters, cudaStream_t s) { burn<<<burn_blocks, 256, 0, s>>>(sink, iters); CHECK(cudaGetLastError()); };

    // calibrate the compute kernel to about the default gather's time
    gather(0, sg);
    CHECK(cudaStreamSynchronize(sg));
    CHECK(cudaEventRecord(t.a, sg));
    gather(0, sg);
    CHECK(cudaEventRecord(t.b, sg));
    CHECK(cudaStreamSynchronize(sg));
    const float g0 = t.ms();
    int iters = 64;
    float c_ms = 0;
    for (int k = 0; k < 16; k++) {
        CHECK(cudaEventRecord(t.a, sc));
        compute(iters, sc);
        CHECK(cudaEventRecord(t.b, sc));
        CHECK(cudaStreamSynchronize(sc));
        c_ms = t.ms();
        if (c_ms >= 0.9f * g0) {
            break;
        }
        iters = (int) std::min<double>(iters * 8.0, iters * (double) g0 / std::max(c_ms, 1e-3f));
    }
    printf("SMs %d; default gather %.2f ms; compute kernel: %d blocks x 256 threads, %d iterations, %.2f ms alone\n",
           sms, g0, burn_blocks, iters, c_ms);
    printf("%-10s %8s %10s %10s %12s %14s %8s\n", "gather", "GB/s", "alone ms", "compute ms", "together ms", "(min - max)", "overlap");

    cudaEvent_t go, end_g;
    CHECK(cudaEventCreate(&go));
    CHECK(cudaEventCreate(&end_g));
    std::vector<unsigned char> back(total);
    const int variants[] = { 0, 4, 8, 12, 16, 24, 32, 64, 132, 264 };   // 0: the grid per expert
    for (int blocks : variants) {
        CHECK(cudaMemsetAsync(dst, 0, total, sg));
        float alone = 0;
        for (int rep = 0; rep < 3; rep++) {   // best of 3
            CHECK(cudaEventRecord(t.a, sg));
            gather(blocks, sg);
            CHECK(cudaEventRecord(t.b, sg));
            CHECK(cudaStreamSynchronize(sg));
            alone = rep == 0 ? t.ms() : std::min(alone, t.ms());
        }
        // the copy, byte for byte: used experts and their tails from the source, every other byte still zero
        CHECK(cudaMemcpy(back.data(), dst, total, cudaMemcpyDeviceToHost));
        size_t bad = 0;
        for (int e = 0; e < n_expert; e++) {
            const size_t begin = (size_t) e * expert;
            const bool   tail_before = e > 0 && flags[e - 1];
            for (size_t i = 0; i < expert; i++) {
                const bool copied = flags[e] || (tail_before && i < std::min(expert, (size_t) kTail));
                if (back[begin + i] != (copied ? src[begin + i] : 0)) {
                    bad++;
                }
            }
        }
        // together: both streams wait behind a short spin on a third one; the gather is queued first
        std::vector<float> both_ms;
        for (int rep = 0; rep < 5; rep++) {
            spin<<<1, 1, 0, s0>>>(1000000);
            CHECK(cudaEventRecord(go, s0));
            CHECK(cudaStreamWaitEvent(sg, go, 0));
            CHECK(cudaStreamWaitEvent(sc, go, 0));
            CHECK(cudaEventRecord(t.a, s0));
            gather(blocks, sg);
            compute(iters, sc);
            CHECK(cudaEventRecord(end_g, sg));
            CHECK(cudaStreamWaitEvent(sc, end_g, 0));
            CHECK(cudaEventRecord(t.b, sc));
            CHECK(cudaStreamSynchronize(sc));
            both_ms.push_back(t.ms());
        }
        std::sort(both_ms.begin(), both_ms.end());
        const float both = both_ms[2];
        const float lo = std::min(alone, c_ms), hi = std::max(alone, c_ms);
        const std::string spread = "(" + std::to_string(both_ms[0]).substr(0, 4) + " - " + std::to_string(both_ms[4]).substr(0, 4) + ")";
        printf("%-10s %8.1f %10.2f %10.2f %12.2f %14s %8.2f%s\n",
               blocks == 0 ? "per-expert" : (std::to_string(blocks) + " blocks").c_str(),
               bytes / (alone * 1e6), alone, c_ms, both, spread.c_str(), 1.0f - (both - hi) / lo,
               bad ? (" BYTES WRONG: " + std::to_string(bad)).c_str() : "");
    }
    return 0;
}
