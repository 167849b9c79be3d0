"""For test_registration.py: init_process_group with each backend string in turn, a CPU all-gather, destroy. Under
torchrun every init rendezvouses through the agent's store, which outlives destroy_process_group, as in a training
script that re-initialises; the harness's fresh stores call main() directly. Returns (and under torchrun prints, one
JSON line per rank) for each init: the string, the backend of each device's collectives, whether the all-gather
was right."""
import json
import sys

import torch
import torch.distributed as dist

import torch_sdma  # noqa: F401  (torch <= 2.13 needs the name registered)


def served(group):
    out = {}
    for device in ("cpu", "cuda"):
        try:
            b = group._get_backend(torch.device(device))
        except RuntimeError:
            out[device] = None
            continue
        if hasattr(b, "_sdma_stats"):
            # An sdma backend made for CUDA alone refuses CPU collectives (its creation verdict for CPU is empty); no
            # CUDA collective runs here, so its CUDA side is not asked.
            out[device] = "sdma" if device == "cuda" or b._sdma_creation_verdict("cpu")[0] else "sdma refusing CPU"
        else:
            out[device] = type(b).__name__.replace("ProcessGroup", "").lower()
    return out


def init_each(strings, **init_kwargs):
    """init_kwargs: a callable giving init_process_group's keyword arguments for each init (a fresh store)."""
    results = []
    for backend in strings:
        dist.init_process_group(backend, **(init_kwargs["make"]() if init_kwargs else {}))
        rank, world = dist.get_rank(), dist.get_world_size()
        got = served(dist.group.WORLD)
        x = torch.arange(1000, dtype=torch.float32) + 1000 * rank
        out = torch.full((world * 1000,), -1.0)
        try:
            dist.all_gather_into_tensor(out, x)
            want = torch.cat([torch.arange(1000, dtype=torch.float32) + 1000 * q for q in range(world)])
            gathered = "right" if torch.equal(out, want) else "wrong bytes"
        except Exception as e:  # noqa: BLE001
            gathered = f"{type(e).__name__}: {e}"
        dist.destroy_process_group()
        results.append({"backend": backend, "served": got, "gathered": gathered})
    return results


if __name__ == "__main__":
    results = init_each(sys.argv[1].split(";"))
    # One write with its newline: the ranks share torchrun's stdout, and print's separate newline let two ranks' lines
    # run together.
    line = "INIT-AGAIN " + json.dumps({"rank": int(__import__("os").environ["RANK"]), "results": results}) + "\n"
    sys.stdout.write(line)
    sys.stdout.flush()
