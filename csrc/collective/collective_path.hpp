// Which way an all-gather goes: the DMA path of this backend (through staging: "dma"; without it: "dma:direct";
// inside a CUDA graph capture: "dma:captured"), or the inner backend and why. Stats, the group's log line and
// torch_sdma.group_path() show it as a key: "dma", "dma:direct", "dma:captured", "inner:<reason>", or "unknown"
// before the first.
#pragma once

#include <string>

namespace sdma {

struct CollectivePath {
  enum class Kind { Unknown, Dma, Inner };
  Kind kind = Kind::Unknown;
  std::string reason;  // Inner: why; Dma: a variant ("captured"), or ""

  // The variant of an all-gather captured into a CUDA graph.
  static constexpr const char* kCaptured = "captured";
  // The variant that copies between the ranks' own buffers, without staging (docs/design.md, "Direct").
  static constexpr const char* kDirect = "direct";
  // A direct broadcast relayed through the peers (relayed_broadcast.hpp).
  static constexpr const char* kRelayed = "relayed";

  static CollectivePath dma(std::string variant = "") {
    return {Kind::Dma, std::move(variant)};
  }
  static CollectivePath inner(std::string why) {
    return {Kind::Inner, std::move(why)};
  }
  bool isDma() const {
    return kind == Kind::Dma;
  }
  bool isCaptured() const {
    return kind == Kind::Dma && reason == kCaptured;
  }
  bool isDirect() const {
    return kind == Kind::Dma && reason == kDirect;
  }
  bool isInner() const {
    return kind == Kind::Inner;
  }
  std::string key() const {
    switch (kind) {
      case Kind::Dma:
        return reason.empty() ? "dma" : "dma:" + reason;
      case Kind::Inner:
        return "inner:" + reason;
      case Kind::Unknown:
        break;
    }
    return "unknown";
  }
};

}  // namespace sdma
