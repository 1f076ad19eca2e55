"""accel.compiler.cudagraph_skips: a compiled graph Inductor runs without the CUDA graphs asked for is reported.

The listener is tested against torch's own reporting function (so a torch that moves its log fails here), and
on a GPU against a real skip."""
import uuid
import warnings

import pytest
import torch

from accel.compiler import cudagraph_skips
from accel.compiler.cudagraph_skips import CudaGraphSkipWarning

_report = pytest.importorskip("torch._inductor.cudagraph_utils", reason="Inductor is part of torch >= 2.0")


def test_each_reason_warns_once_and_every_skip_is_recorded():
    cudagraph_skips.watch()
    cudagraph_skips.watch()  # idempotent: one listener, one record per skip
    heard = len(cudagraph_skips.reasons())
    script = f"/user/{uuid.uuid4().hex}.py"  # a reason this process has not heard before (it warns once)
    message = ('skipping cudagraphs due to mutated inputs (1 instances). Found from : \n'
               f'   File "{script}", line 12, in forward\n    self.count.add_(1)\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        _report.log_cudagraph_skip_and_bump_counter(message)
        _report.log_cudagraph_skip_and_bump_counter(message)
        _report.log_cudagraph_skip_and_bump_counter(f"skipping cudagraphs due to cpu device ({script})")
    expected = ('skipping cudagraphs due to mutated inputs (1 instances) '
                f'[at File "{script}", line 12, in forward: self.count.add_(1)]')
    assert cudagraph_skips.reasons()[heard:] == [expected, expected, f"skipping cudagraphs due to cpu device ({script})"]
    warned = [str(w.message) for w in caught if issubclass(w.category, CudaGraphSkipWarning)]
    assert len(warned) == 2  # once per distinct reason
    assert warned[0].endswith(expected) and "one host launch per kernel" in warned[0]


def test_a_graph_recorded_for_many_sizes_is_not_a_skip():
    # the one other warning of that log (it still replays): torch's own message, from torch's own function
    cudagraph_skips.watch()
    heard = len(cudagraph_skips.reasons())
    limit = torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaGraphSkipWarning)
        assert _report.maybe_warning_due_to_dynamic_shape({i: None for i in range(limit)}, limit + 1)
    assert cudagraph_skips.reasons()[heard:] == []


def test_long_reasons_are_cut():
    cudagraph_skips.watch()
    heard = len(cudagraph_skips.reasons())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphSkipWarning)
        _report.log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to " + "x" * 1000)
    (reason,) = cudagraph_skips.reasons()[heard:]
    assert len(reason) == 400 and reason.endswith("...")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real skip needs CUDA graphs, which need a CUDA GPU")
def test_a_real_skip_on_cuda_is_reported():
    cudagraph_skips.watch()
    heard = len(cudagraph_skips.reasons())
    torch._dynamo.reset()

    @torch.compile(mode="reduce-overhead")
    def bump(x, counter):
        counter.add_(1)  # a mutated input that is neither a parameter nor graph memory: Inductor skips
        return x * 2

    x, counter = torch.ones(8, device="cuda"), torch.zeros(1, device="cuda")
    with pytest.warns(CudaGraphSkipWarning, match="mutated inputs"):
        for _ in range(3):
            bump(x, counter)
    assert any("mutated inputs" in r for r in cudagraph_skips.reasons()[heard:])
    assert counter.item() == 3
