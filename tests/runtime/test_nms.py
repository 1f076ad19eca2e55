import math

import pytest
import torch
import torchvision

from accel.runtime.nn.nms import (batched_soft_nms, batched_soft_nms_reference, nms, nms_normal, nms_reference,
                                  soft_nms, soft_nms_reference)
from accel.utils.xla import xla_available

from ._params import DEVICES, tol

METHODS = ["linear", "gaussian", "naive"]


def _boxes(n, seed, device="cpu", dtype=torch.float32, spread=100.0, size=40.0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * spread
    wh = torch.rand(n, 2, generator=g) * size + 0.5
    return torch.cat([xy, xy + wh], 1).to(device=device, dtype=dtype)


def _scores(n, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.rand(n, generator=g).to(device=device, dtype=dtype)


def _dets(n, seed, device="cpu", dtype=torch.float32):
    return torch.cat([_boxes(n, seed), _scores(n, seed)[:, None]], 1).to(device=device, dtype=dtype)


def _tv_nms(boxes, scores, thr):
    """torchvision's CPU nms on the fp32 (or fp64) values of the inputs: the ground truth."""
    dt = torch.float64 if boxes.dtype == torch.float64 else torch.float32
    return torchvision.ops.nms(boxes.cpu().to(dt), scores.cpu().to(dt), thr)


# ------------------------------------------------------------------ nms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("thr", [0.0, 0.3, 0.5, 0.7, 1.0])
def test_nms_matches_torchvision_random_boxes(device, thr):
    for seed in range(8):
        n = [1, 2, 63, 64, 65, 257, 1000, 2000][seed]
        boxes, scores = _boxes(n, seed, device), _scores(n, seed, device)
        keep = nms(boxes, scores, thr)
        assert keep.dtype == torch.int64 and keep.device == boxes.device
        assert torch.equal(keep.cpu(), _tv_nms(boxes, scores, thr)), (seed, n)


@pytest.mark.parametrize("device", DEVICES)
def test_nms_matches_torchvision_tie_free_dense_clusters(device):
    # a small canvas makes most boxes overlap: long suppression chains across 64-box blocks
    for seed in range(5):
        n = 700 + 300 * seed
        boxes = _boxes(n, seed, device, spread=60.0, size=30.0)
        scores = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)).float() / n).to(device)
        for thr in (0.2, 0.45, 0.8):
            assert torch.equal(nms(boxes, scores, thr).cpu(), _tv_nms(boxes, scores, thr)), (seed, thr)


@pytest.mark.parametrize("device", DEVICES)
def test_nms_equal_scores_follow_input_order(device):
    # every score equal: the stable sort visits boxes in input order, like torchvision's CPU nms
    boxes = _boxes(300, 3, device, spread=50.0, size=20.0)
    scores = torch.ones(300, device=device)
    assert torch.equal(nms(boxes, scores, 0.3).cpu(), _tv_nms(boxes, scores, 0.3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_nms_other_dtypes_computed_in_float(device, dtype):
    for seed in range(3):
        boxes, scores = _boxes(500, seed, device, dtype), _scores(500, seed, device, dtype)
        assert torch.equal(nms(boxes, scores, 0.5).cpu(), _tv_nms(boxes, scores, 0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_nms_hand_computed(device):
    boxes = torch.tensor([[0, 0, 10, 10], [0, 5, 10, 15], [20, 20, 30, 30], [1, 1, 11, 11.]], device=device)
    scores = torch.tensor([0.9, 0.8, 0.6, 0.95], device=device)
    # IoU(0,1) = 50/150, IoU(3,0) = 81/119, IoU(3,1) = 54/146, box 2 is disjoint
    assert nms(boxes, scores, 0.5).tolist() == [3, 1, 2]
    assert nms(boxes, scores, 0.7).tolist() == [3, 0, 1, 2]
    assert nms(boxes, scores, 0.3).tolist() == [3, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_nms_non_contiguous_inputs(device):
    base = _dets(400, 5, device)
    boxes, scores = base[:, :4], base[:, 4]
    assert not boxes.is_contiguous() and not scores.is_contiguous()
    assert torch.equal(nms(boxes, scores, 0.5).cpu(), _tv_nms(boxes, scores, 0.5))


def test_nms_reference_matches_torchvision():
    for seed, thr in [(0, 0.5), (1, 0.3), (2, 0.7)]:
        boxes, scores = _boxes(300, seed), _scores(300, seed)
        assert torch.equal(nms_reference(boxes, scores, thr), _tv_nms(boxes, scores, thr))


@pytest.mark.parametrize("device", DEVICES)
def test_nms_normal_returns_kept_dets(device):
    dets = _dets(800, 7, device)
    kept, inds = nms_normal(dets, 0.4)
    assert torch.equal(inds.cpu(), _tv_nms(dets[:, :4], dets[:, 4], 0.4))
    assert torch.equal(kept, dets[inds])
    assert bool((kept[1:, 4] <= kept[:-1, 4]).all())


def test_nms_torch_compile_fullgraph():
    boxes, scores = _boxes(200, 1), _scores(200, 1)
    compiled = torch.compile(nms, fullgraph=True)
    # data-dependent output sizes need this Dynamo flag (torchvision's nms needs it too)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert torch.equal(compiled(boxes, scores, 0.5), _tv_nms(boxes, scores, 0.5))


# ------------------------------------------------------------------ soft-NMS


def _three_boxes(device="cpu", dtype=torch.float32):
    # IoU(A, B) = 50 / 150 = 1/3; C is disjoint from both.
    return torch.tensor([[0, 0, 10, 10, 0.9],
                         [0, 5, 10, 15, 0.8],
                         [20, 20, 30, 30, 0.6]], device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_soft_nms_hand_computed_three_boxes(device, impl):
    fn = soft_nms if impl == "kernel" else soft_nms_reference
    dets = _three_boxes(device, torch.float64)
    cases = [
        (dict(method="linear", iou_threshold=0.3), [0, 2, 1], [0.9, 0.6, 0.8 * (1 - 1 / 3)]),
        (dict(method="linear", iou_threshold=0.4), [0, 1, 2], [0.9, 0.8, 0.6]),
        (dict(method="gaussian", sigma=0.5), [0, 1, 2], [0.9, 0.8 * math.exp(-(1 / 9) / 0.5), 0.6]),
        (dict(method="naive", iou_threshold=0.3), [0, 2], [0.9, 0.6]),
        (dict(method="naive", iou_threshold=0.5), [0, 1, 2], [0.9, 0.8, 0.6]),
        # linear decay to 0.5333 falls below min_score 0.55: B is dropped
        (dict(method="linear", iou_threshold=0.3, min_score=0.55), [0, 2], [0.9, 0.6]),
        (dict(method="gaussian", min_score=0.7), [0], [0.9]),
    ]
    for kwargs, inds, scores in cases:
        out, got = fn(dets, **kwargs)
        assert got.tolist() == inds, kwargs
        expected = torch.tensor(scores, dtype=torch.float64, device=device)
        torch.testing.assert_close(out[:, 4], expected, rtol=1e-12, atol=1e-12)
        assert torch.equal(out[:, :4], dets[got, :4])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_soft_nms_matches_reference(device, method):
    for seed, (n, thr, sigma, low) in enumerate([(50, 0.3, 0.5, 1e-3), (200, 0.5, 0.3, 0.05),
                                                 (300, 0.2, 1.0, 1e-3), (130, 0.7, 0.5, 0.2)]):
        dets = _dets(n, seed, device)
        dets[:, :2] *= 0.4  # crowd the boxes so decays chain
        out, inds = soft_nms(dets, thr, sigma, low, method)
        ref_out, ref_inds = soft_nms_reference(dets.cpu(), thr, sigma, low, method)
        assert inds.dtype == torch.int64 and inds.device == dets.device
        assert torch.equal(inds.cpu(), ref_inds), (seed, method)
        torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-6, atol=1e-7)
        assert bool((out[:, 4] >= low).all())
        assert bool((out[1:, 4] <= out[:-1, 4]).all())  # selection order is decreasing score


def test_soft_nms_large_crowded_input_matches_reference():
    # 6000 boxes on a small canvas: rounds run in parallel chunks and dead boxes get compacted,
    # while strong decays keep the selections (and the Python reference) short
    n = 6000
    dets = torch.cat([_boxes(n, 21, spread=15.0, size=20.0), _scores(n, 21)[:, None]], 1)
    for method, kwargs in [("linear", dict(iou_threshold=0.3, min_score=0.05)),
                           ("gaussian", dict(sigma=0.1, min_score=0.05)), ("naive", dict(iou_threshold=0.3))]:
        out, inds = soft_nms(dets, method=method, **kwargs)
        ref_out, ref_inds = soft_nms_reference(dets, method=method, **kwargs)
        assert 100 < len(inds) < n and torch.equal(inds, ref_inds), method
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_soft_nms_half_precision_computed_in_float(device, dtype):
    dets = _dets(250, 11, device).to(dtype)
    out, inds = soft_nms(dets, 0.3, 0.5, 1e-3, "gaussian")
    ref_out, ref_inds = soft_nms_reference(dets.float().cpu(), 0.3, 0.5, 1e-3, "gaussian")
    assert out.dtype == dtype
    assert torch.equal(inds.cpu(), ref_inds)
    torch.testing.assert_close(out.cpu(), ref_out.to(dtype), **tol(dtype))


def test_soft_nms_float64_matches_reference():
    dets = _dets(200, 4, dtype=torch.float64)
    for method in METHODS:
        out, inds = soft_nms(dets, 0.3, 0.5, 1e-3, method)
        ref_out, ref_inds = soft_nms_reference(dets, 0.3, 0.5, 1e-3, method)
        assert out.dtype == torch.float64 and torch.equal(inds, ref_inds)
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_nms_naive_is_hard_nms_with_inclusive_threshold(device):
    # naive soft-NMS suppresses at iou >= thr, hard nms at iou > thr: equal away from equality
    dets = _dets(600, 12, device)
    out, inds = soft_nms(dets, 0.45, min_score=1e-6, method="naive")
    assert bool((dets[:, 4] >= 1e-6).all())
    assert torch.equal(inds.cpu(), _tv_nms(dets[:, :4], dets[:, 4], 0.45))
    assert torch.equal(out, dets[inds])


@pytest.mark.parametrize("device", DEVICES)
def test_soft_nms_ties_go_to_lowest_index(device):
    # four identical boxes with equal scores: the first is picked, the rest decay equally
    dets = torch.tensor([[0, 0, 4, 4, 0.5]] * 4, device=device)
    out, inds = soft_nms(dets, 0.3, method="linear", min_score=0.0)
    assert inds.tolist() == [0, 1, 2, 3]
    assert out[:, 4].tolist() == [0.5, 0.0, 0.0, 0.0]


# ------------------------------------------------------------------ batched soft-NMS


def _per_class_loop(boxes, scores, idxs, **kwargs):
    """soft_nms on each class, then merged by decreasing score, ties by index."""
    all_inds, all_scores = [], []
    for c in torch.unique(idxs):
        members = (idxs == c).nonzero().squeeze(1)
        dets = torch.cat([boxes[members], scores[members, None]], 1)
        out, inds = soft_nms(dets, **kwargs)
        all_inds.append(members[inds])
        all_scores.append(out[:, 4])
    inds, new_scores = torch.cat(all_inds), torch.cat(all_scores)
    order = sorted(range(len(inds)), key=lambda k: (-float(new_scores[k]), int(inds[k])))
    return inds[order], new_scores[order]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_batched_soft_nms_equals_per_class_soft_nms(device, method):
    for seed in range(3):
        n = 400
        boxes, scores = _boxes(n, seed, device, spread=60.0), _scores(n, seed, device)
        idxs = torch.randint(0, 5, (n,), generator=torch.Generator().manual_seed(seed)).to(device)
        kwargs = dict(iou_threshold=0.4, sigma=0.5, min_score=0.01, method=method)
        inds, new_scores = batched_soft_nms(boxes, scores, idxs, 0.4, 0.5, 0.01, method)
        ref_inds, ref_scores = _per_class_loop(boxes, scores, idxs, **kwargs)
        assert torch.equal(inds, ref_inds), (seed, method)
        torch.testing.assert_close(new_scores, ref_scores, rtol=0, atol=0)
        # classes matter: class-agnostic soft-NMS keeps different scores
        _, agnostic = soft_nms(torch.cat([boxes, scores[:, None]], 1), **kwargs)
        assert not torch.equal(agnostic, inds)


def test_batched_soft_nms_reference_matches_kernel():
    boxes, scores = _boxes(150, 2, spread=50.0), _scores(150, 2)
    idxs = torch.randint(0, 3, (150,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    for method in METHODS:
        inds, s = batched_soft_nms(boxes, scores, idxs, method=method)
        ref_inds, ref_s = batched_soft_nms_reference(boxes, scores, idxs, method=method)
        assert torch.equal(inds, ref_inds)
        torch.testing.assert_close(s, ref_s, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_batched_soft_nms_disjoint_classes_of_identical_boxes(device):
    # the same box in three classes: nothing interacts, all kept with their own scores
    boxes = torch.tensor([[0, 0, 10, 10.]] * 3, device=device)
    scores = torch.tensor([0.3, 0.9, 0.6], device=device)
    inds, s = batched_soft_nms(boxes, scores, torch.tensor([0, 1, 2], device=device), method="naive")
    assert inds.tolist() == [1, 2, 0]
    assert s.tolist() == pytest.approx([0.9, 0.6, 0.3])
    inds, _ = batched_soft_nms(boxes, scores, torch.tensor([0, 0, 2], device=device), method="naive")
    assert inds.tolist() == [1, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_batched_soft_nms_keeps_scores_dtype(device):
    boxes = _boxes(100, 9, device, torch.float16)
    scores = _scores(100, 9, device, torch.float32)
    idxs = torch.zeros(100, dtype=torch.int64, device=device)
    inds, s = batched_soft_nms(boxes, scores, idxs)
    assert s.dtype == torch.float32 and inds.dtype == torch.int64
    ref_inds, ref_s = batched_soft_nms_reference(boxes.float().cpu(), scores.cpu(), idxs.cpu())
    assert torch.equal(inds.cpu(), ref_inds)
    torch.testing.assert_close(s.cpu(), ref_s, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ empty input, compile, bad input


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_empty_inputs(device, dtype):
    boxes = torch.empty(0, 4, device=device, dtype=dtype)
    scores = torch.empty(0, device=device, dtype=dtype)
    keep = nms(boxes, scores, 0.5)
    assert keep.shape == (0,) and keep.dtype == torch.int64
    kept, inds = nms_normal(torch.empty(0, 5, device=device, dtype=dtype), 0.5)
    assert kept.shape == (0, 5) and kept.dtype == dtype and inds.shape == (0,)
    for method in METHODS:
        out, inds = soft_nms(torch.empty(0, 5, device=device, dtype=dtype), method=method)
        assert out.shape == (0, 5) and out.dtype == dtype and inds.shape == (0,) and inds.dtype == torch.int64
        inds, s = batched_soft_nms(boxes, scores, torch.empty(0, dtype=torch.int64, device=device), method=method)
        assert inds.shape == (0,) and inds.dtype == torch.int64 and s.shape == (0,) and s.dtype == dtype
    out, inds = soft_nms_reference(torch.empty(0, 5, dtype=dtype))
    assert out.shape == (0, 5) and inds.shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_all_scores_below_min_score_keep_nothing(device):
    dets = _dets(20, 1, device)
    dets[:, 4] *= 1e-4
    out, inds = soft_nms(dets, min_score=1e-3)
    assert out.shape == (0, 5) and inds.shape == (0,)


def test_soft_nms_torch_compile_fullgraph():
    dets = _dets(120, 3)
    compiled = torch.compile(soft_nms, fullgraph=True)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out, inds = compiled(dets, 0.3, 0.5, 1e-3, "gaussian")
    ref_out, ref_inds = soft_nms_reference(dets, 0.3, 0.5, 1e-3, "gaussian")
    assert torch.equal(inds, ref_inds)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-7)


def test_bad_input_names_argument():
    boxes, scores = _boxes(5, 0), _scores(5, 0)
    with pytest.raises(ValueError, match="boxes"):
        nms(boxes[:, :3], scores, 0.5)
    with pytest.raises(ValueError, match="boxes"):
        nms(boxes.long(), scores, 0.5)
    with pytest.raises(ValueError, match="boxes"):
        nms(boxes.tolist(), scores, 0.5)
    with pytest.raises(ValueError, match="scores"):
        nms(boxes, scores[:4], 0.5)
    with pytest.raises(ValueError, match="scores"):
        nms(boxes, scores[:, None], 0.5)
    with pytest.raises(ValueError, match="iou_threshold"):
        nms(boxes, scores, "0.5")
    with pytest.raises(ValueError, match="iou_threshold"):
        nms(boxes, scores, None)
    with pytest.raises(ValueError, match="iou_threshold"):
        nms(boxes, scores, float("nan"))
    with pytest.raises(ValueError, match="scores"):
        nms(boxes, scores.to("meta"), 0.5)
    dets = _dets(5, 0)
    with pytest.raises(ValueError, match="dets"):
        nms_normal(dets[:, :4], 0.5)
    with pytest.raises(ValueError, match="dets"):
        soft_nms(dets[:, :4])
    with pytest.raises(ValueError, match="method"):
        soft_nms(dets, method="cubic")
    with pytest.raises(ValueError, match="iou_threshold"):
        soft_nms(dets, iou_threshold=[0.3])
    with pytest.raises(ValueError, match="sigma"):
        soft_nms(dets, sigma=0.0, method="gaussian")
    with pytest.raises(ValueError, match="min_score"):
        soft_nms(dets, min_score="low")
    idxs = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="idxs"):
        batched_soft_nms(boxes, scores, idxs[:4])
    with pytest.raises(ValueError, match="idxs"):
        batched_soft_nms(boxes, scores, idxs.float())
    with pytest.raises(ValueError, match="idxs"):
        batched_soft_nms(boxes, scores, idxs.to("meta"))
    with pytest.raises(ValueError, match="method"):
        batched_soft_nms(boxes, scores, idxs, method="linear2")
    with pytest.raises(ValueError, match="scores"):
        batched_soft_nms(boxes, scores[:3], idxs)


@pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed; the XLA path is the PyTorch reference")
def test_xla_tensors_take_the_reference_path():
    import torch_xla

    dev = torch_xla.device()
    dets = torch.cat([_three_boxes(), torch.tensor([[1, 1, 11, 11, 0.95]])])
    keep = nms(dets[:, :4].to(dev), dets[:, 4].to(dev), 0.5)
    assert keep.device.type == "xla" and keep.cpu().tolist() == nms(dets[:, :4], dets[:, 4], 0.5).tolist()
    out, inds = soft_nms(dets.to(dev), 0.3, method="linear")
    ref_out, ref_inds = soft_nms(dets, 0.3, method="linear")
    assert torch.equal(inds.cpu(), ref_inds)
    torch.testing.assert_close(out.cpu(), ref_out)
