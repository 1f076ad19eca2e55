"""NMS family: ours vs torchvision.ops.nms (hard NMS) and vs the plain-PyTorch soft-NMS reference.

NMS is latency-bound (a sequential greedy pass), not bandwidth-bound, so the cases are judged by
time against the peers, not against copy bandwidth. The soft-NMS reference runs one Python
iteration per selected box (about a millisecond each), so it is only timed at 1000 boxes.
"""
import torch

from accel.runtime.nn.nms import batched_soft_nms, batched_soft_nms_reference, nms, soft_nms, soft_nms_reference

from . import Case

REFERENCE_MAX_BOXES = 1000


def _detections(n: int, device: str, seed: int = 0):
    """Boxes scattered over a 1000x1000 image, sides 1..101 px, uniform scores: a detector's
    pre-NMS output, where IoU 0.5 keeps most boxes and crowded regions chain suppressions."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 1000
    wh = torch.rand(n, 2, generator=g) * 100 + 1
    boxes = torch.cat([xy, xy + wh], 1).to(device)
    scores = torch.rand(n, generator=g).to(device)
    classes = torch.randint(0, 20, (n,), generator=g).to(device)
    return boxes, scores, classes


def cases(device: str, quick: bool) -> list[Case]:
    import torchvision

    sizes = [1000, 5000] if quick else [1000, 5000, 20000]
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
        if n <= REFERENCE_MAX_BOXES:
            soft_peers["soft_nms_reference"] = lambda d=dets: soft_nms_reference(d, 0.3, 0.5, 1e-3, "gaussian")
        out.append(Case("soft_nms gaussian", label, nbytes + n * 4,
                        lambda d=dets: soft_nms(d, 0.3, 0.5, 1e-3, "gaussian"), soft_peers, memory_bound=False))
        batched_peers = {}
        if n <= REFERENCE_MAX_BOXES:
            batched_peers["batched_soft_nms_reference"] = (
                lambda b=boxes, s=scores, c=classes: batched_soft_nms_reference(b, s, c))
        out.append(Case("batched_soft_nms gaussian 20 classes", label, nbytes + n * 8,
                        lambda b=boxes, s=scores, c=classes: batched_soft_nms(b, s, c), batched_peers,
                        memory_bound=False))
    return out
