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

#define GGML_SCHED_PP_STAGE_SPLIT (1u << 20) // a call's pieces of 1 MiB or more are copied by all threads
#define GGML_SCHED_PP_STAGE_BURST (4u << 20) // ... and uploaded in bursts of at least 4 MiB

// a few threads that copy pieces of memory together with the calling thread: the pieces of one copy (a burst) are
// one stream of bytes cut in equal parts, so that many small pieces (a decode's missed experts, ~1.7 MB each) wake
// the threads once a burst and not once a piece
struct ggml_sched_pp_copier {
    struct piece {
        uint8_t *       dst;
        const uint8_t * src;
        size_t          n;
    };
    std::vector<std::thread> threads;
    std::mutex               mtx;
    std::condition_variable  cv_work, cv_done;
    uint64_t                 gen     = 0;
    int                      pending = 0;
    bool                     stop    = false;
    const piece *            pieces  = nullptr;
    size_t                   n_pieces = 0;
    size_t                   total    = 0;

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
    // part `part` of `parts` equal parts of the current pieces' bytes (part sizes are multiples of 64 bytes)
    void copy_part(int part, int parts) const {
        const size_t step = ((total + parts - 1) / parts + 63) & ~(size_t) 63;
        const size_t b    = std::min(total, step * part);
        const size_t e    = std::min(total, b + step);
        size_t at = 0;   // where the piece starts in the stream
        for (size_t i = 0; i < n_pieces && at < e; at += pieces[i].n, i++) {
            const size_t lo = std::max(b, at), hi = std::min(e, at + pieces[i].n);
            if (hi > lo) {
                memcpy(pieces[i].dst + (lo - at), pieces[i].src + (lo - at), hi - lo);
            }
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
    void copy(const piece * ps, size_t n) {
        size_t bytes = 0;
        for (size_t i = 0; i < n; i++) {
            bytes += ps[i].n;
        }
        if (threads.empty() || bytes < GGML_SCHED_PP_STAGE_SPLIT) {
            for (size_t i = 0; i < n; i++) {
                memcpy(ps[i].dst, ps[i].src, ps[i].n);
            }
            return;
        }
        {
            std::lock_guard<std::mutex> lk(mtx);
            pieces = ps; n_pieces = n; total = bytes;
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
    const ggml_sched_pp_piece one = { weight, dst, data, offset, size };
    ggml_backend_sched_pp_upload_pieces(sched, backend_id, &one, 1, via);
}

// the pieces' uploads in their order; those from pageable memory are copied into the staging ring together: a slot's
// pieces in bursts of GGML_SCHED_PP_STAGE_BURST bytes or more (whole pieces), each uploaded once copied, so that the
// link reads a burst while the host copies the next (the slot's event recorded after the uploads that read it)
void ggml_backend_sched_pp_upload_pieces(ggml_backend_sched_t sched, int backend_id, const ggml_sched_pp_piece * pieces,
                                         size_t n_pieces, ggml_backend_t via) {
    ggml_backend_t backend = via != nullptr ? via : sched->backends[backend_id];
    if (via != nullptr) {
        sched->pp.overlap_uploads[backend_id] += n_pieces;
    }
    struct chunk {
        ggml_tensor * dst;
        size_t        offset;
    };
    std::vector<ggml_sched_pp_copier::piece> copies;   // the current slot's copies, and where each goes on the device
    std::vector<chunk> ups;
    auto flush = [&]() {
        if (copies.empty()) {
            return;
        }
        for (size_t i0 = 0, i1 = 0; i0 < copies.size(); i0 = i1) {
            size_t bytes = 0;
            while (i1 < copies.size() && bytes < GGML_SCHED_PP_STAGE_BURST) {
                bytes += copies[i1++].n;
            }
            {
                ggml_sched_pp_timer t(&sched->pp.stage_copy_us);
                sched->pp_copier->copy(copies.data() + i0, i1 - i0);
            }
            sched->pp.stage_copies++;
            for (size_t i = i0; i < i1; i++) {
                ggml_backend_tensor_set_async(backend, ups[i].dst, copies[i].dst, ups[i].offset, copies[i].n);
                sched->pp.staged_bytes[backend_id] += copies[i].n;
            }
        }
        copies.clear();
        ups.clear();
    };
    for (size_t i = 0; i < n_pieces; i++) {
        const ggml_sched_pp_piece & p = pieces[i];
        if (!ggml_backend_sched_pp_stages(sched, backend_id, p.weight)) {
            flush();   // (the order of the uploads kept)
            ggml_backend_tensor_set_async(backend, p.dst, p.data, p.offset, p.size);
            continue;
        }
        ggml_sched_pp_stage * st = sched->pp_stage[backend_id];
        if (st->used > 0 && st->filler != backend) {
            // a slot is read by one stream only: its event follows that stream's copies
            flush();
            ggml_backend_event_record(st->ev[st->cur], st->filler);
            st->recorded[st->cur] = true;
            st->cur  = (st->cur + 1) % st->n_slots;
            st->used = 0;
        }
        st->filler = backend;
        st->graph_bytes += p.size;
        uint8_t * base = (uint8_t *) ggml_backend_buffer_get_base(st->buf);
        const uint8_t * src = (const uint8_t *) p.data;
        size_t offset = p.offset, size = p.size;
        while (size > 0) {
            if (st->used == 0 && st->recorded[st->cur]) {
                // the slot comes round again: wait until the device has read what it held
                ggml_sched_pp_timer t(&sched->pp.stage_wait_us, &sched->pp.stage_waits);
                ggml_backend_event_synchronize(st->ev[st->cur]);
                st->recorded[st->cur] = false;
            }
            const size_t n = std::min(size, st->slot_size - st->used);
            copies.push_back({ base + (size_t) st->cur * st->slot_size + st->used, src, n });
            ups.push_back({ p.dst, offset });
            st->used += n;
            src      += n;
            offset   += n;
            size     -= n;
            if (st->used == st->slot_size) {
                // full: its event follows the copies that read it (recorded now, before later work is queued)
                flush();
                ggml_backend_event_record(st->ev[st->cur], backend);
                st->recorded[st->cur] = true;
                st->cur  = (st->cur + 1) % st->n_slots;
                st->used = 0;
            }
        }
    }
    flush();
}
