"""The all-gather schedules of csrc/collective/ against a fake transport (tests/cpp/schedule_simulation.cpp): W ranks'
recorded operations run in random interleavings that honour only the flags, as independent GPU streams would. Every form
(into tensor, in place, list, coalesced), 1 to 5 ranks, 2 or 4 slots, tiny segments and chunks so that messages span
many chunks, several collectives per group, serials wrapping past 2^32, and the direct schedule (2 to 8 ranks, each push
naming a peer on a peer lane of its own or shared in rotation order) with every way the mailbox settles a pair (each
pushing its own bytes, or one late, in the order the ranks posted) and both things a late pair may do (the later rank
moving both directions, or the earlier one landing its bytes chunk by chunk in the later one's landing area, whose flags
start anywhere, near the wrap too), and the captured schedule recorded once and replayed three times with new inputs
(every flag back at 0 after each replay), and the hierarchical schedule over 1-4 fake nodes of 1-4 ranks in any order of
ranks to nodes, with a fake inner all-gather per rail, its gathers on a lane of their own, beside push and drain on one
lane (one GPU stream), or everything of a rank in one queue (the host runner's worker): each rank's output must hold
every rank's bytes, and no interleaving may deadlock. It also pins the calls a one-chunk all-gather makes (its per-call
CPU cost). And it model-checks calls in flight across streams (--calls-in-flight): several groups' calls on each rank's
push, drain and caller streams, none waiting for another, must complete in call order with the runner's rule, and must
be caught failing without it. With each rank's streams on hardware queues (--hardware-queues: FIFOs, all streams on one
as with CUDA_DEVICE_MAX_CONNECTIONS=1, one per stream, or a random few), calls made in one order on every rank must
still complete; two groups' calls interleaved in different orders on different ranks (--crossed-orders) must be caught
hanging once their streams share a hardware queue, and must pass where they share none. And it model-checks the fault
protocol (--faults, csrc/collective/fault_release.hpp): two ranks whose calls are enqueued apart in time, a rank that
stops after a prefix, a watchdog that fails a rank at any moment, calls the ranks post apart (the second poster
refusing): under the protocol's release no call that ends without error holds a wrong byte, no copy touches a buffer
after its call ended, and no lane hangs once every rank failed; under the old release (every failed rank passing its own
waits) the model must catch both a wrong byte and a write after end; with two groups in crossed orders on one hardware
queue (--shared-queue-crossed) the protocol must be caught hanging, a known limitation; with every stream of a rank on
one hardware queue (--one-hardware-queue, the service stream that writes the releases into failed peers included) every
case must pass, a rank whose peer's process ended passing its own waits from a context of its own, and must be caught
hanging behind its own wait when that release too is a copy on the service stream (--own-release-on-queue, the
legacy-IPC fallback's). And the exchange schedule (--exchanges): all-to-all (uneven splits with zeros, even, lists),
broadcast, gather and scatter from any root, over 2-8 ranks, regions posted as they are or bounced, every pairing, one
queue or two lanes and peer lanes, several calls in a row near the wrap: at each call's end every rank's buffers hold
exactly the bytes sent to it and nothing else changed, and no copy touches them afterwards; wrong variants of the
schedule must be caught. Exchanges also run in the calls-in-flight and the fault models. And send, recv and
batch_isend_irecv (--p2p): the real step formation (pair_steps.hpp) and batch schedule (direct_p2p_batch.cpp) on each
pair's own transport and serials, over random programs valid under NCCL's rules among the group's collectives, with and
without faults; wrong batches, a fault release that passes a failed rank's own waits on a live peer, and the rules the
design needs beyond its words must be caught; batches matched by lone calls that interleave among the batch's peers
complete, each peer's steps on lanes of its own, and hang on lanes the peers share. And captured point-to-point
(--captured-p2p): graphs of p2p batches on the pairs' captured transports mixed with captured collectives, replayed with
new inputs; without the step order every rank shares, rings must be caught hanging."""
import re
import subprocess

import pytest

from cpp_build import build_cpp_test

SOURCES = ["csrc/collective/staging_allgather.cpp", "csrc/collective/direct_allgather.cpp",
           "csrc/collective/captured_allgather.cpp", "csrc/collective/byte_spans.cpp",
           "csrc/collective/hierarchical_allgather.cpp", "csrc/collective/node_layout.cpp",
           "csrc/collective/direct_exchange.cpp", "csrc/collective/captured_exchange.cpp",
           "csrc/collective/direct_p2p_batch.cpp", "csrc/collective/relayed_broadcast.cpp"]


@pytest.fixture(scope="module")
def simulation(tmp_path_factory):
    return build_cpp_test(tmp_path_factory, "schedule_simulation", SOURCES)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_schedules_deliver_every_byte_in_any_interleaving(simulation, seed):
    p = subprocess.run([str(simulation), str(seed), "3000"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 3000", p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_calls_in_flight_across_streams_complete_in_call_order(simulation, seed):
    """2-8 ranks (mostly 2 or 3), 1-3 groups, up to four calls in flight on a rank's push, drain, peer-lane and two
    caller streams, with forkFromCaller's fences and sdma::CallOrder's rule: no interleaving hangs, ends a call early
    or loses a byte."""
    p = subprocess.run([str(simulation), str(seed), "10000", "--calls-in-flight"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 10000", p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_calls_in_flight_without_call_order_fail(simulation, seed):
    """The same model without the rule must find what it is there for: a flag rolled back by an earlier call's
    serial (a hang), or a wait satisfied by a later call's serial (a call ended while a peer still copies into or out
    of its buffers, or read a peer's bounce area before it was filled: bytes not bit-exact). Every seed finds one
    within a few dozen cases; 3000 leaves a wide margin."""
    p = subprocess.run([str(simulation), str(seed), "3000", "--calls-in-flight", "--unordered"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert re.search(r"\bhang\b|early completion|wrong bytes", p.stderr), p.stderr


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_calls_in_flight_without_caller_fences_fail(simulation, seed):
    """Without forkFromCaller's fences a lane may start before the caller's stream wrote the call's input, and sends
    the bytes that were there before."""
    p = subprocess.run([str(simulation), str(seed), "3000", "--calls-in-flight", "--unforked"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "wrong bytes" in p.stderr, p.stderr


def test_calls_in_flight_early_completion_is_caught(simulation):
    """Most unordered seeds hang first (371 of seeds 1-400; 24 end a call early, 5 lose bytes); seed 13's first failure
    (case 0: four calls of one group of two of three ranks, the first two synchronous direct all-gathers on C1, then
    C2) is a call that ends on a rank while its peer still has a copy into its buffers queued, which the
    early-completion check must see."""
    p = subprocess.run([str(simulation), "13", "100", "--calls-in-flight", "--unordered"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "early completion" in p.stderr, p.stderr


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_calls_in_one_order_never_wait_on_each_other_through_hardware_queues(simulation, seed):
    """The calls-in-flight cases with each rank's streams on hardware queues, FIFOs in which a wait at the head holds
    every stream mapped there: all on one (CUDA_DEVICE_MAX_CONNECTIONS=1, Megatron's setting), one per stream, or a
    random few. Calls made in one order on every rank never hang, end early or lose a byte (about a second a seed)."""
    p = subprocess.run([str(simulation), str(seed), "10000", "--hardware-queues"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 10000", p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_crossed_orders_hang_only_on_a_shared_hardware_queue(simulation, seed):
    """Two groups over the same ranks whose calls the ranks interleave in different orders (a thread per group):
    once a hardware queue holds both groups' streams a rank's wait for one group sits before its step of the other
    that a peer waits for, and the case hangs (over half of the cases); the cases whose groups share no hardware queue
    on any rank must all pass, only flags ordering their streams."""
    p = subprocess.run([str(simulation), str(seed), "3000", "--hardware-queues", "--crossed-orders"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    m = re.match(r"caught (\d+) of 3000 cases: hang (\d+); none in the (\d+) cases whose groups share no hardware "
                 r"queue", p.stdout)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) == int(m.group(1)) and int(m.group(3)) > 0, p.stdout + p.stderr
    assert "hang" in p.stderr and "on their hardware queue" in p.stderr, p.stderr


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fault_protocol_release_keeps_every_property(simulation, seed):
    """The protocol's release (fault_release.hpp) over 30000 random cases a seed (about a second each): (a) bytes of
    every call ending without error bit-exact, (b) no copy into or out of a buffer after its call ended or that its
    owner never posted, (c) every lane runs out once every rank failed, (d) cases without faults unchanged."""
    p = subprocess.run([str(simulation), str(seed), "30000", "--faults"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 30000", p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fault_protocol_old_release_is_caught(simulation, seed):
    """The old rule (a failed rank writes its last serial into all of its own flag words) is caught in about 7% of
    the cases of every seed, by both kinds the protocol exists for: a late peer's call ending without error on bytes
    of a later call pushed into its staging before it drained it, and a call ended (its buffers back to the allocator)
    while the late peer still copies into them; a few cases hang, the failed rank's released words rolled back by the
    peer's genuine signals of earlier calls."""
    p = subprocess.run([str(simulation), str(seed), "3000", "--faults", "--old-release"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    counts = dict((k.strip(), int(n)) for k, n in re.findall(r"([a-z][a-z ]+?) (\d+);", p.stdout))
    assert counts.get("write after end", 0) > 0, p.stdout
    assert counts.get("wrong bytes in a call that ended without error", 0) > 0, p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_exchange_schedule_delivers_every_byte_in_any_interleaving(simulation, seed):
    """20000 random exchange cases a seed (about two seconds each)."""
    p = subprocess.run([str(simulation), str(seed), "20000", "--exchanges"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 20000", p.stdout


@pytest.mark.parametrize("mutation", ["--skip-done-wait", "--arrived-before-pack"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_exchange_schedule_mutations_are_caught(simulation, seed, mutation):
    """Wrong exchange schedules: without its Done waits a call ends while peers still write into its output (its
    bytes not there yet at its end, or written after it: caught in about 80% of the cases); with its Arrived signals
    before it packed a bounced input, a late peer pulls the bounce area's old bytes (about 40%)."""
    p = subprocess.run([str(simulation), str(seed), "2000", "--exchanges", mutation], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    m = re.match(r"caught (\d+) of 2000 cases:", p.stdout)
    assert m and int(m.group(1)) >= 200, p.stdout + p.stderr
    counts = dict((k.strip(), int(n)) for k, n in re.findall(r"([a-z][a-z ]+?) (\d+);", p.stdout))
    assert counts.get("wrong bytes", 0) > 0, p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fault_protocol_hangs_on_a_shared_hardware_queue_in_crossed_orders(simulation, seed):
    """A known limitation: two groups whose calls the ranks issue in crossed orders, every stream of a rank on one
    hardware queue. Their waits deadlock, the watchdogs fail both groups on both ranks, and still no rank's lanes of a
    group run out (each waits, directly or behind the other group's wait, on a step of the peer's stuck behind the
    peer's own wait), so the protocol's release never comes: about 40% of the cases hang, and nothing else fails."""
    first = _fault_cases_hang(simulation, seed, "--shared-queue-crossed", at_least=600)
    assert "after every rank failed" in first and "on their hardware queue" in first, first


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_hardware_queue_never_hangs(simulation, seed):
    """Every stream of a rank on one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, or by chance with more), the
    service stream that writes the releases into failed peers included: a rank whose peer's process ended passes its
    own waits on that peer from a context of its own, which no queued work holds, and every case passes (a release
    into a failed live peer, made once this rank's lanes ran out, leaves the queue)."""
    p = subprocess.run([str(simulation), str(seed), "3000", "--faults", "--one-hardware-queue"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok 3000", p.stdout + p.stderr


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gone_peer_release_on_the_service_stream_hangs_behind_its_own_wait(simulation, seed):
    """The same cases with that release made by a copy on the service stream, as the legacy-IPC fallback makes it: the
    copy sits behind the lane's wait it would satisfy, the lanes never run out and the caller's stream stays held.
    About 6% of the cases hang, each behind such a release, and nothing else fails."""
    first = _fault_cases_hang(simulation, seed, "--one-hardware-queue", "--own-release-on-queue", at_least=100)
    assert "its release of its own waits on rank" in first and "process ends" in first, first


def _fault_cases_hang(simulation, seed, *flags, at_least):
    """Runs 3,000 fault cases with `flags`; asserts that at least `at_least` hang and nothing else fails. Returns the
    first hang's report."""
    p = subprocess.run([str(simulation), str(seed), "3000", "--faults", *flags], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    m = re.match(r"caught (\d+) of 3000 cases: hang (\d+);$", p.stdout.strip())
    assert m and int(m.group(1)) == int(m.group(2)) >= at_least, p.stdout + p.stderr
    return p.stderr


def _p2p(simulation, seed, cases, *flags):
    return subprocess.run([str(simulation), str(seed), str(cases), "--p2p", *flags], capture_output=True, text=True,
                          timeout=120)


def _caught(p, cases):
    """The counts by kind of a run that counts the cases it is caught in."""
    assert p.returncode == 1, p.stdout + p.stderr
    m = re.match(rf"caught (\d+) of {cases} cases:", p.stdout)
    assert m, p.stdout + p.stderr
    return int(m.group(1)), dict((k.strip(), int(n)) for k, n in re.findall(r"([a-z][a-z' ]+?) (\d+);", p.stdout))


@pytest.mark.parametrize("flags", [(), ("--faults",)], ids=["plain", "faults"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_batches_deliver_every_byte_in_any_interleaving(simulation, seed, flags):
    """2-4 ranks, random programs valid under NCCL's rules (ring exchanges by batch, pipelines of lone sends and recvs,
    batches with both directions to one peer, random matched batches) among direct and staging all-gathers and
    exchanges of the group, sync and async on two caller streams, late ranks, hardware queues in a third of the cases:
    bytes right at every call's end, no copy before the owner's Arrived or after its end, no hang (about a second a
    seed). With faults: the release protocol over the group's and the pairs' transports keeps every property."""
    p = _p2p(simulation, seed, 4000, *flags)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 4000", p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_batch_that_waits_before_every_arrived_hangs_rings(simulation, seed):
    """Each step of a batch run whole in turn in call order (the exchange schedule called op after op): every ring
    exchange of 3 or more ranks listed the usual way (send to the next, then recv from the previous) hangs, about 160
    cases in 1000."""
    p = _p2p(simulation, seed, 1000, "--wait-before-arrived")
    total, counts = _caught(p, 1000)
    assert counts.get("hang") == total, counts
    m = re.search(r"rings of 3 or more ranks hang (\d+) of (\d+);", p.stdout)
    assert m and int(m.group(1)) == int(m.group(2)) >= 100, p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_copy_before_peer_arrived_is_caught(simulation, seed):
    """A push into a peer without waiting for its Arrived: caught as a copy into its buffers before its stream reached
    the op in about 75% of the cases (without that check, as wrong bytes in about 19%)."""
    total, counts = _caught(_p2p(simulation, seed, 1000, "--copy-before-arrived"), 1000)
    assert counts.get("copy before arrival", 0) >= 500, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_failed_rank_passing_own_waits_on_live_peer_is_caught(simulation, seed):
    """A failed rank that passes its own waits on live peers ends its calls (its buffers back to the caller) while a
    live peer still writes into them (write after end), or reads a live peer's input before it arrived."""
    total, counts = _caught(_p2p(simulation, seed, 1000, "--faults", "--pass-own-waits"), 1000)
    assert counts.get("write after end", 0) > 0, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_refusal_that_posts_buffers_is_caught(simulation, seed):
    """A rank that refuses its call on its own arguments posts the call's steps as refused, with no buffers, and fails:
    a peer that posts in between (before the failure is published) reads the refused post and throws. Posting the
    buffers instead, as an ordinary post does, lets a later peer move both directions with buffers the refusing
    rank's caller took back when the call raised (write after end)."""
    total, counts = _caught(_p2p(simulation, seed, 1000, "--faults", "--refusal-posts-buffers"), 1000)
    assert counts.get("write after end", 0) == total > 0, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_serials_need_one_order_per_pair_in_a_batch(simulation, seed):
    """Each op a step of its own, numbered with a peer in each rank's own call order: ranks that list a batch's send
    and recv to each other in other orders, as NCCL allows, disagree on the pair's serials (about half the cases); the
    real step formation (the k-th send and the k-th recv with a peer as one step) numbers them alike."""
    total, counts = _caught(_p2p(simulation, seed, 1000, "--serials-in-call-order"), 1000)
    assert counts.get("ranks disagree on a pair's serial") == total > 0, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_signals_need_the_serial_order(simulation, seed):
    """Each op a step of its own, numbered in an order both ranks compute alike but run in call order: a later op's
    Arrived lets the peer copy with an earlier op's buffers before that op arrived, and the word then rolls back below
    a serial the peer waits for (a hang); about half the cases."""
    total, counts = _caught(_p2p(simulation, seed, 1000, "--signals-in-call-order"), 1000)
    assert counts.get("hang", 0) > 0 and counts.get("copy before arrival", 0) > 0, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_connects_of_a_batch_need_to_wait_at_once(simulation, seed):
    """Connecting a batch's new pairs one after another, each CPU waiting for the peer at each: a ring's first batch
    waits in a circle (about 10% of the cases)."""
    total, counts = _caught(_p2p(simulation, seed, 1000, "--connect-in-turn"), 1000)
    assert counts.get("hang") == total > 0, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_batches_matched_by_lone_calls(simulation, seed):
    """A batch whose peers make their ops with it as lone calls (valid under NCCL's rules), one direction with each
    peer: the real batch schedule, which signals each step's Done right after its own copies, serves them, also under
    faults. Its Done signals moved after every step's copies (--done-after-every-copy), about a fifth of the cases
    hang, a first Done waiting for a later step's copies whose peer arrives only after its earlier call ended."""
    for flags in [("--unmatched-batches",), ("--faults", "--unmatched-batches")]:
        p = _p2p(simulation, seed, 1000, *flags)
        assert p.returncode == 0 and p.stdout.strip() == "ok 1000", p.stdout + p.stderr
    total, counts = _caught(_p2p(simulation, seed, 1000, "--unmatched-batches", "--done-after-every-copy"), 1000)
    assert counts.get("hang") == total >= 100, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_p2p_batches_matched_by_interleaved_lone_calls(simulation, seed):
    """Those peers' lone calls with the batch's rank interleaved with lone calls among themselves (--interleaved-peers):
    each peer's steps on lanes of that peer alone after the Arrived phase serve them, also under faults. On the batch's
    two lanes shared by every peer (--shared-lanes) about 3% of the cases hang, a copy of one step waiting for a peer
    held by a third rank that waits for a later step's Done; so do two peers on one pair of the pool's lanes
    (--lane-pool=2, batches of up to 3 peers): the pool must give each peer of a batch lanes of its own. The model
    puts each peer lane on a hardware queue of its own; drawn onto shared ones like the other streams
    (--peer-lanes-share-queues), a few cases hang."""
    for flags in [("--interleaved-peers",), ("--faults", "--interleaved-peers")]:
        p = _p2p(simulation, seed, 1000, *flags)
        assert p.returncode == 0 and p.stdout.strip() == "ok 1000", p.stdout + p.stderr
    total, counts = _caught(_p2p(simulation, seed, 1000, "--interleaved-peers", "--shared-lanes"), 1000)
    assert counts.get("hang") == total >= 10, counts
    total, counts = _caught(_p2p(simulation, seed, 1000, "--interleaved-peers", "--lane-pool=1"), 1000)
    assert counts.get("hang") == total >= 10, counts
    # A known limitation on the GPU: peer lanes whose streams share a hardware queue are one FIFO again (6-9 in 1000).
    total, counts = _caught(_p2p(simulation, seed, 1000, "--interleaved-peers", "--peer-lanes-share-queues"), 1000)
    assert counts.get("hang") == total > 0, counts


@pytest.mark.parametrize("mode,cases", [([], 1000), (["--exchanges"], 5000), (["--calls-in-flight"], 3000),
                                        (["--hardware-queues"], 3000)],
                         ids=["direct", "exchanges", "calls-in-flight", "hardware-queues"])
def test_peer_lanes_with_3_to_8_ranks(simulation, mode, cases):
    """The direct all-gather and the exchanges with every push that names a peer on that peer's lane (1 to size - 1
    lanes, peers sharing them in rotation order), over 3 to 8 ranks: alone, several exchanges queued at once, and
    calls in flight across the group's streams, on hardware queues too (peer lanes among the streams a queue holds).
    Every byte where it belongs, no call ending while a copy of it is queued, no hang (about two seconds each)."""
    p = subprocess.run([str(simulation), "1", str(cases), *mode, "--many-ranks"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == f"ok {cases}", p.stdout


def _peer_lanes_caught(simulation, seed, cases, *flags):
    return _caught(subprocess.run([str(simulation), str(seed), str(cases), *flags], capture_output=True, text=True,
                                  timeout=120), cases)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_unjoined_peer_lanes_are_caught(simulation, seed):
    """joinLane(Drain, Push) waiting for the Push lane but not the peer lanes: Done goes out while pushes are still
    queued on the peer lanes, so a peer's call ends before our bytes landed in it (a quarter of the calls-in-flight
    cases); the fault model catches it too, a call that ended without error holding wrong bytes."""
    total, counts = _peer_lanes_caught(simulation, seed, 2000, "--calls-in-flight", "--unjoined-peer-lanes")
    assert total >= 200 and counts.get("early completion", 0) > 0, counts
    total, counts = _peer_lanes_caught(simulation, seed, 2000, "--faults", "--unjoined-peer-lanes")
    assert counts.get("wrong bytes in a call that ended without error", 0) > 0, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_unforked_peer_lanes_are_caught(simulation, seed):
    """Peer lanes that do not first wait for the Push lane: a push starts before the Drain lane copied a bounced
    input into the bounce area (the direct model, a fifth of its cases), or before the caller's stream wrote the input
    (calls in flight, about 40%): the bytes sent are the old ones."""
    total, counts = _peer_lanes_caught(simulation, seed, 1000, "--unforked-peer-lanes")
    assert total >= 100 and counts.get("wrong bytes") == total, counts
    total, counts = _peer_lanes_caught(simulation, seed, 2000, "--calls-in-flight", "--unforked-peer-lanes")
    assert total >= 400 and counts.get("wrong bytes") == total, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_flags_on_peer_lanes_are_caught(simulation, seed):
    """The direct schedules' flags to a peer written on that peer's lane instead of the Drain lane: its Done no
    longer follows the Drain lane's pull from a peer we came late for, so the peer's call ends, or its buffers are
    reused, while we still read them (early completion, some wrong bytes; in the fault model a copy after the call
    ended, or a call that ended without error holding wrong bytes)."""
    total, counts = _peer_lanes_caught(simulation, seed, 2000, "--calls-in-flight", "--flags-on-peer-lanes")
    assert total >= 50 and counts.get("early completion", 0) > 0, counts
    total, counts = _peer_lanes_caught(simulation, seed, 2000, "--faults", "--flags-on-peer-lanes")
    after_end = counts.get("write after end", 0)
    assert total >= 50 and after_end > 0, counts
    assert after_end + counts.get("wrong bytes in a call that ended without error", 0) == total, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_drain_flags_behind_peer_lane_waits_hang_on_shared_hardware_queues(simulation, seed):
    """The direct transport's flag operations submitted as the copy-engine transport collects them, but without
    issuing the Drain lane's collected signals before an operation on a peer lane: a rank's Arrived then sits on a
    shared hardware queue behind its peer lane's wait for the peer's Arrived, which sits behind the peer's own wait the
    same way (a hang in about 14% of the hardware-queue cases; with the signals issued first, none)."""
    total, counts = _peer_lanes_caught(simulation, seed, 3000, "--hardware-queues", "--drain-flags-behind-peer-lanes")
    assert total >= 200 and counts.get("hang") == total, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_relay_waiting_on_the_root_lane_is_caught(simulation, seed):
    """A relayed broadcast's forwarding rank's wait for chunk c on the previous rank's peer lane instead of the lane of
    the next rank it forwards the chunk to: the forward, on that other lane, reads its output before the chunk landed
    there (wrong bytes in 2-4% of the exchange cases, the relayed broadcasts among them)."""
    total, counts = _peer_lanes_caught(simulation, seed, 2000, "--exchanges", "--relay-waits-on-root-lane")
    assert total >= 25 and counts.get("wrong bytes") == total, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_captured_exchanges_replay_every_byte_and_leave_flags_at_zero(simulation, seed):
    """Graphs of 1-5 captured exchanges of every kind (uneven splits with zeros, even, lists, broadcast, gather,
    scatter from any root) mixed with captured all-gathers, 2-5 ranks, recorded once and replayed three times with new
    inputs: every byte where it belongs, poison elsewhere, every flag back at 0 after each replay, with each call forked
    from and joined into the caller's stream where it takes several chunks and on the caller's stream alone otherwise,
    as the runner lays it out, with its lanes left free, or with one queue a rank (20000 cases a seed)."""
    p = subprocess.run([str(simulation), str(seed), "20000", "--captured-exchanges"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 20000", p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_captured_exchanges_without_arrived_are_caught_hanging(simulation, seed):
    """Without the Arrived a rank signals at the start of each captured exchange, a peer that moves nothing with it
    (two non-roots of a broadcast) runs through its next collective and sets Done before the rank's reset of the last
    Done erases it: the model must find that hang (about a third of the cases)."""
    p = subprocess.run([str(simulation), str(seed), "2000", "--captured-exchanges", "--without-arrived"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    m = re.match(r"caught (\d+) of 2000 cases:", p.stdout)
    assert m and int(m.group(1)) >= 200, p.stdout + p.stderr
    counts = dict((k.strip(), int(n)) for k, n in re.findall(r"([a-z][a-z ]+?) (\d+);", p.stdout))
    assert counts.get("hang", 0) > 0, p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_captured_p2p_replays_every_byte_and_leaves_flags_at_zero(simulation, seed):
    """Graphs of captured point-to-point batches (rings of 2-5 ranks in any order and any listing, pipelines of lone
    sends and recvs, random matched batches with several ops and both directions with one peer) mixed with captured
    all-gathers and exchanges, 2-5 ranks, each step on its pair's captured transport in the order every rank shares,
    recorded once and replayed three times with new inputs in random interleavings: every byte where it belongs, the
    poison around it untouched, every flag of every transport back at 0, no hang (4000 cases a seed)."""
    p = subprocess.run([str(simulation), str(seed), "4000", "--captured-p2p"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 4000", p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_captured_p2p_in_listing_order_hangs_rings(simulation, seed):
    """A batch's steps in each rank's listing order instead of the shared (lower member, higher member, k): every ring
    of 3 or more ranks listed the usual way (send to the next first) waits in a cycle and hangs (about 160 in 1000
    cases), and so do some random batches; nothing else fails."""
    p = subprocess.run([str(simulation), str(seed), "1000", "--captured-p2p", "--listing-order"], capture_output=True,
                       text=True, timeout=120)
    total, counts = _caught(p, 1000)
    assert counts.get("hang") == total, counts
    m = re.search(r"rings of 3 or more ranks hang (\d+) of (\d+);", p.stdout)
    assert m and int(m.group(1)) == int(m.group(2)) >= 100, p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_collected_staging_flags_on_shared_queues_never_hang(simulation, seed):
    """The staging transport's flag operations submitted as CopyEngineTransport collects them (each lane's until its
    next copy), with each lane's batch preceded by the other lane's signals collected so far: on hardware queues (one,
    one per stream, a random few) no case hangs, ends early or loses a byte."""
    p = subprocess.run([str(simulation), str(seed), "3000", "--hardware-queues", "--collect-staging-flags"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 3000", p.stdout


def test_collected_signals_behind_the_other_lanes_waits_hang(simulation):
    """Without that rule a staging chunk's Ready, collected on the Push lane until its next copy, reaches a hardware
    queue it shares with the Drain lane behind the Drain lane's wait for the peer's Ready of the same chunk, while the
    peer does the same: caught hanging."""
    p = subprocess.run([str(simulation), "1", "3000", "--hardware-queues", "--collect-staging-flags",
                        "--signals-behind-waits"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0, p.stdout
    assert "hang" in p.stdout + p.stderr, p.stdout + p.stderr
