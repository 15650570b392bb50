// jax_moe_comm._native: registers the bootstrap, handle and FFI-handler entry points. No logic.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nvshmem.h>

#include <mutex>
#include <tuple>
#include <vector>

#include <cuda_runtime.h>

#include "bootstrap.h"
#include "error_text.h"
#include "ffi/handlers.h"
#include "handle.h"
#include "module_util.h"

namespace nb = nanobind;

namespace {

using jmc::open_handle;
using jmc::raise_if;
using jmc::raise_if_cuda;
using jmc::sync_device;

std::tuple<int, int, int> as_tuple(jmc::Version v) { return {v.major, v.minor, v.patch}; }

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "CUDA/NVSHMEM core of jax_moe_comm";

  m.def("built_nvshmem_version", [] { return as_tuple(jmc::built_nvshmem_version()); });
  m.def("runtime_nvshmem_version", [] { return as_tuple(jmc::runtime_nvshmem_version()); });
  m.def("cuda_device_count", &jmc::cuda_device_count);
  m.def("cuda_driver_error", &jmc::cuda_driver_error);

  m.def("make_unique_id", [] {
    const std::string id = jmc::make_unique_id();
    if (id.empty()) throw std::runtime_error("nvshmemx_get_uniqueid failed");
    return nb::bytes(id.data(), id.size());
  });
  m.def("init", [](nb::bytes uid, int rank, int nranks, int device) {
    raise_if(jmc::init(std::string(uid.c_str(), uid.size()), rank, nranks, device));
  });
  // Refused while a handle is open: NVSHMEM's finalize would free the symmetric memory under
  // it, and a compiled step that still names it would write into freed memory.
  m.def("finalize", [] {
    if (const size_t open = jmc::open_handles())
      throw std::runtime_error("finalize() with " + std::to_string(open) +
                               " all-to-all handle(s) still open: close() each (or leave its "
                               "`with` block) on every rank first");
    raise_if(jmc::finalize());
  });
  m.def("initialized", &jmc::initialized);
  m.def("my_pe", &jmc::my_pe);
  m.def("n_pes", &jmc::n_pes);
  m.def("init_status", &jmc::init_status);
  // (free, total) bytes of this process's GPU (cudaMemGetInfo): leak checks in the GPU tests.
  m.def("device_memory", [] {
    size_t free = 0, total = 0;
    raise_if_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return std::make_tuple(free, total);
  });
  m.def("synchronize", [] {
    sync_device();
  });

  m.def(
      "create_handle",
      [](int num_experts, int k, int hidden, int max_m, int world, int dp, int in_bytes,
         int num_scales, int out_bytes, uint64_t timeout_ns, int num_blocks, int warps,
         bool staged, int staged_node_size, uint64_t start_epoch, int packed_rows,
         bool drop_overflow, int expert_rows, uint64_t start_timeout_ns) {
        jmc::Shape s{num_experts, k, hidden, max_m, world, dp, in_bytes, num_scales, out_bytes,
                     packed_rows, drop_overflow ? 1 : 0, expert_rows};
        int64_t id = 0;
        // (id, "") on success; (id, why) when this rank's part failed after the collective
        // step (the caller destroys it on every rank); (0, why) for a bad shape.
        std::string error =
            jmc::create_handle(s, jmc::Launch{num_blocks, warps}, timeout_ns, start_timeout_ns,
                               staged, staged_node_size, start_epoch, &id);
        return std::make_tuple(id, error);
      },
      nb::arg("num_experts"), nb::arg("k"), nb::arg("hidden"), nb::arg("max_m"),
      nb::arg("world"), nb::arg("dp"), nb::arg("in_bytes"), nb::arg("num_scales"),
      nb::arg("out_bytes"), nb::arg("timeout_ns"), nb::arg("num_blocks"), nb::arg("warps"),
      nb::arg("staged"), nb::arg("staged_node_size") = 0, nb::arg("start_epoch") = 0,
      nb::arg("packed_rows") = 0, nb::arg("drop_overflow") = false,
      nb::arg("expert_rows") = 0, nb::arg("start_timeout_ns") = 0);
  m.def("destroy_handle", [](int64_t id) { raise_if(jmc::destroy_handle(id)); });
  // recover(), step 1 (local): the cycles this rank completed with no error (handle.h).
  m.def("quiesce_handle", [](int64_t id) {
    uint64_t clean = 0;
    raise_if(jmc::quiesce_handle(id, &clean));
    return clean;
  });
  // recover(), step 2 (collective): back to a clean device cycle 1, `agreed_cycles` counted as
  // completed (handle.h).
  m.def("recover_handle", [](int64_t id, uint64_t agreed_cycles) {
        raise_if(jmc::recover_handle(id, agreed_cycles));
      },
      nb::arg("id"), nb::arg("agreed_cycles"));
  m.def("open_handles", &jmc::open_handles);
  // The error a launch replayed after close() recorded on closed handle `id` ("" if none).
  m.def("closed_handle_error", &jmc::closed_handle_error);
  m.def("probe_peers_p2p", [] {
    if (!jmc::initialized()) throw std::runtime_error("NVSHMEM is not initialized");
    return jmc::probe_peers_p2p();
  });
  m.def("symmetric_bytes", [](int64_t id) { return open_handle(id)->symmetric_bytes; });
  // Grid of each kernel: [(blocks, warps per block)] in dispatch_send .. combine_recv order.
  m.def("launch_shape", [](int64_t id) {
    auto h = open_handle(id);
    std::vector<std::tuple<int, int>> out;
    for (const jmc::Launch& l : h->launch) out.emplace_back(l.num_blocks, l.warps_per_block);
    for (const jmc::Launch& l : h->fused_launch)
      out.emplace_back(l.num_blocks, l.warps_per_block);
    return out;
  });
  // Whether the kernels start as programmatic dependent launches (core/launch.cuh).
  m.def("dependent_launch", [](int64_t id) { return open_handle(id)->dependent_launch; });
  // Whether the handle acknowledges load/store peers with relaxed stores (JMC_ACKS; handle.cc).
  m.def("relaxed_acks", [](int64_t id) { return !open_handle(id)->release_acks; });
  // Rows dropped past a capacity since creation or recover() (overflow "drop"): waits for
  // the device, then reads DeviceState.
  m.def("dropped_rows", [](int64_t id) {
    auto h = open_handle(id);
    sync_device();
    uint64_t dropped = 0;
    raise_if_cuda(cudaMemcpy(&dropped, &h->scratch.state->dropped_rows, sizeof(dropped),
                             cudaMemcpyDeviceToHost),
                  "cudaMemcpy(dropped_rows)");
    return dropped;
  });
  // The first recorded kernel error ("" if none). Reads pinned memory: no device sync.
  m.def("handle_error", [](int64_t id) {
    auto h = open_handle(id);
    return jmc::describe_error(*h->error_host, h->rank);
  });
  // Tests only: the message of a made-up timeout record (host code, no GPU needed).
  m.def("_describe_timeout", [](int rank, int phase, int peer, uint64_t expected, uint32_t what,
                                uint32_t needed_kernel, uint64_t needed_cycle,
                                std::vector<uint64_t> started, uint32_t late) {
    jmc::ErrorRecord rec{};
    rec.code = jmc::kPeerTimeout;
    rec.phase = static_cast<uint32_t>(phase);
    rec.peer = peer;
    rec.token = -1;
    rec.expected = expected;
    rec.what = what;
    rec.view.needed_kernel = needed_kernel;
    rec.view.needed_cycle = needed_cycle;
    rec.view.late = late;
    for (size_t i = 0; i < 4 && i < started.size(); ++i) rec.view.started[i] = started[i];
    return jmc::describe_error(rec, rank);
  });
  // Synchronizes, then the recorded error, else the abort word a peer set ("" if neither).
  m.def("check_handle", [](int64_t id) {
    auto h = open_handle(id);
    sync_device();
    std::string recorded = jmc::describe_error(*h->error_host, h->rank);
    return recorded.empty() ? jmc::describe_abort(*h) : recorded;
  });
  // How many times a handler of this handle ran (tests: XLA replaying a command buffer runs
  // none of ours).
  m.def("handler_calls", [](int64_t id) {  // closed handles too: their handlers refuse
    auto h = jmc::find_open_or_closed_handle(id);
    if (h == nullptr) throw std::runtime_error("no all-to-all handle " + std::to_string(id));
    std::lock_guard<std::mutex> lock(h->mutex);
    return h->handler_calls;
  });
  m.def("barrier_all", [] {
    if (!jmc::initialized()) throw std::runtime_error("NVSHMEM is not initialized");
    nvshmem_barrier_all();
  });

  nb::dict targets;
  targets["jmc_dispatch_send"] = jmc::handler_capsule(jmc::kDispatchSend);
  targets["jmc_dispatch_recv"] = jmc::handler_capsule(jmc::kDispatchRecv);
  targets["jmc_combine_send"] = jmc::handler_capsule(jmc::kCombineSend);
  targets["jmc_combine_recv"] = jmc::handler_capsule(jmc::kCombineRecv);
  targets["jmc_dispatch"] = jmc::handler_capsule(jmc::kDispatch);
  targets["jmc_combine"] = jmc::handler_capsule(jmc::kCombine);
  targets["jmc_barrier"] = jmc::handler_capsule(jmc::kBarrier);
  targets["jmc_order_after"] = jmc::handler_capsule(jmc::kOrderAfter);
  m.attr("ffi_targets") = targets;
  jmc::define_bench_module(
      m.def_submodule("bench", "benchmarks' and tests' instruments (jax_moe_comm._bench)"));
}
