"""accel.accumulate in one process: N scaled micro-batches give the weights of one N-times larger batch (also
with accel.amp.GradScaler and a sync-free optimizer, whose overflow skips the whole group), and the micro-batch
count runs per model."""
import copy

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel import distributed
from tests.distributed._model import Points, new_model, optimizer_for


def _train(batch_size, micro, steps=3):
    model = new_model()
    optimizer = optimizer_for(model)
    for i, batch in enumerate(DataLoader(Points(), batch_size=batch_size)):
        if i == steps * micro:
            break
        batch.pop("id")
        with accel.accumulate(model, steps=micro):
            (model(**batch)["loss"] / micro).backward()
        if (i + 1) % micro == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def test_micro_batches_equal_one_large_batch():
    got, expected = _train(batch_size=4, micro=4), _train(batch_size=16, micro=1)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)


def _train_scaled(batch_size, micro, steps=3, overflow=None):
    """accel.amp.GradScaler + accel.amp.syncfree.AdamW. overflow=(group, micro-batch): that micro-batch's loss
    is made inf, so its gradients (and its group's sums) are inf/NaN. Returns, after each optimizer step, the
    weights, the optimizer state and the scale."""
    model = new_model()
    optimizer = optimizer_for(model, syncfree=True)
    scaler = accel.amp.GradScaler("cpu")
    after_steps = []
    for i, batch in enumerate(DataLoader(Points(), batch_size=batch_size)):
        if i == steps * micro:
            break
        batch.pop("id")
        with accel.accumulate(model, steps=micro):
            loss = model(**batch)["loss"] / micro
            if overflow == divmod(i, micro):
                loss = loss * float("inf")
            scaler.scale(loss).backward()
        if (i + 1) % micro == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            after_steps.append({"weights": {k: v.clone() for k, v in model.state_dict().items()},
                                "optimizer": copy.deepcopy(optimizer.state_dict()["state"]),
                                "scale": scaler.get_scale()})
    return after_steps


def _assert_same(got, expected, exact=False):
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["weights"], expected["weights"], **tolerance)
    torch.testing.assert_close(got["optimizer"], expected["optimizer"], **tolerance)
    assert got["scale"] == expected["scale"]


def test_micro_batches_with_grad_scaler_and_syncfree_adamw_equal_one_large_batch():
    got, expected = _train_scaled(batch_size=4, micro=4), _train_scaled(batch_size=16, micro=1)
    for g, e in zip(got, expected, strict=True):
        _assert_same(g, e)
    assert [s["scale"] for s in got] == [2.0**16] * 3
    assert float(got[-1]["optimizer"][0]["step"]) == 3


def test_an_overflow_in_one_micro_batch_skips_its_groups_step():
    # The second micro-batch of the second group overflows (a micro-batch whose gradient is not the group's last):
    # that group's step is skipped (weights, moments and step count as after the first group) and the scale
    # halves; the third group updates again at the reduced scale.
    got = _train_scaled(batch_size=4, micro=4, overflow=(1, 1))
    first, skipped, third = got
    _assert_same({**skipped, "scale": first["scale"]}, first, exact=True)
    assert (first["scale"], skipped["scale"], third["scale"]) == (2.0**16, 2.0**15, 2.0**15)
    assert float(skipped["optimizer"][0]["step"]) == 1 and float(third["optimizer"][0]["step"]) == 2
    assert all(torch.isfinite(v).all() for v in third["weights"].values())
    assert not torch.equal(third["weights"]["head.weight"], skipped["weights"]["head.weight"])
    # The same as one 4x batch per step whose second batch overflows.
    for g, e in zip(got, _train_scaled(batch_size=16, micro=1, overflow=(1, 0)), strict=True):
        _assert_same(g, e)


def test_the_group_position_is_kept_per_model():
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    for _ in range(3):
        with accel.accumulate(a, steps=4):
            pass
    with accel.accumulate(b, steps=4):
        pass
    assert distributed._micro_batches[a] == 3 and distributed._micro_batches[b] == 1
    with accel.accumulate(a, steps=4):  # the 4th of a's group: synchronises and starts over
        pass
    assert distributed._micro_batches[a] == 0


@pytest.mark.parametrize("steps,error", [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_steps(steps, error):
    with pytest.raises(error, match="steps: expected an int"):
        with accel.accumulate(torch.nn.Linear(1, 1), steps=steps):
            pass


def test_bad_model():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got function"):
        with accel.accumulate(lambda x: x, steps=2):
            pass
