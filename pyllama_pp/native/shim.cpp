// pyllama_pp shim: see shim.h. Thin on purpose: placement policy, device specs and statistics live in
// Python; this file only translates, catches and reports. ggml RPC's part is rpc.cpp.
#include "shim.h"
#include "shim_impl.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include "llama-context.h"   // llama_context::get_sched (exported C++ member; no policy taken from it)
#include "llama-ext.h"       // llama_get_memory_breakdown
#include "fit.h"             // common/fit.h of this variant
#include "fit_log.h"
#include "trace.h"           // the expert trace (trace.cpp)

#include <dlfcn.h>
#include <unistd.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <memory>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifndef PP_VARIANT
#define PP_VARIANT "unknown"
#endif

namespace {

thread_local std::string g_last_error;
std::atomic<int> g_log_level{1};
std::mutex g_log_mutex;
std::deque<std::string> g_log_tail;   // recent warnings/errors from llama.cpp, attached to failures
std::string g_partial;
bool g_capture_on = false;
std::string g_capture;                // captured log text (pp_log_capture), capped at kCaptureMax
constexpr size_t kCaptureMax = 16u << 20;

}  // namespace

int pp_shim::fail(int code, const std::string & msg) {
    std::string tail;
    {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        for (const auto & l : g_log_tail) {
            tail += "\n  llama.cpp: " + l;
        }
        g_log_tail.clear();
    }
    g_last_error = msg + tail;
    return code;
}

void pp_shim::copy_str(char * dst, size_t n, const char * src) {
    snprintf(dst, n, "%s", src ? src : "");
}

int pp_shim::alloc_scratch(ggml_backend_dev_t dev, const char * dev_name, uint64_t bytes, scratch_tensor & out) {
    ggml_init_params ip = {ggml_tensor_overhead(), nullptr, true};
    out.ctx.reset(ggml_init(ip));
    out.t = out.ctx ? ggml_new_tensor_1d(out.ctx.get(), GGML_TYPE_I8, (int64_t) bytes) : nullptr;
    out.buf.reset(out.t ? ggml_backend_alloc_ctx_tensors_from_buft(out.ctx.get(), ggml_backend_dev_buffer_type(dev))
                        : nullptr);
    if (!out.buf) {
        return fail(PP_ERR_MEMORY, std::string("cannot allocate ") + std::to_string(bytes) + " bytes on " + dev_name);
    }
    return PP_OK;
}

using namespace pp_shim;

namespace {

void log_cb(enum ggml_log_level level, const char * text, void * /*user*/) {
    if (!text) {
        return;
    }
    std::lock_guard<std::mutex> lock(g_log_mutex);
    if (g_capture_on && g_capture.size() < kCaptureMax) {
        g_capture += text;
    }
    // CONT continues the previous line at the previous level
    static enum ggml_log_level last = GGML_LOG_LEVEL_INFO;
    if (level != GGML_LOG_LEVEL_CONT) {
        last = level;
    }
    const int lvl = last == GGML_LOG_LEVEL_ERROR ? 1 : last == GGML_LOG_LEVEL_WARN ? 2 : last == GGML_LOG_LEVEL_DEBUG ? 4 : 3;
    if (lvl <= g_log_level.load()) {
        fputs(text, stderr);
    }
    if (lvl <= 2) {
        g_partial += text;
        size_t nl;
        while ((nl = g_partial.find('\n')) != std::string::npos) {
            if (nl > 0) {
                g_log_tail.push_back(g_partial.substr(0, nl));
            }
            g_partial.erase(0, nl + 1);
            while (g_log_tail.size() > 6) {
                g_log_tail.pop_front();
            }
        }
    }
}

// ggml_abort would kill the user's Python process: turn it into an exception that the entry points catch.
void abort_cb(const char * msg) {
    throw pp_abort_error(std::string("ggml abort: ") + (msg ? msg : "?"));
}

// --- the patched build's extension, looked up in the loaded ggml-base/llama at run time ---
struct ext_api {
    int (*version)(void) = nullptr;
    int (*set_param)(const char *, int64_t) = nullptr;
    int (*get_param)(const char *, int64_t *) = nullptr;
    int (*set_param_text)(const char *, const char *) = nullptr;
    int (*get_param_text)(const char *, char *, size_t) = nullptr;
    size_t (*stats_json)(ggml_backend_sched_t, char *, size_t) = nullptr;
    void (*reset_stats)(ggml_backend_sched_t) = nullptr;
    const char * (*param_info)(int, int64_t *, const char **) = nullptr;
    const char * (*param_spec)(int, const char **, int64_t *, int64_t *, int64_t *, const char **) = nullptr;
    int (*env_problems)(char *, size_t) = nullptr;
    void (*set_gather)(const char *, void *) = nullptr;
    int (*stage_default_threads)(void) = nullptr;
};

const ext_api & ext() {
    static ext_api api = [] {
        ext_api a;
        void * h = dlopen("libggml-base.so", RTLD_NOW | RTLD_NOLOAD);
        if (h) {
            a.version     = (int (*)(void)) dlsym(h, "ggml_backend_sched_pp_ext_version");
            a.set_param   = (int (*)(const char *, int64_t)) dlsym(h, "ggml_backend_sched_pp_set_param");
            a.get_param   = (int (*)(const char *, int64_t *)) dlsym(h, "ggml_backend_sched_pp_get_param");
            a.set_param_text = (int (*)(const char *, const char *)) dlsym(h, "ggml_backend_sched_pp_set_param_text");
            a.get_param_text = (int (*)(const char *, char *, size_t)) dlsym(h, "ggml_backend_sched_pp_get_param_text");
            a.stats_json  = (size_t (*)(ggml_backend_sched_t, char *, size_t)) dlsym(h, "ggml_backend_sched_pp_stats_json");
            a.reset_stats = (void (*)(ggml_backend_sched_t)) dlsym(h, "ggml_backend_sched_pp_reset_stats");
            a.param_info  = (const char * (*)(int, int64_t *, const char **)) dlsym(h, "ggml_backend_sched_pp_param_info");
            a.param_spec  = (const char * (*)(int, const char **, int64_t *, int64_t *, int64_t *, const char **))
                            dlsym(h, "ggml_backend_sched_pp_param_spec");
            a.env_problems = (int (*)(char *, size_t)) dlsym(h, "ggml_backend_sched_pp_env_problems");
            a.set_gather  = (void (*)(const char *, void *)) dlsym(h, "ggml_backend_sched_pp_set_gather");
            a.stage_default_threads = (int (*)(void)) dlsym(h, "ggml_backend_sched_pp_stage_default_threads");
        }
        return a;
    }();
    return api;
}

// the CUDA gather library's count of the bytes a device's gathers read (pp_gather_cuda_counted), once registered
long long (*g_gather_counted)(const char *) = nullptr;

// GATHER for CUDA devices: pyllama_pp's own library next to the backend modules (gather_cuda.cu), registered
// with the patched scheduler for the "CUDA" registry. Nothing to do in the baseline (no such scheduler function),
// without the CUDA backend, or where the library was not built (a CPU-only install).
void register_cuda_gather(const char * backend_dir) {
    if (ext().set_gather == nullptr || ggml_backend_reg_by_name("CUDA") == nullptr || backend_dir == nullptr || !*backend_dir) {
        return;
    }
    const std::string path = std::string(backend_dir) + "/libpyllama_pp_gather_cuda.so";
    void * lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    void * fn  = lib ? dlsym(lib, "pp_gather_cuda_v4") : nullptr;   // (the hook of extension version 4: with a mode)
    if (fn == nullptr) {
        const char * why = dlerror();
        log_cb(GGML_LOG_LEVEL_INFO, ("pyllama_pp: no CUDA gather (" + path + ": " + (why ? why : "no pp_gather_cuda_v4") +
                                     "); GATHER falls back to DIRECT or the selective copy\n").c_str(), nullptr);
        return;
    }
    ext().set_gather("CUDA", fn);
    g_gather_counted = (long long (*)(const char *)) dlsym(lib, "pp_gather_cuda_counted");
}

}  // namespace

struct pp_model {
    llama_model * model = nullptr;
    std::vector<std::string> patterns;
    std::vector<llama_model_tensor_buft_override> overrides;
    std::vector<ggml_backend_dev_t> devices;
};

struct pp_context {
    pp_model * model = nullptr;
    llama_context * ctx = nullptr;
    uint32_t n_batch = 0;
    int32_t n_vocab = 0;
    std::atomic<int> coverage_on{0};
    std::mutex cov_mutex;
    std::vector<pp_coverage_row> coverage;
    std::vector<int32_t> ids_buf;
};

int pp_shim_fail(int code, const char * msg) { return fail(code, msg ? msg : ""); }

// ---- basics ----------------------------------------------------------------------------------------------

PP_EXPORT const char * pp_last_error(void) { return g_last_error.c_str(); }
PP_EXPORT const char * pp_variant(void) { return PP_VARIANT; }
PP_EXPORT const char * pp_system_info(void) { return llama_print_system_info(); }
PP_EXPORT void pp_set_log_level(int level) { g_log_level = level; }

PP_EXPORT void pp_log_capture(int32_t on) {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    g_capture_on = on != 0;
    if (on) {
        g_capture.clear();
    }
}

PP_EXPORT int pp_log_captured(char * buf, size_t n) {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    if (buf && n > 0) {
        snprintf(buf, n, "%s", g_capture.c_str());
    }
    return (int) g_capture.size();
}

PP_EXPORT int pp_init(const char * backend_dir, int log_level) {
    static std::once_flag once;
    g_log_level = log_level;
    return guarded([&] {
        std::call_once(once, [&] {
            llama_log_set(log_cb, nullptr);
            ggml_log_set(log_cb, nullptr);
            ggml_set_abort_callback(abort_cb);
            if (backend_dir && *backend_dir) {
                // the shared modules (CUDA where built, then the CPU) and this variant's own RPC module, next to
                // this library: the patched one speaks the series' RPC protocol
                Dl_info self{};
                std::string own = dladdr((void *) &pp_init, &self) && self.dli_fname ? self.dli_fname : "";
                own = own.substr(0, own.find_last_of('/') == std::string::npos ? 0 : own.find_last_of('/'));
                for (const std::string & path : { std::string(backend_dir) + "/libggml-cuda.so", own + "/libggml-rpc.so",
                                                  std::string(backend_dir) + "/libggml-cpu.so" }) {
                    if (access(path.c_str(), R_OK) == 0) {
                        ggml_backend_load(path.c_str());
                    }
                }
            } else {
                ggml_backend_load_all();
            }
            llama_backend_init();
            register_cuda_gather(backend_dir);
        });
        if (!ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)) {
            return fail(PP_ERR_DEVICE, std::string("no CPU backend found in ") + (backend_dir ? backend_dir : "(default path)") +
                                           ": the package is incomplete; reinstall with `pip install .`");
        }
        return PP_OK;
    });
}

// ---- devices ---------------------------------------------------------------------------------------------

PP_EXPORT int pp_device_count(void) { return (int) ggml_backend_dev_count(); }

PP_EXPORT int pp_device_get(int i, pp_device_info * out) {
    if (i < 0 || i >= (int) ggml_backend_dev_count() || !out) {
        return fail(PP_ERR_ARG, "device index out of range: " + std::to_string(i));
    }
    return guarded([&] {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        ggml_backend_dev_props props;
        ggml_backend_dev_get_props(dev, &props);
        memset(out, 0, sizeof(*out));
        copy_str(out->name, sizeof(out->name), props.name);
        copy_str(out->description, sizeof(out->description), props.description);
        copy_str(out->backend, sizeof(out->backend), ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)));
        out->type         = props.type;
        out->memory_free  = props.memory_free;
        out->memory_total = props.memory_total;
        out->caps_async   = props.caps.async;
        out->caps_host_buffer = props.caps.host_buffer;
        out->caps_buffer_from_host_ptr = props.caps.buffer_from_host_ptr;
        out->caps_events  = props.caps.events;
        return PP_OK;
    });
}

// ---- rates: a device's host link, the host's staging copy ------------------------------------------------

static double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

// GB/s of `bytes` in `seconds`
static double gbps(uint64_t bytes, double seconds) {
    return (double) bytes / std::max(seconds, 1e-9) / 1e9;
}

PP_EXPORT int pp_link_rate(const char * dev_name, uint64_t bytes, int32_t copies, double * pinned_gbps,
                           double * pageable_gbps) {
    if (!dev_name || !pinned_gbps || !pageable_gbps || bytes == 0 || copies <= 0) {
        return fail(PP_ERR_ARG, "null argument, 0 bytes or no copy");
    }
    return guarded([&] {
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(dev_name);
        if (!dev) {
            return fail(PP_ERR_DEVICE, std::string("unknown device '") + dev_name + "'");
        }
        scratch_tensor s;
        if (int rc = alloc_scratch(dev, dev_name, bytes, s); rc != PP_OK) {
            return rc;
        }
        ggml_tensor * t = s.t;
        ggml_backend_buffer_type_t host = ggml_backend_dev_host_buffer_type(dev);
        ggml_backend_buffer_t hbuf = host ? ggml_backend_buft_alloc_buffer(host, bytes) : nullptr;
        std::unique_ptr<ggml_backend_buffer, decltype(&ggml_backend_buffer_free)> keep_host(hbuf, ggml_backend_buffer_free);
        std::vector<uint8_t> pageable(bytes, 0x5a);
        using clock = std::chrono::steady_clock;
        // copies in a row, timed together (a link that lets a short copy return before its time is up, as VDEV's
        // does, charges it to the next one), three times: the median
        auto rate = [&](const uint8_t * src) {
            ggml_backend_tensor_set(t, src, 0, bytes);   // (untimed: a first copy sets up what the device needs)
            std::vector<double> r;
            for (int round = 0; round < 3; round++) {
                auto t0 = clock::now();
                for (int i = 0; i < copies; i++) {
                    ggml_backend_tensor_set(t, src, 0, bytes);   // (synchronous: returns once the device holds them)
                }
                r.push_back(gbps(bytes * (uint64_t) copies, std::chrono::duration<double>(clock::now() - t0).count()));
            }
            return median_of(r);
        };
        uint8_t * pinned = hbuf ? (uint8_t *) ggml_backend_buffer_get_base(hbuf) : nullptr;
        if (pinned) {
            memset(pinned, 0x5a, bytes);
        }
        *pinned_gbps   = pinned ? rate(pinned) : 0.0;
        *pageable_gbps = rate(pageable.data());
        return (int) PP_OK;
    });
}

PP_EXPORT int pp_cpu_expert_rate(int32_t type, int64_t ne0, int64_t ne1, int32_t n_expert, int32_t n_used,
                                 int32_t n_threads, int32_t reps, double * out) {
    if (!out || ne0 <= 0 || ne1 <= 0 || n_expert <= 0 || n_used <= 0 || n_used > n_expert || reps <= 0 ||
        type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size((ggml_type) type) <= 0 ||
        ne0 % ggml_blck_size((ggml_type) type) != 0) {
        return fail(PP_ERR_ARG, "bad expert tensor shape, type, expert counts or repetitions");
    }
    return guarded([&] {
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        ggml_backend_t cpu = dev ? ggml_backend_dev_init(dev, nullptr) : nullptr;
        if (!cpu) {
            return fail(PP_ERR_DEVICE, "no CPU backend");
        }
        std::unique_ptr<ggml_backend, decltype(&ggml_backend_free)> keep_cpu(cpu, ggml_backend_free);
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
        if (set_threads && n_threads > 0) {
            set_threads(cpu, n_threads);
        }
        // one token's expert op as decode runs it on the host (MUL_MAT_ID of n_used experts of a [ne0, ne1, n_expert]
        // tensor), the ids moved on each time so that the experts read are not in the caches
        ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
        std::unique_ptr<ggml_context, decltype(&ggml_free)> ctx(ggml_init(ip), ggml_free);
        if (!ctx) {
            return fail(PP_ERR_MEMORY, "ggml_init failed");
        }
        ggml_tensor * w   = ggml_new_tensor_3d(ctx.get(), (ggml_type) type, ne0, ne1, n_expert);
        ggml_tensor * x   = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, ne0, 1, 1);
        ggml_tensor * ids = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, n_used, 1);
        ggml_tensor * y   = ggml_mul_mat_id(ctx.get(), w, x, ids);
        ggml_cgraph * gf  = ggml_new_graph(ctx.get());
        ggml_build_forward_expand(gf, y);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx.get(), cpu);
        if (!buf) {
            return fail(PP_ERR_MEMORY, "no host memory for the expert tensor");
        }
        std::unique_ptr<ggml_backend_buffer, decltype(&ggml_backend_buffer_free)> keep_buf(buf, ggml_backend_buffer_free);
        // every expert holds one expert's rows of small random values, quantized as the model's are (not zeros:
        // they can run faster than real data)
        std::vector<float> rows((size_t) ne0 * ne1), xin((size_t) ne0);
        uint32_t seed = 12345u;
        auto next = [&]() { seed = seed * 1664525u + 1013904223u; return ((seed >> 8) & 0xffff) / 65536.0f - 0.5f; };
        for (float & v : rows) { v = 0.05f * next(); }
        for (float & v : xin)  { v = next(); }
        const size_t expert_bytes = ggml_row_size((ggml_type) type, ne0) * (size_t) ne1;
        std::vector<uint8_t> q(expert_bytes);
        ggml_quantize_chunk((ggml_type) type, rows.data(), q.data(), 0, ne1, ne0, nullptr);
        for (int32_t e = 0; e < n_expert; e++) {
            ggml_backend_tensor_set(w, q.data(), (size_t) e * expert_bytes, expert_bytes);
        }
        ggml_backend_tensor_set(x, xin.data(), 0, ggml_nbytes(x));
        std::vector<int32_t> sel(n_used);
        using clock = std::chrono::steady_clock;
        std::vector<double> r;
        for (int32_t i = 0; i <= reps; i++) {
            for (int32_t j = 0; j < n_used; j++) {
                sel[j] = (int32_t) (((int64_t) i * n_used + j) % n_expert);
            }
            ggml_backend_tensor_set(ids, sel.data(), 0, ggml_nbytes(ids));
            auto t0 = clock::now();
            if (ggml_backend_graph_compute(cpu, gf) != GGML_STATUS_SUCCESS) {
                return fail(PP_ERR_DEVICE, "the CPU backend failed the expert op");
            }
            if (i > 0) {   // (the first: untimed)
                r.push_back(gbps(expert_bytes * (uint64_t) n_used, std::chrono::duration<double>(clock::now() - t0).count()));
            }
        }
        *out = median_of(r);
        return (int) PP_OK;
    });
}

PP_EXPORT int pp_host_copy_rate(const char * dev_name, uint64_t bytes, int32_t n_threads, int32_t reps, double * out) {
    if (!out || bytes == 0 || reps <= 0) {
        return fail(PP_ERR_ARG, "null argument, 0 bytes or no repetition");
    }
    return guarded([&] {
        const size_t piece = (size_t) 32 << 20;   // (a staging slot)
        // (0: as the patched build's STAGING=1 copies; the baseline stages nothing: one thread)
        const int n = n_threads > 0 ? n_threads : ext().stage_default_threads ? ext().stage_default_threads() : 1;
        ggml_backend_dev_t dev = dev_name ? ggml_backend_dev_by_name(dev_name) : nullptr;
        ggml_backend_buffer_type_t host = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
        ggml_backend_buffer_t hbuf = host ? ggml_backend_buft_alloc_buffer(host, 2 * piece) : nullptr;
        std::unique_ptr<ggml_backend_buffer, decltype(&ggml_backend_buffer_free)> keep(hbuf, ggml_backend_buffer_free);
        std::vector<uint8_t> plain(hbuf ? 0 : 2 * piece);
        uint8_t * slots = hbuf ? (uint8_t *) ggml_backend_buffer_get_base(hbuf) : plain.data();
        memset(slots, 0, 2 * piece);
        std::vector<uint8_t> src(bytes, 0x5a);   // (pageable, touched: resident, as a model's pages in the page cache)
        auto copy = [&](uint8_t * dst, const uint8_t * from, size_t size) {
            const size_t step = ((size + n - 1) / n + 63) & ~(size_t) 63;
            std::vector<std::thread> helpers;
            for (int k = 1; k < n; k++) {
                const size_t b = std::min(size, step * k), e = std::min(size, b + step);
                helpers.emplace_back([=]() { memcpy(dst + b, from + b, e - b); });
            }
            memcpy(dst, from, std::min(size, step));
            for (auto & h : helpers) {
                h.join();
            }
        };
        using clock = std::chrono::steady_clock;
        std::vector<double> r;
        for (int i = 0; i <= reps; i++) {
            auto t0 = clock::now();
            for (size_t off = 0, k = 0; off < bytes; off += piece, k++) {
                copy(slots + (k % 2) * piece, src.data() + off, std::min(piece, (size_t) bytes - off));
            }
            if (i > 0) {   // (the first: untimed)
                r.push_back(gbps(bytes, std::chrono::duration<double>(clock::now() - t0).count()));
            }
        }
        *out = median_of(r);
        return (int) PP_OK;
    });
}

// ---- model -----------------------------------------------------------------------------------------------

static std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> out;
    size_t start = 0;
    while (start <= s.size()) {
        size_t end = s.find(sep, start);
        if (end == std::string::npos) {
            end = s.size();
        }
        if (end > start) {
            out.push_back(s.substr(start, end - start));
        }
        start = end + 1;
    }
    return out;
}

static ggml_backend_buffer_type_t find_buft(const std::string & name) {
    if (name == "CPU") {
        ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        return cpu ? ggml_backend_dev_buffer_type(cpu) : nullptr;
    }
    if (ggml_backend_dev_t dev = ggml_backend_dev_by_name(name.c_str())) {
        return ggml_backend_dev_buffer_type(dev);
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_get(i));
        if (buft && name == ggml_backend_buft_name(buft)) {
            return buft;
        }
    }
    return nullptr;
}

// llama's model parameters for p, with the device list and tensor overrides they point to kept in m
static int model_params_of(const pp_model_params * p, pp_model & m, llama_model_params & mp) {
    mp = llama_model_default_params();
    mp.n_gpu_layers = p->n_gpu_layers;
    mp.split_mode   = (enum llama_split_mode) p->split_mode;
    mp.main_gpu     = p->main_gpu;
    mp.load_mode    = (enum llama_load_mode) p->load_mode;
    mp.no_host      = p->no_host != 0;
    mp.use_extra_bufts = p->use_extra_bufts != 0;
    mp.tensor_split = p->tensor_split;
    if (p->devices && strcmp(p->devices, "none") == 0) {
        m.devices.push_back(nullptr);   // no accelerator at all: CPU only
        mp.devices = m.devices.data();
    } else if (p->devices && *p->devices) {
        for (const auto & name : split(p->devices, ',')) {
            ggml_backend_dev_t dev = ggml_backend_dev_by_name(name.c_str());
            if (!dev) {
                return fail(PP_ERR_DEVICE, "unknown device '" + name + "'");
            }
            m.devices.push_back(dev);
        }
        m.devices.push_back(nullptr);
        mp.devices = m.devices.data();
    }
    if (p->n_overrides < 0 || (p->n_overrides > 0 && !p->overrides)) {
        return fail(PP_ERR_ARG, "bad tensor overrides: n_overrides must be >= 0 with that many strings");
    }
    if (p->n_overrides > 0) {
        m.patterns.reserve(p->n_overrides);
        for (int32_t k = 0; k < p->n_overrides; k++) {
            const std::string item = p->overrides[k] ? p->overrides[k] : "";
            size_t eq = item.rfind('=');
            if (eq == std::string::npos || eq == 0) {
                return fail(PP_ERR_ARG, "bad tensor override '" + item + "': expected PATTERN=BUFFER_TYPE");
            }
            ggml_backend_buffer_type_t buft = find_buft(item.substr(eq + 1));
            if (!buft) {
                return fail(PP_ERR_ARG, "unknown buffer type '" + item.substr(eq + 1) + "' in override '" + item + "'");
            }
            m.patterns.push_back(item.substr(0, eq));
            m.overrides.push_back({ nullptr, buft });
        }
        for (size_t i = 0; i < m.patterns.size(); i++) {
            m.overrides[i].pattern = m.patterns[i].c_str();
        }
        m.overrides.push_back({ nullptr, nullptr });
        mp.tensor_buft_overrides = m.overrides.data();
    }
    return PP_OK;
}

PP_EXPORT pp_model * pp_model_load(const pp_model_params * p) {
    pp_model * result = nullptr;
    int rc = guarded([&] {
        if (!p || !p->path) {
            return fail(PP_ERR_ARG, "no model path given");
        }
        struct stat st;
        if (stat(p->path, &st) != 0 || !S_ISREG(st.st_mode)) {
            return fail(PP_ERR_MODEL, std::string("model file not found: ") + p->path);
        }
        auto m = std::make_unique<pp_model>();
        llama_model_params mp;
        if (int err = model_params_of(p, *m, mp); err != PP_OK) {
            return err;
        }
        m->model = llama_model_load_from_file(p->path, mp);
        if (!m->model) {
            return fail(PP_ERR_MODEL, std::string("llama.cpp could not load ") + p->path);
        }
        result = m.release();
        return PP_OK;
    });
    (void) rc;
    return result;
}

PP_EXPORT void pp_model_free(pp_model * m) {
    if (m) {
        llama_model_free(m->model);
        delete m;
    }
}

PP_EXPORT int pp_model_get_info(const pp_model * m, pp_model_info * out) {
    if (!m || !out) {
        return fail(PP_ERR_ARG, "null model");
    }
    return guarded([&] {
        memset(out, 0, sizeof(*out));
        llama_model_desc(m->model, out->desc, sizeof(out->desc));
        llama_model_meta_val_str(m->model, "general.architecture", out->arch, sizeof(out->arch));
        out->size_bytes  = llama_model_size(m->model);
        out->n_params    = llama_model_n_params(m->model);
        out->n_layer     = llama_model_n_layer(m->model);
        out->n_embd      = llama_model_n_embd(m->model);
        out->n_vocab     = llama_vocab_n_tokens(llama_model_get_vocab(m->model));
        out->n_head      = llama_model_n_head(m->model);
        out->n_head_kv   = llama_model_n_head_kv(m->model);
        out->n_ctx_train = llama_model_n_ctx_train(m->model);
        char buf[64];
        std::string arch = out->arch;
        if (llama_model_meta_val_str(m->model, (arch + ".expert_count").c_str(), buf, sizeof(buf)) > 0) {
            out->n_expert = atoi(buf);
        }
        if (llama_model_meta_val_str(m->model, (arch + ".expert_used_count").c_str(), buf, sizeof(buf)) > 0) {
            out->n_expert_used = atoi(buf);
        }
        return PP_OK;
    });
}

PP_EXPORT int pp_model_meta(const pp_model * m, const char * key, char * buf, size_t n) {
    if (!m || !key || !buf) {
        return fail(PP_ERR_ARG, "null argument");
    }
    int r = llama_model_meta_val_str(m->model, key, buf, n);
    return r < 0 ? fail(PP_ERR_ARG, std::string("no metadata key ") + key) : r;
}

// ---- context ---------------------------------------------------------------------------------------------

// Records the experts each MoE layer used in a ubatch ("ffn_moe_topk-<il>": ids [n_expert_used, n_tokens]).
static bool coverage_cb(struct ggml_tensor * t, bool ask, void * user) {
    auto * c = (pp_context *) user;
    if (!c->coverage_on.load() || strncmp(t->name, "ffn_moe_topk-", 13) != 0 || t->type != GGML_TYPE_I32) {
        return ask ? false : true;
    }
    if (ask) {
        return true;
    }
    // the top-k ids are usually a strided view of the argsort result: read its bytes, index by strides
    const int64_t k = t->ne[0], n_tok = t->ne[1];
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    std::vector<uint8_t> used(4096, 0);
    int n_used = 0;
    for (int64_t i1 = 0; i1 < n_tok; i1++) {
        for (int64_t i0 = 0; i0 < k; i0++) {
            int32_t id;
            memcpy(&id, raw.data() + i1 * t->nb[1] + i0 * t->nb[0], sizeof(id));
            if (id >= 0 && id < (int32_t) used.size() && !used[id]) {
                used[id] = 1;
                n_used++;
            }
        }
    }
    std::lock_guard<std::mutex> lock(c->cov_mutex);
    if (c->coverage.size() < (1u << 20)) {
        c->coverage.push_back({ atoi(t->name + 13), (int32_t) n_tok, n_used });
    }
    return true;
}

// llama's context parameters from ours (the context and fit share them)
static llama_context_params to_llama_context_params(const pp_context_params & p) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx     = p.n_ctx;
    cp.n_batch   = p.n_batch;
    cp.n_ubatch  = p.n_ubatch;
    cp.n_seq_max = p.n_seq_max > 0 ? p.n_seq_max : 1;
    if (p.n_threads > 0) {
        cp.n_threads = cp.n_threads_batch = p.n_threads;
    }
    cp.flash_attn_type = (enum llama_flash_attn_type) p.flash_attn;
    cp.op_offload  = p.op_offload != 0;
    cp.offload_kqv = p.offload_kqv != 0;
    return cp;
}

PP_EXPORT pp_context * pp_context_new(pp_model * m, const pp_context_params * p) {
    pp_context * result = nullptr;
    guarded([&] {
        if (!m || !p) {
            return fail(PP_ERR_ARG, "null model or params");
        }
        auto c = std::make_unique<pp_context>();
        c->model = m;
        llama_context_params cp = to_llama_context_params(*p);
        cp.no_perf = false;
        if (p->coverage) {
            c->coverage_on = 1;
            cp.cb_eval = coverage_cb;
            cp.cb_eval_user_data = c.get();
        }
        if (p->trace) {
            if (p->coverage) {
                return fail(PP_ERR_ARG, "a context records coverage or a trace, not both (one eval callback)");
            }
            cp.cb_eval = pp_trace_eval_cb;
            cp.cb_eval_user_data = p->trace;
        }
        c->ctx = llama_init_from_model(m->model, cp);
        if (!c->ctx) {
            return fail(PP_ERR_MEMORY, "llama.cpp could not create the context (most often: too little device memory "
                                       "for the KV cache and compute buffers; lower n_ctx/n_ubatch or move layers)");
        }
        c->n_batch = llama_n_batch(c->ctx);
        c->n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(m->model));
        result = c.release();
        return PP_OK;
    });
    return result;
}

PP_EXPORT void pp_context_free(pp_context * c) {
    if (c) {
        // a device error not reported yet (a VDEV stream's) would be raised by the synchronize in llama_context's
        // destructor, where an exception ends the process: report (and drop) it here first, keeping the last error
        const std::string keep = g_last_error;
        for (int i = 0; i < 64 && guarded([&] { llama_synchronize(c->ctx); return 0; }) != 0; i++) {
        }
        g_last_error = keep;
        llama_free(c->ctx);
        delete c;
    }
}

PP_EXPORT int pp_memory_clear(pp_context * c) {
    if (!c) {
        return fail(PP_ERR_ARG, "null context");
    }
    return guarded([&] {
        llama_memory_clear(llama_get_memory(c->ctx), true);
        return PP_OK;
    });
}

PP_EXPORT int pp_memory_seq_rm(pp_context * c, int32_t seq, int32_t p0, int32_t p1) {
    if (!c || seq < 0 || p0 < 0) {
        return fail(PP_ERR_ARG, "bad sequence removal arguments");
    }
    return guarded([&] {
        if (!llama_memory_seq_rm(llama_get_memory(c->ctx), seq, p0, p1 < 0 ? -1 : p1)) {
            return fail(PP_ERR_UNSUPPORTED, "this model's memory cannot remove part of a sequence");
        }
        return PP_OK;
    });
}

PP_EXPORT int pp_memory_seq_add(pp_context * c, int32_t seq, int32_t p0, int32_t p1, int32_t delta) {
    if (!c || seq < 0 || p0 < 0) {
        return fail(PP_ERR_ARG, "bad sequence shift arguments");
    }
    return guarded([&] {
        llama_memory_t mem = llama_get_memory(c->ctx);
        if (!llama_memory_can_shift(mem)) {
            return fail(PP_ERR_UNSUPPORTED, "this model's memory cannot shift positions");
        }
        llama_memory_seq_add(mem, seq, p0, p1 < 0 ? -1 : p1, delta);
        return PP_OK;
    });
}

PP_EXPORT int pp_memory_seq_pos_max(pp_context * c, int32_t seq, int32_t * pos_max) {
    if (!c || seq < 0 || !pos_max) {
        return fail(PP_ERR_ARG, "null argument");
    }
    return guarded([&] {
        *pos_max = llama_memory_seq_pos_max(llama_get_memory(c->ctx), seq);
        return PP_OK;
    });
}

PP_EXPORT int pp_synchronize(pp_context * c) {
    if (!c) {
        return fail(PP_ERR_ARG, "null context");
    }
    return guarded([&] {
        llama_synchronize(c->ctx);
        return PP_OK;
    });
}

PP_EXPORT int pp_decode(pp_context * c, const int32_t * tokens, int32_t n_tokens, int32_t pos0, int32_t seq,
                        const int32_t * out_idx, int32_t n_out, float * logits_out) {
    if (!c || !tokens || n_tokens <= 0 || (n_out > 0 && (!out_idx || !logits_out))) {
        return fail(PP_ERR_ARG, "bad decode arguments");
    }
    return guarded([&] {
        const int32_t n_vocab = c->n_vocab;
        for (int32_t i = 0; i < n_tokens; i++) {
            if (tokens[i] < 0 || tokens[i] >= n_vocab) {
                return fail(PP_ERR_ARG, "token " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                                            " is out of range [0, " + std::to_string(n_vocab) + ")");
            }
        }
        for (int32_t j = 0; j < n_out; j++) {
            if (out_idx[j] < 0 || out_idx[j] >= n_tokens || (j > 0 && out_idx[j] <= out_idx[j - 1])) {
                return fail(PP_ERR_ARG, "output indices must be ascending and within the tokens");
            }
        }
        llama_batch batch = llama_batch_init((int32_t) c->n_batch, 0, 1);
        int32_t next_out = 0;
        int rc = PP_OK;
        for (int32_t start = 0; start < n_tokens && rc == PP_OK; start += (int32_t) c->n_batch) {
            const int32_t n = std::min<int32_t>((int32_t) c->n_batch, n_tokens - start);
            batch.n_tokens = n;
            int32_t first_out = next_out;
            for (int32_t i = 0; i < n; i++) {
                batch.token[i]     = tokens[start + i];
                batch.pos[i]       = pos0 + start + i;
                batch.n_seq_id[i]  = 1;
                batch.seq_id[i][0] = seq;
                bool want = next_out < n_out && out_idx[next_out] == start + i;
                batch.logits[i] = want;
                if (want) {
                    next_out++;
                }
            }
            int r = llama_decode(c->ctx, batch);
            if (r != 0) {
                rc = fail(PP_ERR_DECODE, "llama_decode failed with code " + std::to_string(r) +
                                             (r == 1 ? " (no KV cache slot: n_ctx too small for the tokens)" : ""));
                break;
            }
            for (int32_t j = first_out; j < next_out; j++) {
                const float * l = llama_get_logits_ith(c->ctx, out_idx[j] - start);
                if (!l) {
                    rc = fail(PP_ERR_DECODE, "no logits for output " + std::to_string(j));
                    break;
                }
                memcpy(logits_out + (size_t) j * n_vocab, l, sizeof(float) * n_vocab);
            }
        }
        llama_batch_free(batch);
        return rc;
    });
}

PP_EXPORT int pp_get_perf(pp_context * c, pp_perf * out) {
    if (!c || !out) {
        return fail(PP_ERR_ARG, "null argument");
    }
    llama_perf_context_data d = llama_perf_context(c->ctx);
    out->t_load_ms   = d.t_load_ms;
    out->t_p_eval_ms = d.t_p_eval_ms;
    out->t_eval_ms   = d.t_eval_ms;
    out->n_p_eval    = d.n_p_eval;
    out->n_eval      = d.n_eval;
    out->n_reused    = d.n_reused;
    return PP_OK;
}

PP_EXPORT int pp_reset_perf(pp_context * c) {
    if (!c) {
        return fail(PP_ERR_ARG, "null context");
    }
    llama_perf_context_reset(c->ctx);
    return PP_OK;
}

// ---- scheduler facts -------------------------------------------------------------------------------------

PP_EXPORT int pp_get_sched_info(pp_context * c, pp_sched_info * out) {
    if (!c || !out) {
        return fail(PP_ERR_ARG, "null argument");
    }
    return guarded([&] {
        memset(out, 0, sizeof(*out));
        ggml_backend_sched_t sched = c->ctx->get_sched();
        if (!sched) {
            return fail(PP_ERR_INTERNAL, "context has no scheduler");
        }
        out->n_backends = ggml_backend_sched_get_n_backends(sched);
        out->n_copies   = ggml_backend_sched_get_n_copies(sched);
        out->n_splits   = ggml_backend_sched_get_n_splits(sched);
        out->pipeline_parallel = out->n_copies > 1;
        const int nb = std::min<int>(out->n_backends, PP_MAX_DEVICES + 2);
        for (int i = 0; i < nb; i++) {
            ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
            ggml_backend_buffer_type_t buft = ggml_backend_sched_get_buffer_type(sched, b);
            copy_str(out->backends[i].name, PP_NAME_LEN, ggml_backend_name(b));
            copy_str(out->backends[i].buft, PP_NAME_LEN, buft ? ggml_backend_buft_name(buft) : "");
            out->backends[i].compute_buffer_bytes = ggml_backend_sched_get_buffer_size(sched, b);
        }
        return PP_OK;
    });
}

PP_EXPORT int pp_get_memory_breakdown(pp_context * c, pp_memory_row * rows, int32_t max_rows) {
    if (!c || (!rows && max_rows > 0)) {
        return fail(PP_ERR_ARG, "null argument");
    }
    return guarded([&] {
        auto mb = llama_get_memory_breakdown(c->ctx);
        int n = 0;
        for (const auto & [buft, data] : mb) {
            if (n >= max_rows) {
                break;
            }
            pp_memory_row & r = rows[n++];
            memset(&r, 0, sizeof(r));
            copy_str(r.buft, PP_NAME_LEN, ggml_backend_buft_name(buft));
            ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
            copy_str(r.device, PP_NAME_LEN, dev ? ggml_backend_dev_name(dev) : "host");
            r.model_bytes   = data.model;
            r.context_bytes = data.context;
            r.compute_bytes = data.compute;
        }
        return n;
    });
}

// ---- coverage --------------------------------------------------------------------------------------------

PP_EXPORT int pp_coverage_count(pp_context * c) {
    if (!c) {
        return fail(PP_ERR_ARG, "null context");
    }
    std::lock_guard<std::mutex> lock(c->cov_mutex);
    return (int) c->coverage.size();
}

PP_EXPORT int pp_coverage_get(pp_context * c, pp_coverage_row * rows, int32_t max_rows) {
    if (!c || (!rows && max_rows > 0)) {
        return fail(PP_ERR_ARG, "null argument");
    }
    std::lock_guard<std::mutex> lock(c->cov_mutex);
    int n = std::min<int>(max_rows, (int) c->coverage.size());
    memcpy(rows, c->coverage.data(), sizeof(pp_coverage_row) * n);
    return n;
}

PP_EXPORT void pp_coverage_reset(pp_context * c) {
    if (c) {
        std::lock_guard<std::mutex> lock(c->cov_mutex);
        c->coverage.clear();
    }
}

PP_EXPORT void pp_coverage_enable(pp_context * c, int32_t on) {
    if (c) {
        c->coverage_on = on;
    }
}

// ---- fit -------------------------------------------------------------------------------------------------

static void fill_fit_memory(pp_fit_memory & m, const char * name, const common_device_memory_data & d) {
    copy_str(m.name, sizeof(m.name), name);
    m.model_bytes   = d.model;
    m.context_bytes = d.context;
    m.compute_bytes = d.compute;
    m.free_bytes    = d.free;
    m.total_bytes   = d.total;
}

PP_EXPORT int pp_fit(const pp_fit_params * p, const pp_context_params * cx, pp_fit_result * out) {
    if (!p || !p->path || !cx || !out) {
        return fail(PP_ERR_ARG, "null fit argument");
    }
    return guarded([&] {
        memset(out, 0, sizeof(*out));
        struct stat st;
        if (stat(p->path, &st) != 0 || !S_ISREG(st.st_mode)) {
            return fail(PP_ERR_MODEL, std::string("model file not found: ") + p->path);
        }
        std::vector<ggml_backend_dev_t> devices;
        for (const auto & name : split(p->devices ? p->devices : "", ',')) {
            ggml_backend_dev_t dev = ggml_backend_dev_by_name(name.c_str());
            if (!dev) {
                return fail(PP_ERR_DEVICE, "unknown device '" + name + "'");
            }
            devices.push_back(dev);
        }
        if (devices.empty() || devices.size() > PP_MAX_DEVICES) {
            return fail(PP_ERR_DEVICE, "fit needs 1.." + std::to_string(PP_MAX_DEVICES) + " devices");
        }
        devices.push_back(nullptr);

        llama_model_params mp = llama_model_default_params();
        mp.devices    = devices.data();
        mp.split_mode = (enum llama_split_mode) p->split_mode;
        pp_model given;   // (the measured placement's devices and overrides)
        if (p->placement) {
            if (int err = model_params_of(p->placement, given, mp); err != PP_OK) {
                return err;
            }
            mp.devices = devices.data();
        }
        const llama_model_params mp0 = mp;

        llama_context_params cp = to_llama_context_params(*cx);
        const llama_context_params cp0 = cp;

        std::vector<float> tensor_split(llama_max_devices(), 0.0f);
        std::vector<llama_model_tensor_buft_override> tbo(llama_max_tensor_buft_overrides(), { nullptr, nullptr });
        std::vector<size_t> margins(llama_max_devices(), 0);
        for (size_t i = 0; i + 1 < devices.size(); i++) {
            margins[i] = p->margins[i];
        }

        pp_fit_log_begin();
        common_params_fit_status status = COMMON_PARAMS_FIT_STATUS_SUCCESS;
        try {
            if (!p->placement) {   // (a given placement is measured as it is)
                status = common_fit_params(p->path, &mp, &cp, tensor_split.data(), tbo.data(), margins.data(),
                                           p->n_ctx_min > 0 ? p->n_ctx_min : 4096, nullptr, GGML_LOG_LEVEL_ERROR);
            }
        } catch (...) {
            pp_fit_log_end();
            throw;
        }
        pp_fit_log log = pp_fit_log_end();

        out->status = status;
        copy_str(out->message, sizeof(out->message), status == COMMON_PARAMS_FIT_STATUS_SUCCESS ? "" : log.last_warning.c_str());
        std::string report = "[";
        for (const auto & [type, json] : log.records) {
            report += (report.size() > 1 ? ",{\"type\":\"" : "{\"type\":\"") + type + "\",\"data\":" + json + "}";
        }
        report += "]";
        if (report.size() >= sizeof(out->report)) {
            report = "[]";
        }
        copy_str(out->report, sizeof(out->report), report.c_str());
        if (status == COMMON_PARAMS_FIT_STATUS_ERROR && log.last_warning.find("failed to load model") != std::string::npos) {
            return fail(PP_ERR_MODEL, std::string("llama.cpp could not load ") + p->path + " for fit");
        }

        // the memory of the fitted parameters (or, after a failure, of the defaults) per device
        const bool ok = status == COMMON_PARAMS_FIT_STATUS_SUCCESS;
        std::vector<ggml_backend_dev_t> devs;
        uint32_t hp_ngl = 0, hp_nct = 0, hp_nex = 0;
        common_device_memory_data_vec mem;
        try {
            mem = common_get_device_memory_data(p->path, ok ? &mp : &mp0, ok ? &cp : &cp0, devs, hp_ngl, hp_nct, hp_nex,
                                                GGML_LOG_LEVEL_ERROR);
        } catch (const std::exception & e) {
            if (ok) {
                return fail(PP_ERR_INTERNAL, std::string("could not measure the ") + (p->placement ? "given placement: " :
                            "fitted parameters: ") + e.what());
            }
        }
        out->n_gpu_layers = ok ? mp.n_gpu_layers : -1;
        out->n_ctx        = ok ? cp.n_ctx : cx->n_ctx;
        out->n_devices    = (int32_t) devices.size() - 1;
        out->n_layer      = (int32_t) hp_ngl;
        out->n_expert     = (int32_t) hp_nex;
        for (int i = 0; i < out->n_devices; i++) {
            out->tensor_split[i] = ok && mp.tensor_split ? mp.tensor_split[i] : 0.0f;
        }
        if (mem.size() == devs.size() + 1) {
            for (size_t i = 0; i < devs.size() && i < PP_MAX_DEVICES; i++) {
                fill_fit_memory(out->devices[i], ggml_backend_dev_name(devs[i]), mem[i]);
            }
            fill_fit_memory(out->host, "host", mem.back());
        }
        std::string ov;
        int n_ov = 0;
        for (const llama_model_tensor_buft_override * o = ok ? mp.tensor_buft_overrides : nullptr; o && o->pattern; o++) {
            ov += std::string(o->pattern) + "=" + (o->buft == ggml_backend_cpu_buffer_type() ? "CPU" : ggml_backend_buft_name(o->buft)) + "\n";
            n_ov++;
        }
        if (ov.size() >= sizeof(out->overrides)) {
            return fail(PP_ERR_INTERNAL, "fit emitted more tensor overrides than pp_fit_result holds");
        }
        copy_str(out->overrides, sizeof(out->overrides), ov.c_str());
        out->n_overrides = n_ov;
        return PP_OK;
    });
}

// ---- extension -------------------------------------------------------------------------------------------

PP_EXPORT long long pp_gather_counted(const char * dev_name) {
    return g_gather_counted != nullptr && dev_name != nullptr ? g_gather_counted(dev_name) : -1;
}

PP_EXPORT int pp_ext_version(void) { return ext().version ? ext().version() : 0; }

PP_EXPORT int pp_ext_get_stats_json(pp_context * c, char * buf, size_t n) {
    if (!ext().stats_json) {
        return fail(PP_ERR_UNSUPPORTED, std::string("the ") + PP_VARIANT + " build has no scheduler extension");
    }
    if (!c || !buf) {
        return fail(PP_ERR_ARG, "null argument");
    }
    return guarded([&] {
        size_t need = ext().stats_json(c->ctx->get_sched(), buf, n);
        return need >= n ? fail(PP_ERR_ARG, "stats buffer too small: need " + std::to_string(need + 1)) : (int) need;
    });
}

PP_EXPORT int pp_ext_set_param(const char * name, int64_t value) {
    if (!ext().set_param) {
        return fail(PP_ERR_UNSUPPORTED, std::string("the ") + PP_VARIANT + " build has no scheduler extension");
    }
    const int rc = ext().set_param(name, value);
    if (rc == -2) {
        std::string accepted = "see pyllama-pp info";
        for (int i = 0; ext().param_spec != nullptr; i++) {
            const char * t = nullptr;
            const char * v = nullptr;
            int64_t d = 0, lo = 0, hi = 0;
            const char * n = ext().param_spec(i, &t, &d, &lo, &hi, &v);
            if (n == nullptr) {
                break;
            }
            if (strcmp(n, name) == 0) {
                accepted = v ? std::string("one of ") + v : std::to_string(lo) + ".." + std::to_string(hi);
                break;
            }
        }
        return fail(PP_ERR_ARG, std::string("switch ") + name + "=" + std::to_string(value) + " is out of range; accepted: " + accepted);
    }
    return rc == 0 ? PP_OK : fail(PP_ERR_ARG, std::string("unknown switch ") + (name ? name : "(null)"));
}

PP_EXPORT int pp_ext_set_param_text(const char * name, const char * text) {
    if (!ext().set_param_text) {
        return fail(PP_ERR_UNSUPPORTED, std::string("the ") + PP_VARIANT + " build has no switches by text");
    }
    const int rc = ext().set_param_text(name, text);
    if (rc == -2) {
        return fail(PP_ERR_ARG, std::string("switch ") + name + "=" + (text ? text : "(null)") +
                    " is not accepted (out of range, not an integer, or a list for a switch of one value): see pyllama-pp info");
    }
    return rc == 0 ? PP_OK : fail(PP_ERR_ARG, std::string("unknown switch ") + (name ? name : "(null)"));
}

PP_EXPORT int pp_ext_get_param_text(const char * name, char * buf, size_t buf_size) {
    if (!ext().get_param_text) {
        return fail(PP_ERR_UNSUPPORTED, std::string("the ") + PP_VARIANT + " build has no switches by text");
    }
    return ext().get_param_text(name, buf, buf_size) >= 0 ? PP_OK : fail(PP_ERR_ARG, std::string("unknown switch ") + (name ? name : "(null)"));
}

PP_EXPORT int pp_ext_param_spec(int i, char * type, size_t type_size, int64_t * def, int64_t * min, int64_t * max,
                                char * values, size_t values_size) {
    if (!ext().param_spec) {
        return fail(PP_ERR_UNSUPPORTED, std::string("the ") + PP_VARIANT + " build has no typed switch table");
    }
    const char * t = nullptr;
    const char * v = nullptr;
    if (!ext().param_spec(i, &t, def, min, max, &v)) {
        return fail(PP_ERR_ARG, "no switch with index " + std::to_string(i));
    }
    if (type && type_size) {
        snprintf(type, type_size, "%s", t ? t : "");
    }
    if (values && values_size) {
        snprintf(values, values_size, "%s", v ? v : "");
    }
    return PP_OK;
}

PP_EXPORT int pp_ext_env_problems(char * buf, size_t buf_size) {
    if (!ext().env_problems) {
        return fail(PP_ERR_UNSUPPORTED, std::string("the ") + PP_VARIANT + " build has no switch table");
    }
    return ext().env_problems(buf, buf_size);
}

PP_EXPORT int pp_ext_param_info(int i, char * name, size_t name_size, int64_t * value, char * desc, size_t desc_size) {
    if (!ext().param_info) {
        return fail(PP_ERR_UNSUPPORTED, std::string("the ") + PP_VARIANT + " build cannot list scheduler switches");
    }
    const char * d = nullptr;
    const char * n = ext().param_info(i, value, &d);
    if (!n) {
        return fail(PP_ERR_ARG, "no switch with index " + std::to_string(i));
    }
    if (name && name_size) {
        snprintf(name, name_size, "%s", n);
    }
    if (desc && desc_size) {
        snprintf(desc, desc_size, "%s", d ? d : "");
    }
    return PP_OK;
}

PP_EXPORT int pp_ext_get_param(const char * name, int64_t * value) {
    if (!ext().get_param) {
        return fail(PP_ERR_UNSUPPORTED, std::string("the ") + PP_VARIANT + " build has no scheduler extension");
    }
    return ext().get_param(name, value) == 0 ? PP_OK : fail(PP_ERR_ARG, std::string("unknown parameter ") + (name ? name : "(null)"));
}
