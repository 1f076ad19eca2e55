"""allow_recompiles: the limit rises to n, never falls, and past the old limit calls stay compiled;
make_room_for_recompiles adds to it."""
import pytest
import torch
import torch._dynamo

from accel.utils.dynamo import allow_recompiles, make_room_for_recompiles

NAME = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


@pytest.fixture
def limit():
    saved = getattr(torch._dynamo.config, NAME)
    yield
    setattr(torch._dynamo.config, NAME, saved)
    torch._dynamo.reset()


def test_raises_and_never_lowers(limit):
    setattr(torch._dynamo.config, NAME, 8)
    allow_recompiles(20)
    assert getattr(torch._dynamo.config, NAME) == 20
    allow_recompiles(3)
    assert getattr(torch._dynamo.config, NAME) == 20


def test_room_is_added_on_top(limit):
    setattr(torch._dynamo.config, NAME, 8)
    make_room_for_recompiles(4)
    make_room_for_recompiles(4)
    assert getattr(torch._dynamo.config, NAME) == 16
    make_room_for_recompiles(-3)  # never lowers
    assert getattr(torch._dynamo.config, NAME) == 16


def _scaled(k):
    return lambda x: x * k  # every closure shares this lambda's code object, and so Dynamo's cache


def test_closures_of_one_lambda_past_the_default_limit_stay_compiled(limit):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    setattr(torch._dynamo.config, NAME, 2)
    allow_recompiles(6)
    counter = CompileCounter()
    for k in range(5):  # five closures: five graphs, where a limit of 2 would have run three eagerly
        torch.compile(_scaled(k), backend=counter, dynamic=False)(torch.ones(3))
    assert counter.frame_count == 5
