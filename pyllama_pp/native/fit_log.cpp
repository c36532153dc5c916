// common/log.h for the few common/ sources the shim builds (fit.cpp): instead of upstream's log.cpp (a worker
// thread printing to stdout, which would mix with a worker's JSON reply), every message goes to the callback
// llama.cpp logs through (the shim's), and the JSON records fit emits for --log-jsonl consumers are kept for
// pp_fit, which returns them.
#include "fit_log.h"

#include "json.h"
#include "llama.h"
#include "log.h"

#include <cstdarg>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

struct common_log {};

namespace {
common_log g_log;
std::mutex g_mutex;
bool g_collect = false;
std::vector<std::pair<std::string, std::string>> g_records;   // (type, JSON text)
std::string g_last_warning;
}

int  common_log_get_verbosity_thold(void) { return LOG_LEVEL_TRACE; }
void common_log_set_verbosity_thold(int) {}
bool common_log_get_jsonl(void) { return true; }
void common_log_set_jsonl(bool) {}
struct common_log * common_log_main() { return &g_log; }

void common_log_add(struct common_log *, enum ggml_log_level level, const char * fmt, ...) {
    char buf[2048];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (g_collect) {
            g_last_warning = buf;
        }
    }
    ggml_log_callback cb = nullptr;
    void * ud = nullptr;
    llama_log_get(&cb, &ud);
    if (cb) {
        cb(level, buf, ud);
    }
}

void common_log_add_json(struct common_log *, const char * type, const common_json & obj) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_collect && type && std::string(type) != "fit_memory_breakdown") {
        g_records.emplace_back(type, obj.dump());
    }
}

void pp_fit_log_begin() {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_collect = true;
    g_records.clear();
    g_last_warning.clear();
}

pp_fit_log pp_fit_log_end() {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_collect = false;
    return { std::move(g_records), std::move(g_last_warning) };
}
