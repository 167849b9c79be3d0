// Every member of a group must run the same schedule over the same staging: a rank that cuts staging, slots or
// chunks differently writes where its peers do not read (wrong bytes, or a SIGBUS past a smaller mapping), and a
// rank that takes another path waits for peers that never come. So at creation, before any transport exists, the
// members exchange their effective settings as one string through the group's store and refuse to form the group,
// on every rank at once, when any of them differ.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

#include "backend/sdma_options.hpp"

namespace sdma {

// The settings that must agree, one "name=value" per line, in a fixed order. Knobs that only shape this rank's own
// behaviour (TORCH_SDMA_LOG, TORCH_SDMA_DIRECT_PEER_WAIT_US, the test pseudo-node)
// are left out: they may differ by rank.
std::string settingsThatMustAgree(const SdmaOptions& options);

// Collective: throws a ValueError on every member, naming each setting that differs and each rank's value, unless
// all members' settings are equal. `store` is the group's own.
void agreeOnSettings(c10d::Store& store, int rank, int size, const SdmaOptions& options);

}  // namespace sdma
