// What the shim's source files (shim.cpp, rpc.cpp) share and Python never sees: the export macro, the last-error
// slot and the guard that keeps C++ exceptions and ggml aborts out of Python. The C API itself is shim.h.
#pragma once

#include "shim.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#define PP_EXPORT extern "C" __attribute__((visibility("default")))

namespace pp_shim __attribute__((visibility("hidden"))) {   // (the library exports the C API only)

// a ggml abort, thrown by the shim's abort callback (ggml_abort would kill the user's Python process)
struct pp_abort_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// keep msg, with llama.cpp's last warnings and errors, as this thread's pp_last_error(); returns code
int fail(int code, const std::string & msg);

// src (or "") into dst, truncated to n bytes with its terminator
void copy_str(char * dst, size_t n, const char * src);

// one tensor of `bytes` (I8) in a buffer of its own on a device, for the rate probes' copies (freed with it)
struct scratch_tensor {
    std::unique_ptr<ggml_context, decltype(&ggml_free)>                       ctx{nullptr, ggml_free};
    std::unique_ptr<ggml_backend_buffer, decltype(&ggml_backend_buffer_free)> buf{nullptr, ggml_backend_buffer_free};
    ggml_tensor *                                                             t = nullptr;
};

// allocate `out` on device `dev` (named dev_name in the error): PP_OK, or PP_ERR_MEMORY (through fail)
int alloc_scratch(ggml_backend_dev_t dev, const char * dev_name, uint64_t bytes, scratch_tensor & out);

// f() for an entry point: an exception or an abort inside becomes a code and a message
template <typename F>
int guarded(F && f) {
    try {
        return f();
    } catch (const pp_abort_error & e) {
        return fail(PP_ERR_INTERNAL, e.what());
    } catch (const std::bad_alloc &) {
        return fail(PP_ERR_MEMORY, "out of host memory");
    } catch (const std::exception & e) {
        return fail(PP_ERR_INTERNAL, std::string("exception: ") + e.what());
    } catch (...) {
        return fail(PP_ERR_INTERNAL, "unknown exception");
    }
}

}  // namespace pp_shim
