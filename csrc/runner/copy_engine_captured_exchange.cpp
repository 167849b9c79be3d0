// The exchanges captured into a CUDA graph (docs/design.md, "Captured"): the pair check at capture, then the captured
// exchange on the group's captured transport, joined back into the capturing stream before the call returns.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/util/Exception.h>

#include <sstream>

#include "collective/captured_exchange.hpp"
#include "runner/copy_engine_runner.hpp"
#include "runner/size_mismatch.hpp"

namespace sdma {
namespace {

// "s0,r0;s1,r1;...": per peer, the bytes this rank sends it and expects from it.
std::string pairBytesOf(const ExchangePlan& plan) {
  std::ostringstream out;
  for (size_t q = 0; q < plan.sendTo.size(); ++q) {
    out << (q ? ";" : "") << plan.sendTo[q].bytes << "," << plan.recvFrom[q].bytes;
  }
  return out.str();
}

// Per peer, {sends, expects}; empty where `text` is not what pairBytesOf writes for `size` ranks.
std::vector<std::pair<uint64_t, uint64_t>> parsePairBytes(const std::string& text, int size) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  std::istringstream in(text);
  for (int q = 0; q < size; ++q) {
    uint64_t sends = 0, expects = 0;
    char comma = 0, semicolon = ';';
    if ((q > 0 && !(in >> semicolon)) || semicolon != ';' || !(in >> sends >> comma >> expects) || comma != ',') {
      return {};
    }
    out.emplace_back(sends, expects);
  }
  return out;
}

}  // namespace

void CopyEngineRunner::refuseCapturedPairsThatDisagree(const ExchangePlan& plan, const CollectiveInfo& info) {
  std::vector<std::string> posts;
  try {
    c10d::PrefixStore store("capex/" + std::to_string(capturedExchanges_++) + "/", store_);
    posts = exchangeWithGroup(store, "pairs", rank_, size_, pairBytesOf(plan));
  } catch (const std::exception& e) {
    refuseCall(info.describe() + " failed while capturing it: " + messageOf(e));
  }
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> pairs(size_);
  for (int p = 0; p < size_; ++p) {
    pairs[p] = parsePairBytes(posts[p], size_);
    if (pairs[p].empty()) {
      refuseCall(info.describe() + " failed while capturing it: group rank " + std::to_string(p) +
                 " posted unreadable pair sizes '" + posts[p] + "'");
    }
  }
  // Every member reads every post and walks the pairs in the same order: all refuse with the same words.
  for (int p = 0; p < size_; ++p) {
    for (int q = p + 1; q < size_; ++q) {
      const std::string differs =
          pairDisagreement(p, q, pairs[p][q].first, pairs[p][q].second, pairs[q][p].first, pairs[q][p].second);
      if (!differs.empty()) {
        refuseOnBoard(info, info.describe() + " failed: " + differs);
      }
    }
  }
}

c10::intrusive_ptr<c10d::Work> CopyEngineRunner::enqueueCapturedExchange(PlannedExchange& planned,
                                                                         const CollectiveInfo& info,
                                                                         gpu::Stream caller) {
  // A peer with another call is named from the call board rather than found by the store's timeout below.
  meetPeersBeforeConnecting(info);
  refuseCapturedPairsThatDisagree(planned.plan, info);
  CopyEngineTransport& transport = capturedTransport();
  const bool pipelined = capturedExchangeRounds(planned.plan, transport.geometry(), rank_) > 1;
  return enqueueOnCapturedLanes(caller, pipelined, info, planned.device, std::move(planned.outputs),
                                [&](CopyEngineTransport& t) { scheduleCapturedExchange(t, planned.plan); });
}

}  // namespace sdma
