#include "runner/captured_p2p_pairs.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/util/Exception.h>

#include <sstream>

#include "collective/captured_exchange.hpp"
#include "runner/group_failure.hpp"
#include "transport/peer_rendezvous.hpp"

namespace sdma {
namespace {

// What a step moves, as the pair compares it: its directions (p2p_batch.hpp), the bytes this rank sends the peer and
// the bytes it expects from it.
struct StepPost {
  uint64_t directions = 0;
  PairRanges ranges;
};

std::string textOf(const StepPost& p) {
  return std::to_string(p.directions) + "," + std::to_string(p.ranges.sends.bytes) + "," +
         std::to_string(p.ranges.expects.bytes);
}

bool parse(const std::string& text, StepPost* out) {
  std::istringstream in(text);
  char c1 = 0, c2 = 0;
  uint64_t sends = 0, expects = 0;
  if (!(in >> out->directions >> c1 >> sends >> c2 >> expects) || c1 != ',' || c2 != ',') {
    return false;
  }
  out->ranges.sends = {0, sends};
  out->ranges.expects = {0, expects};
  return true;
}

}  // namespace

CapturedP2pPairs::CapturedP2pPairs(int rank, int device, const StagingGeometry& geometry)
    : rank_(rank), device_(device), geometry_(geometry) {}

void CapturedP2pPairs::connect(int peer, const c10::intrusive_ptr<c10d::Store>& pairStore,
                               const std::vector<MemberIdentity>& members) {
  Pair pair;
  pair.store = c10::make_intrusive<c10d::PrefixStore>("captured/", pairStore);
  c10d::PrefixStore connectStore("connect/", pair.store);
  pair.transport = connectCapturedTransport(connectStore, rank_ < peer ? 0 : 1, 2, device_, geometry_, members);
  pairs_.emplace(peer, std::move(pair));
}

c10::intrusive_ptr<c10d::Work> CapturedP2pPairs::enqueue(const std::vector<PairStep>& steps, const CollectiveInfo& info,
                                                         gpu::Stream caller,
                                                         const std::function<void(const std::string&)>& failGroup) {
  const auto refuse = [&](const std::string& reason) {
    failGroup(reason);
    C10_THROW_ERROR(DistBackendError, "torch_sdma: " + reason);
  };
  // Every step's post first, then the reads: a rank never waits for a post before its own are out, so no order of
  // the batch's pairs makes the two members of a pair wait for each other.
  std::vector<ExchangePlan> plans;
  std::vector<StepPost> posts;
  std::vector<std::string> keys;
  std::vector<uint64_t> numbers;
  for (const PairStep& step : steps) {
    Pair& pair = pairs_.at(step.peer);
    const int me = rank_ < step.peer ? 0 : 1;
    plans.push_back(pairPlanOf(step, me));
    StepPost post;
    post.directions = directionsOf(step);
    post.ranges = {plans.back().sendTo[1 - me], plans.back().recvFrom[1 - me]};
    posts.push_back(post);
    numbers.push_back(++pair.steps);
    keys.push_back("check/" + std::to_string(numbers.back()));
    const std::string text = textOf(post);
    pair.store->set(keys.back() + "/" + std::to_string(me), std::vector<uint8_t>(text.begin(), text.end()));
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    const int peer = steps[i].peer;
    const int me = rank_ < peer ? 0 : 1;
    std::vector<std::string> both;
    try {
      both = exchangeWithGroup(*pairs_.at(peer).store, keys[i], me, 2, textOf(posts[i]));
    } catch (const std::exception& e) {
      refuse(info.describe() + " failed while capturing it: " + messageOf(e));
    }
    StepPost theirs;
    if (!parse(both[1 - me], &theirs)) {
      refuse(info.describe() + " failed while capturing it: group rank " + std::to_string(peer) +
             " posted an unreadable step '" + both[1 - me] + "'");
    }
    const std::string differs = pairStepDisagreement(rank_, peer, numbers[i], posts[i].directions, posts[i].ranges,
                                                     theirs.directions, theirs.ranges);
    if (!differs.empty()) {
      refuse(info.describe() + " failed: " + differs);
    }
  }

  // In step order, each step joined back into the caller's stream before the next one starts: a rank's waits follow
  // the order every rank shares, so no chain of waits between ranks closes a cycle.
  StepTensors tensors = tensorsOf(steps);
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::shared_ptr<CopyEngineTransport>& transport = pairs_.at(steps[i].peer).transport;
    const int me = rank_ < steps[i].peer ? 0 : 1;
    const bool pipelined = capturedExchangeRounds(plans[i], transport->geometry(), me) > 1;
    lanes_.run(caller, pipelined, transport, [&](CopyEngineTransport& t) { scheduleCapturedExchange(t, plans[i]); });
  }
  return capturedWork(caller, endEvents_, info, at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_)),
                      std::move(tensors.outputs));
}

}  // namespace sdma
