"""xlarun: torchrun for accel's XLA path.

    xlarun --nproc_per_node=8 train.py --lr 1e-3
    python -m accel.launch --nnodes=2 --node_rank=0 --master_addr=... train.py

Every torchrun flag is accepted (we delegate to torch.distributed.run's own parser and
launcher). Before the workers start we set what torch_xla needs in each of them:
PJRT_DEVICE (TPU when one is attached, else CPU; a value the user set is kept), and one
CPU device per process, because CPU_NUM_DEVICES > 1 under several processes makes the
PJRT CPU client abort in its rendezvous.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import MutableMapping


def _tpu_attached() -> bool:
    return bool(os.environ.get("TPU_NAME")) or os.path.exists("/dev/accel0") or (
        importlib.util.find_spec("libtpu") is not None
    )


def _several_processes(nproc_per_node) -> bool:
    try:
        return int(nproc_per_node) > 1
    except (TypeError, ValueError):  # "auto", "cpu", "gpu": torchrun decides; assume several
        return True


def prepare_environment(nproc_per_node, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the torch_xla variables the workers inherit; returns what was set."""
    env = os.environ if env is None else env
    changed: dict[str, str] = {}
    if not env.get("PJRT_DEVICE"):
        changed["PJRT_DEVICE"] = "TPU" if _tpu_attached() else "CPU"
    device = changed.get("PJRT_DEVICE", env.get("PJRT_DEVICE"))
    if device == "CPU" and _several_processes(nproc_per_node):
        user_value = env.get("CPU_NUM_DEVICES")
        if user_value is None:
            changed["CPU_NUM_DEVICES"] = "1"
        elif user_value != "1":
            warnings.warn(
                f"CPU_NUM_DEVICES={user_value} with several processes per node: the PJRT CPU client "
                "times out in its rendezvous in that setup. Use one device per process, or SPMD "
                "(accel.xla.spmd) in a single process.",
                RuntimeWarning,
                stacklevel=2,
            )
    env.update(changed)
    return changed


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    prepare_environment(args.nproc_per_node)
    record(run)(args)


if __name__ == "__main__":
    main()
