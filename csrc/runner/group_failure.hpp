// Once a collective of a group failed, the group runs no further all-gathers: its peers and streams may be
// anywhere inside the failed one. Guarded by the runner's mutex.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <string>

#include "collective/collective_info.hpp"

namespace sdma {

// An exception's message for a user: c10::Error's what() carries the C++ backtrace, which belongs in the log only.
inline std::string messageOf(const std::exception& e) {
  if (const auto* c10Error = dynamic_cast<const c10::Error*>(&e)) {
    return c10Error->what_without_backtrace();
  }
  return e.what();
}

class GroupFailure {
 public:
  // `reason` may be an exception's what(), which for a c10::Error carries its C++ backtrace: that goes to the log
  // (at INFO level: TORCH_CPP_LOG_LEVEL=INFO), and the refusals of later calls quote only the message, as one
  // paragraph.
  void record(const std::string& reason) {
    if (reason_.empty()) {
      const size_t backtrace = reason.find(kBacktraceStart);
      if (backtrace != std::string::npos) {
        LOG(INFO) << "torch_sdma: the failure that stops the group, with its backtrace: " << reason;
      }
      reason_ = reason.substr(0, backtrace);
    }
  }
  bool happened() const {
    return !reason_.empty();
  }
  const std::string& reason() const {
    return reason_;
  }
  // Throws, naming the collective and the earlier failure, once one happened.
  void refuse(const CollectiveInfo& info) const {
    TORCH_CHECK_WITH(DistBackendError, reason_.empty(), "torch_sdma: ", info.describe(),
                     " refused: an earlier collective on this group failed: ", reason_);
  }

 private:
  // How c10::Error::what() begins the backtrace it appends to the message.
  static constexpr const char* kBacktraceStart = "\nException raised from ";
  std::string reason_;
};

}  // namespace sdma
