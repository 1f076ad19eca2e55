"""Start a test's worker processes (torch.multiprocessing, spawn) and wait for them under a deadline, so that a
hang fails the test instead of blocking the suite."""
import time

import pytest


def run_processes(worker, args: tuple, nprocs: int, deadline_s: float) -> None:
    """Run worker(rank, *args) in `nprocs` spawned processes; fail the calling test past deadline_s (the
    processes are killed)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} processes did not finish within {deadline_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
