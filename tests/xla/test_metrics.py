"""metrics(): compile/execute/transfer counts as deltas between snapshots."""
import pytest
import torch

pytest.importorskip("torch_xla", reason="torch_xla is not installed")

import accel.xla as xm  # noqa: E402


def test_item_is_one_device_to_host_transfer():
    dev = xm.xla_device()
    a = torch.ones(5, device=dev) * 4
    xm.sync()
    before = xm.metrics()
    value = a.sum().item()
    delta = xm.metrics() - before
    assert value == 20.0
    assert delta.d2h_transfers == 1
    assert delta.item_calls == 1
    assert delta.h2d_transfers == 0


def test_same_graph_compiles_once_and_executes_each_time():
    dev = xm.xla_device()
    x = torch.randn(3, 7)
    before = xm.metrics()
    for _ in range(3):
        y = torch.tanh(x.to(dev)) * 2.5 + 0.125
        xm.sync()
    delta = xm.metrics() - before
    assert delta.compiles == 1  # the graph is cached after the first step
    assert delta.executions == 3
    assert delta.h2d_transfers >= 3  # the input each step (scalar constants may add more)
    assert delta.d2h_transfers == 0
    torch.testing.assert_close(y.cpu(), torch.tanh(x) * 2.5 + 0.125)


def test_moving_a_tensor_to_the_device_is_one_host_to_device_transfer():
    dev = xm.xla_device()
    before = xm.metrics()
    t = torch.randn(16).to(dev)
    delta = xm.metrics() - before
    assert (delta.h2d_transfers, delta.d2h_transfers, delta.compiles) == (1, 0, 0)
    assert t.device.type == "xla"


def test_steady_state_without_host_reads_has_no_transfers_back():
    dev = xm.xla_device()
    w = torch.zeros(4, device=dev)
    xm.sync()
    w.add_(1.0)
    xm.sync()
    before = xm.metrics()
    for _ in range(3):
        w.add_(1.0)
        xm.sync()
    assert (xm.metrics() - before).d2h_transfers == 0
    assert w.cpu().tolist() == [4.0] * 4


def test_report_and_snapshot_arithmetic():
    m = xm.metrics()
    assert isinstance(m, xm.XlaMetrics)
    text = str(m)
    assert f"{m.compiles} compiles" in text and f"{m.d2h_transfers} device-to-host" in text
    assert m.since(m) == xm.XlaMetrics()
    with pytest.raises(TypeError):
        m - 3
    assert "CompileTime" in xm.metrics_report()
