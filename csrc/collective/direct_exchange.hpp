// The exchange (all-to-all, broadcast, gather, scatter) without staging (docs/design.md, "Exchange"): straight
// between the ranks' own regions, each pair as the arrival mailbox settled it, as the direct all-gather does. Each
// rank pushes the range it sends a peer into that peer's output; where this rank came late to a pair, it also pulls
// the range the peer sends it from the peer's input. Pairs with nothing to move in a direction skip that copy, but
// every pair still meets through Arrived and Done, so that the collective ends on every rank only once no peer
// copies with its regions any more.
#pragma once

#include <cstdint>
#include <vector>

#include "collective/direct_allgather.hpp"
#include "collective/exchange_plan.hpp"
#include "transport/transport.hpp"

namespace sdma {

struct ExchangePeer {
  PeerBuffers buffers;  // how the pair settled; the peer's posted regions, as this rank's copies address them
  PairRanges ranges;    // what the peer posted about its pair with this rank
};

// `posted`: this rank's regions as it posted them (plan.input / plan.output, or the bounce area standing in for
// them: then the schedule packs the input before, where a peer pulls from it, and unpacks the output after, locally).
// `serial`: the group's direct serial, which this collective's Arrived and Done flags carry. Pushes on the Push lane,
// pulls and local copies on the Drain lane, which writes every flag and ends the collective.
void scheduleDirectExchange(Transport& transport, const ExchangePlan& plan, uint32_t serial,
                            const PostedBuffers& posted, const std::vector<ExchangePeer>& peers);

// What every direct exchange begins and ends with: a bounced input packed where a peer pulls from it or where this
// rank's own pushes must read it (peers write the output over the input's tensors: then the Push lane waits for the
// packing, and open returns true), and Arrived signalled to every peer; then, after the copies, the Push lane joined,
// Done to and from every peer, and a bounced output unpacked (only the `bounced` ranges of it, where given).
// Otherwise the schedule's own copies read the input's tensors where they lie.
bool openDirectExchange(Transport& transport, const ExchangePlan& plan, uint32_t serial, const PostedBuffers& posted,
                        const std::vector<ExchangePeer>& peers);
void closeDirectExchange(Transport& transport, const ExchangePlan& plan, uint32_t serial, const PostedBuffers& posted,
                         const std::vector<ByteRange>* bounced = nullptr);

}  // namespace sdma
