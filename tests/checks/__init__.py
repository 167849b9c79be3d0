"""Device-generic checks shared by the CPU suites (reference: gloo) and the GPU suites (reference: nccl)."""
