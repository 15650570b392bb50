// The host heartbeat's thread (heartbeat.h). Each beat is one 8-byte copy per open handle from
// pinned memory on a stream of its own, then a sync of that stream; the beat value only has to
// change, so it counts beats.
#include "heartbeat.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "core/layout.h"

namespace jmc {
namespace {

// Guards everything below, and is held by the thread for a whole beat: heartbeat_forget takes
// it, so after it returns no copy into a forgotten word is in flight.
std::mutex g_mutex;
std::condition_variable g_wake;
std::vector<uint64_t*> g_words;
std::thread* g_thread = nullptr;  // never destroyed while joinable: heartbeat_stop joins it
bool g_stop = false;
int g_device = 0;
bool g_exit_hook = false;

void beat_loop() {
  cudaSetDevice(g_device);
  // XLA records command buffers by stream capture on its own threads; in the relaxed mode this
  // thread's calls are never refused because of a capture elsewhere.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaStream_t stream = nullptr;
  uint64_t* beat = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaHostAlloc(reinterpret_cast<void**>(&beat), sizeof(uint64_t), cudaHostAllocDefault) !=
          cudaSuccess) {
    return;  // no beat: peers treat this process as gone after their timeout, as without one
  }
  *beat = 0;
  std::unique_lock<std::mutex> lock(g_mutex);
  while (!g_stop) {
    ++*beat;  // the previous beat's copies have completed (synced below)
    for (uint64_t* word : g_words)
      cudaMemcpyAsync(word, beat, sizeof(uint64_t), cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
    g_wake.wait_for(lock, std::chrono::nanoseconds(kHeartbeatPeriodNs), [] { return g_stop; });
  }
  cudaStreamDestroy(stream);
  cudaFreeHost(beat);
}

}  // namespace

std::string heartbeat_watch(uint64_t* word, int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_words.push_back(word);
  if (g_thread != nullptr) return "";
  if (!g_exit_hook) {
    // Before the CUDA runtime's own teardown (registered earlier, so run later): the thread
    // must not outlive it.
    std::atexit(heartbeat_stop);
    g_exit_hook = true;
  }
  g_device = device;
  g_stop = false;
  try {
    g_thread = new std::thread(beat_loop);
  } catch (const std::exception& e) {
    return std::string("cannot start the heartbeat thread: ") + e.what();
  }
  return "";
}

void heartbeat_forget(uint64_t* word) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_words.erase(std::remove(g_words.begin(), g_words.end(), word), g_words.end());
}

void heartbeat_stop() {
  std::thread* thread = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_stop = true;
    thread = g_thread;
    g_thread = nullptr;
  }
  g_wake.notify_all();
  if (thread != nullptr) {
    thread->join();
    delete thread;
  }
}

}  // namespace jmc
