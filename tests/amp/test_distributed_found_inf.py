"""With torch.distributed (world size 2, gloo), an overflow on one replica skips the step on all."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from . import _dist_worker


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_overflow_on_one_replica_skips_every_replica(tmp_path):
    mp.spawn(_dist_worker.run, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    # Both replicas back off at step 1 (found_inf summed over replicas), and agree on the scale.
    assert r0["scales"] == r1["scales"] == [8.0, 4.0, 4.0]
    for r in (r0, r1):
        w = r["weights"]
        assert torch.equal(w[1], w[0])  # step 1 skipped on this replica, both optimizers
        assert not torch.equal(w[2], w[1])  # step 2 applied
