"""Non-maximum suppression: nms, nms_normal, soft_nms, batched_soft_nms.

CPU and CUDA tensors run the kernels in csrc/{cpu,cuda}/nms.*; tensors on other devices (XLA) go to the
host for the CPU kernel and come back (one copy each way, said once: see _to_host). The plain PyTorch
references below are the tests' ground truth. Half and bfloat16 boxes are computed in float32, float64 in float64.

Conventions (shared by kernels and references):
- Boxes are (x1, y1, x2, y2); area = (x2 - x1) * (y2 - y1), no +1 (torchvision, and mmcv's
  default offset=0); IoU = inter / ((area_a + area_b) - inter).
- `nms` is torchvision.ops.nms: visit by decreasing score (stable: equal scores in input order),
  suppress boxes with IoU > iou_threshold.
- `soft_nms` follows mmcv.ops.soft_nms (mmcv/ops/csrc/pytorch/cpu/nms.cpp, offset=0): pick the live
  box with the highest current score, then decay the others:
      naive:    s = 0           if iou >= iou_threshold   (hard NMS)
      linear:   s *= 1 - iou    if iou >= iou_threshold
      gaussian: s *= exp(-iou**2 / sigma)
  Note mmcv compares `>=` for soft-NMS (but `>` for its hard nms); we do the same. A box whose score
  is below min_score is dropped. Two deliberate differences from mmcv's CPU loop, both only in
  corner cases: ties between equal current scores go to the lowest input index (mmcv's choice
  depends on its swap history), and a box whose *initial* score is below min_score is dropped even
  when it is the top box (mmcv never checks the first box it picks, so it returns one box when all
  scores are below min_score; we return none).
- `batched_soft_nms` runs soft_nms per class: boxes of different classes never interact (the CPU
  kernel runs the classes as separate loops, in parallel; the CUDA kernel runs one loop that skips
  cross-class pairs; no coordinate-offset trick, so no precision is lost). It returns the kept boxes
  ordered by decreasing rescored score, ties by input index, which is exactly the order in which
  one greedy loop over all classes selects them.
- The CPU and CUDA kernels share their arithmetic (csrc/nms_host.h) and select the same boxes.
  Gaussian weights are exp in double rounded to float on both, so float32 scores agree bit for bit
  (barring an exact value within ~1e-16 of a float rounding boundary; float64: within an ulp).
- ensemble_boxes.soft_nms (an independent numpy implementation, compared in tests/runtime/test_nms.py)
  computes the same IoU and gaussian decay; its linear method decays iou > iou_thr (strict), its
  method 3 is hard NMS, it keeps final scores > thresh (strict), breaks ties by swap history, and
  returns the kept boxes' original scores, class by class, rather than the rescored ones.

Not differentiable (as mmcv's and torchvision's NMS): the rescored scores never require grad, and
the kept boxes that soft_nms returns carry gradients to dets only as a gather (index_select).

torch.compile: the ops have fake kernels with a data-dependent output size, so fullgraph=True works
with `torch._dynamo.config.capture_dynamic_output_shape_ops = True`, as for torchvision.ops.nms.
The CUDA soft-NMS is one thread block looping over selections: fine up to tens of thousands of
boxes, not meant for millions.
"""
from __future__ import annotations

import warnings

import torch

from accel.runtime import _build
from accel.runtime.nn._common import FLOAT_DTYPES, check_same_device, check_tensor, use_kernel
from accel.utils.checks import check_float

METHODS = {"naive": 0, "linear": 1, "gaussian": 2}
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


# ------------------------------------------------------------------ argument checks


def _check_number(name: str, value) -> float:
    return check_float(name, value, allow_inf=True)


def _check_boxes_scores(boxes, scores) -> None:
    check_tensor("boxes", boxes, dtypes=FLOAT_DTYPES)
    if boxes.dim() != 2 or boxes.size(1) != 4:
        raise ValueError(f"boxes: expected shape [N, 4] (x1, y1, x2, y2), got {tuple(boxes.shape)}")
    check_tensor("scores", scores, dtypes=FLOAT_DTYPES)
    if scores.dim() != 1 or scores.size(0) != boxes.size(0):
        raise ValueError(f"scores: expected shape [N] with N = {boxes.size(0)} (the boxes), "
                         f"got {tuple(scores.shape)}")
    check_same_device(boxes=boxes, scores=scores)


def _check_dets(dets) -> None:
    check_tensor("dets", dets, dtypes=FLOAT_DTYPES)
    if dets.dim() != 2 or dets.size(1) != 5:
        raise ValueError(f"dets: expected shape [N, 5] (x1, y1, x2, y2, score), got {tuple(dets.shape)}")


def _check_method(method) -> int:
    """The kernels' code for a method named by a str (a str subclass such as a StrEnum member too):
    TypeError for anything else, whose lookup in METHODS could itself fail (an unhashable list said
    only "unhashable type: 'list'"), ValueError for an unknown name."""
    accepted = ", ".join(map(repr, METHODS))
    if not isinstance(method, str):
        raise TypeError(f"method: expected a str, one of {accepted}; got {type(method).__name__} {method!r}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {accepted}, got {method!r}")
    return METHODS[method]


def _check_soft_args(iou_threshold, sigma, min_score, method):
    code = _check_method(method)
    thr = _check_number("iou_threshold", iou_threshold)
    sig = _check_number("sigma", sigma)
    if code == METHODS["gaussian"] and sig <= 0:
        raise ValueError(f"sigma: expected > 0 for the gaussian method, got {sig}")
    low = _check_number("min_score", min_score)
    return thr, sig, low, code


def _common_boxes(boxes, scores) -> bool:
    """True for the boxes and scores a detector passes every step: float tensors [N, 4] and [N] on one
    CPU or CUDA device. Accepts only what _check_boxes_scores accepts (and the kernels serve), for a
    few attribute reads; anything else goes through the checks, which name what is wrong."""
    return type(boxes) is torch.Tensor and type(scores) is torch.Tensor and use_kernel(boxes) \
        and boxes.dtype in FLOAT_DTYPES and scores.dtype in FLOAT_DTYPES and boxes.dim() == 2 \
        and boxes.shape[1] == 4 and scores.dim() == 1 and scores.shape[0] == boxes.shape[0] \
        and scores.device == boxes.device


def _common_soft_args(iou_threshold, sigma, min_score, method):
    """_check_soft_args's result for float thresholds (not NaN) and a method named by a str; None for
    anything else, which _check_soft_args then checks and explains."""
    code = METHODS.get(method) if type(method) is str else None
    if code is None or type(iou_threshold) is not float or type(sigma) is not float \
            or type(min_score) is not float or iou_threshold != iou_threshold or min_score != min_score \
            or not (sigma > 0 or (code != METHODS["gaussian"] and sigma == sigma)):
        return None
    return iou_threshold, sigma, min_score, code


# ------------------------------------------------------------------ references (plain PyTorch)


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _pair_overlap(box: torch.Tensor, area: torch.Tensor, boxes: torch.Tensor, areas: torch.Tensor):
    """(inter, iou) of one box against many, in the kernels' order of operations."""
    w = (torch.minimum(box[2], boxes[:, 2]) - torch.maximum(box[0], boxes[:, 0])).clamp(min=0)
    h = (torch.minimum(box[3], boxes[:, 3]) - torch.maximum(box[1], boxes[:, 1])).clamp(min=0)
    inter = w * h
    return inter, inter / ((area + areas) - inter)


def nms_reference(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy hard NMS in plain PyTorch, same semantics as torchvision.ops.nms."""
    n = boxes.size(0)
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes.to(_math_dtype(boxes))[order]
    areas = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    suppressed = torch.zeros(n, dtype=torch.bool, device=boxes.device)
    keep = []
    for i in range(n):
        if bool(suppressed[i]):
            continue
        keep.append(i)
        _, iou = _pair_overlap(b[i], areas[i], b[i + 1:], areas[i + 1:])
        # compared in float64 like torchvision's (float ovr > double threshold)
        suppressed[i + 1:] |= iou.double() > iou_threshold
    return order[torch.tensor(keep, dtype=torch.int64, device=boxes.device)]


@torch.no_grad()  # not differentiable, like the kernels
def _soft_nms_reference(boxes, scores, labels, iou_threshold, sigma, min_score, method):
    """(indices in selection order, rescored scores in the math dtype)."""
    mt = _math_dtype(boxes)
    b = boxes.to(mt)
    s = scores.to(mt).clone()
    areas = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    live = s >= min_score
    picked, picked_scores = [], []
    while bool(live.any()):
        cand = live.nonzero().squeeze(1)
        # argmax returns the first maximum: ties go to the lowest index, as in the kernels
        i = int(cand[torch.argmax(s[cand])])
        picked.append(i)
        picked_scores.append(s[i].clone())
        live[i] = False
        others = live.clone()
        if labels is not None:
            others &= labels == labels[i]
        idx = others.nonzero().squeeze(1)
        if idx.numel() == 0:
            continue
        inter, iou = _pair_overlap(b[i], areas[i], b[idx], areas[idx])
        iou = torch.where(inter == 0, torch.zeros_like(iou), iou)
        if method == "gaussian":
            weight = torch.exp(-(iou * iou) / sigma)
        elif method == "linear":
            weight = torch.where(iou >= iou_threshold, 1 - iou, torch.ones_like(iou))
        else:
            weight = torch.where(iou >= iou_threshold, torch.zeros_like(iou), torch.ones_like(iou))
        s[idx] = s[idx] * weight
        live[idx] = s[idx] >= min_score
    device = boxes.device
    inds = torch.tensor(picked, dtype=torch.int64, device=device)
    new_scores = torch.stack(picked_scores) if picked_scores else torch.empty(0, dtype=mt, device=device)
    return inds, new_scores


def soft_nms_reference(dets: torch.Tensor, iou_threshold: float = 0.3, sigma: float = 0.5,
                       min_score: float = 1e-3, method: str = "linear"):
    """Soft-NMS in plain PyTorch, one selection per Python iteration. Same contract as soft_nms."""
    _check_dets(dets)
    thr, sig, low, _ = _check_soft_args(iou_threshold, sigma, min_score, method)
    inds, new_scores = _soft_nms_reference(dets[:, :4], dets[:, 4], None, thr, sig, low, method)
    out = torch.cat([dets[:, :4].index_select(0, inds), new_scores.to(dets.dtype).unsqueeze(1)], dim=1)
    return out, inds


def batched_soft_nms_reference(boxes, scores, idxs, iou_threshold=0.5, sigma=0.5, score_threshold=1e-3,
                               method="gaussian"):
    """Batched soft-NMS in plain PyTorch. Same contract as batched_soft_nms."""
    _check_batched(boxes, scores, idxs)
    thr, sig, low, _ = _check_soft_args(iou_threshold, sigma, score_threshold, method)
    inds, new_scores = _soft_nms_reference(boxes, scores, idxs.long(), thr, sig, low, method)
    return inds, new_scores.to(scores.dtype)


# ------------------------------------------------------------------ kernels


def _register():
    """Fake (meta) kernels: the number of kept boxes is only known at run time. (Soft-NMS's autograd
    contract, not differentiable, is C++: csrc/autograd/nms_autograd.cpp, as light per call as torch's
    own ops.)"""

    @torch.library.register_fake("accel::nms")
    def _(boxes, scores, iou_threshold):
        k = torch.library.get_ctx().new_dynamic_size()
        return boxes.new_empty((k,), dtype=torch.int64)

    @torch.library.register_fake("accel::nms_soft")
    def _(boxes, scores, labels, iou_threshold, sigma, min_score, method):
        k = torch.library.get_ctx().new_dynamic_size()
        return boxes.new_empty((k,), dtype=torch.int64), boxes.new_empty((k,), dtype=_math_dtype(boxes))


def _ops():
    return _build.ops("nms", _register)


# ------------------------------------------------------------------ devices without kernels (XLA)

_warned_host = False


def _to_host(*tensors: torch.Tensor) -> tuple:
    """NMS is a loop whose every step depends on the data: traced on a lazy device (XLA) it builds and
    compiles a graph per selected box (20 boxes took 10 s, 200 did not finish in 400 s on the PJRT CPU
    client). Such inputs go to the host, once each, for the CPU kernel; the caller moves the results
    back. Said once, since it syncs the device and leaves the graph."""
    global _warned_host
    if not _warned_host:
        _warned_host = True
        warnings.warn(f"accel nms on {tensors[0].device.type}: the boxes are copied to the host and back (the "
                      "selection loop cannot stay in the device graph); this syncs the device", stacklevel=3)
    return tuple(t.cpu() for t in tensors)


# ------------------------------------------------------------------ public API


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Indices (int64) of the boxes kept by greedy NMS, by decreasing score; like torchvision.ops.nms.

    boxes [N, 4] (x1, y1, x2, y2), scores [N]; a box is suppressed by a kept, higher-scoring box
    when their IoU is > iou_threshold.
    """
    if _common_boxes(boxes, scores) and type(iou_threshold) is float and iou_threshold == iou_threshold:
        return _ops().nms(boxes, scores, iou_threshold)  # the step's call: checked
    _check_boxes_scores(boxes, scores)
    thr = _check_number("iou_threshold", iou_threshold)
    if use_kernel(boxes):
        return _ops().nms(boxes, scores, thr)
    return _ops().nms(*_to_host(boxes, scores), thr).to(boxes.device)


def nms_normal(dets: torch.Tensor, iou_threshold: float):
    """mmdet-style hard NMS on dets [N, 5] (x1, y1, x2, y2, score): returns (dets[inds], inds)."""
    _check_dets(dets)
    inds = nms(dets[:, :4], dets[:, 4], iou_threshold)
    return dets[inds], inds


def soft_nms(dets: torch.Tensor, iou_threshold: float = 0.3, sigma: float = 0.5, min_score: float = 1e-3,
             method: str = "linear"):
    """Soft-NMS (mmcv semantics, see the module doc) on dets [N, 5] (x1, y1, x2, y2, score).

    Returns (kept dets [K, 5] with their rescored scores, inds [K] int64 into dets), both in
    selection order (which is decreasing rescored score).
    """
    args = _common_soft_args(iou_threshold, sigma, min_score, method)
    if args is None or type(dets) is not torch.Tensor or not use_kernel(dets) \
            or dets.dtype not in FLOAT_DTYPES or dets.dim() != 2 or dets.shape[1] != 5:
        _check_dets(dets)
        args = _check_soft_args(iou_threshold, sigma, min_score, method)
    thr, sig, low, code = args
    if use_kernel(dets):
        inds, new_scores = _ops().nms_soft(dets[:, :4], dets[:, 4], None, thr, sig, low, code)
    else:
        (host,) = _to_host(dets)
        inds, new_scores = (t.to(dets.device) for t in _ops().nms_soft(host[:, :4], host[:, 4], None, thr, sig,
                                                                        low, code))
    # index_select, not dets[inds]: advanced indexing is much slower on CPU. The kept rows with their
    # scores overwritten: the boxes carry gradients to dets as a gather, the rescored scores none
    # (two ops where cat of the boxes and the scores took five).
    out = dets.index_select(0, inds)
    out.select(1, 4).copy_(new_scores)
    return out, inds


def _check_batched(boxes, scores, idxs) -> None:
    _check_boxes_scores(boxes, scores)
    check_tensor("idxs", idxs, dtypes=INT_DTYPES)
    if idxs.dim() != 1 or idxs.size(0) != boxes.size(0):
        raise ValueError(f"idxs: expected shape [N] with N = {boxes.size(0)} (the boxes), got {tuple(idxs.shape)}")
    check_same_device(boxes=boxes, idxs=idxs)


def batched_soft_nms(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, iou_threshold: float = 0.5,
                     sigma: float = 0.5, score_threshold: float = 1e-3, method: str = "gaussian"):
    """Soft-NMS run independently per class (idxs: class id of each box).

    Returns (inds [K] int64 into boxes, rescored scores [K] in the dtype of scores), ordered by
    decreasing rescored score, ties by input index. Equal to running soft_nms on each class and
    merging the results in that order.
    """
    args = _common_soft_args(iou_threshold, sigma, score_threshold, method)
    if args is None or not _common_boxes(boxes, scores) or type(idxs) is not torch.Tensor \
            or idxs.dtype not in INT_DTYPES or idxs.shape != scores.shape or idxs.device != boxes.device:
        _check_batched(boxes, scores, idxs)
        args = _check_soft_args(iou_threshold, sigma, score_threshold, method)
    thr, sig, low, code = args
    if use_kernel(boxes):
        inds, new_scores = _ops().nms_soft(boxes, scores, idxs.long(), thr, sig, low, code)
    else:
        host_boxes, host_scores, host_idxs = _to_host(boxes, scores, idxs)
        inds, new_scores = (t.to(boxes.device) for t in _ops().nms_soft(host_boxes, host_scores, host_idxs.long(),
                                                                         thr, sig, low, code))
    return inds, new_scores.to(scores.dtype)
