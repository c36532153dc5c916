// pyllama_pp: STAGING - uploads from pageable host memory go through pinned slots that helper threads fill.

#include "ggml-backend-pp-impl.h"

#include <sched.h>
#include <string.h>
#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// STAGING: a device copies from pageable host memory (an mmap-ed model) synchronously - the host blocks on
// every upload, so nothing overlaps. Uploads of host weights from pageable memory therefore go through pinned
// staging slots (the device's host buffer type): helper threads copy each piece into a slot, the device reads it
// asynchronously, and an event per slot tells when the slot may be filled again. The ring holds one layer's pageable
// weights that the backend uploads in a graph, and two slots more (a layer's upload starts mid-slot, and a change of
// stream leaves a slot's rest unused), at least GGML_SCHED_PP_STAGE_MIN_SLOTS slots and at most GGML_SCHED_PP_STAGE_MAX
// bytes: a layer's upload (LAYER_MAJOR's lead, issued while the previous layer computes) then fills slots the device
// read a layer ago, and the host does not wait on the device before it queues the layer's compute. Layers of more
// pageable bytes than the cap wait as before for the rest. With a ring of 4 slots (128 MiB) the host waited for the
// slots of each 642 MB layer while the device had nothing queued: an mmap-ed 30B-A3B preset's layer-major prompt ran
// at 81% of in VRAM on an H100 (docs/results/gpu-h100-2026-12-07d). A graph that needs more slots than the ring has
// (a prompt after decode graphs) grows it at its end.
#define GGML_SCHED_PP_STAGE_MIN_SLOTS 4
#define GGML_SCHED_PP_STAGE_SLOT      ((size_t) 32 << 20)
#define GGML_SCHED_PP_STAGE_MAX       ((size_t) 1 << 30)

#define GGML_SCHED_PP_STAGE_SPLIT (1u << 20) // pieces from 1 MiB on are copied by all threads

// a few threads that copy one large piece of memory together with the calling thread
struct ggml_sched_pp_copier {
    std::vector<std::thread> threads;
    std::mutex               mtx;
    std::condition_variable  cv_work, cv_done;
    uint64_t                 gen     = 0;
    int                      pending = 0;
    bool                     stop    = false;
    uint8_t *                dst     = nullptr;
    const uint8_t *          src     = nullptr;
    size_t                   n       = 0;

    explicit ggml_sched_pp_copier(int n_threads) {
        try {
            for (int i = 0; i < n_threads; i++) {
                threads.emplace_back([this, i]() { work(i + 1); });
            }
        } catch (const std::exception & e) {
            // copy with the threads that started (or the caller's alone)
            GGML_LOG_WARN("%s: started %d of %d staging threads: %s\n", __func__, (int) threads.size(), n_threads, e.what());
        }
    }
    ~ggml_sched_pp_copier() {
        {
            std::lock_guard<std::mutex> lk(mtx);
            stop = true;
        }
        cv_work.notify_all();
        for (auto & t : threads) {
            t.join();
        }
    }
    // part `part` of `parts` equal parts of the current piece (part sizes are multiples of 64 bytes)
    void copy_part(int part, int parts) const {
        const size_t step = ((n + parts - 1) / parts + 63) & ~(size_t) 63;
        const size_t b    = std::min(n, step * part);
        const size_t e    = std::min(n, b + step);
        if (e > b) {
            memcpy(dst + b, src + b, e - b);
        }
    }
    void work(int part) {
        uint64_t seen = 0;
        for (;;) {
            {
                std::unique_lock<std::mutex> lk(mtx);
                cv_work.wait(lk, [&]() { return stop || gen != seen; });
                if (stop) {
                    return;
                }
                seen = gen;
            }
            copy_part(part, (int) threads.size() + 1);
            std::lock_guard<std::mutex> lk(mtx);
            if (--pending == 0) {
                cv_done.notify_one();
            }
        }
    }
    void copy(void * d, const void * s, size_t size) {
        if (threads.empty() || size < GGML_SCHED_PP_STAGE_SPLIT) {
            memcpy(d, s, size);
            return;
        }
        {
            std::lock_guard<std::mutex> lk(mtx);
            dst = (uint8_t *) d; src = (const uint8_t *) s; n = size;
            pending = (int) threads.size();
            gen++;
        }
        cv_work.notify_all();
        copy_part(0, (int) threads.size() + 1);
        std::unique_lock<std::mutex> lk(mtx);
        cv_done.wait(lk, [&]() { return pending == 0; });
    }
};

struct ggml_sched_pp_stage {
    ggml_backend_buffer_t buf = nullptr;   // n_slots slots of slot_size bytes, pinned
    std::vector<ggml_backend_event_t> ev;
    std::vector<bool>     recorded;
    int                   n_slots   = 0;
    size_t                slot_size = 0;
    int                   cur  = 0;
    size_t                used = 0;
    ggml_backend_t        filler = nullptr; // the stream that reads the current slot (the split's, or OVERLAP=2's)
    size_t                graph_bytes = 0;  // bytes the current graph staged (a ring that held them all was enough)
    int                   asked  = 0;       // the slots asked for when the ring was made (fewer where pinning failed)
    bool                  unusable = false; // no host buffer type, no events or no memory: plain uploads
};

// a backend's ring freed: the copies still queued from its slots done first (the backend may be gone already: the
// events tell, and every graph recorded one for its partly filled slot, ggml_backend_sched_pp_stage_mark)
static void ggml_backend_sched_pp_ring_free(ggml_backend_sched_t sched, int backend_id) {
    ggml_sched_pp_stage * st = sched->pp_stage[backend_id];
    if (st == nullptr) {
        return;
    }
    for (int i = 0; i < st->n_slots; i++) {
        if (st->ev[i] != nullptr) {
            if (st->recorded[i]) {
                ggml_backend_event_synchronize(st->ev[i]);
            }
            ggml_backend_event_free(st->ev[i]);
        }
    }
    ggml_backend_buffer_free(st->buf);
    delete st;
    sched->pp_stage[backend_id] = nullptr;
}

void ggml_backend_sched_pp_stage_free(ggml_backend_sched_t sched) {
    for (int b = 0; b < GGML_SCHED_MAX_BACKENDS; b++) {
        ggml_backend_sched_pp_ring_free(sched, b);
    }
    delete sched->pp_copier;
    sched->pp_copier = nullptr;
}

// true if host memory of this buffer is pinned: of the host buffer type of one of the scheduler's devices
bool ggml_backend_sched_pp_buffer_is_pinned(ggml_backend_sched_t sched, ggml_backend_buffer_t buf) {
    const ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(buf);
    for (int b = 0; b < sched->n_backends; b++) {
        ggml_backend_dev_t dev = ggml_backend_get_device(sched->backends[b]);
        if (dev != nullptr && ggml_backend_dev_host_buffer_type(dev) == buft) {
            return true;
        }
    }
    return false;
}

// the slots of a backend's ring for the current graph: one layer's pageable host weights that its splits on the
// backend read (a weight of no layer counts alone) and two more, within GGML_SCHED_PP_STAGE_MIN_SLOTS and
// GGML_SCHED_PP_STAGE_MAX
static int ggml_backend_sched_pp_stage_slots(ggml_backend_sched_t sched, int backend_id) {
    std::unordered_map<int, size_t> layer_bytes;
    std::unordered_set<const ggml_tensor *> seen;
    size_t most = 0;
    for (int i = 0; i < sched->n_splits; i++) {
        const ggml_backend_sched_split & split = sched->splits[i];
        for (int j = 0; j < split.n_inputs && split.backend_id == backend_id; j++) {
            const ggml_tensor * w = split.inputs[j];
            if (w->buffer == nullptr || ggml_backend_buffer_get_usage(w->buffer) != GGML_BACKEND_BUFFER_USAGE_WEIGHTS ||
                !ggml_backend_buffer_is_host(w->buffer) || ggml_backend_sched_pp_buffer_is_pinned(sched, w->buffer) ||
                !seen.insert(w).second) {
                continue;
            }
            const char * rest = nullptr;
            const int il = ggml_backend_sched_pp_weight_layer(w->name, &rest);
            const size_t n = il >= 0 ? (layer_bytes[il] += ggml_nbytes(w)) : ggml_nbytes(w);
            most = std::max(most, n);
        }
    }
    const size_t slots = (most + GGML_SCHED_PP_STAGE_SLOT - 1) / GGML_SCHED_PP_STAGE_SLOT + 2;
    return (int) std::max((size_t) GGML_SCHED_PP_STAGE_MIN_SLOTS,
                          std::min(slots, GGML_SCHED_PP_STAGE_MAX / GGML_SCHED_PP_STAGE_SLOT));
}

// at the end of a graph: an event after the copies queued from each partly filled slot (so that freeing the
// scheduler can wait for them without its backends); a ring smaller than this graph needed is freed (after its
// copies), to be made again at the size the next graph needs
void ggml_backend_sched_pp_stage_mark(ggml_backend_sched_t sched) {
    for (int b = 0; b < sched->n_backends; b++) {
        ggml_sched_pp_stage * st = sched->pp_stage[b];
        if (st == nullptr || st->unusable) {
            continue;
        }
        if (st->used > 0) {
            ggml_backend_event_record(st->ev[st->cur], st->filler);
            st->recorded[st->cur] = true;
        }
        // (a graph that staged no more than the ring holds cannot have needed more: no count of its splits)
        if (st->graph_bytes > st->slot_size * st->n_slots && st->asked < ggml_backend_sched_pp_stage_slots(sched, b)) {
            ggml_backend_sched_pp_ring_free(sched, b);
            continue;
        }
        st->graph_bytes = 0;
    }
}

// the staging slots of a backend, created on first use (nullptr: upload directly)
static ggml_sched_pp_stage * ggml_backend_sched_pp_stage_get(ggml_backend_sched_t sched, int backend_id) {
    ggml_sched_pp_stage * st = sched->pp_stage[backend_id];
    if (st != nullptr) {
        return st->unusable ? nullptr : st;
    }
    st = new ggml_sched_pp_stage();
    sched->pp_stage[backend_id] = st;
    ggml_backend_t backend = sched->backends[backend_id];
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_buffer_type_t host = dev != nullptr ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    st->unusable = true;
    if (host == nullptr || backend->iface.event_record == nullptr || backend->iface.set_tensor_async == nullptr) {
        return nullptr;
    }
    // the ring this graph needs, else the fewest slots (pinning a large buffer can fail where a small one does not)
    st->slot_size = GGML_SCHED_PP_STAGE_SLOT;
    const int want = ggml_backend_sched_pp_stage_slots(sched, backend_id);
    st->asked = want;
    for (int n : { want, GGML_SCHED_PP_STAGE_MIN_SLOTS }) {
        st->buf = ggml_backend_buft_alloc_buffer(host, st->slot_size * n);
        if (st->buf != nullptr && ggml_backend_buffer_get_type(st->buf) == host) {
            st->n_slots = n;
            break;
        }
        // (CUDA_Host falls back to a plain CPU buffer when pinning fails: pageable again)
        ggml_backend_buffer_free(st->buf);
        st->buf = nullptr;
    }
    if (st->buf == nullptr) {
        GGML_LOG_WARN("%s: no pinned staging memory for %s: pageable uploads stay synchronous\n", __func__, ggml_backend_name(backend));
        return nullptr;
    }
    st->ev.assign(st->n_slots, nullptr);
    st->recorded.assign(st->n_slots, false);
    for (int i = 0; i < st->n_slots; i++) {
        st->ev[i] = ggml_backend_event_new(dev);
        if (st->ev[i] == nullptr) {
            for (int k = 0; k < i; k++) {
                ggml_backend_event_free(st->ev[k]);
            }
            ggml_backend_buffer_free(st->buf);
            st->buf = nullptr;
            st->n_slots = 0;
            st->ev.clear();
            st->recorded.clear();
            return nullptr;
        }
    }
    if (sched->pp_copier == nullptr) {
        // STAGING=1: ggml_backend_sched_pp_stage_default_threads; STAGING=N >= 2: N threads with the calling one
        const int n = sched->pp_cfg.staging >= 2 ? (int) sched->pp_cfg.staging : ggml_backend_sched_pp_stage_default_threads();
        sched->pp_copier = new ggml_sched_pp_copier(n - 1);
    }
    st->unusable = false;
    return st;
}

// STAGING=1's copier threads with the calling one: three quarters of the cores this process may run on (its
// affinity), at most 16 (an H100 host of 16 cores staged 29 / 34 / 38 GB/s with 8 / 12 / 16:
// docs/results/gpu-h100-2026-12-07d)
int ggml_backend_sched_pp_stage_default_threads(void) {
    cpu_set_t set;
    const int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : (int) std::thread::hardware_concurrency();
    return std::min(16, std::max(1, 3 * cores / 4));
}

int ggml_backend_sched_pp_stage_slots_of(ggml_backend_sched_t sched, int backend_id) {
    const ggml_sched_pp_stage * st = sched->pp_stage[backend_id];
    return st != nullptr && !st->unusable ? st->n_slots : 0;
}

int ggml_backend_sched_pp_stage_threads(ggml_backend_sched_t sched) {
    return sched->pp_copier != nullptr ? (int) sched->pp_copier->threads.size() + 1 : 0;
}

bool ggml_backend_sched_pp_staging_usable(ggml_backend_dev_t dev) {
    if (ggml_backend_sched_pp_param("STAGING") == 0 || dev == nullptr) {
        return false;
    }
    ggml_backend_buffer_type_t host = ggml_backend_dev_host_buffer_type(dev);
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    if (host == nullptr || !props.caps.async || !props.caps.events) {
        return false;
    }
    ggml_backend_buffer_t probe = ggml_backend_buft_alloc_buffer(host, 4096);
    const bool pinned = probe != nullptr && ggml_backend_buffer_get_type(probe) == host;
    ggml_backend_buffer_free(probe);
    return pinned;
}

// true if a pageable host weight that backend_id consumes goes up through its staging slots (STAGING)
bool ggml_backend_sched_pp_stages(ggml_backend_sched_t sched, int backend_id, const struct ggml_tensor * weight) {
    return sched->n_copies > 1 && sched->pp_cfg.staging != 0 && weight->buffer != nullptr &&
           !ggml_backend_sched_pp_buffer_is_pinned(sched, weight->buffer) &&
           ggml_backend_sched_pp_stage_get(sched, backend_id) != nullptr;
}

// ggml_backend_tensor_set_async of a host weight's bytes, on the split backend's stream or OVERLAP=2's early-upload
// stream (via); from pageable memory through the staging slots
void ggml_backend_sched_pp_upload(ggml_backend_sched_t sched, int backend_id, const struct ggml_tensor * weight,
                                  struct ggml_tensor * dst, const void * data, size_t offset, size_t size,
                                  ggml_backend_t via) {
    ggml_backend_t backend = via != nullptr ? via : sched->backends[backend_id];
    if (via != nullptr) {
        sched->pp.overlap_uploads[backend_id]++;
    }
    if (!ggml_backend_sched_pp_stages(sched, backend_id, weight)) {
        ggml_backend_tensor_set_async(backend, dst, data, offset, size);
        return;
    }
    ggml_sched_pp_stage * st = sched->pp_stage[backend_id];
    if (st->used > 0 && st->filler != backend) {
        // a slot is read by one stream only: its event follows that stream's copies
        ggml_backend_event_record(st->ev[st->cur], st->filler);
        st->recorded[st->cur] = true;
        st->cur  = (st->cur + 1) % st->n_slots;
        st->used = 0;
    }
    st->filler = backend;
    st->graph_bytes += size;
    uint8_t * base = (uint8_t *) ggml_backend_buffer_get_base(st->buf);
    const uint8_t * src = (const uint8_t *) data;
    while (size > 0) {
        if (st->used == 0 && st->recorded[st->cur]) {
            // the slot comes round again: wait until the device has read what it held
            ggml_sched_pp_timer t(&sched->pp.stage_wait_us, &sched->pp.stage_waits);
            ggml_backend_event_synchronize(st->ev[st->cur]);
            st->recorded[st->cur] = false;
        }
        const size_t n = std::min(size, st->slot_size - st->used);
        uint8_t * slot = base + (size_t) st->cur * st->slot_size + st->used;
        {
            ggml_sched_pp_timer t(&sched->pp.stage_copy_us);
            sched->pp_copier->copy(slot, src, n);
        }
        ggml_backend_tensor_set_async(backend, dst, slot, offset, n);
        sched->pp.staged_bytes[backend_id] += n;
        st->used += n;
        src      += n;
        offset   += n;
        size     -= n;
        if (st->used == st->slot_size) {
            // full: its event follows the copies that read it (recorded now, before later work is queued)
            ggml_backend_event_record(st->ev[st->cur], backend);
            st->recorded[st->cur] = true;
            st->cur  = (st->cur + 1) % st->n_slots;
            st->used = 0;
        }
    }
}
