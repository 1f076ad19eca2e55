"""HostStagedProcessGroup's data-movement methods on CPU tensors, two ranks as two threads.

No processes and no XLA here: the group is built directly over an in-memory store, so every
argument check, split and dtype path runs in milliseconds. XLA tensors and the dispatch from
``dist.<fn>`` are covered by the 2-process run in test_distributed.py. Expected values are
written out by hand (rank r contributes numbers starting at 10 * r).
"""
import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from accel.xla.backend import HostStagedProcessGroup

TIMEOUT = datetime.timedelta(seconds=20)  # a deadlock fails the test instead of hanging it


def run_ranks(fn, size=2):
    """Run fn(pg, rank) on ``size`` threads, one rank each; return their results in rank order."""
    store = dist.HashStore()
    results, errors = [None] * size, []

    def body(rank):
        try:
            results[rank] = fn(HostStagedProcessGroup(store, rank, size, TIMEOUT), rank)
        except BaseException as e:  # re-raised on the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank is still blocked"
    if errors:
        raise errors[0]
    return results


def test_scatter_from_either_root_and_in_dtypes_gloo_lacks():
    def fn(pg, rank):
        got = {}
        for root in (0, 1):
            for dtype in (torch.float32, torch.int16, torch.bool):
                out = torch.zeros(2, dtype=dtype)
                inputs = []
                if rank == root:
                    inputs = [[torch.tensor([root * 10 + i, 1], dtype=dtype) for i in range(2)]]
                opts = dist.ScatterOptions()
                opts.rootRank = root
                assert pg.scatter([out], inputs, opts).is_completed()
                got[root, dtype] = out.tolist()
        return got

    ranks = run_ranks(fn)
    for r in range(2):
        assert ranks[r][0, torch.float32] == [float(r), 1.0]
        assert ranks[r][1, torch.float32] == [10.0 + r, 1.0]
        assert ranks[r][1, torch.int16] == [10 + r, 1]
        assert ranks[r][0, torch.bool] == [r == 1, True]  # bool(0 * 10 + r)


def test_gather_to_root_leaves_other_ranks_alone():
    def fn(pg, rank):
        opts = dist.GatherOptions()
        opts.rootRank = 1
        outs = [[torch.zeros(2, 2, dtype=torch.int16) for _ in range(2)]] if rank == 1 else []
        src = torch.tensor([[rank * 10, 1], [2, 3]], dtype=torch.int16).t()  # non-contiguous input
        pg.gather(outs, [src], opts)
        return [o.tolist() for o in outs[0]] if outs else None

    ranks = run_ranks(fn)
    assert ranks[0] is None
    assert ranks[1] == [[[0, 2], [1, 3]], [[10, 2], [1, 3]]]


def test_all_to_all_single_even_uneven_and_empty_splits():
    def fn(pg, rank):
        even_out = torch.zeros(4)
        pg.alltoall_base(even_out, torch.arange(4.0) + 10 * rank, [], [])
        # Rows of 2: rank 0 keeps none of its 3 rows and sends all 3 to rank 1;
        # rank 1 keeps 1 row and sends 2 to rank 0.
        rows = {0: 3, 1: 3}[rank]
        inp = (torch.arange(rows * 2.0) + 10 * rank).reshape(rows, 2)
        in_splits = {0: [0, 3], 1: [2, 1]}[rank]
        out_splits = {0: [0, 2], 1: [3, 1]}[rank]
        uneven_out = torch.full((sum(out_splits), 2), -1.0)
        pg.alltoall_base(uneven_out, inp, out_splits, in_splits)
        # Rank 0 sends no rows at all (an expert with no tokens); rank 1 sends it one row of 3.
        none_in = torch.zeros(0, 3) if rank == 0 else torch.full((1, 3), 7.0)
        none_out = torch.full((1 - rank, 3), -1.0)
        pg.alltoall_base(none_out, none_in, [0, 1] if rank == 0 else [0, 0], [0, 0] if rank == 0 else [1, 0])
        return even_out.tolist(), uneven_out.tolist(), none_out.tolist()

    ranks = run_ranks(fn)
    assert ranks[0][0] == [0.0, 1.0, 10.0, 11.0]
    assert ranks[1][0] == [2.0, 3.0, 12.0, 13.0]
    assert ranks[0][1] == [[10.0, 11.0], [12.0, 13.0]]  # rank 1's first two rows
    assert ranks[1][1] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [14.0, 15.0]]
    assert ranks[0][2] == [[7.0, 7.0, 7.0]] and ranks[1][2] == []


def test_all_to_all_lists_of_different_shapes():
    def fn(pg, rank):
        # rank r sends (i + 1) elements to rank i; it receives (r + 1) from each.
        inputs = [torch.full((i + 1,), 10.0 * rank + i) for i in range(2)]
        outputs = [torch.zeros(rank + 1) for _ in range(2)]
        pg.alltoall(outputs, inputs)
        return [o.tolist() for o in outputs]

    ranks = run_ranks(fn)
    assert ranks[0] == [[0.0], [10.0]]
    assert ranks[1] == [[1.0, 1.0], [11.0, 11.0]]


def test_send_recv_and_any_source_report_the_sender():
    def fn(pg, rank):
        if rank == 0:
            pg.send([torch.tensor([7.0, 8.0])], 1, 0).wait()
            pg.send([torch.tensor([9], dtype=torch.int16)], 1, 3).wait()
            return None
        a = torch.zeros(2)
        pg.recv([a], 0, 0).wait()
        b = torch.zeros(1, dtype=torch.int16)
        work = pg.recv_anysource([b], 3)
        work.wait()
        return a.tolist(), b.tolist(), work._source_rank()

    assert run_ranks(fn)[1] == ([7.0, 8.0], [9], 0)


def test_receives_posted_before_sends_do_not_deadlock():
    # gloo's send completes only once the peer has posted its receive, so both ranks posting
    # irecv first only works if receives stay in flight after they return.
    def fn(pg, rank):
        peer = 1 - rank
        target = torch.zeros(3, 2).t()  # non-contiguous: received through a host buffer
        recv_work = pg.recv([target], peer, 0)
        send_work = pg.send([torch.tensor([[rank * 10.0, 1], [2, 3], [4, 5]]).t().contiguous()], peer, 0)
        send_work.wait()
        recv_work.wait()
        return target.tolist(), recv_work.is_completed(), recv_work.get_future().value()[0] is target

    ranks = run_ranks(fn)
    for r in range(2):
        peer = 1 - r
        assert ranks[r] == ([[peer * 10.0, 2.0, 4.0], [1.0, 3.0, 5.0]], True, True)


def test_strided_cpu_inputs_travel_as_their_values():
    # Views whose last stride is not 1 cannot be reinterpreted as bytes in place: their bytes are copied.
    def fn(pg, rank):
        base = torch.arange(12.0).reshape(3, 4) + 100 * rank  # rank r: rows [100r + 4i .. 100r + 4i + 3]
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        scattered = torch.zeros(3)
        pg.scatter([scattered], [[base[:, 0], base[:, 1]]] if rank == 0 else [], opts)  # columns of rank 0
        a2a = torch.zeros(4, 3)
        pg.alltoall_base(a2a, base.t(), [], [])  # rows of base.t() are base's columns
        got = torch.zeros(2)
        if rank == 0:
            pg.send([base[0, ::2]], 1, 0).wait()
        else:
            pg.recv([got], 0, 0).wait()
        return scattered.tolist(), a2a.tolist(), got.tolist()

    ranks = run_ranks(fn)
    assert ranks[0][0] == [0.0, 4.0, 8.0] and ranks[1][0] == [1.0, 5.0, 9.0]
    # rank r gets columns 2r, 2r + 1 of rank 0's base, then the same columns of rank 1's.
    assert ranks[0][1] == [[0.0, 4.0, 8.0], [1.0, 5.0, 9.0], [100.0, 104.0, 108.0], [101.0, 105.0, 109.0]]
    assert ranks[1][1] == [[2.0, 6.0, 10.0], [3.0, 7.0, 11.0], [102.0, 106.0, 110.0], [103.0, 107.0, 111.0]]
    assert ranks[1][2] == [0.0, 2.0]


def test_bad_arguments_raise_value_error_naming_them():
    def fn(pg, rank):
        with pytest.raises(ValueError, match="input_split_sizes"):
            pg.alltoall_base(torch.zeros(3), torch.zeros(3), [], [1, 1])
        with pytest.raises(ValueError, match="output_split_sizes"):
            pg.alltoall_base(torch.zeros(3), torch.zeros(4), [2, 2], [])
        with pytest.raises(ValueError, match=r"input.shape\[0\]=3 must divide"):
            pg.alltoall_base(torch.zeros(4), torch.zeros(3), [], [])
        with pytest.raises(ValueError, match="at least one dimension"):
            pg.alltoall_base(torch.zeros(2), torch.tensor(1.0), [], [])
        with pytest.raises(ValueError, match="rows of the same size"):
            pg.alltoall_base(torch.zeros(2, 3), torch.zeros(2, 2), [], [])
        with pytest.raises(ValueError, match="output_tensor_list"):
            pg.alltoall([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)])
        opts = dist.ScatterOptions()
        opts.rootRank = rank
        with pytest.raises(ValueError, match="scatter_list must hold world_size=2"):
            pg.scatter([torch.zeros(1)], [[torch.zeros(1)]], opts)
        with pytest.raises(ValueError, match=r"scatter_list\[1\] must have 1 elements"):
            pg.scatter([torch.zeros(1)], [[torch.zeros(1), torch.zeros(2)]], opts)
        gopts = dist.GatherOptions()
        gopts.rootRank = rank
        with pytest.raises(ValueError, match=r"gather_list\[0\] must have 2 elements of torch.float32"):
            pg.gather([[torch.zeros(2, dtype=torch.int64), torch.zeros(2)]], [torch.zeros(2)], gopts)
        with pytest.raises(ValueError, match="tensors must hold exactly one"):
            pg.send([torch.zeros(1), torch.zeros(1)], 1 - rank, 0)
        return True

    # No rank reaches gloo, so nothing waits on the other: each check is local.
    assert run_ranks(fn) == [True, True]
