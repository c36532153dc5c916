// pyllama_pp's GATHER for CUDA devices (the patched scheduler's ggml_backend_pp_gather_t, ggml-backend-pp.h).
//
// Below the upload-all bar the scheduler copies only the experts a MUL_MAT_ID uses. Upstream reads the routing ids
// back on the host for that (a sync per expert op, which stops the pipeline); DIRECT lets the matmul kernel read
// host memory itself (once per tile of tokens, at about half the copy engine's rate). This library does the copy on
// the device instead: one kernel marks the experts the ids (in device memory) name, a second copies those experts
// from pinned host memory (mapped: the same pointer on the device) into the device copy with 16-byte loads. Each
// byte crosses the link once and the host never waits.
//
// Ordering without access to the backend's stream: an event recorded on the backend is waited for on a stream of
// this library (high priority, so its blocks are scheduled ahead of waiting compute blocks), and the backend waits
// for an event recorded behind the copy. A ggml CUDA event's context is its cudaEvent_t.
//
// Built only with the CUDA backend, as a library of its own next to the backend modules (not a backend: the
// loader does not pick it up); the shim registers it with the patched scheduler for the "CUDA" registry.

#include "ggml-backend.h"
#include "ggml-backend-impl.h"

#include "gather_cuda_kernels.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>
#include <unistd.h>
#include <unordered_map>
#include <vector>

namespace {

using namespace pp_gather;

// one per physical device (virtual CUDA devices of one GPU share it; so do a scheduler's backends and their second
// streams): bounded by the device count, kept for the process. `mutex` covers a whole gather - the events and the
// flags are reused by the next one.
struct gather_stream {
    std::mutex           mutex;
    bool                 usable = false;    // false: setting it up failed once; never tried again
    cudaStream_t         stream = nullptr;
    int *                used   = nullptr;  // kMaxExperts flags on the device
    ggml_backend_event_t before = nullptr;  // recorded on the calling backend, waited for here
    ggml_backend_event_t after  = nullptr;  // recorded here, waited for on the calling backend
    // PREFETCH: per weight (host data) its last used set, per copy (device data) the set the last prefetch brought
    // (n_expert flags each on the device, zeroed when made; a few hundred per model)
    std::unordered_map<const void *, int *> last;
    std::unordered_map<const void *, int *> pref;
    // the bytes each ggml device's gathers read over the link, counted by the kernels into host memory mapped into
    // the device (kMaxCounted slots; pp_gather_cuda_counted reads them)
    unsigned long long * counted_host = nullptr;
    unsigned long long * counted_dev  = nullptr;
    // PYLLAMA_PP_GATHER_TIMELINE: a ring of kTimeline records in mapped host memory (the kernels write them), with
    // each record's mode, weight and host time of queueing (CLOCK_REALTIME, ns: the GPUs' global timer runs on the
    // same clock here, so t0 - queued tells whether the host queued the gather ahead of the GPU or just in time);
    // nullptr: not recorded
    struct record { unsigned long long t0, t1, bytes; };
    record *                 tl_host = nullptr;
    record *                 tl_dev  = nullptr;
    std::vector<int>         tl_mode, tl_weight;
    std::vector<unsigned long long> tl_queued;
    size_t                   tl_n    = 0;
};
constexpr int    kMaxCounted = 64;
constexpr size_t kTimeline   = 1 << 16;

// n zeroed bytes of pinned host memory mapped into the current device: the host pointer, with the device's in
// *dev; nullptr (nothing held) where it cannot be had
void * mapped_zeroed(size_t n, void ** dev) {
    void * host = nullptr;
    if (cudaHostAlloc(&host, n, cudaHostAllocMapped) != cudaSuccess || cudaHostGetDevicePointer(dev, host, 0) != cudaSuccess) {
        (void) cudaGetLastError();
        if (host != nullptr) {
            cudaFreeHost(host);
        }
        return nullptr;
    }
    memset(host, 0, n);
    return host;
}

std::mutex                               g_mutex;
std::unordered_map<int, gather_stream *> g_streams;  // CUDA device -> its stream
std::unordered_map<std::string, unsigned long long *> g_counted;  // ggml device name -> its count (host side; g_mutex)

// the count of ggml device `dev` on g's GPU (device pointer), a slot taken on first use; nullptr: not counted
unsigned long long * counted_for(gather_stream * g, ggml_backend_dev_t dev) {
    if (g->counted_host == nullptr) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    const std::string name = ggml_backend_dev_name(dev);
    auto it = g_counted.find(name);
    if (it != g_counted.end()) {
        const ptrdiff_t slot = it->second - g->counted_host;
        return slot >= 0 && slot < kMaxCounted ? g->counted_dev + slot : nullptr;   // (another GPU's: not here)
    }
    int used = 0;
    for (const auto & [n, p] : g_counted) {
        used += p >= g->counted_host && p < g->counted_host + kMaxCounted;
    }
    if (used >= kMaxCounted) {
        return nullptr;
    }
    g_counted[name] = g->counted_host + used;
    return g->counted_dev + used;
}

constexpr int kBesideBlocks = 16;   // a gather with compute beside it (OVERLAP=2: leaves the SMs to that compute),
                                    // and every prefetch (always beside compute, whatever PYLLAMA_PP_GATHER_BLOCKS says)

// the copy kernel's blocks: by default kBesideBlocks in all (copy_used_few) where compute may run beside the copy
// (the scheduler's BESIDE flag, OVERLAP=2), else the grid of kBlocksPerExpert blocks per expert (copy_used: 0; 1-2%
// faster where nothing runs beside it: docs/RESULTS.md); PYLLAMA_PP_GATHER_BLOCKS=N sets N blocks in all for every
// gather, 0 the grid (gather_cuda_kernels.cuh)
int copy_blocks(bool beside) {
    static const int n = [] {
        const char * v = getenv("PYLLAMA_PP_GATHER_BLOCKS");
        const int    x = v != nullptr && *v != '\0' ? atoi(v) : -1;
        return x >= 0 && x <= 1024 ? x : -1;
    }();
    return n >= 0 ? n : (beside ? kBesideBlocks : 0);
}

// PYLLAMA_PP_GATHER_TIMELINE=PREFIX (a diagnosis, off by default): each gather's start and end on its GPU's
// stream (the device's global timer, ns) and bytes, written at exit to PREFIX.<pid>.csv; bench/gather_timeline.py
// reads it (where the link waits, and for what)
const char * timeline_prefix() {
    static const char * p = [] {
        const char * v = getenv("PYLLAMA_PP_GATHER_TIMELINE");
        return v != nullptr && *v != '\0' ? v : nullptr;
    }();
    return p;
}

// the host's clock for the timeline's queued_ns (CLOCK_REALTIME, ns)
unsigned long long realtime_ns() {
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long) ts.tv_sec * 1000000000ull + (unsigned long long) ts.tv_nsec;
}

std::vector<std::string>                 g_weight_names;   // under g_mutex
std::unordered_map<const void *, int>    g_weight_ids;

int weight_id(const ggml_tensor * src) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_weight_ids.find(src->data);
    if (it != g_weight_ids.end()) {
        return it->second;
    }
    g_weight_names.emplace_back(src->name);
    return g_weight_ids[src->data] = (int) g_weight_names.size() - 1;
}

void write_timeline();

// the timeline ring of g (mapped host memory), set up with g; registered for writing at exit after CUDA's own
// exit handler (so it runs first)
void timeline_setup(gather_stream * g) {
    void * dev_ptr = nullptr;
    g->tl_host = (gather_stream::record *) mapped_zeroed(kTimeline * sizeof(gather_stream::record), &dev_ptr);
    if (g->tl_host == nullptr) {
        fprintf(stderr, "pyllama_pp: PYLLAMA_PP_GATHER_TIMELINE: no mapped host memory for the timeline; not recorded\n");
        return;
    }
    g->tl_dev = (gather_stream::record *) dev_ptr;
    g->tl_mode.assign(kTimeline, -1);
    g->tl_weight.assign(kTimeline, -1);
    g->tl_queued.assign(kTimeline, 0);
    static std::once_flag once;
    std::call_once(once, [] { atexit(write_timeline); });
}

using namespace pp_gather_abi;   // the modes of ggml_backend_pp_gather_t (gather_abi.h)

constexpr size_t kMaxFlagSets   = 4096;   // per GPU and kind: weights x copies stay far below

// the flag set of `key` in `sets` (n_expert ints, zeroed on the stream when made); nullptr: the cap is reached or
// the device has no memory (then the caller declines)
int * flag_set(std::unordered_map<const void *, int *> & sets, const void * key, cudaStream_t stream) {
    auto it = sets.find(key);
    if (it != sets.end()) {
        return it->second;
    }
    int * p = nullptr;
    if (sets.size() >= kMaxFlagSets || cudaMalloc((void **) &p, kMaxExperts * sizeof(int)) != cudaSuccess) {
        (void) cudaGetLastError();
        return nullptr;
    }
    if (cudaMemsetAsync(p, 0, kMaxExperts * sizeof(int), stream) != cudaSuccess) {
        (void) cudaGetLastError();
        cudaFree(p);
        return nullptr;
    }
    sets[key] = p;
    return p;
}

bool is_cuda(ggml_backend_dev_t dev) {
    const char * reg = dev != nullptr ? ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)) : nullptr;
    return reg != nullptr && strcmp(reg, "CUDA") == 0;
}

// the CUDA device of device memory p, or -1
int device_of(const void * p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

// the CUDA device behind a ggml CUDA device, from its PCI bus id (virtual devices of one GPU carry a "-v<N>"
// suffix); -1 where unknown
int physical_of(ggml_backend_dev_t dev) {
    static std::unordered_map<ggml_backend_dev_t, int> known;   // under g_mutex
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = known.find(dev);
    if (it != known.end()) {
        return it->second;
    }
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    int device = -1;
    if (props.device_id != nullptr) {
        std::string id = props.device_id;
        const size_t v = id.rfind("-v");
        if (v != std::string::npos) {
            id.resize(v);
        }
        if (cudaDeviceGetByPCIBusId(&device, id.c_str()) != cudaSuccess) {
            (void) cudaGetLastError();
            device = -1;
        }
    }
    known[dev] = device;
    return device;
}

// the stream of CUDA device `device`, set up on first use with events of the ggml device `dev` (whose physical GPU
// must be `device`); nullptr where setting it up failed (remembered: nothing is retried, nothing leaks)
gather_stream * stream_for(int device, ggml_backend_dev_t dev) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_streams.find(device);
    if (it != g_streams.end()) {
        return it->second->usable ? it->second : nullptr;
    }
    auto * g = new gather_stream();
    g_streams[device] = g;
    int least = 0, greatest = 0, current = -1;
    bool ok = cudaSetDevice(device) == cudaSuccess &&
              cudaDeviceGetStreamPriorityRange(&least, &greatest) == cudaSuccess &&
              cudaStreamCreateWithPriority(&g->stream, cudaStreamNonBlocking, greatest) == cudaSuccess &&
              cudaMalloc((void **) &g->used, kMaxExperts * sizeof(int)) == cudaSuccess;
    if (ok) {   // (no count where mapped host memory cannot be had: the gathers still run)
        void * dev_ptr = nullptr;
        g->counted_host = (unsigned long long *) mapped_zeroed(kMaxCounted * sizeof(unsigned long long), &dev_ptr);
        g->counted_dev  = (unsigned long long *) dev_ptr;
        if (timeline_prefix() != nullptr) {
            timeline_setup(g);
        }
        g->before = ggml_backend_event_new(dev);   // (leaves the current device at dev's physical GPU)
        g->after  = ggml_backend_event_new(dev);
        ok = g->before != nullptr && g->after != nullptr && cudaGetDevice(&current) == cudaSuccess && current == device;
    }
    if (!ok) {
        (void) cudaGetLastError();
        if (g->before != nullptr) { ggml_backend_event_free(g->before); g->before = nullptr; }
        if (g->after  != nullptr) { ggml_backend_event_free(g->after);  g->after  = nullptr; }
        if (g->used   != nullptr) { cudaFree(g->used);                  g->used   = nullptr; }
        if (g->counted_host != nullptr) { cudaFreeHost(g->counted_host); g->counted_host = nullptr; g->counted_dev = nullptr; }
        if (g->tl_host != nullptr) { cudaFreeHost(g->tl_host); g->tl_host = nullptr; g->tl_dev = nullptr; }
        if (g->stream != nullptr) { cudaStreamDestroy(g->stream);       g->stream = nullptr; }
        (void) cudaGetLastError();
        return nullptr;
    }
    g->usable = true;
    return g;
}

}  // namespace

// The contract (ggml-backend-pp.h): false only with nothing queued; once the copy is queued, true - if the event
// behind it cannot be recorded, the host waits for the copy instead.
// PREFETCH (mode 1, no ids): the experts of src's last used set on this GPU (false where none was recorded yet);
// REST (mode 2): the used experts the last prefetch into dst did not bring. Every gather with ids records its set.
// BESIDE (flag 16): compute may run beside the copy - the copy takes a few blocks then (copy_blocks).
extern "C" __attribute__((visibility("default")))
bool pp_gather_cuda_v4(ggml_backend_t backend, struct ggml_tensor * dst, const struct ggml_tensor * src,
                       const struct ggml_tensor * ids, int mode) {
    const bool beside  = (mode & kBeside) != 0;
    const bool chained = (mode & kChained) != 0;   // (the gathers of a device run in order on its one stream)
    mode &= ~(kBeside | kChained);
    const bool prefetch = mode == kPrefetch;
    if ((mode != kUsed && mode != kPrefetch && mode != kRest) || (ids == nullptr) != prefetch ||
        (ids != nullptr && (ids->data == nullptr || ids->type != GGML_TYPE_I32 || ids->ne[2] != 1 || ids->ne[3] != 1))) {
        return false;
    }
    if (backend == nullptr || dst == nullptr || src == nullptr || dst->data == nullptr || src->data == nullptr ||
        src->ne[2] < 1 || src->ne[2] > kMaxExperts || src->ne[3] != 1 || !ggml_is_contiguous(src) ||
        !ggml_is_contiguous(dst) || ggml_nbytes(dst) != ggml_nbytes(src) || dst->nb[2] != src->nb[2]) {
        return false;
    }
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    if (!is_cuda(dev)) {
        return false;
    }
    (void) cudaGetLastError();   // an error another component left must not read as ours
    // the source: host memory the device reads through the same pointer (pinned by the CUDA host buffer type)
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, src->data) != cudaSuccess || a.type != cudaMemoryTypeHost || a.devicePointer != src->data) {
        (void) cudaGetLastError();
        return false;
    }
    // the copy, the ids and the backend's stream on one GPU (events are recorded on the backend's stream)
    const int device = device_of(dst->data);
    const int physical = physical_of(dev);   // (-1: no bus id to tell; then the pointers' device is trusted)
    if (device < 0 || (ids != nullptr && device_of(ids->data) != device) || (physical >= 0 && physical != device)) {
        return false;
    }
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) {
        (void) cudaGetLastError();
        prev = -1;
    }
    gather_stream * g = stream_for(device, dev);
    if (g == nullptr) {
        if (prev >= 0) {
            cudaSetDevice(prev);
        }
        return false;
    }
    unsigned long long * counted = counted_for(g, dev);   // (before g->mutex: counted_for and weight_id take g_mutex)
    const int weight = g->tl_dev != nullptr ? weight_id(src) : -1;
    const unsigned long long queued_at = g->tl_dev != nullptr ? realtime_ns() : 0;
    std::lock_guard<std::mutex> lock(g->mutex);
    bool queued = false;
    const int n_expert = (int) src->ne[2];
    if (cudaSetDevice(device) == cudaSuccess) {
        // the flag sets first (nothing queued yet if they cannot be had)
        int * last = nullptr, * pref = nullptr, * need = g->used;
        bool ready = true;
        if (prefetch) {
            auto it = g->last.find(src->data);
            last = it != g->last.end() ? it->second : nullptr;
            pref = last != nullptr ? flag_set(g->pref, dst->data, g->stream) : nullptr;
            ready = pref != nullptr;
        } else {
            last = flag_set(g->last, src->data, g->stream);   // (none: the gather goes on without recording)
            if (mode == kRest) {
                auto it = g->pref.find(dst->data);
                pref = it != g->pref.end() ? it->second : nullptr;   // (none: every used expert)
            }
        }
        if (ready) {
            if (!chained) {
                ggml_backend_event_record(g->before, backend);
            }
            if (chained || cudaStreamWaitEvent(g->stream, (cudaEvent_t) g->before->context, 0) == cudaSuccess) {
                gather_stream::record * rec = nullptr;   // (the timeline's; where recorded)
                if (g->tl_dev != nullptr) {
                    const size_t i = g->tl_n++ % kTimeline;
                    g->tl_host[i] = {0, 0, 0};
                    g->tl_mode[i]   = mode;
                    g->tl_weight[i] = weight;
                    g->tl_queued[i] = queued_at;
                    rec = g->tl_dev + i;
                    stamp<<<1, 1, 0, g->stream>>>(&rec->t0);
                }
                // the flags (a prefetch: its set; a gather: the used experts it still needs), then the copy
                if (prefetch) {
                    copy_flags<<<1, 1024, 0, g->stream>>>(pref, last, n_expert, src->nb[2], counted,
                                                          rec != nullptr ? &rec->bytes : nullptr);
                } else {
                    mark_rest<<<1, 1024, n_expert * sizeof(int), g->stream>>>((const char *) ids->data, ids->ne[0], ids->ne[1],
                                                                               ids->nb[0], ids->nb[1], n_expert, pref, need, last,
                                                                               src->nb[2], counted,
                                                                               rec != nullptr ? &rec->bytes : nullptr);
                }
                if (cudaGetLastError() == cudaSuccess) {
                    launch_copy(prefetch ? kBesideBlocks : copy_blocks(beside), g->stream, (char *) dst->data,
                                (const char *) src->data, src->nb[2], n_expert, prefetch ? pref : need);
                    if (rec != nullptr) {
                        stamp<<<1, 1, 0, g->stream>>>(&rec->t1);
                    }
                    queued = cudaGetLastError() == cudaSuccess;
                }
            }
            (void) cudaGetLastError();
        }
    }
    if (queued) {
        if (cudaEventRecord((cudaEvent_t) g->after->context, g->stream) == cudaSuccess) {
            ggml_backend_event_wait(backend, g->after);
        } else {
            (void) cudaGetLastError();
            cudaStreamSynchronize(g->stream);   // no event to order the backend after the copy: wait for it here
        }
    }
    (void) cudaGetLastError();
    if (prev >= 0) {
        cudaSetDevice(prev);
    }
    return queued;
}

// the bytes the gathers of ggml device `dev_name` (e.g. "CUDA0") have read over the link so far, prefetches
// included (what the kernels flagged, counted on the device: complete once the copies are); -1 where none counted
extern "C" __attribute__((visibility("default")))
long long pp_gather_cuda_counted(const char * dev_name) {
    if (dev_name == nullptr) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_counted.find(dev_name);
    return it != g_counted.end() ? (long long) *(volatile unsigned long long *) it->second : -1;
}

namespace {

// at exit (PYLLAMA_PP_GATHER_TIMELINE=PREFIX): every recorded gather, oldest first, to PREFIX.<pid>.csv - its GPU,
// order, mode (gather_abi.h), weight, start and end (ns, the GPU's global timer; 0: not reached), bytes read and
// when the host queued it (ns, CLOCK_REALTIME)
void write_timeline() {
    std::lock_guard<std::mutex> lock(g_mutex);
    const std::string path = std::string(timeline_prefix()) + "." + std::to_string(getpid()) + ".csv";
    FILE * f = fopen(path.c_str(), "w");
    if (f == nullptr) {
        fprintf(stderr, "pyllama_pp: PYLLAMA_PP_GATHER_TIMELINE: cannot write %s\n", path.c_str());
        return;
    }
    fprintf(f, "gpu,seq,mode,weight,t0_ns,t1_ns,bytes,queued_ns\n");
    for (const auto & [device, g] : g_streams) {
        if (g->tl_host == nullptr) {
            continue;
        }
        std::lock_guard<std::mutex> glock(g->mutex);
        if (cudaSetDevice(device) != cudaSuccess || cudaStreamSynchronize(g->stream) != cudaSuccess) {
            (void) cudaGetLastError();   // (what the kernels wrote so far is written)
        }
        const size_t first = g->tl_n > kTimeline ? g->tl_n - kTimeline : 0;
        for (size_t n = first; n < g->tl_n; n++) {
            const size_t i = n % kTimeline;
            const volatile gather_stream::record & r = g->tl_host[i];
            const int w = g->tl_weight[i];
            fprintf(f, "%d,%zu,%d,%s,%llu,%llu,%llu,%llu\n", device, n, g->tl_mode[i],
                    w >= 0 && w < (int) g_weight_names.size() ? g_weight_names[w].c_str() : "?", r.t0, r.t1, r.bytes,
                    g->tl_queued[i]);
        }
    }
    fclose(f);
}

}  // namespace
