"""What a model is under the wrappers training puts around it."""
from __future__ import annotations

import sys

from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's own module inside DistributedDataParallel, torch.compile's OptimizedModule and accel's
    PackedModel (HF Accelerate's unwrap_model): its state_dict keys are the ones an un-accelerated model has, and
    its methods (save_pretrained, generate) are the model's. FSDP2 shards a module in place: it comes back as is.

    Raises:
        TypeError: `model` is not an nn.Module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    packed = sys.modules.get("accel.compiler.packed")  # not imported: no PackedModel can exist
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif isinstance(model._modules.get("_orig_mod"), nn.Module):  # torch.compile's OptimizedModule
            model = model._modules["_orig_mod"]
        elif packed is not None and isinstance(model, packed.PackedModel):
            model = model.model
        else:
            return model


def is_sharded(model: nn.Module) -> bool:
    """FSDP2 (fully_shard), FSDP1, or DTensor parameters. Their modules are looked up only if imported: a
    model cannot hold instances of classes nobody imported, and importing them costs a plain run time."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        classes = tuple(c for c in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None))
                        if c is not None)
        if classes and any(isinstance(m, classes) for m in model.modules()):
            return True
    tensor = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(tensor, "DTensor", None)
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def acts_as_linear(module) -> bool:
    """Whether calling `module` is calling an nn.Linear: one, a PEFT adapter layer over one (LoRA's, IA3's: its
    base_layer, the adapter's update added) or PEFT's ModulesToSaveWrapper of one (a trained copy of a head,
    modules_to_save: its original_module). Code that calls such a module as a projection (the first-token cut,
    the packed classifier heads) takes all three; code that reads its weight needs the plain nn.Linear."""
    return isinstance(module, nn.Linear) or any(
        isinstance(getattr(module, inner, None), nn.Linear) for inner in ("base_layer", "original_module"))
