#include "runner/kept_for_life.hpp"

#include <mutex>

namespace sdma {
namespace {

// Never destroyed, so nothing here is freed at exit either, when the interpreter that owns a tensor may be gone.
struct Kept {
  std::mutex mutex;
  std::vector<at::Tensor> tensors;
  std::vector<std::shared_ptr<void>> owners;
  KeptForLife total;
};

Kept& kept() {
  static Kept* k = new Kept();
  return *k;
}

}  // namespace

void keepTensorsForLife(std::vector<at::Tensor> tensors) {
  Kept& k = kept();
  std::lock_guard<std::mutex> lock(k.mutex);
  for (auto& t : tensors) {
    if (t.defined()) {
      k.total.bytes += t.storage().nbytes();
      ++k.total.items;
      k.tensors.push_back(std::move(t));
    }
  }
}

void keepForLife(std::shared_ptr<void> owner, size_t bytes) {
  Kept& k = kept();
  std::lock_guard<std::mutex> lock(k.mutex);
  k.total.bytes += bytes;
  ++k.total.items;
  k.owners.push_back(std::move(owner));
}

KeptForLife keptForLife() {
  Kept& k = kept();
  std::lock_guard<std::mutex> lock(k.mutex);
  return k.total;
}

}  // namespace sdma
