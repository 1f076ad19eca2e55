"""accel's Inductor passes compare equal by class and uuid(): torch's Inductor backend compares its options by value,
so two models compiled with equal passes share one backend, and the second runs the graphs of the first."""
from accel.compiler.cpu_dropout import DrawDropoutMasks
from accel.compiler.cpu_gemm import SwapCpuGemms


class _OtherUuid(SwapCpuGemms):
    def uuid(self):
        return "another pass"


def test_equal_by_class_and_uuid():
    assert DrawDropoutMasks() == DrawDropoutMasks() and hash(DrawDropoutMasks()) == hash(DrawDropoutMasks())
    assert SwapCpuGemms() == SwapCpuGemms() and {SwapCpuGemms(), SwapCpuGemms()} == {SwapCpuGemms()}
    assert SwapCpuGemms() != DrawDropoutMasks()
    assert _OtherUuid() != SwapCpuGemms() and SwapCpuGemms() != _OtherUuid()
    assert SwapCpuGemms() != object()


def test_inductor_backends_with_equal_passes_are_equal():
    """What Dynamo checks before it runs a cached graph for another call's backend."""
    import torch

    def backend(passes):
        return torch._TorchCompileInductorWrapper(None, {"joint_custom_pre_pass": passes[0],
                                                          "post_grad_custom_post_pass": passes[1]}, False)

    assert backend((DrawDropoutMasks(), SwapCpuGemms())) == backend((DrawDropoutMasks(), SwapCpuGemms()))
    assert backend((DrawDropoutMasks(), SwapCpuGemms())) != backend((DrawDropoutMasks(), _OtherUuid()))
