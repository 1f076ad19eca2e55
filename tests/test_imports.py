"""The public API imports without torch_xla (and without CUDA), and says how to get torch_xla when needed."""
import subprocess
import sys
import textwrap

BLOCK_XLA = textwrap.dedent("""
    import importlib.abc, sys
    class _NoXla(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch_xla" or name.startswith("torch_xla."):
                raise ImportError(f"blocked for this test: {name}")
            return None
    sys.meta_path.insert(0, _NoXla())
""")

IMPORT_ALL = textwrap.dedent("""
    import importlib, pkgutil, accel
    names = sorted(m.name for m in pkgutil.walk_packages(accel.__path__, "accel.")
                   if not m.name.startswith("accel._csrc") and not m.name.startswith("accel._ext"))
    for name in names:
        importlib.import_module(name)
    assert "torch_xla" not in sys.modules
    print("IMPORTED", len(names))
""")


def _run(code):
    return subprocess.run([sys.executable, "-c", BLOCK_XLA + code], capture_output=True, text=True, timeout=300)


def test_every_module_imports_without_torch_xla():
    proc = _run(IMPORT_ALL)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split("IMPORTED")[1]) > 10


def test_xla_call_without_torch_xla_names_the_extra():
    proc = _run(textwrap.dedent("""
        import accel.xla as xm
        try:
            xm.xla_device()
        except RuntimeError as e:
            print("MESSAGE", e)
    """))
    assert proc.returncode == 0, proc.stderr
    assert "accel[xla]" in proc.stdout
