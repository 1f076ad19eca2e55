"""InstanceForward: a module's forward replaced on the instance stacks on an earlier one, keeps hooks and
state_dict keys, leaves other instances of the class alone, and pickles."""
import pickle

import torch
from torch import nn

from accel.utils.instance_forward import InstanceForward


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
