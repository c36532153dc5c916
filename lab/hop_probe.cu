// Probe: what does a cross-stream event hop cost on the GPU? (On 2x H200 the CUDA gathers of one GPU sat ~55 us
// apart in the gather timeline, on both GPUs, even between two gathers with no dependency between them.
// Each gather waits on an event recorded on the scheduler's stream (`via`), which itself waits on the gather
// before: a round trip gather stream -> via -> gather stream.)
//
// Two spin kernels with a %globaltimer stamp at the end of the first and the start of the second; the gap between
// them (median of 50) for:
//   same stream          k1; k2
//   one hop              G: k1, record e1; V: wait e1; k2 on V
//   round trip           G: k1, record e1; V: wait e1, record e2; G: wait e2; k2 on G   (the gather's chain)
// with events created with and without timing.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 lab/hop_probe.cu -o /tmp/hop_probe && /tmp/hop_probe

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__device__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// spin for `ns`, then stamp the end (first kernel) / stamp the start (second kernel)
__global__ void k_end(unsigned long long * at, unsigned long long ns) {
    const unsigned long long t0 = now();
    while (now() - t0 < ns) {
    }
    *at = now();
}

__global__ void k_start(unsigned long long * at) {
    *at = now();
}

int main() {
    unsigned long long * st = nullptr;
    CHECK(cudaMallocHost((void **) &st, 2 * sizeof(unsigned long long)));
    cudaStream_t g, v;
    CHECK(cudaStreamCreateWithFlags(&g, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&v, cudaStreamNonBlocking));
    for (int timing = 0; timing < 2; timing++) {
        cudaEvent_t e1, e2;
        const unsigned flags = timing ? cudaEventDefault : cudaEventDisableTiming;
        CHECK(cudaEventCreateWithFlags(&e1, flags));
        CHECK(cudaEventCreateWithFlags(&e2, flags));
        for (int mode = 0; mode < 3; mode++) {
            std::vector<double> gaps;
            for (int rep = 0; rep < 51; rep++) {
                k_end<<<1, 1, 0, g>>>(&st[0], 200000);   // 200 us: everything below is queued before it ends
                cudaStream_t second = g;
                if (mode >= 1) {
                    CHECK(cudaEventRecord(e1, g));
                    CHECK(cudaStreamWaitEvent(v, e1, 0));
                    second = v;
                }
                if (mode == 2) {
                    CHECK(cudaEventRecord(e2, v));
                    CHECK(cudaStreamWaitEvent(g, e2, 0));
                    second = g;
                }
                k_start<<<1, 1, 0, second>>>(&st[1]);
                CHECK(cudaDeviceSynchronize());
                if (rep > 0) {
                    gaps.push_back((double) (st[1] - st[0]) / 1e3);
                }
            }
            std::sort(gaps.begin(), gaps.end());
            printf("%-12s events %-9s gap p10 %6.1f  p50 %6.1f  p90 %6.1f us\n",
                   mode == 0 ? "same stream" : mode == 1 ? "one hop" : "round trip", timing ? "timed" : "untimed",
                   gaps[gaps.size() / 10], gaps[gaps.size() / 2], gaps[9 * gaps.size() / 10]);
        }
    }
    return 0;
}
