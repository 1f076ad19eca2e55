"""NMS family: ours vs torchvision.ops.nms (hard NMS), ensemble_boxes.soft_nms (soft-NMS, numpy) and
the plain-PyTorch soft-NMS reference.

NMS is latency-bound (a sequential greedy pass), not bandwidth-bound, so the cases are judged by
time against the peers, not against copy bandwidth. The soft-NMS reference runs one Python
iteration per selected box (about a millisecond each), so it is only timed at 1000 boxes.

ensemble_boxes (github.com/ZFTurbo/Weighted-Boxes-Fusion) is the independent soft-NMS peer: numpy
on the CPU, one vectorized pass per selected box, classes run one after another. It wants boxes
normalized to [0, 1] as lists of numpy arrays (one per model); its timed call includes that
normalization (numpy arrays made from the tensors beforehand, on the host whatever the device),
and what it does itself: concatenating the model lists, clipping, the per-class split. Its
semantics match ours for gaussian soft-NMS up to rounding (tests/runtime/test_nms.py compares the
two), except that it returns the original scores of the kept boxes rather than the rescored ones.
"""
import numpy as np
import torch

from accel.runtime.nn.nms import batched_soft_nms, batched_soft_nms_reference, nms, soft_nms, soft_nms_reference

from . import Case

REFERENCE_MAX_BOXES = 1000
IMAGE_SIDE = 1000.0
MAX_BOX_SIDE = 101.0  # boxes reach IMAGE_SIDE + MAX_BOX_SIDE: the normalizing scale


def _detections(n: int, device: str, seed: int = 0):
    """Boxes scattered over a 1000x1000 image, sides 1..101 px, uniform scores: a detector's
    pre-NMS output, where IoU 0.5 keeps most boxes and crowded regions chain suppressions."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * IMAGE_SIDE
    wh = torch.rand(n, 2, generator=g) * (MAX_BOX_SIDE - 1) + 1
    boxes = torch.cat([xy, xy + wh], 1).to(device)
    scores = torch.rand(n, generator=g).to(device)
    classes = torch.randint(0, 20, (n,), generator=g).to(device)
    return boxes, scores, classes


def _ensemble_soft_nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, iou_threshold: float,
                       sigma: float, thresh: float):
    """The timed call of ensemble_boxes.soft_nms (gaussian) on host numpy copies of the inputs."""
    import ensemble_boxes

    b, s, c = boxes.cpu().numpy(), scores.cpu().numpy(), classes.cpu().numpy()
    scale = np.float32(IMAGE_SIDE + MAX_BOX_SIDE)
    return lambda: ensemble_boxes.soft_nms([b / scale], [s], [c], method=2, iou_thr=iou_threshold, sigma=sigma,
                                           thresh=thresh)


def _ensemble_boxes_available() -> bool:
    try:
        import ensemble_boxes  # noqa: F401
    except ImportError:
        return False
    return True


def cases(device: str, quick: bool) -> list[Case]:
    import torchvision

    sizes = [1000, 5000] if quick else [1000, 5000, 20000]
    with_ensemble = _ensemble_boxes_available()
    out = []
    for n in sizes:
        boxes, scores, classes = _detections(n, device)
        dets = torch.cat([boxes, scores[:, None]], 1)
        # read boxes + scores (+ classes), write at most n int64 indices (+ n scores)
        nbytes = n * (4 * 4 + 4) + n * 8
        label = f"{n} boxes fp32"
        out.append(Case("nms iou0.5", label, nbytes,
                        lambda b=boxes, s=scores: nms(b, s, 0.5),
                        {"torchvision.ops.nms": lambda b=boxes, s=scores: torchvision.ops.nms(b, s, 0.5)},
                        memory_bound=False))

        soft_peers = {}
        if with_ensemble:
            soft_peers["ensemble_boxes.soft_nms (numpy, 1 class, incl. normalizing)"] = _ensemble_soft_nms(
                boxes, scores, torch.zeros_like(classes), 0.3, 0.5, 1e-3)
        if n <= REFERENCE_MAX_BOXES:
            soft_peers["soft_nms_reference"] = lambda d=dets: soft_nms_reference(d, 0.3, 0.5, 1e-3, "gaussian")
        out.append(Case("soft_nms gaussian", label, nbytes + n * 4,
                        lambda d=dets: soft_nms(d, 0.3, 0.5, 1e-3, "gaussian"), soft_peers, memory_bound=False))

        batched_peers = {}
        if with_ensemble:
            batched_peers["ensemble_boxes.soft_nms (numpy, incl. normalizing)"] = _ensemble_soft_nms(
                boxes, scores, classes, 0.5, 0.5, 1e-3)
        if n <= REFERENCE_MAX_BOXES:
            batched_peers["batched_soft_nms_reference"] = (
                lambda b=boxes, s=scores, c=classes: batched_soft_nms_reference(b, s, c))
        out.append(Case("batched_soft_nms gaussian 20 classes", label, nbytes + n * 8,
                        lambda b=boxes, s=scores, c=classes: batched_soft_nms(b, s, c), batched_peers,
                        memory_bound=False))
    return out


def host_cases(device: str) -> list[Case]:
    """The NMS calls of a detector's post-processing on 16 boxes: hard NMS against torchvision.ops.nms,
    soft-NMS (which torchvision lacks) against its hard NMS on the same dets, batched soft-NMS against
    torchvision.ops.batched_nms; the last with scores that require grad (a head in training)."""
    import torchvision

    boxes, scores, classes = _detections(16, device)
    dets = torch.cat([boxes, scores[:, None]], 1)
    scores_grad = scores.clone().requires_grad_()
    tv_nms = torchvision.ops.nms

    def tv_hard_dets(d=dets):  # torchvision's hard NMS on dets, returning (kept dets, inds) as soft_nms does
        inds = tv_nms(d[:, :4], d[:, 4], 0.3)
        return d.index_select(0, inds), inds

    return [
        Case("nms", "16 boxes", 0, lambda: nms(boxes, scores, 0.5),
             {"torchvision.ops.nms": lambda: tv_nms(boxes, scores, 0.5)}, False),
        Case("soft_nms gaussian", "16 boxes", 0, lambda: soft_nms(dets, 0.3, 0.5, 1e-3, "gaussian"),
             {"torchvision.ops.nms (hard) on dets": tv_hard_dets}, False),
        Case("batched_soft_nms (grad)", "16 boxes", 0, lambda: batched_soft_nms(boxes, scores_grad, classes),
             {"torchvision.ops.batched_nms": lambda: torchvision.ops.batched_nms(boxes, scores_grad, classes, 0.5)},
             False),
    ]
