"""FSDP on the xla backend: torch_xla's FSDPv2 (SpmdFullyShardedDataParallel) over an 'fsdp' mesh axis.

accel.accelerate() calls `fully_shard` for backend='xla' with dist.fsdp.size > 1. It is SPMD: ONE process
drives every device (CPU_NUM_DEVICES devices on the PJRT CPU client, every chip of the host / slice on
TPU). Each parameter is annotated as split along its largest dimension over the mesh's 'fsdp' axis
(replicated over 'dp' when there is one), each wrapped block's output and each batch as split along dim 0
(the batch) over all the mesh's axes; XLA's SPMD partitioner then compiles one program per device that
all-gathers a block's parameters before it runs and reduce-scatters their gradients in backward. Nothing
here communicates by itself, and the optimizer step runs on the shards (its state is sharded the same way,
by propagation). Sharding annotations constrain the layout, never the values: the result is the one
process, one device result (the tests check it against eager training on the CPU).

What runs where:
- the PJRT CPU client (PJRT_DEVICE=CPU CPU_NUM_DEVICES=N): all of it, with the same collectives and
  numerics; that is what the tests run (tests/xla/test_fsdp_spmd.py). It proves correctness only: the N
  "devices" share one host's memory and cores, so there is no memory saved and no speed gained (slower
  than eager, as the xla backend is on a CPU anyway).
- TPU: the same program. Only there does each chip hold 1/fsdp of the parameters, gradients and optimizer
  state (the memory FSDP exists to save) and do the all-gathers overlap compute on the chips' links. The
  per-block wrapping (and FSDPv2's optimization barrier in each block's backward) keeps XLA from fusing
  the whole model's all-gathers into one, so peak memory stays about one block's full parameters; that is
  a TPU memory property nothing on the CPU client measures.

Unlike the cuda/cpu path (torch FSDP2) there is no offload (dist.fsdp.cpu_offload is refused), no
separate mixed-precision policy (compute.bf16/fp16 is autocast around the forward; the parameters,
gradients and their reductions stay fp32), and no flat parameter (FSDPv2 shards every parameter on its
own; dist.fsdp.flatten_parameters has no effect, as with FSDP2).

Parameters whose largest dimension is smaller than the 'fsdp' axis (a [1] bias) stay replicated:
split, some devices would hold nothing but padding.

State dict keys: FSDPv2 holds the wrapped module as `_orig_module`, so parameter names gain
`_orig_module.` segments; the root wrapper's state_dict() drops them again and its load_state_dict() puts
them back, so checkpoints (accel.save_state included) have the plain model's keys.
"""
from __future__ import annotations

import sys
from collections import OrderedDict

from torch import nn

from accel.utils.batch import iter_tensors
from accel.utils.xla import is_xla_tensor, require_xla

INNER = "_orig_module"  # where FSDPv2 keeps the module it wraps


def _fsdp_class():
    require_xla("FSDP on the xla backend")
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    return SpmdFullyShardedDataParallel


class ShardOutput:
    """FSDPv2's shard_output: marks dim 0 (the batch) of every tensor the wrapped module returns as split
    over the mesh's axes, which tells the partitioner that activations stay batch-sharded (so it gathers
    the parameters, not the activations). FSDPv2's own default takes a tensor or a tuple's first element
    only; models return dicts (transformers' ModelOutput), so accel walks dicts, lists, tuples and
    dataclasses. 0-d tensors (a loss) stay replicated. A plain object, so the model still pickles."""

    def __call__(self, output, mesh) -> None:
        import torch_xla.distributed.spmd as xs

        from accel.xla.spmd import batch_partition_spec

        for t in iter_tensors(output):
            if t.dim() >= 1 and is_xla_tensor(t):
                xs.mark_sharding(t, mesh, batch_partition_spec(mesh, t.dim()))


def _wrap(module: nn.Module, mesh, shard_output) -> nn.Module:
    cls = _fsdp_class()
    # FSDPv2 insists that type(module) defines forward and refuses a module whose `forward` is an instance
    # attribute (accelerate()'s autocast forward is one). The wrapper calls module(...), which still finds
    # the instance forward, so it is set aside only while FSDPv2 checks.
    own = module.__dict__.pop("forward", None)
    try:
        return cls(module, mesh=mesh, shard_output=shard_output)
    finally:
        if own is not None:
            object.__setattr__(module, "forward", own)


def _user_key(key: str) -> str:
    return ".".join(part for part in key.split(".") if part != INNER)


def _drop_wrapper_keys(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook of the root wrapper: keys (and their version metadata) without `_orig_module`."""
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        state_dict[prefix + _user_key(key[len(prefix):]) if key.startswith(prefix) else key] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # parents come first: an inner module's entry overwrites its wrapper's (the inner module's version
        # is the one its loader reads)
        renamed = OrderedDict()
        for key, value in metadata.items():
            if key == prefix[:-1] or key.startswith(prefix):  # the root wrapper's own entry or one below it
                user = _user_key(key[len(prefix):] if key.startswith(prefix) else "")
                key = prefix + user if user else prefix[:-1]
            renamed[key] = value
        metadata.clear()
        metadata.update(renamed)


def _internal_key(root: nn.Module, key: str) -> str:
    """A state-dict key relative to `root` with `_orig_module` put in after every FSDPv2 wrapper on its path
    (keys that already have them come back unchanged)."""
    cls = _fsdp_class()
    out, module = [], root
    for part in key.split("."):
        if isinstance(module, cls) and part != INNER:
            out.append(INNER)
            module = module._modules[INNER]
        out.append(part)
        module = module._modules.get(part) if module is not None else None
    return ".".join(out)


def _add_wrapper_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs) -> None:
    """load_state_dict pre-hook of the root wrapper: plain keys -> the wrapped modules' keys."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        internal = prefix + _internal_key(module, key[len(prefix):])
        if internal != key:
            state_dict[internal] = state_dict.pop(key)


def _replicate_small_parameters(model: nn.Module, mesh) -> None:
    """Mark parameters whose largest dim is smaller than the 'fsdp' axis (a [1] bias) as replicated, which
    FSDPv2 then leaves alone. Split, some devices would hold only padding and every device a padded
    element anyway: no memory saved, a collective more. (torch_xla also turns such a padded sharding into
    a replicated one behind the annotation once the tensor is read back to the host.)"""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    size = mesh.mesh_shape[mesh.axis_names.index("fsdp")]
    for p in model.parameters():
        if p.dim() >= 1 and max(p.shape) < size and torch_xla._XLAC._get_xla_sharding_spec(p) == "":
            xs.mark_sharding(p, mesh, (None,) * p.dim())


def fully_shard(model: nn.Module, mesh, blocks: list[tuple[str, nn.Module]] = ()) -> nn.Module:
    """Wrap each of `blocks` ((name, module) pairs of `model`, as accel.checkpoint's finders return them)
    in an FSDPv2 unit, then the root; returns the root wrapper (see the module docstring).

    `mesh` must have an 'fsdp' axis (accel.xla.spmd.fsdp_mesh); SPMD must be on and `model` on the XLA
    device. Blocks are replaced in their parents (model.blocks[0] becomes the wrapper; attribute access
    goes through to the wrapped module).
    """
    if "fsdp" not in tuple(mesh.axis_names):
        raise ValueError(f"mesh: FSDPv2 shards over an axis named 'fsdp', got axes {tuple(mesh.axis_names)}")
    _replicate_small_parameters(model, mesh)
    shard_output = ShardOutput()
    targets, seen = [], set()
    for name, block in blocks:
        if not name or id(block) in seen or block is model:
            continue
        seen.add(id(block))
        parent_name, _, attr = name.rpartition(".")
        targets.append((name.count("."), model.get_submodule(parent_name), attr, block))
    # innermost first: a unit's parameters are sharded by the innermost unit that holds them
    for _, parent, attr, block in sorted(targets, key=lambda t: -t[0]):
        parent._modules[attr] = _wrap(block, mesh, shard_output)
    root = _wrap(model, mesh, shard_output)
    root.register_state_dict_post_hook(_drop_wrapper_keys)
    root.register_load_state_dict_pre_hook(_add_wrapper_keys)
    return root


def is_fully_sharded(model: nn.Module) -> bool:
    """True for a model fully_shard returned (without importing torch_xla when nothing imported it)."""
    module = sys.modules.get("torch_xla.experimental.spmd_fully_sharded_data_parallel")
    return module is not None and isinstance(model, module.SpmdFullyShardedDataParallel)


def mesh_of(model: nn.Module):
    """The mesh a fully_shard()ed model is sharded over, else None."""
    return model._mesh if is_fully_sharded(model) else None


def parameter_shardings(model: nn.Module) -> dict[str, str]:
    """{parameter name (plain, without `_orig_module`): torch_xla's sharding spec string}; '' = not sharded."""
    import torch_xla

    return {_user_key(name): torch_xla._XLAC._get_xla_sharding_spec(p) for name, p in model.named_parameters()}


__all__ = ["ShardOutput", "fully_shard", "is_fully_sharded", "mesh_of", "parameter_shardings"]
