// pyllama_pp shim, expert trace: the shim's internal side (the C API is in shim.h, "expert trace").
#pragma once

#include "shim.h"

struct ggml_tensor;

// llama's eval callback (llama_context_params.cb_eval) that records the expert ids of every MoE layer into the
// pp_trace passed as its user data
bool pp_trace_eval_cb(struct ggml_tensor * t, bool ask, void * user);

// sets the shim's last error (pp_last_error) and returns code (defined in shim.cpp)
int pp_shim_fail(int code, const char * msg);
