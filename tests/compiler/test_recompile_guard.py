"""RecompileGuard: warns after warm-up when the compile count grows, naming the input and dimension.

Dynamo runs with backend="eager" and dynamic=False (every new shape is a new graph, compiled fast);
the guard's bookkeeping is also driven by a hand-stepped counter, where the expected events are exact.
"""
import collections
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from accel.compiler import recompile_guard as rg
from accel.compiler.recompile_guard import RecompileGuard, RecompileWarning, guard_module
from accel.utils.batch import iter_tensors
from accel.utils.xla import xla_available

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("xla_report", ROOT / "tools" / "xla_report.py")
xla_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(xla_report)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, input_ids, attention_mask):
        return (input_ids.float() * attention_mask * self.w).sum()


class Single(torch.nn.Module):
    def forward(self, x, scale=1.0):
        return x * scale


def batch(n):
    return {"input_ids": torch.ones(2, n, dtype=torch.long), "attention_mask": torch.ones(2, n)}


@pytest.fixture
def compiled():
    # Dynamo caches graphs per code object (Tiny.forward), across instances and tests: start empty.
    torch._dynamo.reset()
    yield torch.compile(Tiny(), backend="eager", dynamic=False)
    torch._dynamo.reset()


def run(model, guard, lengths):
    """One step per length; returns the RecompileWarnings' messages."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in lengths:
            b = batch(n)
            model(**b)
            guard.step(b)
    return [str(w.message) for w in caught if issubclass(w.category, RecompileWarning)]


class Counter:
    """A compile counter the test advances by hand: backend=Counter() drives the guard exactly."""

    def __init__(self):
        self.value = 0

    def __call__(self):
        return self.value


def drive(guard, counter, steps):
    """steps: (inputs, compiles during the step); returns the RecompileWarnings' messages."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for inputs, compiles in steps:
            counter.value += compiles
            guard.step(inputs)
    return [str(w.message) for w in caught if issubclass(w.category, RecompileWarning)]


# -- torch.compile (Dynamo) -----------------------------------------------------------------------


def test_shape_change_after_warmup_warns_naming_input_and_dim(compiled):
    guard = RecompileGuard(warmup_steps=2)
    messages = run(compiled, guard, [8, 8, 8, 11, 8, 11])
    assert guard.backend == "dynamo"
    assert (guard.steps, guard.compiles) == (6, 2)  # the 8 graph at step 1, the 11 graph at step 4
    assert len(messages) == 1
    assert "batch['input_ids'] dim 1: 8 -> 11" in messages[0]
    assert "batch['attention_mask'] dim 1: 8 -> 11" in messages[0]
    assert "step 4" in messages[0] and "step 3, the last step that did not compile" in messages[0]
    first, second = guard.report()
    assert (first.step, first.count, first.warmup, first.cause) == (1, 1, True, "first step")
    assert (second.step, second.count, second.warmup, second.reference_step) == (4, 1, False, 3)
    assert second.changes == ("batch['input_ids'] dim 1: 8 -> 11", "batch['attention_mask'] dim 1: 8 -> 11")
    assert second.inputs == (("batch['input_ids']", (2, 11), "int64"), ("batch['attention_mask']", (2, 11), "float32"))


def test_constant_shapes_never_warn(compiled):
    guard = RecompileGuard(warmup_steps=2)
    assert run(compiled, guard, [8] * 6) == []
    assert [(e.step, e.warmup, e.cause) for e in guard.report()] == [(1, True, "first step")]


def test_shape_changes_during_warmup_do_not_warn(compiled):
    guard = RecompileGuard(warmup_steps=3)
    assert run(compiled, guard, [8, 9, 8, 9, 8, 9]) == []
    events = guard.report()
    assert [(e.step, e.warmup) for e in events] == [(1, True), (2, True)]
    assert events[1].cause == "batch['input_ids'] dim 1: 8 -> 9; batch['attention_mask'] dim 1: 8 -> 9"


def test_each_new_shape_warns_against_the_last_step_that_did_not_compile(compiled):
    guard = RecompileGuard(warmup_steps=1)
    messages = run(compiled, guard, [8, 8, 11, 11, 13])
    assert len(messages) == 2
    assert "batch['input_ids'] dim 1: 8 -> 11" in messages[0]
    assert "batch['input_ids'] dim 1: 11 -> 13" in messages[1]  # step 4 (11) did not compile
    assert [e.reference_step for e in guard.report()] == [None, 2, 4]


def test_hooked_compiled_module_names_forward_arguments():
    torch._dynamo.reset()
    model = torch.compile(Single(), backend="eager", dynamic=False)
    guard = guard_module(model, warmup_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (3, 3, 3, 5):
            model(torch.ones(rows, 4))
        # Call 4 compiled, but it is attributed when the next call (or close()) ends it.
        assert guard.steps == 3
        model(torch.ones(5, 4), scale=2.0)  # scale is a new Python value: a recompile
        guard.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RecompileWarning)]
    torch._dynamo.reset()
    assert len(messages) == 2
    assert "x dim 0: 3 -> 5" in messages[0]
    assert "x dim 0: 3 -> 5; scale: new input, 2.0" in messages[1]
    assert guard.steps == 5
    assert [e.step for e in guard.report()] == [1, 4, 5]
    assert guard.report()[0].inputs == (
        ("x", (3, 4), "float32"), ("torch.is_grad_enabled()", None, "True"), ("Single.training", None, "True")
    )
    model(torch.ones(7, 4))  # closed: the hook is gone
    assert guard.steps == 5


def test_hook_names_an_eval_pass_under_no_grad():
    torch._dynamo.reset()
    model = torch.compile(Single(), backend="eager", dynamic=False)
    with guard_module(model, warmup_steps=1, warn=False) as guard:
        model(torch.ones(3, 4))
        model(torch.ones(3, 4))
        with torch.no_grad():
            model(torch.ones(3, 4))
    torch._dynamo.reset()
    assert [(e.step, e.cause) for e in guard.report()][1:] == [(3, "torch.is_grad_enabled(): True -> False")]


# -- the bookkeeping, with a hand-stepped counter ---------------------------------------------------


def test_warns_once_per_new_shape():
    counter = Counter()
    guard = RecompileGuard(warmup_steps=2, backend=counter)
    x = lambda n: {"x": torch.empty(2, n)}  # noqa: E731
    messages = drive(guard, counter, [(x(8), 1), (x(8), 0), (x(8), 0), (x(11), 1), (x(8), 0), (x(11), 1), (x(12), 1)])
    assert guard.backend == "custom"
    assert messages[0].count("batch['x'] dim 1: 8 -> 11") == 1
    assert "batch['x'] dim 1: 8 -> 12" in messages[1]
    assert len(messages) == 2  # 8 -> 11 again at step 6 is recorded, not warned again
    assert [(e.step, e.cause) for e in guard.report()] == [
        (1, "first step"),
        (4, "batch['x'] dim 1: 8 -> 11"),
        (6, "batch['x'] dim 1: 8 -> 11"),
        (7, "batch['x'] dim 1: 8 -> 12"),
    ]


def test_names_dtype_rank_value_added_and_removed_inputs():
    counter = Counter()
    guard = RecompileGuard(warmup_steps=1, backend=counter, name="b", warn=False)
    base = {"x": torch.empty(2, 8), "n": 3}
    steps = [
        (base, 1),
        (base, 0),
        ({"x": torch.empty(2, 8, dtype=torch.float64), "n": 3}, 1),
        ({"x": torch.empty(2, 8, 1), "n": 3}, 1),
        ({"x": torch.empty(2, 8), "n": 4}, 1),
        ({"x": torch.empty(2, 8), "n": 3.0}, 1),  # 3 == 3.0, but a float is a different graph constant
        ({"x": torch.empty(2, 8), "n": 3, "y": torch.empty(5)}, 1),
        ({"n": 3}, 1),
        (base, 1),
    ]
    drive(guard, counter, steps)
    assert [e.cause for e in guard.report()[1:]] == [
        "b['x'] dtype: float32 -> float64",
        "b['x'] shape: (2, 8) -> (2, 8, 1)",
        "b['n']: 3 -> 4",
        "b['n']: 3 -> 3.0",
        "b['y']: new input, tensor (5,) float32",
        "b['x']: no longer passed (was tensor (2, 8) float32)",
        rg._UNEXPLAINED["custom"],
    ]
    assert all(e.reference_step == 2 for e in guard.report()[1:])  # step 2 is the only clean step


def test_without_a_clean_step_compares_with_the_step_before():
    counter = Counter()
    guard = RecompileGuard(warmup_steps=1, backend=counter)
    messages = drive(guard, counter, [(torch.empty(2), 1), (torch.empty(3), 1)])
    assert len(messages) == 1
    assert "batch dim 0: 2 -> 3 (compared with step 1; every step so far compiled)" in messages[0]


def test_a_cleared_counter_is_not_a_negative_count():
    counter = Counter()
    counter.value = 5
    guard = RecompileGuard(warmup_steps=1, backend=counter, warn=False)  # baseline 5
    guard.step(torch.empty(2))
    counter.value = 1  # cleared (clear_metrics(), counters.clear()), then one compile
    guard.step(torch.empty(3))
    assert [(e.step, e.count) for e in guard.report()] == [(2, 1)]


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    meta: dict


Pair = collections.namedtuple("Pair", ["left", "right"])


def test_nested_batch_paths_follow_the_batch_helpers_order():
    counter = Counter()
    guard = RecompileGuard(warmup_steps=1, backend=counter, name="batch")
    nested = {
        "sample": Sample(image=torch.empty(3, 4), meta={"ids": torch.empty(5, dtype=torch.int32), "len": 7}),
        "pair": Pair(torch.empty(1), [torch.empty(2), "text", None]),
    }
    counter.value = 1
    event = guard.step(nested)
    assert [p for p, _, _ in event.inputs] == [
        "batch['sample'].image",
        "batch['sample'].meta['ids']",
        "batch['sample'].meta['len']",
        "batch['pair'].left",
        "batch['pair'].right[0]",
    ]
    assert [s for _, s, _ in event.inputs if s is not None] == [tuple(t.shape) for t in iter_tensors(nested)]


# -- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"warmup_steps": True}, "warmup_steps"),
        ({"warmup_steps": "3"}, "warmup_steps"),
        ({"backend": "cuda"}, "backend"),
        ({"name": ""}, "name"),
        ({"warn": 1}, "warn"),
        ({"max_events": 0}, "max_events"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RecompileGuard(**kwargs)


def test_attach_rejects_what_it_cannot_watch():
    with pytest.raises(ValueError, match="module"):
        guard_module("not a module")
    in_place = Single()
    in_place.compile(backend="eager")
    with pytest.raises(ValueError, match=r"module\.compile\(\)"):
        guard_module(in_place)
    guard = guard_module(Single())
    with pytest.raises(ValueError, match="module"):
        guard.attach(Single())
    guard.close()
    with pytest.raises(ValueError, match="path"):
        guard.save(3)
    with pytest.raises(ValueError, match="backend"):
        RecompileGuard(backend=lambda: "3").step()


def test_max_events_keeps_the_first_ones():
    counter = Counter()
    guard = RecompileGuard(warmup_steps=1, backend=counter, warn=False, max_events=2)
    drive(guard, counter, [(torch.empty(n), 1) for n in range(1, 5)])
    assert [e.step for e in guard.report()] == [1, 2]
    assert (guard.dropped_events, guard.compiles) == (2, 4)


# -- save() and tools/xla_report.py -----------------------------------------------------------------


def saved_report(tmp_path):
    counter = Counter()
    guard = RecompileGuard(warmup_steps=2, backend=counter, warn=False)
    x = lambda n: {"input_ids": torch.empty(4, n, dtype=torch.long)}  # noqa: E731
    drive(guard, counter, [(x(128), 2), (x(128), 1), (x(128), 0), (x(131), 1), (x(128), 0)])
    path = tmp_path / "recompiles.json"
    guard.save(path)
    return guard, path


def test_save_writes_the_report_atomically(tmp_path):
    guard, path = saved_report(tmp_path)
    assert os.listdir(tmp_path) == ["recompiles.json"]  # the temporary file was renamed, none left over
    data = json.loads(path.read_text())
    assert data == guard.to_dict()
    assert (data["format"], data["version"]) == (xla_report.FORMAT, xla_report.FORMAT_VERSION)
    assert (data["steps"], data["compiles"], data["backend"]) == (5, 4, "custom")
    assert data["events"][2]["inputs"] == [{"path": "batch['input_ids']", "shape": [4, 131], "dtype": "int64"}]


def test_report_tool_prints_the_table(tmp_path, capsys):
    _, path = saved_report(tmp_path)
    assert xla_report.main([str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "step  compiles  phase    cause",
        "----  --------  -------  " + "-" * len(rg._UNEXPLAINED["custom"]),
        "   1         2  warm-up  first step",
        "   2         1  warm-up  no input shape, dtype or Python value changed; the recompilation has another cause",
        "   4         1  steady   batch['input_ids'] dim 1: 128 -> 131",
        "4 compiles in 3 of 5 steps (1 after warm-up); backend custom, 2 warm-up steps",
    ]


def test_report_tool_options_and_errors(tmp_path, capsys):
    _, path = saved_report(tmp_path)
    assert xla_report.main(["--strict", "--after-warmup", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2:] == ["   4         1  steady  batch['input_ids'] dim 1: 128 -> 131", out[-1]] and len(out) == 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    assert xla_report.main([str(bad)]) == 2
    assert "not a RecompileGuard report" in capsys.readouterr().err
    assert xla_report.main([str(tmp_path / "missing.json")]) == 2
    with pytest.raises(SystemExit) as exc:
        xla_report.main(["--help"])
    assert exc.value.code == 0
    assert "RecompileGuard.save()" in capsys.readouterr().out


def test_report_tool_runs_as_a_script(tmp_path):
    _, path = saved_report(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "xla_report.py"), str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "batch['input_ids'] dim 1: 128 -> 131" in proc.stdout


def test_tool_format_matches_the_guard():
    assert (xla_report.FORMAT, xla_report.FORMAT_VERSION) == (rg.FORMAT, rg.FORMAT_VERSION)


# -- PyTorch/XLA ----------------------------------------------------------------------------------

needs_xla = pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")


@needs_xla
def test_xla_guard_names_the_changed_input_and_lists_it_in_metrics(capsys):
    import accel.xla as xm
    from accel.xla._metrics import XlaCompilation

    dev = xm.xla_device()
    layer = torch.nn.Linear(4, 2).to(dev)
    xm.sync()
    guard = RecompileGuard(warmup_steps=2, name="xla_batch")
    before = xm.metrics()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (8, 8, 8, 11, 8):
            b = {"x": torch.ones(2, n, 4).to(dev)}
            _alive = layer(b["x"]).sum()  # kept alive: sync() compiles only graphs of live tensors
            xm.sync()  # XLA compiles here
            guard.step(b)
    delta = xm.metrics() - before
    messages = [str(w.message) for w in caught if issubclass(w.category, RecompileWarning)]
    assert guard.backend == "xla"
    assert len(messages) == 1 and "xla_batch['x'] dim 1: 8 -> 11" in messages[0]
    assert [(e.step, e.count) for e in guard.report()] == [(1, 1), (4, 1)]
    assert all(e.compile_time_s > 0 for e in guard.report())
    assert delta.compiles == 2
    assert (delta.d2h_transfers, delta.item_calls) == (0, 0)  # the guard read shapes only, no host sync
    assert delta.compilations == (
        XlaCompilation(1, 1, True, "first step", (("xla_batch['x']", (2, 8, 4), "float32"),), "xla_batch"),
        XlaCompilation(4, 1, False, "xla_batch['x'] dim 1: 8 -> 11", (("xla_batch['x']", (2, 11, 4), "float32"),),
                       "xla_batch"),
    )
    assert xla_report.main([]) == 0
    assert "   4         1  steady   xla_batch  xla_batch['x'] dim 1: 8 -> 11" in capsys.readouterr().out


@needs_xla
def test_xla_hooked_module_names_the_forward_argument():
    import accel.xla as xm

    dev = xm.xla_device()
    layer = torch.nn.Linear(4, 3).to(dev)  # Linear.forward(self, input)
    xm.sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard_module(layer, warmup_steps=2) as guard:
            for rows in (6, 6, 6, 9):
                _alive = layer(torch.ones(rows, 4).to(dev)).sum()  # kept alive, so that sync() compiles it
                xm.sync()
    messages = [str(w.message) for w in caught if issubclass(w.category, RecompileWarning)]
    assert guard.backend == "xla"
    assert len(messages) == 1 and "input dim 0: 6 -> 9" in messages[0]
    assert [e.step for e in guard.report()] == [1, 4]
