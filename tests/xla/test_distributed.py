"""Two processes under xlarun/torchrun with the "xla" process group on CPU PJRT.

Each rank writes what it saw to a JSON file; the expected values are computed here by hand
or with plain torch. Rank r contributes r + 1, so a true sum is 3 where a silently local
result would be 1 or 2.
"""
import json
import os

import pytest
import torch

pytest.importorskip("torch_xla", reason="torch_xla is not installed")

from ._helpers import HERE, free_port, run_python  # noqa: E402

WORKER = os.path.join(HERE, "_dist_worker.py")
ENV = {"PJRT_DEVICE": "CPU"}


def _launch(out_dir, launcher, init_method, mode):
    run_python(
        ["-m", launcher, "--nproc_per_node=2", f"--master_port={free_port()}", WORKER, str(out_dir), init_method, mode],
        env_extra=ENV,
        drop_env=("CPU_NUM_DEVICES", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"),
        timeout=300,
    )
    ranks = []
    for r in range(2):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("xla_dist")
    return out, _launch(out, "accel.launch", "env://", "full")


@pytest.mark.slow
def test_topology_comes_from_the_process_group(full_run):
    _, ranks = full_run
    for r, res in enumerate(ranks):
        assert res["backend_name"] == "xla"
        assert res["staging_warned"]  # the slow host path says so
        assert (res["world_size"], res["xrt_world_size"], res["ordinal"], res["local_ordinal"]) == (2, 2, r, r)
        assert res["is_master"] == (r == 0)


@pytest.mark.slow
def test_gather_for_metrics_over_the_xla_group(full_run):
    _, ranks = full_run
    for res in ranks:
        assert res["gather_for_metrics"] == list(range(11))  # each sample once, the repeat dropped


@pytest.mark.slow
def test_torch_distributed_collectives_are_cross_process(full_run):
    _, ranks = full_run
    for r, res in enumerate(ranks):
        assert res["all_reduce_sum"] == [3.0, 30.0]
        assert res["all_reduce_max"] == [3.0] and res["all_reduce_min"] == [2.0]
        assert res["all_reduce_product"] == [6.0] and res["all_reduce_avg"] == [1.5]
        assert res["all_gather"] == [[0.0, 0.5], [1.0, 1.5]]
        assert res["all_gather_into_tensor"] == [0.0, 1.0, 10.0, 11.0]
        assert res["broadcast_from_1"] == [8.0]
        assert res["cpu_all_reduce"] == [3.0]
    # reduce_scatter: sum over ranks of arange(4) * (r + 1) = arange(4) * 3, split in halves.
    assert ranks[0]["reduce_scatter_tensor"] == [0.0, 3.0]
    assert ranks[1]["reduce_scatter_tensor"] == [6.0, 9.0]
    # list form: rank 0 gets 1 + 2, rank 1 gets 10 + 20.
    assert ranks[0]["reduce_scatter_list"] == [3.0] and ranks[1]["reduce_scatter_list"] == [30.0]
    for res in ranks:
        assert res["all_gather_object"] == [{"rank": 0}, {"rank": 1}]


@pytest.mark.slow
def test_scatter_gather_and_all_to_all_move_xla_tensors(full_run):
    _, ranks = full_run
    for r, res in enumerate(ranks):
        assert res["scatter_from_0"] == [0.0 + r, -1.0]  # root src sends [src * 10 + r, -1] to rank r
        assert res["scatter_from_1"] == [10.0 + r, -1.0]
    assert ranks[0]["gather_to_0"] == [[1.0, 2.0], [11.0, 12.0]]
    assert ranks[1]["gather_to_0"] is None
    # rank r's input is arange(4) + 10 r; rank i gets elements 2i, 2i + 1 of each.
    assert ranks[0]["all_to_all_single_even"] == [0.0, 1.0, 10.0, 11.0]
    assert ranks[1]["all_to_all_single_even"] == [2.0, 3.0, 12.0, 13.0]
    # rank r's input rows are [10r, 10r + 1], [10r + 2, ...], [10r + 4, ...]; splits 1/2 and 3/0.
    assert ranks[0]["all_to_all_single_uneven"] == [[0.0, 1.0], [10.0, 11.0], [12.0, 13.0], [14.0, 15.0]]
    assert ranks[1]["all_to_all_single_uneven"] == [[2.0, 3.0], [4.0, 5.0]]
    # rank r sends i + 1 copies of 10r + i to rank i.
    assert ranks[0]["all_to_all"] == [[0.0], [10.0]]
    assert ranks[1]["all_to_all"] == [[1.0, 1.0], [11.0, 11.0]]


@pytest.mark.slow
def test_point_to_point_moves_xla_tensors(full_run):
    _, ranks = full_run
    assert ranks[1]["recv"] == [5.0, 6.0]
    assert ranks[1]["recv_any"] == [7.0] and ranks[1]["recv_any_sender"] == 0
    for r, res in enumerate(ranks):
        peer = 1 - r
        assert res["batch_isend_irecv"] == [peer * 10.0, 1.0]
        assert res["isend_irecv"] == [peer + 100.0]


@pytest.mark.slow
def test_object_collectives(full_run):
    _, ranks = full_run
    for r, res in enumerate(ranks):
        assert res["broadcast_object_list"] == [{"from": 0, "x": [1, 2]}, "second"]
        assert res["broadcast_object_list_xla"] == [4]  # rank 1's 1 * 3 + 1
        assert res["scatter_object_list"] == {"to": r}
    assert ranks[0]["gather_object"] == [{"rank": 0, "sq": 0}, {"rank": 1, "sq": 1}]
    assert ranks[1]["gather_object"] is None


@pytest.mark.slow
def test_accel_all_reduce_semantics_across_processes(full_run):
    _, ranks = full_run
    for r, res in enumerate(ranks):
        assert res["xm_all_reduce_list"] == [[1.5, 1.5], [1.5]]  # (1 + 2) / 2 and (0 + 3) / 2, in place
        assert res["xm_all_reduce_single"] == [[2.0], [r + 1.0]]  # returned; the input is untouched
        assert res["xm_all_reduce_mul"] == [6.0, 0.0]
        assert res["xm_all_reduce_min"] == [2.0, -1.0]
        assert res["xm_all_reduce_max"] == [3.0, 0.0]
        assert res["xm_all_reduce_and"] == [True, False, False]
        assert res["xm_all_reduce_or"] == [True, True, False]
        assert res["xm_all_reduce_own_group"] == [r + 1.0]  # groups=[[0], [1]]: each rank alone
        assert res["rendezvous"] == ["hello0", "hello1"]


@pytest.mark.slow
def test_gradients_are_averaged_and_steps_agree(full_run):
    out, ranks = full_run
    assert ranks[0]["init_weight"] == ranks[1]["init_weight"]  # set_rng_state: same init everywhere
    local = [[torch.tensor(g) for g in res["local_grads"]] for res in ranks]
    assert not torch.equal(local[0][0], local[1][0])  # different data, so averaging matters
    mean = [(a + b) / 2 for a, b in zip(*local)]
    for res in ranks:
        for got, want in zip(res["reduced_grads"], mean):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-6, atol=1e-7)
    # SGD(lr=0.1) from the shared init with the mean gradient, computed with plain torch.
    ref = torch.nn.Linear(3, 2)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(ranks[0]["init_weight"]))
        ref.bias.zero_()
    expected_w = ref.weight - 0.1 * mean[0]
    for res in ranks:
        torch.testing.assert_close(torch.tensor(res["after_step"][0]), expected_w, rtol=1e-6, atol=1e-6)
        assert res["after_step"] == ranks[0]["after_step"]
    ckpt = torch.load(out / "ckpt.pt")
    assert ckpt["rank"] == 0  # only the master wrote
    torch.testing.assert_close(ckpt["w"], torch.tensor(ranks[0]["after_step"][0]))


@pytest.mark.slow
def test_xla_init_method_under_plain_torchrun(tmp_path):
    ranks = _launch(tmp_path, "torch.distributed.run", "xla://", "quick")
    for r, res in enumerate(ranks):
        assert (res["world_size"], res["ordinal"]) == (2, r)
        assert res["all_reduce_sum"] == [3.0, 30.0]
