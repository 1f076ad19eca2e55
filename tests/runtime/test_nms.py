import math
import warnings

import numpy as np
import pytest
import torch
import torchvision

from accel.runtime.nn.nms import _ops as nms_ops
from accel.runtime.nn.nms import (
    _soft_nms_reference,
    batched_soft_nms,
    batched_soft_nms_reference,
    nms,
    nms_normal,
    nms_reference,
    soft_nms,
    soft_nms_reference,
)
from accel.utils.xla import xla_available

from ._autograd_probe import LIBRARY, autograd_kernel, python_calls, ran
from ._params import DEVICES, NO_CUDA, tol

try:  # an independent soft-NMS implementation (numpy); a test dependency, see pyproject.toml
    import ensemble_boxes
    from ensemble_boxes.ensemble_boxes_nms import cpu_soft_nms_float
except ImportError:
    ensemble_boxes = None

needs_ensemble_boxes = pytest.mark.skipif(ensemble_boxes is None, reason="ensemble_boxes is not installed "
                                          "(pip install ensemble-boxes, part of the test extras)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)

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


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_nms_many_boxes_blocks_and_threads_match_torchvision(threads):
    # 20000 boxes: many 1024-box blocks, and the kept boxes of a block suppress the later ones in a
    # parallel pass; the result must not depend on the blocks or the thread count.
    boxes, scores = _boxes(20000, 3, spread=400.0), _scores(20000, 3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for thr in (0.3, 0.7):
            assert torch.equal(nms(boxes, scores, thr), _tv_nms(boxes, scores, thr)), thr
    finally:
        torch.set_num_threads(before)


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


@pytest.mark.parametrize("device", DEVICES)
def test_nms_nan_coordinates_match_torchvision(device):
    # a NaN coordinate makes the box's area, hence every IoU with it, NaN: it is kept, and neither
    # suppresses nor is suppressed by anything (NaN > thr is false), as in torchvision
    boxes, scores = _boxes(500, 4, spread=60.0, size=30.0), _scores(500, 4)
    for col in range(4):
        boxes[col::37, col] = float("nan")
    keep = nms(boxes.to(device), scores.to(device), 0.4).cpu()
    assert torch.equal(keep, _tv_nms(boxes, scores, 0.4))
    finite = ~boxes.isnan().any(1)
    assert set((~finite).nonzero().squeeze(1).tolist()) <= set(keep.tolist())
    # the NaN boxes change nothing for the others
    rows = finite.nonzero().squeeze(1)
    assert torch.equal(keep[finite[keep]], rows[nms(boxes[rows], scores[rows], 0.4)])


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


# ------------------------------------------------------------------ autograd in C++


@pytest.mark.parametrize("labelled", [False, True], ids=["soft", "batched"])
def test_soft_nms_autograd_is_cpp_and_not_differentiable(labelled):
    # nms_soft's autograd (not differentiable) is C++ (csrc/autograd/nms_autograd.cpp): a call with
    # scores that require grad runs no torch.library.register_autograd Python (torch/_library/), and
    # neither output requires grad. The kept boxes still carry gradients to dets, as a gather.
    dets = _dets(40, 6).requires_grad_()
    labels = (torch.arange(40) % 3) if labelled else None
    soft_nms(dets.detach())  # loads the kernels outside the profiled call
    assert "nms_autograd.cpp" in autograd_kernel("accel::nms_soft")
    (inds, new_scores), files = python_calls(
        lambda: torch.ops.accel.nms_soft(dets[:, :4], dets[:, 4], labels, 0.3, 0.5, 1e-3, 2))
    assert not ran(files, LIBRARY)
    assert not inds.requires_grad and not new_scores.requires_grad
    ref_inds, ref_scores = _soft_nms_reference(dets.detach()[:, :4], dets.detach()[:, 4], labels, 0.3, 0.5,
                                               1e-3, "gaussian")
    assert torch.equal(inds, ref_inds)
    torch.testing.assert_close(new_scores, ref_scores, rtol=1e-6, atol=1e-7)

    out, kept = soft_nms(dets, 0.3, 0.5, 1e-3, "gaussian")
    assert out.requires_grad
    out.sum().backward()
    expected = torch.zeros_like(dets)
    expected[kept, :4] = 1
    assert torch.equal(dets.grad, expected)
    _, scores = batched_soft_nms(dets[:, :4], dets[:, 4], torch.arange(40) % 3)
    assert not scores.requires_grad


# ------------------------------------------------------------------ ensemble_boxes as a soft-NMS peer
#
# What ensemble_boxes 1.0.9 (ensemble_boxes/ensemble_boxes_nms.py) computes, read from its source,
# against our (mmcv) semantics:
# - IoU: inter / (area_a + area_b - inter), no +1, like ours. It promotes the coordinates to
#   float64 (by concatenating an index column) and multiplies the y-extent by the x-extent: for
#   float64 boxes the same IoU as ours, bit for bit; for float32 boxes ours is computed in float32.
# - gaussian: exp(-iou^2 / sigma) for every box, as ours (a disjoint box gets exp(-0) = 1).
#   linear: 1 - iou only where iou > iou_thr (strict); mmcv and we use iou >= iou_thr.
#   method 3 is hard NMS (nms_float_fast: suppress iou > iou_thr, thresh ignored); our "naive"
#   zeroes iou >= iou_threshold and then drops the box (score 0 < min_score).
# - Threshold: it decays every box and keeps, at the end, those whose score is > thresh (strict);
#   we drop a box as soon as its score is < min_score (keep >=). The same boxes, away from a score
#   exactly equal to the threshold: scores only decrease, so a box below the threshold is selected
#   only after every box above it and decays none of them.
# - Ties: each round it keeps the box in the current position unless a later one is strictly
#   higher, so equal scores are broken by its swap history; ours by the lowest index. The inputs
#   below have distinct scores.
# - Output: per label (ascending), the kept boxes in selection order with their ORIGINAL scores;
#   the rescored ones are left in the score array cpu_soft_nms_float decays in place.
# - prepare_boxes clips coordinates to [0, 1] and drops zero-area boxes: the inputs below are
#   normalized boxes with positive area, which it passes through unchanged.
# Float64 results agree exactly for linear and to a couple of ulps for gaussian (numpy's exp vs
# libm's); float32 within float32 rounding (its scores are rounded to float32 after float64 decays).

EB_METHODS = {"linear": 1, "gaussian": 2}


def _unit_boxes(n, seed, device="cpu", dtype=torch.float64):
    """Normalized, crowded boxes with positive area, and distinct scores."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g, dtype=torch.float64) * 0.7
    wh = torch.rand(n, 2, generator=g, dtype=torch.float64) * 0.25 + 0.02
    scores = torch.rand(n, generator=g, dtype=torch.float64)
    return torch.cat([xy, xy + wh], 1).to(device, dtype), scores.to(device, dtype)


def _ensemble_rescored(boxes, scores, method, thr, sigma, thresh):
    """cpu_soft_nms_float: (kept indices, their rescored scores), both in selection order."""
    sc = scores.cpu().numpy().copy()
    keep = cpu_soft_nms_float(boxes.cpu().numpy().copy(), sc, Nt=thr, sigma=sigma, thresh=thresh,
                              method=EB_METHODS[method])
    # positions are selections; a position's score is final once selected, and non-increasing
    return torch.from_numpy(keep.astype(np.int64)), torch.from_numpy(sc[:len(keep)])


def _ensemble_public(boxes, scores, labels, code, thr, sigma, thresh):
    """ensemble_boxes.soft_nms on one model: (input indices, returned scores), label by label."""
    out_boxes, out_scores, out_labels = ensemble_boxes.soft_nms(
        [boxes.cpu().numpy()], [scores.cpu().numpy()], [labels.cpu().numpy()], method=code, iou_thr=thr,
        sigma=sigma, thresh=thresh)
    row_of = {tuple(r): i for i, r in enumerate(boxes.cpu().tolist())}
    inds = torch.tensor([row_of[tuple(r)] for r in out_boxes.tolist()], dtype=torch.int64)
    assert torch.equal(torch.from_numpy(out_labels).long(), labels.cpu()[inds])
    return inds, torch.from_numpy(out_scores)


@needs_ensemble_boxes
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", sorted(EB_METHODS))
def test_soft_nms_matches_ensemble_boxes_rescored_scores(device, method):
    for seed, (thr, sigma, low) in enumerate([(0.3, 0.5, 1e-3), (0.5, 0.2, 0.05), (0.1, 1.0, 0.3)]):
        boxes, scores = _unit_boxes(300, seed, device)
        out, inds = soft_nms(torch.cat([boxes, scores[:, None]], 1), thr, sigma, low, method)
        ref_inds, ref_scores = _ensemble_rescored(boxes, scores, method, thr, sigma, low)
        assert 50 < len(ref_inds) < 300, "the case should both keep and drop boxes"
        assert torch.equal(inds.cpu(), ref_inds), (seed, method)
        if method == "linear":  # the same float64 operations in the same order
            assert torch.equal(out[:, 4].cpu(), ref_scores)
        else:  # exp from numpy vs libm / CUDA: an ulp or two per decay, over chains of decays
            torch.testing.assert_close(out[:, 4].cpu(), ref_scores, rtol=1e-13, atol=0)


@needs_ensemble_boxes
def test_linear_threshold_inclusive_here_strict_in_ensemble_boxes():
    # IoU(A, B) = 50 / 150, exactly the float64 value of 1/3: at iou == iou_threshold we decay B
    # (mmcv's >=), ensemble_boxes does not (>)
    dets = _three_boxes(dtype=torch.float64)
    out, inds = soft_nms(dets, 1 / 3, method="linear", min_score=0.0)
    assert inds.tolist() == [0, 2, 1] and out[2, 4].item() == 0.8 * (1 - 1 / 3)
    ref_inds, ref_scores = _ensemble_rescored(dets[:, :4], dets[:, 4], "linear", 1 / 3, 0.5, 0.0)
    assert ref_inds.tolist() == [0, 1, 2] and ref_scores.tolist() == [0.9, 0.8, 0.6]
    # just above the threshold both decay
    ref_inds, _ = _ensemble_rescored(dets[:, :4], dets[:, 4], "linear", 1 / 3 - 1e-9, 0.5, 0.0)
    assert ref_inds.tolist() == [0, 2, 1]


@needs_ensemble_boxes
@pytest.mark.parametrize("device", DEVICES)
def test_soft_nms_float32_close_to_ensemble_boxes(device):
    # ensemble_boxes decays float32 scores with float64 IoUs; ours is float32 throughout
    boxes, scores = _unit_boxes(300, 5, device, torch.float32)
    for method in sorted(EB_METHODS):
        out, inds = soft_nms(torch.cat([boxes, scores[:, None]], 1), 0.3, 0.5, 0.01, method)
        ref_inds, ref_scores = _ensemble_rescored(boxes, scores, method, 0.3, 0.5, 0.01)
        assert torch.equal(inds.cpu(), ref_inds), method
        torch.testing.assert_close(out[:, 4].cpu(), ref_scores, rtol=2e-6, atol=0)


@needs_ensemble_boxes
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["linear", "gaussian", "naive"])
def test_batched_soft_nms_matches_ensemble_boxes_soft_nms(device, method):
    # naive with min_score below every score is hard NMS with iou >= thr, which is ensemble_boxes'
    # method 3 (iou > thr) for IoUs that never equal the threshold
    code, low = {"linear": (1, 0.05), "gaussian": (2, 0.05), "naive": (3, 1e-9)}[method]
    boxes, scores = _unit_boxes(400, 7, device)
    labels = torch.randint(0, 4, (400,), generator=torch.Generator().manual_seed(1)).to(device)
    inds, new_scores = batched_soft_nms(boxes, scores, labels, 0.4, 0.5, low, method)
    ref_inds, ref_scores = _ensemble_public(boxes, scores, labels, code, 0.4, 0.5, low)
    assert 100 < len(ref_inds) < 400
    # ours: one list by decreasing rescored score; theirs: label by label, each in selection order
    by_label = inds.cpu()[torch.sort(labels.cpu()[inds.cpu()], stable=True).indices]
    assert torch.equal(by_label, ref_inds), method
    # it returns the original scores of the kept boxes; ours are rescored, never higher
    assert torch.equal(ref_scores, scores.cpu()[ref_inds])
    assert bool((new_scores.cpu() <= scores.cpu()[inds.cpu()]).all())
    # one label: the same run through soft_nms
    if method != "naive":
        one = torch.zeros_like(labels)
        _, inds1 = soft_nms(torch.cat([boxes, scores[:, None]], 1), 0.4, 0.5, low, method)
        assert torch.equal(inds1.cpu(), _ensemble_public(boxes, scores, one, code, 0.4, 0.5, low)[0])


# ------------------------------------------------------------------ CUDA selects exactly what the CPU selects


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_kernels_equal_cpu_kernels(dtype):
    # Both kernels evaluate the same functions (csrc/nms_host.h): identical indices, and rescored
    # scores equal except where the device's and libm's double exp round a gaussian weight to
    # different floats (an exact value within ~1e-16 of a rounding boundary: rare, one ulp).
    # NaN coordinates exercise the min/max semantics; 4097 boxes end on a 1-box mask word.
    for seed, n in enumerate([63, 1000, 4097]):
        boxes, scores = _boxes(n, seed, dtype=dtype, spread=60.0, size=30.0), _scores(n, seed, dtype=dtype)
        boxes[::97, seed % 4] = float("nan")
        labels = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(seed))
        cuda = lambda t: t.to("cuda")  # noqa: E731
        assert torch.equal(nms(cuda(boxes), cuda(scores), 0.5).cpu(), nms(boxes, scores, 0.5))
        dets = torch.cat([boxes, scores[:, None]], 1)
        ulps = dict(rtol=1e-6, atol=0) if dtype == torch.float32 else dict(rtol=1e-12, atol=0)
        for method in METHODS:
            out_g, inds_g = soft_nms(cuda(dets), 0.3, 0.5, 0.01, method)
            out_c, inds_c = soft_nms(dets, 0.3, 0.5, 0.01, method)
            assert torch.equal(inds_g.cpu(), inds_c), (seed, method)
            torch.testing.assert_close(out_g.cpu(), out_c, **ulps, equal_nan=True)
            inds_g, s_g = batched_soft_nms(cuda(boxes), cuda(scores), cuda(labels), 0.3, 0.5, 0.01, method)
            inds_c, s_c = batched_soft_nms(boxes, scores, labels, 0.3, 0.5, 0.01, method)
            assert torch.equal(inds_g.cpu(), inds_c), (seed, method)
            torch.testing.assert_close(s_g.cpu(), s_c, **ulps)


@needs_cuda
def test_cuda_nms_more_mask_words_than_threads():
    # 70000 boxes: 1094 mask words, more than the keep kernel's 1024 threads, so each thread owns
    # several; crowded enough (about 1900 kept) that the CPU kernel takes well under a second
    n = 70000
    boxes, scores = _boxes(n, 3, spread=150.0, size=40.0), _scores(n, 3)
    keep = nms(boxes.cuda(), scores.cuda(), 0.1).cpu()
    assert 1000 < len(keep) < 5000 and torch.equal(keep, nms(boxes, scores, 0.1))


@needs_cuda
def test_cuda_ops_reject_inputs_on_another_device():
    # the op itself (not only the Python wrapper) refuses, instead of reading a host pointer
    ops = nms_ops()  # torch.ops.accel, with the nms kernels loaded
    boxes, scores = _boxes(10, 0).cuda(), _scores(10, 0)
    with pytest.raises(RuntimeError, match="scores must be on"):
        ops.nms(boxes, scores, 0.5)
    with pytest.raises(RuntimeError, match="scores must be on"):
        ops.nms_soft(boxes, scores, None, 0.3, 0.5, 1e-3, 1)
    with pytest.raises(RuntimeError, match="labels must be on"):
        ops.nms_soft(boxes, scores.cuda(), torch.zeros(10, dtype=torch.int64), 0.3, 0.5, 1e-3, 1)


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
    with pytest.raises(TypeError, match="boxes"):
        nms(boxes.long(), scores, 0.5)
    with pytest.raises(TypeError, match="boxes"):
        nms(boxes.tolist(), scores, 0.5)
    with pytest.raises(ValueError, match="scores"):
        nms(boxes, scores[:4], 0.5)
    with pytest.raises(ValueError, match="scores"):
        nms(boxes, scores[:, None], 0.5)
    with pytest.raises(TypeError, match="iou_threshold: expected a float, got str"):
        nms(boxes, scores, "0.5")
    with pytest.raises(TypeError, match="iou_threshold: expected a float, got NoneType"):
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
    with pytest.raises(TypeError, match="iou_threshold: expected a float, got list"):
        soft_nms(dets, iou_threshold=[0.3])
    with pytest.raises(ValueError, match="sigma"):
        soft_nms(dets, sigma=0.0, method="gaussian")
    with pytest.raises(TypeError, match="min_score: expected a float, got str"):
        soft_nms(dets, min_score="low")
    idxs = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="idxs"):
        batched_soft_nms(boxes, scores, idxs[:4])
    with pytest.raises(TypeError, match="idxs"):
        batched_soft_nms(boxes, scores, idxs.float())
    with pytest.raises(ValueError, match="idxs"):
        batched_soft_nms(boxes, scores, idxs.to("meta"))
    with pytest.raises(ValueError, match="method"):
        batched_soft_nms(boxes, scores, idxs, method="linear2")
    with pytest.raises(ValueError, match="scores"):
        batched_soft_nms(boxes, scores[:3], idxs)


ACCEPTED_METHODS = "'naive', 'linear', 'gaussian'"


@pytest.mark.parametrize("device", DEVICES)
def test_method_of_a_wrong_type_or_name_lists_the_accepted_ones(device):
    # Issue 11.10: method=[] said only "unhashable type: 'list'". A method that is no str is a TypeError,
    # an unknown name a ValueError (accel's rule, accel/utils/checks.py), both naming the argument and
    # the accepted methods, in the kernels' calls and in the references alike.
    dets = _dets(6, 0).to(device)
    boxes, scores, idxs = dets[:, :4], dets[:, 4], torch.zeros(6, dtype=torch.int64, device=device)
    calls = {
        "soft_nms": lambda m: soft_nms(dets, method=m),
        "batched_soft_nms": lambda m: batched_soft_nms(boxes, scores, idxs, method=m),
        "soft_nms_reference": lambda m: soft_nms_reference(dets, method=m),
        "batched_soft_nms_reference": lambda m: batched_soft_nms_reference(boxes, scores, idxs, method=m),
    }
    for name, call in calls.items():
        for bad in ([], ["linear"], {"linear": 1}, None, 1, 2.0, b"linear"):
            message = rf"method: expected a str, one of {ACCEPTED_METHODS}; got {type(bad).__name__}"
            with pytest.raises(TypeError, match=message):
                call(bad)
        for bad in ("cubic", "Linear", ""):
            with pytest.raises(ValueError, match=rf"method: expected one of {ACCEPTED_METHODS}, got '{bad}'"):
                call(bad)


def test_method_given_as_a_str_enum_member():
    # a str subclass names its method as the plain str does (taking the checked path, not the fast one)
    import enum

    class Method(str, enum.Enum):
        GAUSSIAN = "gaussian"

    dets = _dets(40, 3)
    out, inds = soft_nms(dets, method=Method.GAUSSIAN)
    ref_out, ref_inds = soft_nms(dets, method="gaussian")
    assert torch.equal(inds, ref_inds) and torch.equal(out, ref_out)


@pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")
def test_xla_tensors_go_to_the_host_kernel_once_and_back():
    # The reference's per-box loop traced on XLA compiled a graph per selected box (200 boxes did not
    # finish in 400 s); the host kernel takes one copy each way, whatever the box count.
    import torch_xla

    from accel.runtime.nn import nms as nms_module

    dev = torch_xla.device()
    boxes, scores = _boxes(300, 5), _scores(300, 5)
    dets = torch.cat([boxes, scores[:, None]], 1)
    nms_module._warned_host = False
    with pytest.warns(UserWarning, match="copied to the host and back"):
        keep = nms(boxes.to(dev), scores.to(dev), 0.5)
    assert keep.device.type == "xla" and torch.equal(keep.cpu(), _tv_nms(boxes, scores, 0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        out, inds = soft_nms(dets.to(dev), 0.3, method="linear")
        b_inds, b_scores = batched_soft_nms(boxes.to(dev), scores.to(dev), (torch.arange(300) % 3).to(dev))
    ref_out, ref_inds = soft_nms(dets, 0.3, method="linear")
    assert inds.device.type == "xla" and torch.equal(inds.cpu(), ref_inds)
    torch.testing.assert_close(out.cpu(), ref_out)
    ref_b_inds, ref_b_scores = batched_soft_nms(boxes, scores, torch.arange(300) % 3)
    assert torch.equal(b_inds.cpu(), ref_b_inds) and torch.equal(b_scores.cpu(), ref_b_scores)
