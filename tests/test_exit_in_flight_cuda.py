"""The GPU twin of test_exit_in_flight_cpu.py (2 GPUs, or one shared by two ranks with SDMA_TEST_SHARE_GPU=1;
skipped elsewhere): a script that ends with copy-engine all-gathers in flight exits with its own status, no signal,
nothing left in /dev/shm; the watchdog lets go of no tensor once the interpreter exits."""
import pytest
from test_exit_in_flight_cpu import check_runs

from conftest import cuda_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("env", [{}, {"TORCH_SDMA_DIRECT": "0"}], ids=["direct", "staging"])
@pytest.mark.parametrize("mode", ["in_flight", "late_peer"])
def test_script_ending_with_calls_in_flight_exits_with_its_status(mode, env):
    check_runs(mode, runs=5, device="cuda", env=env)  # ten each on CPU ranks (CI); a GPU run costs more


@pytest.mark.parametrize("mode", ["temporaries", "callbacks", "destroy"])
def test_other_endings_exit_with_their_status(mode):
    check_runs(mode, runs=2, device="cuda")
