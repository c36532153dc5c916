// pyllama_pp shim, ggml RPC's part (see shim.h, "RPC"): connect to rpc-servers and register their devices, serve this
// process's devices, and ask a server what the patched protocol adds (its host memory, its own weight copies) or what
// the network to it carries. Upstream's RPC module is loaded at run time, so its API is reached through the registry's
// proc addresses; the patched module's additions are optional.
#include "shim.h"
#include "shim_impl.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using namespace pp_shim;

namespace {

// "HOST:PORT" -> host, port (the last colon splits, as the RPC client's parse_endpoint does)
bool split_endpoint(const char * endpoint, std::string & host, int & port) {
    if (!endpoint) {
        return false;
    }
    const std::string e(endpoint);
    const size_t colon = e.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 >= e.size()) {
        return false;
    }
    host = e.substr(0, colon);
    const std::string p = e.substr(colon + 1);
    if (p.find_first_not_of("0123456789") != std::string::npos || p.size() > 5) {
        return false;
    }
    port = std::stoi(p);
    return port > 0 && port < 65536;
}

// a plain TCP connect with a timeout: "" when it connects, else why not
std::string tcp_probe(const std::string & host, int port, int timeout_ms) {
    addrinfo hints{};
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * res = nullptr;
    const int gai = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai != 0) {
        return std::string("cannot resolve ") + host + ": " + gai_strerror(gai);
    }
    std::string why = "no address";
    for (addrinfo * a = res; a; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) {
            why = strerror(errno);
            continue;
        }
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
        int rc = connect(fd, a->ai_addr, a->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            pollfd pfd{fd, POLLOUT, 0};
            rc = poll(&pfd, 1, timeout_ms);
            if (rc == 0) {
                why = "timed out after " + std::to_string(timeout_ms) + " ms";
                rc = -1;
            } else if (rc > 0) {
                int err = 0;
                socklen_t len = sizeof(err);
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
                rc = err == 0 ? 0 : -1;
                if (err) {
                    why = strerror(err);
                }
            } else {
                why = strerror(errno);
            }
        } else if (rc != 0) {
            why = strerror(errno);
        }
        close(fd);
        if (rc == 0) {
            freeaddrinfo(res);
            return "";
        }
    }
    freeaddrinfo(res);
    return why;
}

ggml_backend_reg_t rpc_reg() {
    return ggml_backend_reg_by_name("RPC");
}

// the RPC module's function `fn` (upstream's API is reached through its proc address: the module is loaded at run
// time), or nullptr after fail() said why
void * rpc_proc(const char * fn) {
    ggml_backend_reg_t reg = rpc_reg();
    if (!reg) {
        fail(PP_ERR_DEVICE, "no RPC backend loaded: the package was built without its RPC module");
        return nullptr;
    }
    void * f = ggml_backend_reg_get_proc_address(reg, fn);
    if (!f) {
        fail(PP_ERR_DEVICE, std::string("the RPC backend has no ") + fn);
    }
    return f;
}

// the RPC module's function `fn` where it has it (the patched module's additions), else nullptr, silently
void * rpc_optional(const char * fn) {
    ggml_backend_reg_t reg = rpc_reg();
    return reg ? ggml_backend_reg_get_proc_address(reg, fn) : nullptr;
}

int check_endpoint(const char * endpoint, std::string & host, int & port) {
    if (!split_endpoint(endpoint, host, port)) {
        return fail(PP_ERR_ARG, std::string("bad RPC endpoint '") + endpoint + "': expected HOST:PORT");
    }
    return PP_OK;
}

}  // namespace

PP_EXPORT int pp_rpc_add_server(const char * endpoint, char * names, size_t names_size) {
    if (!endpoint || !names || names_size == 0) {
        return fail(PP_ERR_ARG, "null argument");
    }
    std::string host;
    int port = 0;
    if (int rc = check_endpoint(endpoint, host, port); rc != PP_OK) {
        return rc;
    }
    return guarded([&] {
        using add_server_t = ggml_backend_reg_t (*)(const char *);
        auto add_server = (add_server_t) rpc_proc("ggml_backend_rpc_add_server");
        if (!add_server) {
            return (int) PP_ERR_DEVICE;   // (rpc_proc said why)
        }
        const std::string why = tcp_probe(host, port, 3000);
        if (!why.empty()) {
            return fail(PP_ERR_DEVICE, std::string("cannot reach the RPC server at ") + endpoint + ": " + why);
        }
        ggml_backend_reg_t srv = add_server(endpoint);
        if (!srv) {
            return fail(PP_ERR_DEVICE, std::string("the RPC server at ") + endpoint + " offers no devices");
        }
        // add_server returns the same registry for an endpoint it knows: register it once
        bool known = false;
        for (size_t i = 0; i < ggml_backend_reg_count(); i++) {
            known = known || ggml_backend_reg_get(i) == srv;
        }
        if (!known) {
            ggml_backend_register(srv);
        }
        std::string out;
        for (size_t i = 0; i < ggml_backend_reg_dev_count(srv); i++) {
            out += (i ? "," : "") + std::string(ggml_backend_dev_name(ggml_backend_reg_dev_get(srv, i)));
        }
        if (out.size() >= names_size) {
            return fail(PP_ERR_ARG, "names buffer too small: need " + std::to_string(out.size() + 1));
        }
        copy_str(names, names_size, out.c_str());
        return PP_OK;
    });
}

// the device number and endpoint of a scheduler's RPC backend "RPC<N>[HOST:PORT]"
static bool rpc_backend_name(const char * backend_name, unsigned & device, char (&endpoint)[256]) {
    return backend_name && sscanf(backend_name, "RPC%u[%255[^]]]", &device, endpoint) == 2;
}

PP_EXPORT long long pp_rpc_host_weight_bytes(const char * backend_name) {
    unsigned device = 0;
    char endpoint[256] = {};
    using bytes_t = int64_t (*)(const char *, uint32_t);
    auto bytes = (bytes_t) rpc_optional("ggml_backend_rpc_host_weight_bytes");
    if (!rpc_backend_name(backend_name, device, endpoint) || !bytes) {
        return -1;
    }
    long long n = -1;
    guarded([&] {
        n = (long long) bytes(endpoint, device);
        return (int) PP_OK;
    });
    return n;
}

PP_EXPORT int pp_rpc_host_cache_counts(const char * backend_name, pp_cache_counts * out) {
    unsigned device = 0;
    char endpoint[256] = {};
    // (the patched module's ggml_backend_pp_cache_counts: the same eight counters, in this order)
    using counts_t = bool (*)(const char *, uint32_t, pp_cache_counts *);
    auto counts = (counts_t) rpc_optional("ggml_backend_rpc_host_cache_counts");
    if (!out || !rpc_backend_name(backend_name, device, endpoint) || !counts) {
        return PP_ERR_UNSUPPORTED;
    }
    return guarded([&] {
        pp_cache_counts got = {};
        if (!counts(endpoint, device, &got)) {
            return (int) PP_ERR_UNSUPPORTED;
        }
        *out = got;
        return (int) PP_OK;
    });
}

PP_EXPORT int pp_rpc_host_memory(const char * dev_name, uint64_t * free, uint64_t * total) {
    if (!dev_name || !free || !total) {
        return fail(PP_ERR_ARG, "null argument");
    }
    return guarded([&] {
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(dev_name);
        if (!dev) {
            return fail(PP_ERR_DEVICE, std::string("unknown device '") + dev_name + "'");
        }
        using host_memory_t = bool (*)(ggml_backend_dev_t, size_t *, size_t *);
        auto host_memory = (host_memory_t) rpc_optional("ggml_backend_rpc_dev_host_memory");
        size_t f = 0, t = 0;
        if (!host_memory || !host_memory(dev, &f, &t)) {
            return fail(PP_ERR_UNSUPPORTED, std::string(dev_name) + " has no host memory on its server (not an RPC "
                                            "device, or a server of protocol 7.0)");
        }
        *free = f;
        *total = t;
        return (int) PP_OK;
    });
}

PP_EXPORT int pp_rpc_net_rate(const char * dev_name, uint64_t bytes, double * up_gbps, double * down_gbps,
                              double * rtt_s) {
    if (!dev_name || !up_gbps || !down_gbps || !rtt_s || bytes == 0) {
        return fail(PP_ERR_ARG, "null argument or 0 bytes");
    }
    return guarded([&] {
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(dev_name);
        if (!dev) {
            return fail(PP_ERR_DEVICE, std::string("unknown device '") + dev_name + "'");
        }
        if (!rpc_reg() || ggml_backend_dev_backend_reg(dev) != rpc_reg()) {
            return fail(PP_ERR_UNSUPPORTED, std::string(dev_name) + " is not an RPC device");
        }
        scratch_tensor s;
        if (int rc = alloc_scratch(dev, dev_name, bytes, s); rc != PP_OK) {
            return rc;
        }
        ggml_tensor * t = s.t;
        std::vector<uint8_t> data(bytes, 0x5a);   // (a buffer not for weights: the server's tensor cache never sees it)
        using clock = std::chrono::steady_clock;
        uint8_t one = 0;
        ggml_backend_tensor_get(t, &one, 0, 1);   // a round trip first: the connection is up and idle
        std::vector<double> rtt;
        for (int i = 0; i < 5; i++) {             // a message's round trip: the median of five
            auto r0 = clock::now();
            ggml_backend_tensor_get(t, &one, 0, 1);
            rtt.push_back(std::chrono::duration<double>(clock::now() - r0).count());
        }
        std::sort(rtt.begin(), rtt.end());
        *rtt_s = rtt[2];
        auto t0 = clock::now();
        ggml_backend_tensor_set(t, data.data(), 0, bytes);
        ggml_backend_tensor_get(t, &one, 0, 1);   // (answered after the set: the server has taken every byte)
        auto t1 = clock::now();
        ggml_backend_tensor_get(t, data.data(), 0, bytes);
        auto t2 = clock::now();
        double up = std::chrono::duration<double>(t1 - t0).count(), down = std::chrono::duration<double>(t2 - t1).count();
        *up_gbps = bytes / std::max(up, 1e-9) / 1e9;
        *down_gbps = bytes / std::max(down, 1e-9) / 1e9;
        return (int) PP_OK;
    });
}

PP_EXPORT int pp_rpc_start_server(const char * endpoint, const char * const * dev_names, int n_devs, int n_threads,
                                  uint64_t host_limit) {
    if (!endpoint || !dev_names || n_devs <= 0) {
        return fail(PP_ERR_ARG, "null endpoint or no devices");
    }
    std::string host;
    int port = 0;
    if (int rc = check_endpoint(endpoint, host, port); rc != PP_OK) {
        return rc;
    }
    return guarded([&] {
        using start_server_t = void (*)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *);
        auto start_server = (start_server_t) rpc_proc("ggml_backend_rpc_start_server");
        if (!start_server) {
            return (int) PP_ERR_DEVICE;   // (rpc_proc said why)
        }
        std::vector<ggml_backend_dev_t> devs;
        for (int i = 0; i < n_devs; i++) {
            ggml_backend_dev_t dev = dev_names[i] ? ggml_backend_dev_by_name(dev_names[i]) : nullptr;
            if (!dev) {
                return fail(PP_ERR_DEVICE, std::string("unknown device '") + (dev_names[i] ? dev_names[i] : "(null)") + "'");
            }
            devs.push_back(dev);
        }
        // the patched server keeps host buffers, whose graphs also run on the CPU device
        using set_host_t = void (*)(ggml_backend_dev_t);
        if (auto set_host = (set_host_t) rpc_optional("ggml_backend_rpc_server_set_host_device")) {
            set_host(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
        }
        using set_limit_t = void (*)(size_t);
        auto set_limit = (set_limit_t) rpc_optional("ggml_backend_rpc_server_set_host_memory_limit");
        if (host_limit > 0 && !set_limit) {
            return fail(PP_ERR_UNSUPPORTED, "this variant's RPC server keeps no host memory of its own (upstream's, "
                                            "protocol 7.0): a host memory limit needs the patched variant");
        }
        if (set_limit) {
            set_limit((size_t) host_limit);
        }
        start_server(endpoint, nullptr, (size_t) std::max(1, n_threads), devs.size(), devs.data());
        return fail(PP_ERR_DEVICE, std::string("the RPC server at ") + endpoint + " stopped (could it bind the port?)");
    });
}
