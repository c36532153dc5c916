// The GATHER hook's contract as pyllama_pp's devices implement it (VDEV in vdev.cpp, CUDA in gather_cuda.cu),
// mirrored from the patched tree's ggml-backend-pp.h: both are built in the baseline variant too, whose tree has
// no such header.
#pragma once

namespace pp_gather_abi {

constexpr int kUsed     = 0;   // GGML_BACKEND_PP_GATHER_USED: the experts the ids select (records the set used)
constexpr int kPrefetch = 1;   // GGML_BACKEND_PP_GATHER_PREFETCH: no ids; the weight's last used set
constexpr int kRest     = 2;   // GGML_BACKEND_PP_GATHER_REST: the used experts the last prefetch did not bring
constexpr int kBeside   = 16;  // GGML_BACKEND_PP_GATHER_BESIDE, a flag: compute may run beside the copy (OVERLAP=2)
constexpr int kChained  = 32;  // GGML_BACKEND_PP_GATHER_CHAINED, a flag: queue it right behind the device's gather before
constexpr int kTail     = 512; // GGML_BACKEND_PP_GATHER_TAIL: bytes after an expert that must be numbers

}  // namespace pp_gather_abi
