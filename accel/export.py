"""accel.save_model: the trained weights of an accelerated model, for from_pretrained or load_state_dict.

    model, loader = accel.accelerate(model, loader, config)     # DDP, FSDP2, compiled, packed: any of them
    ...                                                          # train
    accel.save_model(model, "out/")                              # every rank calls it
    # a transformers model:  AutoModelForSequenceClassification.from_pretrained("out/")
    # any other module:      model.load_state_dict(safetensors.torch.load_file("out/model.safetensors"))

save_state (accel.state) keeps a run going: optimizer, RNGs, loader position, in a layout of its own. save_model
is what a run hands on: the user's own module's weights (accel.utils.modules.unwrap_model: no "module." or
"_orig_mod." prefixes, accel's wrappers gone), gathered whole from FSDP2 shards, in the files users load:
- a transformers model: what its save_pretrained writes (config.json, generation_config.json, model.safetensors,
  sharded with an index past max_shard_size), the architecture named without FSDP's class prefix;
- a PEFT model (LoRA, ...): what its save_pretrained writes, the adapters (adapter_config.json,
  adapter_model.safetensors), for PeftModel.from_pretrained over the base model;
- any other nn.Module: model.safetensors of its state dict (tied weights stored once per key), or
  pytorch_model.bin (torch.save) where safetensors is not installed or the state dict holds non-tensor values.
Rank 0 writes into a temporary folder next to `directory` and then moves the files in, so a failed save leaves
what was there; weight files of an earlier save that this one did not write (shards of a larger model) are
removed once the new ones are in place.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

import torch
from torch import nn

from accel.state import _has_xla_tensor, _on_rank0, _rank_world, _to_cpu
from accel.utils.modules import is_sharded, unwrap_model

__all__ = ["save_model", "unwrap_model"]

# the weight files save_pretrained and save_model write (whole, sharded, and their indexes; a PEFT model's adapters)
_WEIGHT_FILE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def save_model(model: nn.Module, directory, *, max_shard_size: int | str = "50GB") -> None:
    """Write the model's trained weights to `directory` (see the module docstring).

    Every rank of a distributed run must call it (an FSDP2 model's shards are gathered); rank 0 writes.

    Args:
        model: what accel.accelerate() returned, or any nn.Module: plain, DistributedDataParallel,
            torch.compile'd, PackedModel or FSDP2; a transformers or a PEFT model among them.
        directory: the folder to write into (created if missing; its parent must exist).
        max_shard_size: a transformers model's largest weight file (save_pretrained's argument), e.g. "5GB".

    Raises:
        TypeError: `model` is not an nn.Module, or `directory` not a path.
        ValueError: `directory` is a file.
        FileNotFoundError: the parent of `directory` does not exist (named).
        RuntimeError: on the other ranks, when rank 0 failed to write.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory: expected a path (str or os.PathLike), got {type(directory).__name__}")
    directory = os.fspath(directory)
    if os.path.isfile(directory):
        raise ValueError(f"directory: {directory!r} is a file; save_model writes a folder")
    module = unwrap_model(model)
    rank, world = _rank_world()
    # A sharded model's full state dict is a collective (every rank takes part; rank 0 gets the tensors).
    sharded_state = _gathered_state_dict(module) if is_sharded(module) else None

    def write() -> None:
        state = sharded_state if sharded_state is not None else _local_state_dict(module)
        _write(module, state, directory, max_shard_size)

    _on_rank0(write, directory, rank, world, caller="save_model")


def _gathered_state_dict(module: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _local_state_dict(module: nn.Module) -> dict:
    state = module.state_dict()
    if _has_xla_tensor(state):
        from accel.utils.xla import mark_step

        mark_step()  # pending lazy updates land before the values are read
    return _to_cpu(state, copy=False)


def _instance_of(module: nn.Module, package: str, name: str) -> bool:
    """isinstance(module, package.name), also as FSDP2 leaves it (its class a subclass defined in torch); False
    while the package is not imported (no such module can exist then)."""
    loaded = sys.modules.get(package)
    cls = getattr(loaded, name, None) if loaded is not None else None
    return cls is not None and isinstance(module, cls)


def _write(module: nn.Module, state: dict, directory: str, max_shard_size) -> None:
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(parent):
        raise FileNotFoundError(2, "No such folder to create the directory in", directory)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(directory))}.", suffix=".tmp", dir=parent)
    try:
        if _instance_of(module, "peft", "PeftModel"):  # its adapters: adapter_config.json, adapter_model.safetensors
            module.save_pretrained(staging, state_dict=state)
        elif _instance_of(module, "transformers", "PreTrainedModel"):
            module.save_pretrained(staging, state_dict=state, max_shard_size=max_shard_size)
        else:
            _save_state_dict(state, staging)
        os.makedirs(directory, exist_ok=True)
        written = set(os.listdir(staging))
        for name in written:
            target = os.path.join(directory, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(staging, name), target)
        for name in os.listdir(directory):  # an earlier save's weights this one did not replace
            if _WEIGHT_FILE.match(name) and name not in written:
                os.remove(os.path.join(directory, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save_state_dict(state: dict, folder: str) -> None:
    """model.safetensors, each key's tensor contiguous and with storage of its own (safetensors refuses tensors
    that share memory, as tied weights do); pytorch_model.bin where that cannot hold the state dict."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        save_file = None
    if save_file is None or not all(isinstance(value, torch.Tensor) for value in state.values()):
        torch.save(state, os.path.join(folder, "pytorch_model.bin"))
        return
    tensors, storages = {}, set()
    for key, value in state.items():
        tensor = value.detach().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        tensors[key] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
