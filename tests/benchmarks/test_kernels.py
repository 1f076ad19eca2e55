"""benchmarks/kernels.py and its cases (benchmarks/kernel_cases/<op>.py): the GPU runs use them, so they are
built and run here on the CPU, where a broken case would otherwise wait for the next lent GPU to show."""
import json
import pkgutil

import pytest

from benchmarks import kernel_cases, kernels


def _torchvision_loads() -> bool:
    try:
        import torchvision.ops  # noqa: F401
    except (ImportError, RuntimeError):  # none, or a build that does not match this torch
        return False
    return True


@pytest.mark.slow
def test_every_op_builds_its_quick_cases():
    ops = {info.name for info in pkgutil.iter_modules(kernel_cases.__path__)}
    if not _torchvision_loads():  # tools/test_torch.sh under a torch whose torchvision is not on PyPI
        ops -= {"dcn_v2", "nms"}  # their peer is torchvision
    built = dict(kernels.load_cases("cpu", True, ops))
    assert set(built) == ops
    for op, cases in built.items():
        assert cases, op
        for case in cases:
            assert case.op and case.size and callable(case.ours) and case.bytes_moved >= 0, (op, case)
            assert all(callable(fn) for fn in case.peers.values()), (op, case.op)


@pytest.mark.slow
def test_compiled_layer_norm_tail_runs_ours_and_the_peer(tmp_path):
    # the case that ends in a LayerNorm (bias_dropout_add's op), compiled
    assert kernels.main(["--device", "cpu", "--quick", "--ops", "bias_dropout_add", "--min-time", "0.001",
                         "--exclude", "^(bias_dropout_add fwd|philox_dropout|compiled softmax)",
                         "--results-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "kernels_cpu.json").read_text())["rows"]
    assert {r["op"] for r in rows} == {"bias_dropout_add compiled, before a LayerNorm, fwd+bwd"}
    assert len(rows) == 4  # fp32 and bf16 at the two quick sizes
    for r in rows:
        assert r["ours_ms"] > 0 and r["peer_ms"] > 0 and r["best_peer"] in r["peers_ms"]
