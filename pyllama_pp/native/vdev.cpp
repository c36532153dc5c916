// pyllama_pp virtual accelerator device (VDEV) ggml backend.
//
// Model:
//   * memory: host memory under a per-device budget; the buffer type is NOT host, so the
//     scheduler treats it like GPU memory (host weights become split inputs that get copied);
//   * stream: every backend instance owns one worker thread with a FIFO job queue; async
//     copies, graph computes, event records and event waits are jobs on it;
//   * links: host<->device transfers are throttled on a link object (shared by devices of the
//     same link group), device<->device copies on a per-destination d2d link;
//   * compute: the CPU backend (found through the registry, never linked) runs a deep copy of
//     the submitted graph on the worker thread; a compute factor slows it down.
#include "vdev.h"
#include "gather_abi.h"

#include "ggml-backend-impl.h"

// ggml-impl.h defines static helpers this file does not all use
#if defined(__GNUC__)
#    pragma GCC diagnostic push
#    pragma GCC diagnostic ignored "-Wunused-function"
#endif
#include "ggml-impl.h"
#if defined(__GNUC__)
#    pragma GCC diagnostic pop
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#define PP_VDEV_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using clock_t_ = std::chrono::steady_clock;

constexpr size_t   VDEV_ALIGNMENT      = 128;              // tensor alignment reported to ggml
constexpr size_t   VDEV_HOST_ALIGN     = VDEV_ALIGNMENT;   // the base must be as aligned as the tensors
constexpr uint64_t VDEV_UNLIMITED_MEM  = 1ull << 40;       // reported when the budget is 0 (1 TiB)

// ---------------------------------------------------------------------------------------------
// links
// ---------------------------------------------------------------------------------------------

struct vdev_link {
    std::mutex             mtx;
    clock_t_::time_point   busy_until{};
};

// ---------------------------------------------------------------------------------------------
// devices
// ---------------------------------------------------------------------------------------------

struct vdev_counters_atomic {
    std::atomic<uint64_t> h2d_bytes{0}, d2h_bytes{0}, d2d_bytes{0};
    std::atomic<uint64_t> h2d_copies{0}, d2h_copies{0}, d2d_copies{0};
    std::atomic<uint64_t> graph_computes{0};
    std::atomic<uint64_t> host_syncs{0};
    std::atomic<uint64_t> gathers{0};
    std::atomic<uint64_t> beside_gathers{0};
    std::atomic<uint64_t> chained_gathers{0};
    std::atomic<uint64_t> event_records{0}, event_waits{0};
    std::atomic<uint64_t> alloc_bytes{0}, peak_alloc_bytes{0}, failed_allocs{0};
    std::atomic<uint64_t> link_busy_ns{0};
    std::atomic<uint64_t> compute_ns{0};
    std::atomic<uint64_t> buffer_allocs{0};   // since registration (injected faults count these); never reset
    std::atomic<uint64_t> hd_copies{0};
};

struct vdev_device {
    int                          index = 0;
    std::string                  name;
    std::string                  description;
    ggml_backend_device          dev{};
    ggml_backend_buffer_type     buft{};
    std::string                  buft_name;
    std::string                  bus_id;          // props.device_id (see vdev_dev_get_props)

    mutable std::mutex           cfg_mtx;
    pp_vdev_config               cfg{};
    std::atomic<vdev_link *>     link{nullptr};   // host<->device link (own or shared)
    vdev_link                    d2d_link;        // device<->device link (this device as destination)

    vdev_counters_atomic         c;

    pp_vdev_config get_cfg() const {
        std::lock_guard<std::mutex> lk(cfg_mtx);
        return cfg;
    }
};

// global state: created once, intentionally never freed (worker threads and the registry may
// outlive static destructors at process exit)
std::mutex                      g_mtx;
int                             g_n_devices = 0;
vdev_device *                   g_devices[PP_VDEV_MAX] = {};
std::map<int, vdev_link *> *    g_group_links = nullptr;
ggml_backend_reg                g_reg{};
std::atomic<bool>               g_registered{false};

ggml_guid g_vdev_guid = { 0x70, 0x79, 0x6c, 0x6c, 0x61, 0x6d, 0x61, 0x5f, 0x70, 0x70, 0x5f, 0x76, 0x64, 0x65, 0x76, 0x01 };

void atomic_max(std::atomic<uint64_t> & a, uint64_t v) {
    uint64_t cur = a.load();
    while (cur < v && !a.compare_exchange_weak(cur, v)) {
    }
}

uint64_t secs_to_ns(double s) {
    if (!(s > 0.0)) {
        return 0;
    }
    return (uint64_t) std::llround(s * 1e9);
}

pp_vdev_config sanitize_cfg(const pp_vdev_config & in) {
    pp_vdev_config c = in;
    if (!(c.compute_factor >= 1.0) || !std::isfinite(c.compute_factor)) {
        c.compute_factor = 1.0;
    }
    if (c.n_threads <= 0) {
        c.n_threads = 1;
    }
    if (c.link_group < 0) {
        c.link_group = -1;
    }
    if (!std::isfinite(c.link_gbps)) {
        c.link_gbps = 0.0;
    }
    if (!std::isfinite(c.d2d_gbps)) {
        c.d2d_gbps = 0.0;
    }
    if (!(c.direct_read > 0.0 && c.direct_read <= 1.0)) {
        c.direct_read = 1.0; // the C API's default (zeroed config): the link's full rate; Python's device specs say 0.5
    }
    if (c.row_pad < 0) {
        c.row_pad = 0;
    }
    if (c.fail_alloc_at < 0) {
        c.fail_alloc_at = 0;
    }
    if (c.fail_copy_at < 0) {
        c.fail_copy_at = 0;
    }
    return c;
}

pp_vdev_config default_cfg() {
    pp_vdev_config c{};
    c.memory_bytes   = 0;
    c.link_gbps      = 0.0;
    c.link_group     = -1;
    c.compute_factor = 1.0;
    c.n_threads      = 1;
    c.d2d_gbps       = 0.0;
    return c;
}

// the link for a group (g_mtx must be held); group < 0: a new private link
vdev_link * link_for_group_locked(int group) {
    if (group < 0) {
        return new vdev_link();
    }
    if (!g_group_links) {
        g_group_links = new std::map<int, vdev_link *>();
    }
    auto it = g_group_links->find(group);
    if (it != g_group_links->end()) {
        return it->second;
    }
    vdev_link * l = new vdev_link();
    (*g_group_links)[group] = l;
    return l;
}

// apply a (sanitized) config to a device (g_mtx must be held)
void apply_cfg_locked(vdev_device * d, const pp_vdev_config & cfg) {
    pp_vdev_config old;
    {
        std::lock_guard<std::mutex> lk(d->cfg_mtx);
        old    = d->cfg;
        d->cfg = cfg;
    }
    vdev_link * cur = d->link.load();
    if (cur == nullptr || old.link_group != cfg.link_group) {
        // a private link that is dropped is leaked on purpose: a worker may still use it
        d->link.store(link_for_group_locked(cfg.link_group));
    }
}

// Move `bytes` over link `l` at `gbps` GB/s: reserve the link's time slot, do the copy, then
// sleep until the slot ends (see kSlack). Returns the seconds charged (0 when unthrottled).
double link_transfer(vdev_link * l, double gbps, size_t bytes, const std::function<void()> & copy) {
    if (l == nullptr || !(gbps > 0.0) || bytes == 0) {
        copy();
        return 0.0;
    }
    const double secs = (double) bytes / (gbps * 1e9);
    const auto   dur  = std::chrono::duration_cast<clock_t_::duration>(std::chrono::duration<double>(secs));
    clock_t_::time_point end;
    {
        std::lock_guard<std::mutex> lk(l->mtx);
        const auto now   = clock_t_::now();
        const auto start = std::max(now, l->busy_until);
        end              = start + dur;
        l->busy_until    = end;
    }
    copy();
    // Sleeping has ~0.1 ms of overshoot, which would dominate thousands of small expert copies. A copy that
    // ends less than kSlack from now returns at once: its time stays reserved on the link (busy_until), so
    // the next transfer waits for it and the link's throughput bound holds.
    constexpr auto kSlack = std::chrono::microseconds(250);
    if (end - clock_t_::now() > kSlack) {
        std::this_thread::sleep_until(end);
    }
    return secs;
}

// host->device bytes over device d's link at `gbps`, counted as `copies` copies
void charge_h2d(vdev_device * d, double gbps, size_t size, const std::function<void()> & copy, int copies) {
    const double secs = link_transfer(d->link.load(), gbps, size, copy);
    d->c.h2d_bytes  += size;
    d->c.h2d_copies += copies;
    d->c.link_busy_ns += secs_to_ns(secs);
}

// injected fault (fail_copy_at): a host<->device copy that fails. ggml's copy calls return nothing and CUDA's
// backend aborts on a failed cudaMemcpy (CUDA_CHECK), so this does what a GPU build would do: abort the process
void count_hd_copy(vdev_device * d, const pp_vdev_config & cfg, const char * dir, size_t size) {
    const uint64_t n = ++d->c.hd_copies;
    if (cfg.fail_copy_at > 0 && n == (uint64_t) cfg.fail_copy_at) {
        if (cfg.fault_abort) {
            fprintf(stderr, "pyllama_pp vdev %s: injected fault: %s copy #%llu (%zu bytes) failed (fail_copy_after=%lld): "
                "aborting the process\n", d->name.c_str(), dir, (unsigned long long) n, size, (long long) cfg.fail_copy_at - 1);
            fflush(stderr);
            abort();
        }
        GGML_ABORT("pyllama_pp vdev %s: injected fault: %s copy #%llu (%zu bytes) failed (fail_copy_after=%lld)",
            d->name.c_str(), dir, (unsigned long long) n, size, (long long) cfg.fail_copy_at - 1);
    }
}

// host<->device transfer charged to device d
void h2d_transfer(vdev_device * d, void * dst, const void * src, size_t size) {
    const pp_vdev_config cfg = d->get_cfg();
    count_hd_copy(d, cfg, "host->device", size);
    charge_h2d(d, cfg.link_gbps, size, [&]() { memcpy(dst, src, size); }, 1);
}

void d2h_transfer(vdev_device * d, void * dst, const void * src, size_t size) {
    const pp_vdev_config cfg = d->get_cfg();
    count_hd_copy(d, cfg, "device->host", size);
    const double secs = link_transfer(d->link.load(), cfg.link_gbps, size, [&]() { memcpy(dst, src, size); });
    d->c.d2h_bytes  += size;
    d->c.d2h_copies += 1;
    d->c.link_busy_ns += secs_to_ns(secs);
}

// device->device copy onto device dst_dev (charged to the destination's d2d link)
void d2d_transfer(vdev_device * src_dev, vdev_device * dst_dev, void * dst, const void * src, size_t size) {
    if (src_dev == dst_dev) {
        // a copy inside one device: device memory bandwidth, not a link
        memmove(dst, src, size);
        return;
    }
    const pp_vdev_config cfg = dst_dev->get_cfg();
    link_transfer(&dst_dev->d2d_link, cfg.d2d_gbps, size, [&]() { memcpy(dst, src, size); });
    dst_dev->c.d2d_bytes  += size;
    dst_dev->c.d2d_copies += 1;
}

// ---------------------------------------------------------------------------------------------
// CPU backend lookup (ggml-cpu is a dynamically loaded module: never link it)
// ---------------------------------------------------------------------------------------------

ggml_backend_dev_t cpu_device() {
    static std::atomic<ggml_backend_dev_t> cached{nullptr};
    ggml_backend_dev_t d = cached.load();
    if (d == nullptr) {
        d = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        if (d != nullptr) {
            cached.store(d);
        }
    }
    return d;
}

// ---------------------------------------------------------------------------------------------
// buffer type / buffers
// ---------------------------------------------------------------------------------------------

struct vdev_buffer_ctx {
    vdev_device * dev;
    void *        base;
    size_t        size;
};

const char * vdev_buft_get_name(ggml_backend_buffer_type_t buft);

bool buft_is_vdev(ggml_backend_buffer_type_t buft) {
    return buft != nullptr && buft->iface.get_name == vdev_buft_get_name;
}

bool buffer_is_vdev(ggml_backend_buffer_t buf) {
    return buf != nullptr && buft_is_vdev(buf->buft) && buf->context != nullptr;
}

ggml_backend_buffer_t tensor_buffer(const ggml_tensor * t) {
    return t->view_src ? t->view_src->buffer : t->buffer;
}

vdev_device * buffer_device(ggml_backend_buffer_t buf) {
    return ((vdev_buffer_ctx *) buf->context)->dev;
}

void vdev_buffer_free(ggml_backend_buffer_t buffer) {
    auto * ctx = (vdev_buffer_ctx *) buffer->context;
    if (ctx == nullptr) {
        return;
    }
    ctx->dev->c.alloc_bytes -= ctx->size;
    free(ctx->base);
    delete ctx;
    buffer->context = nullptr;
}

void * vdev_buffer_get_base(ggml_backend_buffer_t buffer) {
    auto * ctx = (vdev_buffer_ctx *) buffer->context;
    return ctx ? ctx->base : nullptr;
}

void vdev_buffer_memset_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, uint8_t value, size_t offset, size_t size) {
    (void) buffer;
    memset((char *) tensor->data + offset, value, size);
}

void vdev_buffer_set_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    auto * ctx = (vdev_buffer_ctx *) buffer->context;
    h2d_transfer(ctx->dev, (char *) tensor->data + offset, data, size);
}

void vdev_buffer_get_tensor(ggml_backend_buffer_t buffer, const ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    auto * ctx = (vdev_buffer_ctx *) buffer->context;
    ctx->dev->c.host_syncs += 1;
    d2h_transfer(ctx->dev, data, (const char *) tensor->data + offset, size);
}

bool vdev_buffer_cpy_tensor(ggml_backend_buffer_t buffer, const ggml_tensor * src, ggml_tensor * dst) {
    ggml_backend_buffer_t src_buf = tensor_buffer(src);
    if (!buffer_is_vdev(src_buf) || !buffer_is_vdev(buffer)) {
        return false;
    }
    d2d_transfer(buffer_device(src_buf), buffer_device(buffer), dst->data, src->data, ggml_nbytes(src));
    return true;
}

void vdev_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    auto * ctx = (vdev_buffer_ctx *) buffer->context;
    if (ctx && ctx->base) {
        memset(ctx->base, value, ctx->size);
    }
}

const char * vdev_buft_get_name(ggml_backend_buffer_type_t buft) {
    auto * d = (vdev_device *) buft->context;
    return d->buft_name.c_str();
}

ggml_backend_buffer_t vdev_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    auto * d = (vdev_device *) buft->context;
    const pp_vdev_config cfg = d->get_cfg();
    const uint64_t budget = cfg.memory_bytes;

    // injected fault (fail_alloc_at): from this allocation on the device is full
    const uint64_t n_alloc = ++d->c.buffer_allocs;
    if (cfg.fail_alloc_at > 0 && n_alloc >= (uint64_t) cfg.fail_alloc_at) {
        d->c.failed_allocs += 1;
        GGML_LOG_ERROR("%s: allocating %.2f MiB on %s failed: out of (virtual) memory (injected fault: allocation #%llu, "
            "fail_alloc_after=%lld)\n", __func__, size / 1024.0 / 1024.0, d->name.c_str(), (unsigned long long) n_alloc,
            (long long) cfg.fail_alloc_at - 1);
        return nullptr;
    }

    // reserve against the budget first
    uint64_t cur = d->c.alloc_bytes.load();
    for (;;) {
        if (budget > 0 && (cur + size > budget || cur + size < cur)) {
            d->c.failed_allocs += 1;
            GGML_LOG_ERROR("%s: allocating %.2f MiB on %s failed: out of (virtual) memory (%.2f of %.2f MiB in use)\n",
                __func__, size / 1024.0 / 1024.0, d->name.c_str(), cur / 1024.0 / 1024.0, budget / 1024.0 / 1024.0);
            return nullptr;
        }
        if (d->c.alloc_bytes.compare_exchange_weak(cur, cur + size)) {
            break;
        }
    }

    size_t host_size = size == 0 ? VDEV_HOST_ALIGN : size;
    host_size = (host_size + VDEV_HOST_ALIGN - 1) / VDEV_HOST_ALIGN * VDEV_HOST_ALIGN;
    void * base = nullptr;
    if (posix_memalign(&base, VDEV_HOST_ALIGN, host_size) != 0) {
        base = nullptr;
    }
    if (base == nullptr) {
        d->c.alloc_bytes -= size;
        d->c.failed_allocs += 1;
        GGML_LOG_ERROR("%s: allocating %.2f MiB on %s failed: host allocation failed\n", __func__, size / 1024.0 / 1024.0, d->name.c_str());
        return nullptr;
    }
    atomic_max(d->c.peak_alloc_bytes, d->c.alloc_bytes.load());

    auto * ctx = new vdev_buffer_ctx{ d, base, size };

    ggml_backend_buffer_i iface{};
    iface.free_buffer   = vdev_buffer_free;
    iface.get_base      = vdev_buffer_get_base;
    iface.init_tensor   = nullptr;
    iface.memset_tensor = vdev_buffer_memset_tensor;
    iface.set_tensor    = vdev_buffer_set_tensor;
    iface.get_tensor    = vdev_buffer_get_tensor;
    iface.cpy_tensor    = vdev_buffer_cpy_tensor;
    iface.clear         = vdev_buffer_clear;
    iface.reset         = nullptr;

    return ggml_backend_buffer_init(buft, iface, ctx, size);
}

size_t vdev_buft_get_alignment(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return VDEV_ALIGNMENT;
}

// row_pad: CUDA's rule (ggml_backend_cuda_buffer_type_get_alloc_size) - kernels step through quantized rows a
// whole number of padding steps at a time, so one step's worth of room follows the tensor
size_t vdev_buft_get_alloc_size(ggml_backend_buffer_type_t buft, const ggml_tensor * tensor) {
    size_t size = ggml_nbytes(tensor);
    if (!ggml_is_quantized(tensor->type)) {
        return size;
    }
    auto * d = (vdev_device *) buft->context;
    const int64_t pad = d->get_cfg().row_pad; // 0 or a multiple of 256 (devices.py): whole blocks of every type
    if (pad > 0 && tensor->ne[0] % pad != 0) {
        size += ggml_row_size(tensor->type, pad - tensor->ne[0] % pad);
    }
    return size;
}

size_t vdev_buft_get_max_size(ggml_backend_buffer_type_t buft) {
    auto * d = (vdev_device *) buft->context;
    const uint64_t budget = d->get_cfg().memory_bytes;
    if (budget == 0 || budget > (uint64_t) SIZE_MAX) {
        return SIZE_MAX;
    }
    return (size_t) budget;
}

bool vdev_buft_is_host(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return false;
}

// ---------------------------------------------------------------------------------------------
// events
// ---------------------------------------------------------------------------------------------

// a stream job that failed and has not been reported yet (like CUDA's sticky errors): the host's next synchronize or
// graph compute on that stream, or its next event synchronize on an event the stream recorded after it, reports it
// A stream stays failed after that (as a CUDA context does): its later copies and computes are skipped, so none of
// them writes into memory that the host frees while it unwinds from the error; markers and events still run.
struct vdev_backend;

struct vdev_stream_error {
    std::mutex        mtx;
    std::string       msg;
    std::atomic<bool> failed{false};
    vdev_backend *    owner = nullptr;   // its stream (nullptr once freed): drained when the error is reported
};

struct vdev_event_state {
    std::mutex              mtx;
    std::condition_variable cv;
    uint64_t                recorded = 0;   // last generation handed out by a record
    uint64_t                done     = 0;   // highest generation reached on its stream
    std::shared_ptr<vdev_stream_error> stream_error;   // the recording stream's (set when a record is reached)
};

using vdev_event_ptr = std::shared_ptr<vdev_event_state>;

vdev_event_ptr event_state(ggml_backend_event_t ev) {
    if (ev == nullptr || ev->context == nullptr) {
        return nullptr;
    }
    return *(vdev_event_ptr *) ev->context;
}

// one-shot marker for cross-stream copies
struct vdev_marker {
    std::mutex              mtx;
    std::condition_variable cv;
    bool                    done = false;

    void signal() {
        {
            std::lock_guard<std::mutex> lk(mtx);
            done = true;
        }
        cv.notify_all();
    }
    void wait() {
        std::unique_lock<std::mutex> lk(mtx);
        cv.wait(lk, [&]() { return done; });
    }
};

// ---------------------------------------------------------------------------------------------
// backend (stream)
// ---------------------------------------------------------------------------------------------

struct vdev_backend {
    vdev_device *                       dev = nullptr;
    std::string                         name;

    ggml_backend_t                      cpu = nullptr;
    ggml_backend_set_n_threads_t        set_n_threads = nullptr;
    int                                 cur_threads = -1;   // worker thread only

    std::thread                         worker;
    std::mutex                          mtx;
    std::condition_variable             cv_job;
    std::condition_variable             cv_done;
    std::deque<std::pair<std::function<void()>, bool>> queue;   // (job, is work: a copy or a compute)
    uint64_t                            submitted = 0;
    uint64_t                            completed = 0;
    std::multiset<uint64_t>             drain_targets;   // of the drain() calls waiting
    bool                                stop = false;
    std::shared_ptr<vdev_stream_error>  error = std::make_shared<vdev_stream_error>();

    vdev_backend() { error->owner = this; }

    // work: a copy or a compute, skipped once the stream has failed (markers and event records always run)
    void enqueue(std::function<void()> job, bool work = false) {
        {
            std::lock_guard<std::mutex> lk(mtx);
            queue.emplace_back(std::move(job), work);
            submitted++;
        }
        cv_job.notify_one();
    }

    // drain() waits until the jobs submitted before it have completed; the worker wakes a waiter only once the
    // earliest target is reached, not after every job (a compute followed by an event record would otherwise wake
    // the host twice, where a GPU stream wakes it once)
    void drain() {
        std::unique_lock<std::mutex> lk(mtx);
        const uint64_t target = submitted;
        if (completed >= target) {
            return;
        }
        const auto it = drain_targets.insert(target);
        cv_done.wait(lk, [&]() { return completed >= target; });
        drain_targets.erase(it);
    }

    void run() {
        for (;;) {
            std::function<void()> job;
            bool work = false;
            {
                std::unique_lock<std::mutex> lk(mtx);
                cv_job.wait(lk, [&]() { return stop || !queue.empty(); });
                if (queue.empty()) {
                    return; // stop requested and drained
                }
                job  = std::move(queue.front().first);
                work = queue.front().second;
                queue.pop_front();
            }
            // a job that fails (a GGML_ABORT that an abort callback turned into an exception, as pyllama_pp's shim
            // does, or any exception) must not pass silently: its copy or compute did not happen. Keep the first
            // message for the host, which reports it at its next synchronize or graph compute on this stream.
            std::string failed;
            try {
                if (!(work && error->failed.load())) {
                    job();
                }
            } catch (const std::exception & e) {
                failed = e.what();
            } catch (...) {
                failed = "unknown exception";
            }
            if (!failed.empty()) {
                fprintf(stderr, "pyllama_pp vdev %s: stream job failed: %s\n", name.c_str(), failed.c_str());
                std::lock_guard<std::mutex> lk(error->mtx);
                if (!error->failed.exchange(true)) {
                    error->msg = failed;
                }
            }
            bool wake;
            {
                std::lock_guard<std::mutex> lk(mtx);
                completed++;
                wake = !drain_targets.empty() && completed >= *drain_targets.begin();
            }
            if (wake) {
                cv_done.notify_all();
            }
        }
    }
};

const char * vdev_backend_get_name(ggml_backend_t backend);

bool backend_is_vdev(ggml_backend_t backend) {
    return backend != nullptr && backend->iface.get_name == vdev_backend_get_name;
}

const char * vdev_backend_get_name(ggml_backend_t backend) {
    return ((vdev_backend *) backend->context)->name.c_str();
}

void vdev_backend_free(ggml_backend_t backend) {
    auto * b = (vdev_backend *) backend->context;
    if (b != nullptr) {
        {
            std::lock_guard<std::mutex> lk(b->mtx);
            b->stop = true;
        }
        b->cv_job.notify_all();
        if (b->worker.joinable()) {
            b->worker.join();
        }
        if (b->cpu != nullptr) {
            ggml_backend_free(b->cpu);
        }
        {
            std::lock_guard<std::mutex> lk(b->error->mtx);   // events may outlive their stream
            b->error->owner = nullptr;
        }
        delete b;
    }
    delete backend;
}

// ---------------------------------------------------------------------------------------------
// "Pinned" host memory: the devices' host buffer type (like CUDA_Host). Copies between it and a VDEV are
// asynchronous; copies from or to any other host memory (pageable, e.g. an mmap-ed model) block the host
// until the stream has done them, as cudaMemcpyAsync does with pageable memory.

std::mutex                   g_pinned_mtx;
std::map<uintptr_t, size_t>  g_pinned;          // base -> size of live VDEV_Host buffers
void (*g_cpu_free_buffer)(ggml_backend_buffer_t) = nullptr;   // set under g_pinned_mtx

bool host_ptr_is_pinned(const void * p) {
    std::lock_guard<std::mutex> lk(g_pinned_mtx);
    auto it = g_pinned.upper_bound((uintptr_t) p);
    if (it == g_pinned.begin()) {
        return false;
    }
    --it;
    return (uintptr_t) p < it->first + it->second;
}

void vdev_host_buffer_free(ggml_backend_buffer_t buffer) {
    void (*cpu_free)(ggml_backend_buffer_t) = nullptr;
    {
        std::lock_guard<std::mutex> lk(g_pinned_mtx);
        g_pinned.erase((uintptr_t) ggml_backend_buffer_get_base(buffer));
        cpu_free = g_cpu_free_buffer;
    }
    cpu_free(buffer);
}

const char * vdev_host_buft_get_name(ggml_backend_buffer_type_t) { return "VDEV_Host"; }

ggml_backend_buffer_t vdev_host_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (buf == nullptr) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lk(g_pinned_mtx);
    g_cpu_free_buffer = buf->iface.free_buffer;   // the CPU buffer type's, the same for every buffer
    buf->iface.free_buffer = vdev_host_buffer_free;
    buf->buft = buft;
    g_pinned[(uintptr_t) ggml_backend_buffer_get_base(buf)] = ggml_backend_buffer_get_size(buf);
    return buf;
}

size_t vdev_host_buft_get_alignment(ggml_backend_buffer_type_t) {
    return ggml_backend_buft_get_alignment(ggml_backend_cpu_buffer_type());
}

bool vdev_host_buft_is_host(ggml_backend_buffer_type_t) { return true; }

ggml_backend_buffer_type_t vdev_dev_get_host_buffer_type(ggml_backend_dev_t dev) {
    static ggml_backend_buffer_type buft = {
        /* .iface   = */ {
            /* .get_name       = */ vdev_host_buft_get_name,
            /* .alloc_buffer   = */ vdev_host_buft_alloc_buffer,
            /* .get_alignment  = */ vdev_host_buft_get_alignment,
            /* .get_max_size   = */ nullptr,
            /* .get_alloc_size = */ nullptr,
            /* .is_host        = */ vdev_host_buft_is_host,
        },
        /* .device  = */ nullptr,
        /* .context = */ nullptr,
    };
    // like CUDA_Host, the type belongs to the first device that hands it out; llama uses that to keep mmap-ed
    // weights in pageable memory instead of copying them into the host buffer type
    static std::once_flag once;
    std::call_once(once, [&]() { buft.device = dev; });
    return &buft;
}

void vdev_backend_synchronize(ggml_backend_t backend);

void vdev_backend_set_tensor_async(ggml_backend_t backend, ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    auto * b = (vdev_backend *) backend->context;
    ggml_backend_buffer_t buf = tensor_buffer(tensor);
    if (!buffer_is_vdev(buf)) {
        GGML_LOG_WARN("%s: %s: tensor %s is not in a VDEV buffer, doing a synchronous copy\n", __func__, b->name.c_str(), tensor->name);
        b->drain();
        ggml_backend_tensor_set(tensor, data, offset, size);
        return;
    }
    vdev_device * d   = buffer_device(buf);
    char *        dst = (char *) tensor->data + offset;
    b->enqueue([d, dst, data, size]() { h2d_transfer(d, dst, data, size); }, /*work =*/ true);
    if (!host_ptr_is_pinned(data)) {
        vdev_backend_synchronize(backend); // pageable source: the host waits for the copy (cudaMemcpyAsync from pageable memory)
    }
}

void vdev_backend_get_tensor_async(ggml_backend_t backend, const ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    auto * b = (vdev_backend *) backend->context;
    ggml_backend_buffer_t buf = tensor_buffer(tensor);
    if (!buffer_is_vdev(buf)) {
        GGML_LOG_WARN("%s: %s: tensor %s is not in a VDEV buffer, doing a synchronous copy\n", __func__, b->name.c_str(), tensor->name);
        b->drain();
        ggml_backend_tensor_get(tensor, data, offset, size);
        return;
    }
    vdev_device * d   = buffer_device(buf);
    const char *  src = (const char *) tensor->data + offset;
    b->enqueue([d, data, src, size]() { d2h_transfer(d, data, src, size); }, /*work =*/ true);
    if (!host_ptr_is_pinned(data)) {
        vdev_backend_synchronize(backend); // pageable destination: the host waits for the copy
    }
}

bool vdev_backend_cpy_tensor_async(ggml_backend_t backend_src, ggml_backend_t backend_dst, const ggml_tensor * src, ggml_tensor * dst) {
    if (!backend_is_vdev(backend_src) || !backend_is_vdev(backend_dst)) {
        return false; // like CUDA: host (or foreign) sources use the scheduler's synchronous fallback
    }
    ggml_backend_buffer_t buf_src = tensor_buffer(src);
    ggml_backend_buffer_t buf_dst = tensor_buffer(dst);
    if (!buffer_is_vdev(buf_src) || !buffer_is_vdev(buf_dst)) {
        return false;
    }
    auto * bs = (vdev_backend *) backend_src->context;
    auto * bd = (vdev_backend *) backend_dst->context;
    vdev_device * ds = buffer_device(buf_src);
    vdev_device * dd = buffer_device(buf_dst);
    if (bs->dev != ds || bd->dev != dd) {
        return false; // backend and buffer devices do not match
    }

    void *       dst_data = dst->data;
    const void * src_data = src->data;
    const size_t nbytes   = ggml_nbytes(dst);

    if (bs == bd) {
        bs->enqueue([ds, dd, dst_data, src_data, nbytes]() { d2d_transfer(ds, dd, dst_data, src_data, nbytes); }, true);
        return true;
    }

    // copy on the source stream, then make the destination stream wait for it
    auto marker = std::make_shared<vdev_marker>();
    bs->enqueue([ds, dd, dst_data, src_data, nbytes, marker]() {
        struct signal_guard {
            vdev_marker * m;
            ~signal_guard() { m->signal(); }
        } guard{ marker.get() };
        d2d_transfer(ds, dd, dst_data, src_data, nbytes);
    });
    bd->enqueue([marker]() { marker->wait(); });
    return true;
}

// a failed stream job, reported on the host thread (once): ggml's synchronize returns nothing, so this aborts - with
// an abort callback that throws (pyllama_pp's shim), the caller gets a clean error instead of a dead process
// Reported once: the jobs the stream took before the host heard of the failure are skipped (drained), then the
// stream runs again, so a caller that goes on after the error computes for real (and a destructor's synchronize,
// llama_context's, finds nothing left to report once the shim has flushed it).
void raise_stream_error(const std::shared_ptr<vdev_stream_error> & err) {
    std::string    msg;
    vdev_backend * owner = nullptr;
    if (err) {
        std::lock_guard<std::mutex> lk(err->mtx);
        msg.swap(err->msg);
        owner = err->owner;
    }
    if (msg.empty()) {
        return;
    }
    if (owner != nullptr) {
        owner->drain();
    }
    err->failed = false;
    GGML_ABORT("a VDEV stream job failed: %s", msg.c_str());
}

void raise_stream_error(vdev_backend * b) {
    raise_stream_error(b->error);
}

void vdev_backend_synchronize(ggml_backend_t backend) {
    auto * b = (vdev_backend *) backend->context;
    b->dev->c.host_syncs += 1;
    b->drain();
    raise_stream_error(b);
}

// --- graph compute: deep copy of the graph's tensor structs, computed on the worker ----------

struct vdev_graph_job {
    std::vector<ggml_tensor>    tensors;     // copies of every struct the compute needs
    std::vector<ggml_tensor *>  nodes;       // the copied nodes, in order
    std::vector<ggml_bitset_t>  hs_used;     // hash set over the copied nodes (for use counts)
    std::vector<ggml_tensor *>  hs_keys;
    std::vector<int32_t>        use_counts;
    ggml_cgraph                 graph{};
    // MUL_MAT_ID nodes whose weights are in pinned host memory (DIRECT reads), and whether their routing ids are
    // computed in this graph itself (counted after the compute) or come from earlier work (counted before it)
    std::vector<std::pair<const ggml_tensor *, bool>> direct_reads;
};

int32_t orig_use_count(const ggml_cgraph * cg, const ggml_tensor * node) {
    const ggml_hash_set & hs = cg->visited_hash_set;
    if (cg->use_counts == nullptr || hs.size == 0 || hs.used == nullptr || hs.keys == nullptr) {
        return 0;
    }
    const size_t h = ggml_hash(node) % hs.size;
    size_t i = h;
    while (ggml_bitset_get(hs.used, i)) {
        if (hs.keys[i] == node) {
            return cg->use_counts[i];
        }
        i = (i + 1) % hs.size;
        if (i == h) {
            break;
        }
    }
    return 0;
}

std::shared_ptr<vdev_graph_job> build_graph_job(const ggml_cgraph * cg) {
    auto job = std::make_shared<vdev_graph_job>();
    const int n_nodes = cg->n_nodes;

    // 1. collect the structs: the nodes, their src[] and view_src, and the view_src of those
    std::unordered_map<const ggml_tensor *, size_t> idx;
    std::vector<const ggml_tensor *> order;
    idx.reserve((size_t) n_nodes * 4 + 16);
    order.reserve((size_t) n_nodes * 4 + 16);

    auto add = [&](const ggml_tensor * t) -> bool {
        if (t == nullptr) {
            return false;
        }
        if (idx.emplace(t, order.size()).second) {
            order.push_back(t);
            return true;
        }
        return false;
    };
    for (int i = 0; i < n_nodes; i++) {
        add(cg->nodes[i]);
    }
    const size_t n_first = order.size();
    for (size_t k = 0; k < n_first; k++) {
        const ggml_tensor * t = order[k];
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            add(t->src[s]);
        }
        add(t->view_src);
    }
    // view chains of the non-node tensors (short: ggml keeps view_src at the root)
    for (size_t k = n_first; k < order.size(); k++) {
        add(order[k]->view_src);
    }

    // 2. copy them and remap the pointers between copies
    job->tensors.resize(order.size());
    for (size_t k = 0; k < order.size(); k++) {
        job->tensors[k] = *order[k];
    }
    auto remap = [&](ggml_tensor * p) -> ggml_tensor * {
        if (p == nullptr) {
            return nullptr;
        }
        auto it = idx.find(p);
        return it == idx.end() ? nullptr : &job->tensors[it->second];
    };
    for (size_t k = 0; k < order.size(); k++) {
        ggml_tensor & t = job->tensors[k];
        for (int s = 0; s < GGML_MAX_SRC; s++) {
            // nodes' sources were all copied; non-node copies lose sources that were not
            // (a compute only reads a node's direct sources)
            t.src[s] = remap(t.src[s]);
        }
        t.view_src = remap(t.view_src);
    }

    // 3. the node list, and a hash set carrying the original graph's use counts (CPU op fusion)
    job->nodes.resize((size_t) n_nodes);
    for (int i = 0; i < n_nodes; i++) {
        job->nodes[i] = &job->tensors[idx[cg->nodes[i]]];
    }
    auto is_node = [&](const ggml_tensor * t) {
        auto it = t != nullptr ? idx.find(t) : idx.end();
        return it != idx.end() && it->second < n_first;
    };
    for (int i = 0; i < n_nodes; i++) {
        const ggml_tensor * node = cg->nodes[i];
        const ggml_tensor * ids  = node->src[2];
        if (node->op == GGML_OP_MUL_MAT_ID && node->src[0] != nullptr && ids != nullptr && ids->type == GGML_TYPE_I32 &&
            host_ptr_is_pinned(node->src[0]->data)) {
            job->direct_reads.emplace_back(job->nodes[i], is_node(ids) || is_node(ids->view_src));
        }
    }
    const size_t hs_size = (size_t) n_nodes * 2 + 1;
    job->hs_used.assign(ggml_bitset_size(hs_size), 0);
    job->hs_keys.assign(hs_size, nullptr);
    job->use_counts.assign(hs_size, 0);
    for (int i = 0; i < n_nodes; i++) {
        ggml_tensor * key = job->nodes[i];
        size_t h = ggml_hash(key) % hs_size;
        while (ggml_bitset_get(job->hs_used.data(), h) && job->hs_keys[h] != key) {
            h = (h + 1) % hs_size;
        }
        ggml_bitset_set(job->hs_used.data(), h);
        job->hs_keys[h]    = key;
        job->use_counts[h] = orig_use_count(cg, cg->nodes[i]);
    }

    job->graph                       = *cg;
    job->graph.size                  = n_nodes;
    job->graph.n_nodes               = n_nodes;
    job->graph.n_leafs               = 0;
    job->graph.nodes                 = job->nodes.data();
    job->graph.grads                 = nullptr;
    job->graph.grad_accs             = nullptr;
    job->graph.leafs                 = nullptr;
    job->graph.use_counts            = job->use_counts.data();
    job->graph.visited_hash_set.size = hs_size;
    job->graph.visited_hash_set.used = job->hs_used.data();
    job->graph.visited_hash_set.keys = job->hs_keys.data();
    return job;
}

// Mimics CUDA's graph_optimize (ggml-cuda.cu): for the top-k MoE routing it fuses, CUDA asks the scheduler to
// keep the router output allocated until the fused sequence ends - an extra dependency node in the
// scheduler's graph - but only when the fusion applies, and it does not for an empty op (the last layer of a
// ubatch without outputs). So the node count of the scheduler's graph depends on whether a ubatch has
// outputs, which is what makes a reserved layout not fit (a re-reservation). VDEV reproduces that.
void vdev_backend_graph_optimize(ggml_backend_t backend, ggml_cgraph * cgraph, ggml_backend_graph_optimize_params * params) {
    (void) backend;
    for (int i = 0; i < cgraph->n_nodes; i++) {
        ggml_tensor * node = cgraph->nodes[i];
        if (node->op == GGML_OP_ARGSORT && node->src[0] != nullptr && !ggml_is_empty(node)) {
            params->add_alloc_dep(params->user_data, node->src[0], node);
        }
    }
}

// the experts (of n_expert) that the int32 routing ids at `ids` (n_col x n_row, strides nb0 / nb1) name
std::vector<bool> used_experts(const char * ids, int64_t n_col, int64_t n_row, size_t nb0, size_t nb1, int64_t n_expert) {
    std::vector<bool> used((size_t) n_expert, false);
    for (int64_t r = 0; r < n_row; r++) {
        for (int64_t c = 0; c < n_col; c++) {
            const int32_t e = *(const int32_t *) (ids + r * nb1 + c * nb0);
            if (e >= 0 && e < n_expert) {
                used[(size_t) e] = true;
            }
        }
    }
    return used;
}

// A kernel that reads expert weights straight from pinned host memory (the patched scheduler's DIRECT: a GPU
// maps pinned host memory) moves the experts its routing ids select over the host link. Charged as h2d bytes
// and link time, before the graph (`before`: ops whose ids come from earlier work on this stream, as the
// scheduler's are) or after it (ids computed in the graph itself; by then later nodes may have reused their
// memory, so those counts are best effort). The model serializes compute and those reads (a real kernel
// overlaps them) at `direct_read` times the link's rate (a kernel reads host memory more slowly than a copy
// engine: about half on the 2xH200 box, docs/RESULTS.md section 2d).
void charge_direct_reads(vdev_device * d, const vdev_graph_job & job, bool before) {
    if (job.direct_reads.empty()) {
        return;
    }
    const pp_vdev_config cfg = d->get_cfg();
    for (const auto & [node, ids_in_graph] : job.direct_reads) {
        if (ids_in_graph == before) {
            continue;
        }
        const ggml_tensor * w   = node->src[0];
        const ggml_tensor * ids = node->src[2];
        const std::vector<bool> used = used_experts((const char *) ids->data, ids->ne[0], ids->ne[1], ids->nb[0], ids->nb[1], w->ne[2]);
        const size_t n_used = (size_t) std::count(used.begin(), used.end(), true);
        charge_h2d(d, cfg.link_gbps * cfg.direct_read, n_used * w->nb[2], []() {}, /*copies =*/ 0);
    }
}

ggml_status vdev_backend_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph) {
    auto * b = (vdev_backend *) backend->context;
    raise_stream_error(b);
    b->dev->c.graph_computes += 1;
    if (cgraph == nullptr || cgraph->n_nodes <= 0) {
        return GGML_STATUS_SUCCESS;
    }
    std::shared_ptr<vdev_graph_job> job;
    try {
        job = build_graph_job(cgraph);
    } catch (const std::exception & e) {
        GGML_LOG_ERROR("%s: %s: cannot copy the graph: %s\n", __func__, b->name.c_str(), e.what());
        return GGML_STATUS_ALLOC_FAILED;
    }
    b->enqueue([b, job]() {
        const pp_vdev_config cfg = b->dev->get_cfg();
        if (b->set_n_threads != nullptr && cfg.n_threads != b->cur_threads) {
            b->set_n_threads(b->cpu, cfg.n_threads);
            b->cur_threads = cfg.n_threads;
        }
        charge_direct_reads(b->dev, *job, /*before =*/ true);
        const auto t0 = clock_t_::now();
        const ggml_status st = ggml_backend_graph_compute(b->cpu, &job->graph);
        const double elapsed = std::chrono::duration<double>(clock_t_::now() - t0).count();
        if (st != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "pyllama_pp vdev %s: graph compute failed with status %d\n", b->name.c_str(), (int) st);
        }
        if (cfg.compute_factor > 1.0 && elapsed > 0.0) {
            std::this_thread::sleep_until(t0 + std::chrono::duration_cast<clock_t_::duration>(
                std::chrono::duration<double>(elapsed * cfg.compute_factor)));
        }
        charge_direct_reads(b->dev, *job, /*before =*/ false);
        const double total = std::chrono::duration<double>(clock_t_::now() - t0).count();
        b->dev->c.compute_ns += secs_to_ns(total);
    }, /*work =*/ true);
    return GGML_STATUS_SUCCESS;
}

void vdev_backend_event_record(ggml_backend_t backend, ggml_backend_event_t event) {
    auto * b = (vdev_backend *) backend->context;
    vdev_event_ptr ev = event_state(event);
    if (!ev) {
        return;
    }
    uint64_t gen;
    {
        std::lock_guard<std::mutex> lk(ev->mtx);
        gen = ++ev->recorded;
    }
    b->dev->c.event_records += 1;
    b->enqueue([ev, gen, err = b->error]() {
        {
            std::lock_guard<std::mutex> lk(ev->mtx);
            ev->done = std::max(ev->done, gen);
            ev->stream_error = err;
        }
        ev->cv.notify_all();
    });
}

void vdev_backend_event_wait(ggml_backend_t backend, ggml_backend_event_t event) {
    auto * b = (vdev_backend *) backend->context;
    vdev_event_ptr ev = event_state(event);
    if (!ev) {
        return;
    }
    uint64_t target;
    {
        std::lock_guard<std::mutex> lk(ev->mtx);
        target = ev->recorded;
    }
    b->dev->c.event_waits += 1;
    if (target == 0) {
        return; // never recorded: nothing to wait for
    }
    b->enqueue([ev, target]() {
        std::unique_lock<std::mutex> lk(ev->mtx);
        ev->cv.wait(lk, [&]() { return ev->done >= target; });
    });
}

ggml_backend_t vdev_backend_init(vdev_device * d) {
    ggml_backend_dev_t cpu_dev = cpu_device();
    if (cpu_dev == nullptr) {
        GGML_LOG_ERROR("%s: %s: no CPU backend is registered (load it before creating a VDEV backend)\n", __func__, d->name.c_str());
        return nullptr;
    }
    ggml_backend_t cpu = ggml_backend_dev_init(cpu_dev, nullptr);
    if (cpu == nullptr) {
        GGML_LOG_ERROR("%s: %s: failed to create the CPU backend\n", __func__, d->name.c_str());
        return nullptr;
    }

    auto * b = new vdev_backend();
    b->dev  = d;
    b->name = d->name;
    b->cpu  = cpu;
    ggml_backend_reg_t cpu_reg = ggml_backend_dev_backend_reg(cpu_dev);
    if (cpu_reg != nullptr) {
        b->set_n_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(cpu_reg, "ggml_backend_set_n_threads");
    }
    const pp_vdev_config cfg = d->get_cfg();
    if (b->set_n_threads != nullptr) {
        b->set_n_threads(cpu, cfg.n_threads);
        b->cur_threads = cfg.n_threads;
    }

    try {
        b->worker = std::thread([b]() { b->run(); });
    } catch (const std::exception & e) {
        GGML_LOG_ERROR("%s: %s: cannot start the worker thread: %s\n", __func__, d->name.c_str(), e.what());
        ggml_backend_free(cpu);
        delete b;
        return nullptr;
    }

    ggml_backend_i iface{};
    iface.graph_optimize      = vdev_backend_graph_optimize;
    iface.get_name            = vdev_backend_get_name;
    iface.free                = vdev_backend_free;
    iface.set_tensor_async    = vdev_backend_set_tensor_async;
    iface.get_tensor_async    = vdev_backend_get_tensor_async;
    iface.set_tensor_2d_async = nullptr;
    iface.get_tensor_2d_async = nullptr;
    iface.cpy_tensor_async    = vdev_backend_cpy_tensor_async;
    iface.synchronize         = vdev_backend_synchronize;
    iface.graph_plan_create   = nullptr;
    iface.graph_plan_free     = nullptr;
    iface.graph_plan_update   = nullptr;
    iface.graph_plan_compute  = nullptr;
    iface.graph_compute       = vdev_backend_graph_compute;
    iface.event_record        = vdev_backend_event_record;
    iface.event_wait          = vdev_backend_event_wait;

    return new ggml_backend{ &g_vdev_guid, iface, &d->dev, b };
}

// ---------------------------------------------------------------------------------------------
// device interface
// ---------------------------------------------------------------------------------------------

vdev_device * dev_ctx(ggml_backend_dev_t dev) {
    return (vdev_device *) dev->context;
}

const char * vdev_dev_get_name(ggml_backend_dev_t dev) {
    return dev_ctx(dev)->name.c_str();
}

const char * vdev_dev_get_description(ggml_backend_dev_t dev) {
    return dev_ctx(dev)->description.c_str();
}

void vdev_dev_get_memory(ggml_backend_dev_t dev, size_t * free_mem, size_t * total_mem) {
    vdev_device * d = dev_ctx(dev);
    uint64_t total = d->get_cfg().memory_bytes;
    if (total == 0) {
        total = VDEV_UNLIMITED_MEM;
    }
    const uint64_t used = d->c.alloc_bytes.load();
    const uint64_t avail = used >= total ? 0 : total - used;
    *total_mem = (size_t) std::min<uint64_t>(total, SIZE_MAX);
    *free_mem  = (size_t) std::min<uint64_t>(avail, SIZE_MAX);
}

enum ggml_backend_dev_type vdev_dev_get_type(ggml_backend_dev_t dev) {
    (void) dev;
    return GGML_BACKEND_DEVICE_TYPE_GPU;
}

void vdev_dev_get_props(ggml_backend_dev_t dev, ggml_backend_dev_props * props) {
    memset(props, 0, sizeof(*props));
    props->name        = vdev_dev_get_name(dev);
    props->description = vdev_dev_get_description(dev);
    props->type        = vdev_dev_get_type(dev);
    // like a PCI bus id, it tells which devices share a host link: VDEVs in one link group get the group's id with
    // a "-v<N>" suffix, as ggml-cuda's virtual devices of one GPU (GGML_CUDA_DEVICES) carry their GPU's id
    {
        vdev_device * d = dev_ctx(dev);
        std::lock_guard<std::mutex> lk(d->cfg_mtx);   // the link group and the id under one lock
        const int group = d->cfg.link_group;
        const std::string id = group >= 0 ? "vdev-link" + std::to_string(group) + "-v" + std::to_string(d->index)
                                          : "vdev-" + std::to_string(d->index);
        if (d->bus_id != id) {
            d->bus_id = id; // (unchanged ids keep their pointer valid for earlier callers)
        }
        props->device_id = d->bus_id.c_str();
    }
    vdev_dev_get_memory(dev, &props->memory_free, &props->memory_total);
    props->caps.async                = true;
    props->caps.host_buffer          = true;
    props->caps.buffer_from_host_ptr = false;
    props->caps.events               = true;
    props->caps.mmap_support         = false;
}

ggml_backend_t vdev_dev_init_backend(ggml_backend_dev_t dev, const char * params) {
    (void) params;
    try {
        return vdev_backend_init(dev_ctx(dev));
    } catch (const std::exception & e) {
        GGML_LOG_ERROR("%s: %s\n", __func__, e.what());
        return nullptr;
    }
}

ggml_backend_buffer_type_t vdev_dev_get_buffer_type(ggml_backend_dev_t dev) {
    return &dev_ctx(dev)->buft;
}

bool vdev_dev_supports_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    (void) dev;
    ggml_backend_dev_t cpu_dev = cpu_device();
    if (cpu_dev == nullptr) {
        return false;
    }
    // sources in CPU-specific (non-host) buffer types such as repacked weights have a layout
    // only the CPU backend's extra kernels understand
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        const ggml_tensor * s = op->src[i];
        if (s == nullptr) {
            continue;
        }
        ggml_backend_buffer_t buf = tensor_buffer(s);
        if (buf == nullptr || buffer_is_vdev(buf) || buft_is_vdev(buf->buft)) {
            continue;
        }
        ggml_backend_dev_t bdev = ggml_backend_buft_get_device(buf->buft);
        if (!ggml_backend_buft_is_host(buf->buft) && bdev != nullptr &&
            ggml_backend_dev_type(bdev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            return false;
        }
    }
    return ggml_backend_dev_supports_op(cpu_dev, op);
}

bool vdev_dev_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    return buft_is_vdev(buft) && buft->device == dev;
}

int64_t op_offload_min_batch() {
    static const int64_t v = []() -> int64_t {
        const char * e = getenv("GGML_OP_OFFLOAD_MIN_BATCH");
        if (e != nullptr && *e != '\0') {
            char * end = nullptr;
            const long long x = strtoll(e, &end, 10);
            if (end != e) {
                return (int64_t) x;
            }
        }
        return 32;
    }();
    return v;
}

int64_t op_batch_size(const ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_GET_ROWS:
            return 0;
        case GGML_OP_MUL_MAT:
            return op->ne[1];
        case GGML_OP_MUL_MAT_ID:
        case GGML_OP_ROPE:
        case GGML_OP_ROPE_BACK:
            return op->ne[2];
        default:
            return ggml_nrows(op);
    }
}

bool vdev_dev_offload_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    (void) dev;
    return op_batch_size(op) >= op_offload_min_batch();
}

ggml_backend_event_t vdev_dev_event_new(ggml_backend_dev_t dev) {
    try {
        auto * holder = new vdev_event_ptr(std::make_shared<vdev_event_state>());
        return new ggml_backend_event{ dev, holder };
    } catch (const std::exception & e) {
        GGML_LOG_ERROR("%s: %s\n", __func__, e.what());
        return nullptr;
    }
}

void vdev_dev_event_free(ggml_backend_dev_t dev, ggml_backend_event_t event) {
    (void) dev;
    if (event == nullptr) {
        return;
    }
    delete (vdev_event_ptr *) event->context; // queued jobs keep their own reference
    delete event;
}

void vdev_dev_event_synchronize(ggml_backend_dev_t dev, ggml_backend_event_t event) {
    vdev_event_ptr ev = event_state(event);
    dev_ctx(dev)->c.host_syncs += 1;
    if (!ev) {
        return;
    }
    std::shared_ptr<vdev_stream_error> err;
    {
        std::unique_lock<std::mutex> lk(ev->mtx);
        const uint64_t target = ev->recorded;
        ev->cv.wait(lk, [&]() { return ev->done >= target; });
        err = ev->stream_error;
    }
    raise_stream_error(err);
}

// ---------------------------------------------------------------------------------------------
// registry
// ---------------------------------------------------------------------------------------------

const char * vdev_reg_get_name(ggml_backend_reg_t reg) {
    (void) reg;
    return "VDEV";
}

size_t vdev_reg_get_device_count(ggml_backend_reg_t reg) {
    (void) reg;
    return (size_t) g_n_devices;
}

ggml_backend_dev_t vdev_reg_get_device(ggml_backend_reg_t reg, size_t index) {
    (void) reg;
    if (index >= (size_t) g_n_devices) {
        return nullptr;
    }
    return &g_devices[index]->dev;
}

// GATHER (the patched scheduler's ggml_backend_pp_gather_t, ggml-backend-pp.h; the baseline never asks): on the
// backend's queue, after what is queued before it, read the int32 routing ids in device memory and copy each used
// expert of the host tensor `src` into `dst`, plus the first min(nb[2], 512) bytes of the expert after it
// (GGML_BACKEND_PP_GATHER_TAIL: what the selective copy leaves there) - charged to the link at its full rate, as
// a copy engine moves it (CUDA's gather kernel reads host memory itself; measure it there).
// Modes (gather_abi.h): USED; PREFETCH (no ids: the experts `src` used at its last gather on this device, into
// `dst`, remembered for `dst`); REST (USED less what the last prefetch into `dst` brought). Every gather with ids
// records the set it used for `src`.

struct vdev_gather_state {   // per device; written on the queues in their order, read there (prefetch, rest)
    std::mutex                                              mtx;
    std::unordered_map<const void *, std::vector<bool>>     last;   // src data -> experts its last gather used
    std::unordered_map<const void *, std::vector<bool>>     pref;   // dst data -> experts the last prefetch brought
    std::unordered_set<const void *>                        known;  // host side: src data with a gather queued
    // the device's gathers run in order on a queue of their own, as CUDA's on one stream per GPU: each waits for the
    // calling backend's queue to get to it (not a CHAINED one: only for the gathers before it), and the calling
    // backend's queue waits for it (created with the device's first gather; never freed, as the devices)
    vdev_backend *                                          worker = nullptr;
};
vdev_gather_state g_gather_state[PP_VDEV_MAX];
constexpr size_t kMaxGatherSets = 16384;   // per device: weights and copies of the models loaded so far

// copy the selected experts of `in` (and the tail after each run of them) into `out`, charged to d's link
void gather_runs(vdev_device * d, char * out, const char * in, size_t expert, int64_t n_expert, const std::vector<bool> & sel) {
    std::vector<std::pair<size_t, size_t>> runs;   // (offset, bytes)
    size_t total = 0;
    for (int64_t e = 0; e < n_expert; e++) {
        if (!sel[(size_t) e]) {
            continue;
        }
        int64_t last = e;
        while (last + 1 < n_expert && sel[(size_t) last + 1]) {
            last++;
        }
        const size_t tail = last < n_expert - 1 ? std::min<size_t>(expert, pp_gather_abi::kTail) : 0;
        runs.emplace_back((size_t) e * expert, (size_t) (last - e + 1) * expert + tail);
        total += runs.back().second;
        e = last;
    }
    charge_h2d(d, d->get_cfg().link_gbps, total, [&]() {
        for (const auto & [off, n] : runs) {
            memcpy(out + off, in + off, n);
        }
    }, (int) runs.size());
}

bool vdev_pp_gather(ggml_backend_t backend, ggml_tensor * dst, const ggml_tensor * src, const ggml_tensor * ids, int mode) {
    using namespace pp_gather_abi;
    const bool beside  = (mode & kBeside) != 0;    // (counted; VDEV copies alike either way)
    const bool chained = (mode & kChained) != 0;   // (counted; on the gather queue: waits for no calling queue)
    mode &= ~(kBeside | kChained);
    const bool prefetch = mode == kPrefetch;
    if (!backend_is_vdev(backend) || dst == nullptr || src == nullptr || (ids == nullptr) != prefetch ||
        (mode != kUsed && mode != kPrefetch && mode != kRest) ||
        (ids != nullptr && (ids->type != GGML_TYPE_I32 || ids->data == nullptr || !buffer_is_vdev(tensor_buffer(ids)))) ||
        dst->data == nullptr || src->data == nullptr || !ggml_is_contiguous(src) ||
        !ggml_is_contiguous(dst) || ggml_nbytes(dst) != ggml_nbytes(src) ||
        dst->nb[2] != src->nb[2] || !buffer_is_vdev(tensor_buffer(dst))) {
        return false;
    }
    auto *         b = (vdev_backend *) backend->context;
    vdev_device *  d = buffer_device(tensor_buffer(dst));
    if (b->dev != d || (ids != nullptr && buffer_device(tensor_buffer(ids)) != d)) {
        return false;
    }
    vdev_gather_state & st = g_gather_state[d->index];
    {
        std::lock_guard<std::mutex> lk(st.mtx);
        if (prefetch && !st.known.count(src->data)) {
            return false;   // nothing gathered from this weight yet: no set to predict from
        }
        if (st.known.size() + st.pref.size() > kMaxGatherSets) {
            // bounded (models come and go; pointers are reused): forgetting is safe - a prefetch then brings
            // nothing it cannot find, and a rest with no prefetched set copies every used expert
            st.known.clear();
            st.last.clear();
            st.pref.clear();
            if (prefetch) {
                return false;
            }
        }
        st.known.insert(src->data);
    }
    char *         out      = (char *) dst->data;
    const char *   in       = (const char *) src->data;
    const char *   id_data  = ids != nullptr ? (const char *) ids->data : nullptr;
    const size_t   expert   = src->nb[2];
    const int64_t  n_expert = src->ne[2];
    const int64_t  n_col = ids != nullptr ? ids->ne[0] : 0, n_row = ids != nullptr ? ids->ne[1] : 0;
    const size_t   nb0 = ids != nullptr ? ids->nb[0] : 0, nb1 = ids != nullptr ? ids->nb[1] : 0;
    // on the device's gather queue: after the calling backend's queue got here (a CHAINED gather: after the gathers
    // before it only), and the calling backend's queue after the copy, however the job ends (a job that throws is
    // skipped by its worker: the backend must not wait forever)
    auto before = std::make_shared<vdev_marker>(), after = std::make_shared<vdev_marker>();
    auto job = [=, &st]() {
        struct signal_guard {
            vdev_marker * m;
            ~signal_guard() { m->signal(); }
        } guard{ after.get() };
        if (!chained) {
            before->wait();
        }
        std::vector<bool> sel;
        if (prefetch) {
            std::lock_guard<std::mutex> lk(st.mtx);
            auto it = st.last.find(in);
            sel = it != st.last.end() && (int64_t) it->second.size() == n_expert ? it->second : std::vector<bool>((size_t) n_expert, false);
            st.pref[out] = sel;
        } else {
            sel = used_experts(id_data, n_col, n_row, nb0, nb1, n_expert);
            std::lock_guard<std::mutex> lk(st.mtx);
            st.last[in] = sel;
            auto it = st.pref.find(out);
            if (mode == kRest && it != st.pref.end() && (int64_t) it->second.size() == n_expert) {
                for (int64_t e = 0; e < n_expert; e++) {
                    sel[(size_t) e] = sel[(size_t) e] && !it->second[(size_t) e];
                }
            }
        }
        gather_runs(d, out, in, expert, n_expert, sel);
    };
    {
        // (one host thread at a time: the gather queue gets the jobs in the order the calling queues get their marks)
        std::lock_guard<std::mutex> lk(st.mtx);
        if (st.worker == nullptr) {
            auto * w = new (std::nothrow) vdev_backend();
            if (w == nullptr) {
                return false;
            }
            w->dev  = d;
            w->name = d->name + "-gather";
            try {
                w->worker = std::thread([w]() { w->run(); });
            } catch (const std::exception &) {
                delete w;
                return false;   // nothing queued
            }
            st.worker = w;
        }
        try {
            st.worker->enqueue(job);
        } catch (...) {
            return false;   // nothing queued
        }
        // (a mark the backend cannot queue: the gather goes on at once, and the backend waits for it here)
        try {
            b->enqueue([before]() { before->signal(); });
            b->enqueue([after]() { after->wait(); });
        } catch (...) {
            before->signal();
            after->wait();
        }
    }
    d->c.gathers += 1;
    d->c.beside_gathers += beside ? 1 : 0;
    d->c.chained_gathers += chained ? 1 : 0;
    return true;
}

void * vdev_reg_get_proc_address(ggml_backend_reg_t reg, const char * name) {
    (void) reg;
    if (name != nullptr && strcmp(name, "ggml_backend_pp_gather_v4") == 0) {   // (with a mode: extension version 4)
        return (void *) vdev_pp_gather;
    }
    return nullptr;
}

vdev_device * make_device(int i) {
    auto * d = new vdev_device();
    d->index       = i;
    d->name        = "VDEV" + std::to_string(i);
    d->description = "pyllama_pp virtual device";
    d->buft_name   = d->name;

    ggml_backend_device_i di{};
    di.get_name             = vdev_dev_get_name;
    di.get_description      = vdev_dev_get_description;
    di.get_memory           = vdev_dev_get_memory;
    di.get_type             = vdev_dev_get_type;
    di.get_props            = vdev_dev_get_props;
    di.init_backend         = vdev_dev_init_backend;
    di.get_buffer_type      = vdev_dev_get_buffer_type;
    di.get_host_buffer_type = vdev_dev_get_host_buffer_type;
    di.buffer_from_host_ptr = nullptr;
    di.supports_op          = vdev_dev_supports_op;
    di.supports_buft        = vdev_dev_supports_buft;
    di.offload_op           = vdev_dev_offload_op;
    di.event_new            = vdev_dev_event_new;
    di.event_free           = vdev_dev_event_free;
    di.event_synchronize    = vdev_dev_event_synchronize;

    d->dev.iface   = di;
    d->dev.reg     = &g_reg;
    d->dev.context = d;

    ggml_backend_buffer_type_i bi{};
    bi.get_name       = vdev_buft_get_name;
    bi.alloc_buffer   = vdev_buft_alloc_buffer;
    bi.get_alignment  = vdev_buft_get_alignment;
    bi.get_max_size   = vdev_buft_get_max_size;
    bi.get_alloc_size = vdev_buft_get_alloc_size;
    bi.is_host        = vdev_buft_is_host;

    d->buft.iface   = bi;
    d->buft.device  = &d->dev;
    d->buft.context = d;
    return d;
}

void set_err(char * err, size_t err_size, const char * msg) {
    if (err != nullptr && err_size > 0) {
        snprintf(err, err_size, "%s", msg);
    }
}

} // namespace

// ---------------------------------------------------------------------------------------------
// public C API
// ---------------------------------------------------------------------------------------------

PP_VDEV_EXPORT int pp_vdev_register(const struct pp_vdev_config * cfg, int n, char * err, size_t err_size) {
    try {
        std::lock_guard<std::mutex> lk(g_mtx);
        if (n < 1 || n > PP_VDEV_MAX) {
            char msg[128];
            snprintf(msg, sizeof(msg), "pp_vdev_register: n must be in 1..%d (got %d)", PP_VDEV_MAX, n);
            set_err(err, err_size, msg);
            return -1;
        }
        if (g_registered.load()) {
            if (n != g_n_devices) {
                char msg[160];
                snprintf(msg, sizeof(msg), "pp_vdev_register: %d VDEV devices are already registered in this process; cannot register %d",
                         g_n_devices, n);
                set_err(err, err_size, msg);
                return -1;
            }
            for (int i = 0; i < n; i++) {
                apply_cfg_locked(g_devices[i], sanitize_cfg(cfg ? cfg[i] : default_cfg()));
            }
            set_err(err, err_size, "");
            return 0;
        }

        for (int i = 0; i < n; i++) {
            vdev_device * d = make_device(i);
            apply_cfg_locked(d, sanitize_cfg(cfg ? cfg[i] : default_cfg()));
            g_devices[i] = d;
        }
        g_n_devices = n;

        ggml_backend_reg_i ri{};
        ri.get_name         = vdev_reg_get_name;
        ri.get_device_count = vdev_reg_get_device_count;
        ri.get_device       = vdev_reg_get_device;
        ri.get_proc_address = vdev_reg_get_proc_address;
        g_reg.api_version = GGML_BACKEND_API_VERSION;
        g_reg.iface       = ri;
        g_reg.context     = nullptr;

        ggml_backend_register(&g_reg);
        g_registered.store(true);
        set_err(err, err_size, "");
        return 0;
    } catch (const std::exception & e) {
        set_err(err, err_size, e.what());
        return -1;
    } catch (...) {
        set_err(err, err_size, "pp_vdev_register: unknown error");
        return -1;
    }
}

PP_VDEV_EXPORT int pp_vdev_count(void) {
    std::lock_guard<std::mutex> lk(g_mtx);
    return g_registered.load() ? g_n_devices : 0;
}

PP_VDEV_EXPORT int pp_vdev_configure(int i, const struct pp_vdev_config * cfg) {
    if (cfg == nullptr) {
        return -1;
    }
    try {
        std::lock_guard<std::mutex> lk(g_mtx);
        if (!g_registered.load() || i < 0 || i >= g_n_devices) {
            return -1;
        }
        apply_cfg_locked(g_devices[i], sanitize_cfg(*cfg));
        return 0;
    } catch (...) {
        return -1;
    }
}

PP_VDEV_EXPORT int pp_vdev_get_counters(int i, struct pp_vdev_counters * out) {
    if (out == nullptr) {
        return -1;
    }
    vdev_device * d;
    {
        std::lock_guard<std::mutex> lk(g_mtx);
        if (!g_registered.load() || i < 0 || i >= g_n_devices) {
            return -1;
        }
        d = g_devices[i];
    }
    const vdev_counters_atomic & c = d->c;
    out->h2d_bytes        = c.h2d_bytes.load();
    out->d2h_bytes        = c.d2h_bytes.load();
    out->d2d_bytes        = c.d2d_bytes.load();
    out->h2d_copies       = c.h2d_copies.load();
    out->d2h_copies       = c.d2h_copies.load();
    out->d2d_copies       = c.d2d_copies.load();
    out->graph_computes   = c.graph_computes.load();
    out->host_syncs       = c.host_syncs.load();
    out->event_records    = c.event_records.load();
    out->event_waits      = c.event_waits.load();
    out->alloc_bytes      = c.alloc_bytes.load();
    out->peak_alloc_bytes = c.peak_alloc_bytes.load();
    out->failed_allocs    = c.failed_allocs.load();
    out->link_busy_s      = (double) c.link_busy_ns.load() * 1e-9;
    out->compute_s        = (double) c.compute_ns.load() * 1e-9;
    out->gathers          = c.gathers.load();
    out->beside_gathers   = c.beside_gathers.load();
    out->chained_gathers  = c.chained_gathers.load();
    out->buffer_allocs    = c.buffer_allocs.load();
    out->hd_copies        = c.hd_copies.load();
    return 0;
}

PP_VDEV_EXPORT void pp_vdev_reset_counters(void) {
    std::lock_guard<std::mutex> lk(g_mtx);
    if (!g_registered.load()) {
        return;
    }
    for (int i = 0; i < g_n_devices; i++) {
        vdev_counters_atomic & c = g_devices[i]->c;
        c.h2d_bytes = 0;  c.d2h_bytes = 0;  c.d2d_bytes = 0;
        c.h2d_copies = 0; c.d2h_copies = 0; c.d2d_copies = 0;
        c.graph_computes = 0;
        c.host_syncs = 0;
        c.gathers = 0; c.beside_gathers = 0; c.chained_gathers = 0;
        c.event_records = 0; c.event_waits = 0;
        c.failed_allocs = 0;
        c.peak_alloc_bytes = c.alloc_bytes.load();
        c.link_busy_ns = 0;
        c.compute_ns = 0;
    }
}

PP_VDEV_EXPORT ggml_backend_reg_t pp_vdev_reg(void) {
    return g_registered.load() ? &g_reg : nullptr;
}
