#include "runner/graph_held_transports.hpp"

#include <c10/util/Logging.h>

#include <atomic>
#include <mutex>
#include <vector>

namespace sdma {
namespace {

using Held = std::shared_ptr<CopyEngineTransport>;

struct Released {
  std::mutex mutex;
  std::vector<Held*> gone;
  std::atomic<bool> any{false};
};

// Never destroyed: a runtime thread may report a graph gone while the process exits.
Released& released() {
  static Released* r = new Released();
  return *r;
}

// On the runtime's thread: no GPU call, so the transport is only handed over.
void onGraphGone(void* object) {
  Released& r = released();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.gone.push_back(static_cast<Held*>(object));
  r.any.store(true, std::memory_order_release);
}

}  // namespace

void holdWhileGraphLives(gpu::Stream capturing, const std::shared_ptr<CopyEngineTransport>& transport) {
  if (!gpu::releaseWithCapturedGraph(capturing, new Held(transport), onGraphGone)) {
    LOG(WARNING) << "torch_sdma: a captured graph cannot hold its all-gather's staging; it stays mapped for the life "
                    "of the process";
    new Held(transport);  // deliberately never freed
  }
}

void freeTransportsOfDestroyedGraphs() {
  Released& r = released();
  if (!r.any.load(std::memory_order_acquire)) {
    return;
  }
  std::vector<Held*> gone;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    gone.swap(r.gone);
    r.any.store(false, std::memory_order_release);
  }
  for (Held* h : gone) {
    delete h;
  }
}

}  // namespace sdma
