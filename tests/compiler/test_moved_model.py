"""A compiled model moved to another kind of device after accelerate() (transformers' Trainer moves models to the
XLA device when torch_xla is installed): a failing compiled call names the move and the way out; calls that work,
and failures on the device accelerate() chose, are left as they were."""
import pytest
import torch
from torch import nn

import accel
from accel.compiler.moved_model import explain_failures_after_a_move
from accel.utils.xla import xla_available


def _refuses_meta(gm, example_inputs):
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in example_inputs):
        raise NotImplementedError("no code generator for meta")  # as Inductor has none for 'xla'
    return gm.forward


# Defined here: Dynamo does not trace a torch.nn module's own forward as a frame, and the graphs of this class
# are this file's alone (other tests' models do not fill its cache)
class _Affine(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 3))

    def forward(self, x):
        return x @ self.weight.T + 1.0


def _compiled_linear():
    torch.manual_seed(0)
    model = _Affine()
    model.compile(backend=_refuses_meta, dynamic=False)
    explain_failures_after_a_move(model, torch.device("cpu"))
    return model


def test_a_failure_after_a_move_names_both_devices_and_the_way_out():
    model = _compiled_linear()
    x = torch.randn(4, 3)
    torch.testing.assert_close(model(x), x @ model.weight.T + 1.0)  # on its device: the compiled call
    model.to("meta")
    with pytest.raises(RuntimeError, match=r"placed this model on cpu .* moved to meta afterwards") as caught:
        model(torch.randn(4, 3, device="meta"))
    assert "no code generator for meta" in str(caught.value.__cause__)  # the failure itself, chained


def test_a_failure_on_the_device_accelerate_chose_is_raised_unchanged():
    model = _compiled_linear()
    with pytest.raises(RuntimeError) as caught:
        model(torch.randn(4, 5))  # wrong width: the model's own error
    assert "placed this model" not in str(caught.value)


def test_an_uncompiled_model_is_refused():
    with pytest.raises(ValueError, match="model: expected a module compiled with .compile"):
        explain_failures_after_a_move(nn.Linear(2, 2), torch.device("cpu"))


@pytest.mark.skipif(not xla_available(), reason="needs torch_xla: the move to an XLA device is the case")
def test_a_model_accelerated_for_the_cpu_and_moved_to_xla_says_so():
    import torch_xla.core.xla_model as xm

    torch.manual_seed(0)
    model = accel.accelerate(_Affine(), config=accel.Config(backend="cpu"))
    assert model(torch.randn(4, 3)).shape == (4, 2)
    device = xm.xla_device()
    model.to(device)
    with pytest.raises(RuntimeError, match=r"moved to xla:0 afterwards .* config.backend='xla'"):
        model(torch.randn(4, 3, device=device))
