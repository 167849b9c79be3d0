"""What a user sees after a background thread of ours failed (TORCH_SDMA_TEST_FAULT): the all-gather it concerned
fails with its message, and the group refuses the next ones, saying why."""
import torch.distributed as dist


def assert_refused_after(failure_words, out, x, group):
    """The next all-gather on `group` raises, saying it was refused and naming the failure."""
    try:
        dist.all_gather_into_tensor(out, x, group=group)
    except Exception as e:  # noqa: BLE001
        later = str(e)
    else:
        raise AssertionError(f"an all-gather after '{failure_words}' was not refused")
    assert "refused" in later and failure_words in later, later
