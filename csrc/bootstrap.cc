#include "bootstrap.h"
#include "heartbeat.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>

namespace jmc {
namespace {
bool g_initialized = false;  // by this module (init is reference-counted in NVSHMEM)
}

Version built_nvshmem_version() {
  return {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
          NVSHMEM_VENDOR_PATCH_VERSION};
}

Version runtime_nvshmem_version() {
  Version v{0, 0, 0};
  nvshmemx_vendor_get_version_info(&v.major, &v.minor, &v.patch);
  return v;
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string cuda_driver_error() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaSuccess) return n > 0 ? "" : "no CUDA device";
  cudaGetLastError();
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

std::string make_unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) return std::string();
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

std::string init(const std::string& unique_id, int rank, int nranks, int device) {
  if (g_initialized) return "";
  const Version built = built_nvshmem_version(), run = runtime_nvshmem_version();
  if (built.major != run.major || built.minor != run.minor || built.patch != run.patch)
    return "NVSHMEM version mismatch: built against " + std::to_string(built.major) + "." +
           std::to_string(built.minor) + "." + std::to_string(built.patch) +
           ", loaded libnvshmem_host " + std::to_string(run.major) + "." +
           std::to_string(run.minor) + "." + std::to_string(run.patch);
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t))
    return "unique id has " + std::to_string(unique_id.size()) + " bytes, expected " +
           std::to_string(sizeof(nvshmemx_uniqueid_t));
  if (cudaSetDevice(device) != cudaSuccess)
    return "cudaSetDevice(" + std::to_string(device) + ") failed: " + cuda_driver_error();
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr) != 0)
    return "nvshmemx_set_attr_uniqueid_args failed";
  // Header-inline: it exits the process on failure, which is why everything above is checked.
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
    return "nvshmemx_init_attr failed";
  g_initialized = true;
  return "";
}

std::string finalize() {
  if (!g_initialized) return "";
  heartbeat_stop();  // (finalize refuses while a handle is open: no word is left to beat)
  cudaDeviceSynchronize();
  nvshmem_finalize();
  g_initialized = false;
  return "";
}

bool initialized() { return g_initialized; }
int my_pe() { return g_initialized ? nvshmem_my_pe() : -1; }
int n_pes() { return g_initialized ? nvshmem_n_pes() : 0; }
int init_status() { return nvshmemx_init_status(); }

}  // namespace jmc
