// The exchange (all-to-all, broadcast, gather, scatter) for a CUDA graph, through the captured transport's staging,
// as the captured all-gather moves its bytes (docs/design.md, "Captured"). Each pair's bytes, what one rank sends the
// other, are cut into chunks by the same rule on both sides (chunkBytesFor over the pair's byte count, which the
// ranks compared at capture), and chunk k of every pair goes through slot k mod slots. A graph replays the flag
// values it was captured with, so every flag is 1 while it means something and its waiter returns it to 0 in the same
// replay, after the wait.
#pragma once

#include <cstddef>

#include "collective/exchange_plan.hpp"
#include "transport/transport.hpp"

namespace sdma {

// Enqueues the collective on `transport` (the group's captured transport, whose staging and flags no eager schedule
// uses, with direct() for the flags of one peer). Pushes and the Arrived signals on the Push lane; the local copy,
// the drains and the Credit and Done signals on the Drain lane. Needs every peer to have posted the same bytes for
// each pair (sendTo[q] here is recvFrom[me] there): the caller compares them first.
void scheduleCapturedExchange(Transport& transport, const ExchangePlan& plan);

// The rounds scheduleCapturedExchange() takes on rank `rank`: the most chunks of any pair it sends or receives. With
// one round at most, pushes and drains gain nothing from running apart.
size_t capturedExchangeRounds(const ExchangePlan& plan, const StagingGeometry& geometry, int rank);

}  // namespace sdma
