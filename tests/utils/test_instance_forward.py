"""InstanceForward: a module's forward replaced on the instance stacks on an earlier one, keeps hooks and
state_dict keys, leaves other instances of the class alone, pickles and deep-copies, and lets a second module
run the graph compiled for the first."""
import copy
import pickle

import torch
from torch import nn

from accel.utils.instance_forward import InstanceForward, installed_forward, stacked_forward


class _Times(InstanceForward):
    def __init__(self, module, factor):
        super().__init__(module)
        self.factor = factor

    def __call__(self, x):
        return self.own(x) * self.factor


def test_stacks_keeps_hooks_and_leaves_other_instances_alone():
    torch.manual_seed(0)
    layer, other = nn.Linear(3, 2), nn.Linear(3, 2)
    keys = list(layer.state_dict())
    x = torch.randn(4, 3)
    plain = layer(x)
    _Times(layer, 2.0).install()
    _Times(layer, 5.0).install()  # calls the first one, which calls nn.Linear.forward
    clone = pickle.loads(pickle.dumps(layer))
    torch.testing.assert_close(clone(x), plain * 10.0)
    seen = []
    layer.register_forward_hook(lambda module, args, out: seen.append(out))
    torch.testing.assert_close(layer(x), plain * 10.0)
    assert len(seen) == 1 and list(layer.state_dict()) == keys
    torch.testing.assert_close(other(x), nn.functional.linear(x, other.weight, other.bias))


def test_deep_copies_and_is_found_by_installed_forward():
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    assert installed_forward(layer) is None
    outer = _Times(_Times(layer, 2.0).install().module, 3.0).install()
    assert installed_forward(layer) is outer
    clone = copy.deepcopy(layer)
    assert installed_forward(clone).module is clone and clone.weight is not layer.weight  # the copy's own
    torch.testing.assert_close(clone(x), nn.functional.linear(x, layer.weight, layer.bias) * 6.0)


class _Plus(InstanceForward):
    def __call__(self, x):
        return self.own(x) + 1.0


def test_stacked_forward_finds_a_kind_under_later_ones():
    layer = nn.Linear(3, 2)
    assert stacked_forward(layer, _Times) is None
    times = _Times(layer, 2.0).install()
    assert stacked_forward(layer, _Times) is times and stacked_forward(layer, _Plus) is None
    plus = _Plus(layer).install()  # installed later: above the first
    assert installed_forward(layer) is plus
    assert stacked_forward(layer, _Times) is times and stacked_forward(layer, (_Plus, _Times)) is plus


class _Block(nn.Module):  # defined here: Dynamo compiles a test's modules, not torch.nn's own forwards
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 3)

    def forward(self, x):
        return self.inner(x).relu()


def test_a_second_module_runs_the_graph_compiled_for_the_first():
    """Dynamo guards an instance forward by identity unless it is a bound method (then by its function): so the
    transform's forward is the object's bound __call__, and a module built like the first compiles nothing."""
    torch._dynamo.reset()
    x = torch.randn(4, 3)
    first, second = _Block(), _Block()
    for block in (first, second):
        _Times(block.inner, 2.0).install()
    torch.compile(first)(x)
    with torch.compiler.set_stance("fail_on_recompile"):
        out = torch.compile(second)(x)
    torch.testing.assert_close(out, (nn.functional.linear(x, second.inner.weight, second.inner.bias) * 2.0).relu())


class _Named(nn.Module):
    def forward(self, input_ids, attention_mask=None, *, labels=None, **kwargs):
        return input_ids * 2


class _Pass(InstanceForward):
    def __call__(self, *args, **kwargs):
        return self.own(*args, **kwargs)


def test_the_forward_has_the_signature_it_replaced():
    """inspect.signature(module.forward) names the replaced forward's parameters, stacked, pickled and copied
    too: HF Trainer keeps the batch columns it names (with (*args, **kwargs) it dropped every one)."""
    import inspect

    module = _Named()
    want = inspect.signature(module.forward)
    _Pass(module).install()
    _Times(module, 3.0).install()
    # pickled after the transform that refers to it: unpickling binds the module's forward before that object's
    # state exists, and binds it again once it does
    _, reached_late = pickle.loads(pickle.dumps((installed_forward(module), module)))
    for each in (module, pickle.loads(pickle.dumps(module)), copy.deepcopy(module), reached_late):
        assert inspect.signature(each.forward) == want
        assert list(inspect.signature(each.forward).parameters) == ["input_ids", "attention_mask", "labels",
                                                                    "kwargs"]
        torch.testing.assert_close(each(torch.ones(2)), torch.full((2,), 6.0))
