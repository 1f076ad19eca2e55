"""accel.amp works on CPU tensors in a process where torch_xla cannot be imported."""
from __future__ import annotations

import subprocess
import sys
import textwrap

CODE = textwrap.dedent(
    """
    import os, sys
    sys.modules["torch_xla"] = None  # makes `import torch_xla` fail and find_spec report it absent
    os.environ["PJRT_DEVICE"] = "CPU"  # set, yet without torch_xla the default device is not xla
    import torch
    from accel.amp import GradScaler, autocast, syncfree

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = syncfree.AdamW(model.parameters(), lr=1e-2)
    scaler = GradScaler()
    before = model.weight.detach().clone()
    ctx = autocast()
    # without torch_xla the default is cuda (fp16) where a GPU is present, else cpu (bf16): never xla
    expected = ("cuda", torch.float16) if torch.cuda.is_available() else ("cpu", torch.bfloat16)
    assert (ctx.device, ctx.fast_dtype) == expected, (ctx.device, ctx.fast_dtype)
    ctx = autocast("cpu")  # the CPU flow below, on any machine
    with ctx:
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.weight, before)
    try:
        GradScaler(device="xla")
    except RuntimeError as e:
        assert "torch_xla" in str(e)
    else:
        raise AssertionError("GradScaler(device='xla') without torch_xla should say it needs torch_xla")
    print("OK")
    """
)


def test_cpu_amp_flow_without_torch_xla():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("OK")
