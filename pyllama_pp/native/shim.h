// pyllama_pp shim: a thin, flat C API over llama.h / ggml-backend.h for cffi.
//
// Conventions: functions return 0 (PP_OK) or a negative PP_ERR_* code; the message of the last failure
// on this thread is pp_last_error(). Handles are opaque. No C++ exception crosses this boundary.
// The same source compiles against both variants; patched-only features are found at run time
// (pp_ext_available), never by #ifdef.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "vdev.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PP_OK              0
#define PP_ERR_ARG        -1   // a bad argument (range, NULL, unknown name)
#define PP_ERR_MODEL      -2   // the model could not be loaded
#define PP_ERR_MEMORY     -3   // an allocation failed (device or host)
#define PP_ERR_DEVICE     -4   // device setup failed
#define PP_ERR_DECODE     -5   // llama_decode failed
#define PP_ERR_INTERNAL   -6   // an exception or an abort inside llama.cpp/ggml
#define PP_ERR_UNSUPPORTED -7  // not available in this variant

#define PP_MAX_DEVICES 16
#define PP_NAME_LEN    64

typedef struct pp_model   pp_model;
typedef struct pp_context pp_context;
typedef struct pp_trace   pp_trace;

const char * pp_last_error(void);
const char * pp_variant(void);                 // "baseline" or "patched"
const char * pp_system_info(void);
// load backend modules from dir (CPU, RPC, CUDA) once; log_level: 0 quiet, 1 errors, 2 warnings, 3 info, 4 debug
int  pp_init(const char * backend_dir, int log_level);
void pp_set_log_level(int log_level);

// Capture llama.cpp/ggml log text of every level (e.g. GGML_SCHED_DEBUG's split listing). on != 0 starts a
// fresh capture, 0 stops it; pp_log_captured copies the text and returns its full length.
void pp_log_capture(int32_t on);
int  pp_log_captured(char * buf, size_t buf_size);

// ---- devices -----------------------------------------------------------------------------------------
typedef struct {
    char     name[PP_NAME_LEN];
    char     description[128];
    char     backend[PP_NAME_LEN];             // registry name: CPU, CUDA, VDEV, RPC
    int32_t  type;                             // enum ggml_backend_dev_type
    uint64_t memory_free;
    uint64_t memory_total;
    int32_t  caps_async, caps_host_buffer, caps_buffer_from_host_ptr, caps_events;
} pp_device_info;

int pp_device_count(void);
int pp_device_get(int i, pp_device_info * out);

// A device's host link, measured: `bytes` set into a buffer on device `dev_name` `copies` times in a row, from its
// pinned host buffer type (0 where it has none) and from pageable memory, each the median of three such rounds
// after one untimed copy (GB/s, 1e9 B/s). PP_ERR_MEMORY where the device cannot hold `bytes`.
int pp_link_rate(const char * dev_name, uint64_t bytes, int32_t copies, double * pinned_gbps, double * pageable_gbps);
// The host's copy from pageable memory into pinned memory (device `dev_name`'s host buffer type, else plain memory)
// as the patched build's staging copies run it: pieces of 32 MiB, each split over `n_threads` threads (0: as
// as the patched build's STAGING=1 picks them); `bytes` in all, the median of `reps` after one untimed (GB/s).
int pp_host_copy_rate(const char * dev_name, uint64_t bytes, int32_t n_threads, int32_t reps, double * gbps);
// The host CPU's decode expert op: one token's MUL_MAT_ID over n_used of the n_expert experts of a [ne0, ne1, n_expert]
// tensor of ggml type `type` on the CPU backend with `n_threads` threads (0: its default), other experts each time;
// the used experts' bytes over the op's time, the median of `reps` after one untimed (GB/s).
int pp_cpu_expert_rate(int32_t type, int64_t ne0, int64_t ne1, int32_t n_expert, int32_t n_used, int32_t n_threads,
                       int32_t reps, double * gbps);

// ---- model -------------------------------------------------------------------------------------------
typedef struct {
    const char * path;
    int32_t      n_gpu_layers;                 // -1: all
    int32_t      split_mode;                   // enum llama_split_mode: 0 none, 1 layer, 2 row
    int32_t      main_gpu;
    float        tensor_split[PP_MAX_DEVICES]; // proportions per device (0 = even)
    const char * devices;                      // comma-separated device names in order; "none": CPU only; NULL/"": all
    const char * const * overrides;            // n_overrides tensor overrides, "PATTERN=BUFT" each (llama's -ot);
    int32_t      n_overrides;                  // BUFT: CPU or a device name
    int32_t      load_mode;                    // enum llama_load_mode (0 none = pinned host weights, 1 mmap)
    int32_t      no_host;                      // bypass the host (pinned) buffer type
    int32_t      use_extra_bufts;              // CPU repack buffers
} pp_model_params;

typedef struct {
    char     desc[128];
    char     arch[PP_NAME_LEN];
    uint64_t size_bytes;
    uint64_t n_params;
    int32_t  n_layer, n_embd, n_vocab, n_head, n_head_kv, n_expert, n_expert_used, n_ctx_train;
} pp_model_info;

pp_model * pp_model_load(const pp_model_params * params);   // NULL on failure: see pp_last_error
void       pp_model_free(pp_model * model);
int        pp_model_get_info(const pp_model * model, pp_model_info * out);
// metadata value by key (e.g. "pyllama_pp.synth.routing"); returns length or a negative code
int        pp_model_meta(const pp_model * model, const char * key, char * buf, size_t buf_size);

// ---- context -----------------------------------------------------------------------------------------
typedef struct {
    uint32_t n_ctx, n_batch, n_ubatch, n_seq_max;
    int32_t  n_threads;                        // <= 0: default
    int32_t  flash_attn;                       // -1 auto, 0 off, 1 on
    int32_t  op_offload;                       // offload host-weight ops to devices
    int32_t  offload_kqv;
    int32_t  coverage;                         // record experts used per MoE layer per ubatch (one host sync each)
    pp_trace * trace;                          // record each token's expert ids into it (one host sync per MoE
                                               // layer); NULL: none; not with coverage
} pp_context_params;

pp_context * pp_context_new(pp_model * model, const pp_context_params * params);
void         pp_context_free(pp_context * ctx);
int          pp_memory_clear(pp_context * ctx);
int          pp_synchronize(pp_context * ctx);
// The KV cache of sequence seq, as a server edits it: remove positions [p0, p1) (p1 < 0: to the end; rewinding
// to p0 before decoding there again), shift positions [p0, p1) by delta (a context shift: the K rotation runs at the
// next decode), the largest position held (-1: none). pp_memory_seq_rm: PP_ERR_UNSUPPORTED where the memory cannot
// remove part of a sequence; pp_memory_seq_add: PP_ERR_UNSUPPORTED where it cannot shift (llama_memory_can_shift).
int          pp_memory_seq_rm(pp_context * ctx, int32_t seq, int32_t p0, int32_t p1);
int          pp_memory_seq_add(pp_context * ctx, int32_t seq, int32_t p0, int32_t p1, int32_t delta);
int          pp_memory_seq_pos_max(pp_context * ctx, int32_t seq, int32_t * pos_max);

// Decode n_tokens tokens of sequence seq at positions pos0..pos0+n_tokens-1, in batches of n_batch.
// Logits are requested for positions listed in out_idx (indices into tokens, ascending) and copied to
// logits_out (n_out x n_vocab floats). n_out may be 0.
int pp_decode(pp_context * ctx, const int32_t * tokens, int32_t n_tokens, int32_t pos0, int32_t seq,
              const int32_t * out_idx, int32_t n_out, float * logits_out);

typedef struct {
    double   t_load_ms, t_p_eval_ms, t_eval_ms;
    int32_t  n_p_eval, n_eval, n_reused;
} pp_perf;
int pp_get_perf(pp_context * ctx, pp_perf * out);
int pp_reset_perf(pp_context * ctx);

// ---- scheduler facts ---------------------------------------------------------------------------------
typedef struct {
    char     name[PP_NAME_LEN];
    char     buft[PP_NAME_LEN];
    uint64_t compute_buffer_bytes;
} pp_sched_backend;

typedef struct {
    int32_t  n_backends;
    int32_t  n_copies;
    int32_t  n_splits;
    int32_t  pipeline_parallel;                // n_copies > 1
    int32_t  n_graph_nodes;                    // nodes of the last graph (0 if unknown)
    pp_sched_backend backends[PP_MAX_DEVICES + 2];
} pp_sched_info;
int pp_get_sched_info(pp_context * ctx, pp_sched_info * out);

typedef struct {
    char     buft[PP_NAME_LEN];
    char     device[PP_NAME_LEN];
    uint64_t model_bytes, context_bytes, compute_bytes;
} pp_memory_row;
// fills up to max_rows rows; returns the number of rows or a negative code
int pp_get_memory_breakdown(pp_context * ctx, pp_memory_row * rows, int32_t max_rows);

// ---- expert coverage (when pp_context_params.coverage) -------------------------------------------------
typedef struct {
    int32_t layer;
    int32_t n_tokens;
    int32_t n_used;                            // distinct experts selected by those tokens
} pp_coverage_row;
int  pp_coverage_count(pp_context * ctx);
int  pp_coverage_get(pp_context * ctx, pp_coverage_row * rows, int32_t max_rows);
void pp_coverage_reset(pp_context * ctx);
void pp_coverage_enable(pp_context * ctx, int32_t on);

// ---- expert trace (pp_context_params.trace; trace.cpp) ----------------------------------------------------
// One record per MoE layer per ubatch, in the order llama computed them: the layer, its tokens, k (experts used),
// and where its n_tokens x k ids (token-major, each token's ids in top-k order) start in the trace's ids.
typedef struct {
    int32_t layer;
    int32_t n_tokens;
    int32_t k;
    int64_t offset;
} pp_trace_record;
// A trace that keeps at most max_ids ids (later records are dropped and counted); free it after its contexts.
pp_trace * pp_trace_new(int64_t max_ids);
void       pp_trace_free(pp_trace * trace);
int        pp_trace_size(pp_trace * trace, int64_t * n_records, int64_t * n_ids, int64_t * n_dropped);
// copies every record and id; PP_ERR_ARG where the buffers are smaller than pp_trace_size says
int        pp_trace_get(pp_trace * trace, pp_trace_record * records, int64_t max_records, int32_t * ids, int64_t max_ids);
void       pp_trace_clear(pp_trace * trace);
// Also record the f32 tensors named "<prefix>-<layer>" (llama's eval-callback names: "l_out", "ffn_inp", "ffn_norm"),
// [n_embd, n_tokens] each, for hidden-state studies; at most max_values values for this prefix (later ones are dropped
// and counted). Call before the decode; at most PP_TRACE_MAX_CAPTURES prefixes.
#define PP_TRACE_MAX_CAPTURES 8
typedef struct {
    int32_t capture;    // which prefix: its index in the order pp_trace_capture added them
    int32_t layer;
    int32_t n_tokens;
    int32_t width;      // values per token (ne[0])
    int64_t offset;     // where its n_tokens x width values (token-major) start in the trace's values
} pp_trace_tensor;
int pp_trace_capture(pp_trace * trace, const char * prefix, int64_t max_values);
int pp_trace_tensors_size(pp_trace * trace, int64_t * n_records, int64_t * n_values, int64_t * n_dropped);
// copies every tensor record and value; PP_ERR_ARG where the buffers are smaller than pp_trace_tensors_size says
int pp_trace_tensors_get(pp_trace * trace, pp_trace_tensor * records, int64_t max_records, float * values,
                         int64_t max_values);

// ---- fit (upstream's common_fit_params, the variant's own common/fit.cpp) -----------------------------------
#define PP_FIT_OVERRIDES_LEN 65536
#define PP_FIT_REPORT_LEN    8192

typedef struct {
    const char * path;
    const char * devices;                      // comma-separated device names in order (as pp_model_params.devices)
    int32_t      split_mode;                   // enum llama_split_mode
    uint64_t     margins[PP_MAX_DEVICES];      // bytes to leave free on each device (fit's target = free - margin)
    uint32_t     n_ctx_min;                    // the smallest context fit may reduce an automatic n_ctx (0) to
    const pp_model_params * placement;         // non-NULL: no fit, this placement's memory measured as it is (its
                                               // layers, split and overrides; its path and devices are not read)
} pp_fit_params;

typedef struct {
    char     name[PP_NAME_LEN];                // device name; "host" for the last entry
    uint64_t model_bytes, context_bytes, compute_bytes;
    int64_t  free_bytes, total_bytes;
} pp_fit_memory;

typedef struct {
    int32_t       status;                      // enum common_params_fit_status: 0 success, 1 failure, 2 error
    int32_t       n_gpu_layers;
    uint32_t      n_ctx;
    int32_t       n_devices;
    int32_t       n_layer, n_expert;           // the model's repeating layers and experts
    float         tensor_split[PP_MAX_DEVICES];
    pp_fit_memory devices[PP_MAX_DEVICES];     // common_get_device_memory_data for the fitted parameters
    pp_fit_memory host;
    int32_t       n_overrides;
    char          overrides[PP_FIT_OVERRIDES_LEN];   // "PATTERN=BUFT" lines separated by newlines
    char          message[512];                // why fit failed (its last warning), else empty
    char          report[PP_FIT_REPORT_LEN];   // JSON array of fit's own records (patched: "fit_placement")
} pp_fit_result;

// Runs common_fit_params for the model at params->path on the listed devices with the context parameters ctx
// (n_ctx 0: fit chooses it), then measures the fitted parameters' memory per device (with params->placement: that
// placement's, no fit). Returns PP_OK with out->status telling whether fit found a placement; PP_ERR_MODEL when the
// model cannot be loaded at all.
int pp_fit(const pp_fit_params * params, const pp_context_params * ctx, pp_fit_result * out);

// ---- patched-build extension (discovered at run time) ------------------------------------------------
// Returns the extension's version (> 0) or 0 when this build has none (the baseline).
int pp_ext_version(void);
// Generic access to the extension's counters and switches by name; PP_ERR_UNSUPPORTED without it.
int pp_ext_get_stats_json(pp_context * ctx, char * buf, size_t buf_size);
int pp_ext_set_param(const char * name, int64_t value);
int pp_ext_get_param(const char * name, int64_t * value);
// ... as text: an integer, or for a switch of type "ints" a comma list of one value per device too ("-2,-4")
int pp_ext_set_param_text(const char * name, const char * text);
int pp_ext_get_param_text(const char * name, char * buf, size_t buf_size);
// the i-th switch (0-based): name, current value, meaning; PP_ERR_ARG past the last one
int pp_ext_param_info(int i, char * name, size_t name_size, int64_t * value, char * desc, size_t desc_size);
// ... its type ("bool", "int" or "ints": an int or one per device), default and accepted range [min, max]; `values` gets the accepted values where not
// every value in the range is accepted ("0,2"), else ""
int pp_ext_param_spec(int i, char * type, size_t type_size, int64_t * def, int64_t * min, int64_t * max,
                      char * values, size_t values_size);
// GGML_SCHED_PP_* environment variables the switch table does not accept (a name it does not know, a value that is
// not an integer or out of range): how many (0: none), one line each into buf; PP_ERR_UNSUPPORTED without the table
int pp_ext_env_problems(char * buf, size_t buf_size);
// ---- RPC (llama.cpp's ggml RPC backend, the module in the backends folder; rpc.cpp) ------------------
// Connect to an rpc-server at endpoint "HOST:PORT", register its devices and write their names, comma-separated,
// into names. PP_ERR_DEVICE when the server cannot be reached (checked with a TCP connect and a timeout first:
// the RPC client aborts on a refused connection) or the RPC module is not loaded; PP_ERR_ARG on a bad endpoint.
int pp_rpc_add_server(const char * endpoint, char * names, size_t names_size);
// Serve the n_devs devices named in dev_names at endpoint "HOST:PORT" (ggml_backend_rpc_start_server): blocks.
// host_limit: the most bytes of this host's memory the clients' host weights may take (0: no limit of its own);
// PP_ERR_UNSUPPORTED for a limit where the variant's server keeps no host memory of its own (upstream's).
int pp_rpc_start_server(const char * endpoint, const char * const * dev_names, int n_devs, int n_threads,
                        uint64_t host_limit);
// The host memory the server of RPC device `dev_name` can still give host weights, and its total (within the
// server's limit); PP_ERR_UNSUPPORTED where the device is not an RPC device or its server keeps none (protocol 7.0).
int pp_rpc_host_memory(const char * dev_name, uint64_t * free, uint64_t * total);
// The network between this process and the server of RPC device `dev_name`, measured: a message's round trip in
// seconds (a one-byte read, the median of five), and `bytes` written to a buffer on the device and read back, each
// way's rate in GB/s (the server's copy to its device included; a round trip first, so a connection's setup is not
// counted). PP_ERR_UNSUPPORTED for a device that is not an RPC device, PP_ERR_MEMORY where the device cannot hold
// `bytes`. (A server lost during the measure ends the process, as any lost server does in ggml RPC.)
int pp_rpc_net_rate(const char * dev_name, uint64_t bytes, double * up_gbps, double * down_gbps, double * rtt_s);
// The host-weight bytes the patched RPC server behind backend `backend_name` ("RPC<N>[HOST:PORT]", as the
// scheduler's stats name it) moved to its device N so far; -1 for another backend, or a server of protocol 7.0.
long long pp_rpc_host_weight_bytes(const char * backend_name);
// The expert cache's counters of the schedulers of the patched RPC server behind backend `backend_name` for its
// device N (EXPERT_CACHE on the server, protocol 7.1.1): the first five count since the client connected, the last
// three are levels (device memory its slots take, layers with slots, the fewest slots of those).
typedef struct pp_cache_counts {
    uint64_t ops, hits, misses, evictions, bytes;
    uint64_t buffer_bytes, layers, slots;
} pp_cache_counts;
// PP_OK, or PP_ERR_UNSUPPORTED for another backend or a server before protocol 7.1.1 (no counters; out untouched).
int pp_rpc_host_cache_counts(const char * backend_name, pp_cache_counts * out);
// The bytes the gathers of ggml device `dev_name` ("CUDA0", ...) read over its host link so far, prefetches
// included, as counted by pyllama_pp's CUDA gather library on the device; -1 where nothing is counted (no such
// library, a device it never gathered for, or not CUDA).
long long pp_gather_counted(const char * dev_name);

#ifdef __cplusplus
}
#endif
