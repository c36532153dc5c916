// pyllama_pp virtual accelerator device (VDEV): a ggml backend that behaves like an
// asynchronous GPU (own memory budget, stream, events, throttled host<->device links)
// but computes on the CPU backend. See vdev.cpp for the model.
#pragma once
#include "ggml-backend.h"
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif
#define PP_VDEV_MAX 16
struct pp_vdev_config {
    uint64_t memory_bytes;   // memory budget; an allocation past it fails like a real OOM (0 = unlimited)
    double   link_gbps;      // host<->device link bandwidth in GB/s (1e9 bytes/s); <= 0: unthrottled
    int32_t  link_group;     // devices with the same group >= 0 share one link (its bandwidth is split); -1: own link
    double   compute_factor; // >= 1.0: every graph compute takes this many times as long (mixed GPUs); 1.0 = CPU speed
    int32_t  n_threads;      // CPU threads used for this device's compute (<= 0: 1)
    double   d2d_gbps;       // device<->device bandwidth in GB/s; <= 0: unthrottled
    double   direct_read;    // kernels reading pinned host memory (DIRECT) move at this fraction of link_gbps; <= 0: 1
    int32_t  row_pad;        // > 0: like CUDA's MATRIX_ROW_PADDING, a quantized tensor whose rows are not a multiple of
                             // this many values gets room for the rest of one such step past its end (alloc size); 0: none
    // injected faults (tests of the error paths; 0 = none). The counts run from registration (never reset):
    int64_t  fail_alloc_at;  // > 0: this buffer allocation on the device and every later one fail (a full device):
                             // 1 = the first (at model load)
    int64_t  fail_copy_at;   // > 0: this host<->device copy on the device fails. ggml's copy calls cannot return an
                             // error (CUDA's backend aborts on a failed copy), so neither can VDEV: GGML_ABORT (an abort
                             // callback that throws, as pyllama_pp's shim sets, turns it into an error)
    int32_t  fault_abort;    // 1: the failed copy calls abort() itself, past any callback: the process dies (SIGABRT), as
                             // it does where nothing can catch the abort (a thread of a backend's own, no callback)
};
struct pp_vdev_counters {
    uint64_t h2d_bytes, d2h_bytes, d2d_bytes;     // bytes moved per direction (d2d counted on the destination)
    uint64_t h2d_copies, d2h_copies, d2d_copies;
    uint64_t graph_computes;                      // graph_compute calls
    uint64_t host_syncs;                          // host blocked on this device: synchronize, event_synchronize, sync get_tensor,
                                                  // async copies from/to pageable host memory
    uint64_t event_records, event_waits;
    uint64_t alloc_bytes, peak_alloc_bytes, failed_allocs;
    double   link_busy_s;                          // seconds of throttled transfer charged to this device's link
    double   compute_s;                            // seconds spent computing (including the slow-down)
    uint64_t gathers;                              // GATHER hook calls taken (gathers and prefetches)
    uint64_t beside_gathers;                       // of those, flagged BESIDE by the scheduler (OVERLAP=2)
    uint64_t chained_gathers;                      // of those, flagged CHAINED by the scheduler (CHAIN)
    uint64_t buffer_allocs;                        // buffers allocated since registration (a level: never reset; the
                                                   // count fail_alloc_at refers to, failed ones included)
    uint64_t hd_copies;                            // host<->device copies since registration (never reset; fail_copy_at's count)
};
// Register n (1..PP_VDEV_MAX) virtual devices "VDEV0".."VDEV{n-1}" with ggml's backend registry.
// Once per process: a second call with the same n only reconfigures; with another n it fails. Returns 0, or -1 with a message in err.
int  pp_vdev_register(const struct pp_vdev_config * cfg, int n, char * err, size_t err_size);
int  pp_vdev_count(void);
int  pp_vdev_configure(int i, const struct pp_vdev_config * cfg);     // change knobs of device i later; 0 or -1
int  pp_vdev_get_counters(int i, struct pp_vdev_counters * out);      // 0 or -1
void pp_vdev_reset_counters(void);                                     // zero all counters (peak_alloc_bytes := alloc_bytes)
ggml_backend_reg_t pp_vdev_reg(void);                                  // NULL before pp_vdev_register
#ifdef __cplusplus
}
#endif
