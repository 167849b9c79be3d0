// Which way an all-gather goes: the DMA path of this backend, or the inner backend and why. Stats, the group's
// log line and torch_sdma.group_path() show it as a key: "dma", "inner:<reason>", or "unknown" before the first.
#pragma once

#include <string>

namespace sdma {

struct CollectivePath {
  enum class Kind { Unknown, Dma, Inner };
  Kind kind = Kind::Unknown;
  std::string reason;  // Inner only

  static CollectivePath dma() {
    return {Kind::Dma, ""};
  }
  static CollectivePath inner(std::string why) {
    return {Kind::Inner, std::move(why)};
  }
  bool isDma() const {
    return kind == Kind::Dma;
  }
  bool isInner() const {
    return kind == Kind::Inner;
  }
  std::string key() const {
    switch (kind) {
      case Kind::Dma:
        return "dma";
      case Kind::Inner:
        return "inner:" + reason;
      case Kind::Unknown:
        break;
    }
    return "unknown";
  }
};

}  // namespace sdma
