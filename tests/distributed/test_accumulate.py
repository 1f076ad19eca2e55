"""accel.accumulate in one process: N scaled micro-batches give the weights of one N-times larger batch, and
the micro-batch count runs per model."""
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
