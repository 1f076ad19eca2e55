"""accel.accelerate(model, dataloader=None, config=None): TorchAcc's one call.

    model, loader = accel.accelerate(model, loader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)     # built from the returned model
    for batch in loader:                                           # batches arrive on the device
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

What it does, in order (each step says why it sits where it does):
1. backend: 'auto' is cuda when a GPU is present, else xla when torch_xla is installed and its device is
   an accelerator (TPU: PJRT_DEVICE names it, or libtpu is installed), else cpu. XLA's CPU client is
   slower than eager on the same CPU (measured), so 'auto' leaves it to an explicit backend='xla'.
2. precision: compute.bf16 / compute.fp16 become an autocast around the (outermost) model's forward. On a CPU
   (and the XLA CPU client) without native arithmetic in that dtype it stays fp32 and says so once: emulated
   bf16/fp16 is many times slower there (accel.utils.cpu). fp16 needs a GradScaler: use accel.amp.GradScaler (sync-free).
3. the model moves to the device. Before that, for models that run on the CPU (and the XLA CPU client),
   memory.keep_freed_memory: accel's caching allocator keeps large tensors' freed memory for reuse
   (accel.runtime.host_memory), so the large tensors of every step stop costing page faults (batch 16 x 512 on
   2 cores: a 4-layer BERT's eager fp32 step 1.26x, benchmarks/results/host_memory_cpu.json; BERT-base's
   compiled bf16 step 1.68x with glibc keeping the memory before, which the allocator matches).
4. kernels: the library's hooks where they win on this device (accel.runtime.policy). LayerNorm and Dropout
   modules already built are switched to FusedLayerNorm / PhiloxDropout in place (same parameters); fused
   Adam is a hook on torch.optim.Adam/AdamW, so it reaches the optimizer the user builds next. Where
   PhiloxDropout wins (the CPU), compiled graphs draw every other dropout mask (F.dropout calls) with its kernel
   too (accel.compiler.cpu_dropout, a graph pass given to Inductor at step 7).
5. activation checkpointing (memory.gc): the blocks named by memory.gc_cls, or the repeated blocks
   auto_checkpoint finds; memory.gc_cnt limits it to the first N. memory.fused_lm_loss: a causal or masked LM's
   training loss without its logits (accel.compiler.fused_lm_loss). Then compute.first_token_only: a
   classifier that reads one token (an encoder's first, a Llama-family decoder's last) gets a last layer that
   computes only that token (accel.compiler.first_token; after checkpointing, which would recompute that layer
   outside the call).
6. packing (dataloader.pack): the model is wrapped to take packed rows (accel.compiler.packed); the
   autocast of step 2 goes around that wrapper. With compute.first_token_only a packed sequence classifier's
   last layer computes each sample's read token alone. A model with "sdpa" attention switches to accel's
   "accel_sdpa" (accel.compiler.unpadded_attention): the same attention, without a mask when a bidirectional
   attention's batch has no padding mask, also under torch.compile (where transformers would build one), with the
   attention module's own dropout layer where step 4 swapped it, on packed rows on the CPU each sample's attention
   computed alone (accel.runtime.nn.varlen_attention), and on the CPU a 16-bit training attention (bidirectional,
   cross-attention, causal) in plain ops where a probe finds them faster than SDPA's flash kernel
   (compute.cpu_attention).
7. compile (compute.compile): cuda and cpu compile the module in place with torch.compile, static
   shapes (one graph per bucket shape), CUDA graphs on cuda when compute.cuda_graphs (a graph Inductor runs
   without them gets a CudaGraphSkipWarning with its reason: accel.compiler.cudagraph_skips); calls carrying a
   key/value cache (generate()) run uncompiled (accel.compiler.decoding). On xla the lazy-tensor device itself
   is the compiler.
   Optimizers the user builds over the model's parameters (cuda, cpu): torch Adam/AdamW at their defaults
   switch to torch's fused kernel, and steps are compiled where that pays (accel.compiler.optimizer); with
   compute.optimizer_cuda_graphs (off until measured) the compiled steps are CUDA-graph replays too.
   compute.step_graph (cuda, off until measured): the model is compiled without CUDA graphs of its own and the
   optimizers are made capturable, for accel.graph_step to capture the user's whole step as one graph.
8. distributed (when the launcher started several ranks): the process group is started if the script
   has not (xla / nccl / gloo), then dist.dp / dist.fsdp wrap the model: DDP, FSDP2 (one unit per block
   of dist.fsdp.wrap_layer_cls, or per repeated block), HSDP for both; on xla, gradients averaged at each
   optimizer step (accel.distributed). It wraps after the steps above (FSDP2 shards the parameters the
   model ends up with) and before compile (the compiled graph includes the wrapper's hooks).
   FSDP on xla (dist.fsdp.size > 1) is different: ONE process drives all devices with torch_xla SPMD
   (switched on at the start, before anything touches the device), FSDPv2 shards the parameters over the
   mesh's 'fsdp' axis, and the loader splits each batch over the mesh (accel.xla.fsdp).
   Gradient accumulation: `with accel.accumulate(model, steps):` around each micro-batch.
9. the loader (input_ids padded with the model's config.pad_token_id where dataloader.pad_value_dict leaves
   the default 0: a decoder's sequence classifier finds each row's last token by it): each rank gets its share
   (a DistributedSampler; accel.data.sharding), made resumable
   (accel.data.ResumableLoader: accel.save_state records the epoch and position, set_epoch at every
   pass), then static shapes by bucketing (dataloader.buckets / max_length / num_buckets: every batch
   padded to a bucket length) or packing; or, with dataloader.drop_full_masks, a transformers model's
   all-ones attention masks dropped on the host (accel.data.full_mask); then the backend's device loader
   (MpDeviceLoader on xla, the Prefetcher with pinned host memory and a reading thread on cuda, the
   Prefetcher reading in the training thread on cpu, whose cores the step's threads use; a loader whose reads
   draw random numbers in the main process, e.g. a masked-LM collator with num_workers=0, is read when the loop
   asks for each batch, so a seed reproduces the run and a checkpoint resumes it exactly); for a compiled model without buckets or packing, a warning when its batches come in
   more shapes than full and last batches give (accel.compiler.batch_shapes; with no loader given, the same
   warning watches the model's calls); with compute.recompile_guard, a guard that warns about compilations
   after the first steps.

The model is modified in place where possible (kernels, checkpointing, FSDP2, compile) and returned; its
state_dict keys stay as they were except under packing (the wrapper holds the model as `.model`) and DDP
(`.module`). xla's FSDPv2 wrapper holds it as `_orig_module` (so do the wrapped blocks, in their parents),
but its state_dict()/load_state_dict() use the plain keys.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import nn

from accel import distributed
from accel.compiler.unpadded_attention import switches, unpadded_attention
from accel.config import Config
from accel.data.full_mask import reads_no_mask_as_full
from accel.runtime import policy
from accel.runtime.host_memory import keep_freed_memory
from accel.utils.cpu import native, warn_emulated
from accel.utils.instance_forward import InstanceForward
from accel.utils.transformers_models import name_the_default_loss, transformers_model
from accel.utils.xla import require_xla, xla_available, xla_on_accelerator, xla_on_cpu_client

__all__ = ["accelerate", "resolve_backend"]


def resolve_backend(backend: str) -> str:
    """'auto' -> 'cuda' | 'xla' | 'cpu' (see the module docstring); others are checked against the machine."""
    if backend == "auto":
        if torch.cuda.is_available():
            return "cuda"
        # XLA's CPU client is slower than eager on the CPU (BERT-base 8x128: 11 s vs 5.5-7 s a step,
        # benchmarks/bert_base.py): 'auto' must not pick what slows training down. backend='xla' still does.
        return "xla" if xla_available() and xla_on_accelerator() else "cpu"
    if backend == "cuda" and not torch.cuda.is_available():
        raise ValueError("backend: 'cuda' needs a CUDA GPU, and torch.cuda.is_available() is False here")
    if backend == "xla":
        require_xla("backend='xla'")
    return backend


def _device(backend: str) -> torch.device:
    if backend == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "xla":
        from accel.xla import xla_device

        return xla_device()
    return torch.device("cpu")


def _runs_on_cpu(backend: str) -> bool:
    """Whether the model's arithmetic runs on this machine's CPU: the cpu backend, or XLA's CPU client."""
    return backend == "cpu" or (backend == "xla" and xla_on_cpu_client())


def _autocast_dtype(config: Config, backend: str) -> torch.dtype | None:
    """The autocast dtype, or None for fp32 (also where the device would only emulate the dtype)."""
    wanted = torch.bfloat16 if config.compute.bf16 else torch.float16 if config.compute.fp16 else None
    if wanted is None:
        return None
    short = "bf16" if wanted is torch.bfloat16 else "fp16"
    if _runs_on_cpu(backend) and not native(short):
        warn_emulated(f"accelerate(): compute.{short} stays fp32 on this CPU", short, stacklevel=4)  # the user's call
        return None
    return wanted


class _AutocastForward(InstanceForward):
    """The model's forward under autocast (an instance forward: accel.utils.instance_forward)."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype, cache_casts: bool = True):
        super().__init__(module)
        self.device_type = device_type
        self.dtype = dtype
        self.cache_casts = cache_casts

    def __call__(self, *args, **kwargs):
        # checked by accelerate(); traced under compile
        with torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=self.cache_casts):
            return self.own(*args, **kwargs)


def _onednn_products(library: str, backend: str) -> bool:
    """Whether the model's large fp32 products go to oneDNN (compute.cpu_gemm; "auto": where the probe found it
    faster on this CPU; accel.runtime.nn.onednn_mm)."""
    if backend != "cpu" or library == "torch":
        return False
    from accel.runtime.nn.onednn_mm import onednn_available, onednn_wins

    if library == "onednn":
        if not onednn_available():
            raise ValueError("compute.cpu_gemm: 'onednn' asked for, but this torch build has no oneDNN linear op")
        return True
    return distributed.all_ranks_agree(onednn_wins())  # every rank probes; all compute alike


def _plain_training_attention(model: nn.Module, choice: str, backend: str, dtype: torch.dtype | None
                              ) -> tuple[bool, bool]:
    """Whether the model's 16-bit training attention runs in plain ops (compute.cpu_attention; "auto": where the
    probe found them faster on this CPU; accel.compiler.unpadded_attention): (bidirectional, causal). The probes run
    only for a model whose attention unpadded_attention switches, one per kind of attention it has."""
    if backend != "cpu" or dtype not in (torch.bfloat16, torch.float16) or choice == "sdpa" or not switches(model):
        return False, False
    if choice == "plain":
        return True, True
    from accel.compiler.unpadded_attention import MIN_PLAIN_SPEEDUP, causal_kinds, plain_attention_speedup

    kinds = causal_kinds(model)
    # all ranks compute alike
    return tuple(distributed.all_ranks_agree(causal in kinds and plain_attention_speedup(dtype, causal=causal)
                                             >= MIN_PLAIN_SPEEDUP) for causal in (False, True))


def _retype(model: nn.Module, torch_class: type, subclass: type) -> None:
    """Give the model's modules of exactly torch_class accel's subclass of it: same attributes and parameters,
    only forward differs."""
    for module in model.modules():
        if type(module) is torch_class:
            module.__class__ = subclass


def _apply_kernels(model: nn.Module, kernels: frozenset[str]) -> None:
    from accel.runtime import hooks

    if policy.LAYER_NORM in kernels:
        from accel.runtime.nn.layer_norm import FusedLayerNorm, _TorchLayerNorm

        hooks.enable_fused_layer_norm()  # layers built later (e.g. by the user's code) too
        _retype(model, _TorchLayerNorm, FusedLayerNorm)
    if policy.DROPOUT in kernels:
        from accel.runtime.nn.bias_dropout_add import swap_in_philox_dropout

        swap_in_philox_dropout(model)  # other models in the process keep torch's dropout
    if policy.ADAM in kernels:
        hooks.enable_fused_adam()


def _compile(model: nn.Module, backend: str, device: torch.device, cuda_graphs: bool, n_shapes: int,
             inductor_options: dict, watch_shapes: bool = False, hf: nn.Module | None = None):
    """Compile `model` in place (`hf`: the transformers model inside it, if any); returns the watch of its call
    shapes (watch_shapes), else None."""
    from accel.compiler.batch_shapes import watch_call_shapes
    from accel.compiler.decoding import eager_when_decoding
    from accel.compiler.moved_model import explain_failures_after_a_move
    from accel.compiler.problem_type import settle_problem_type
    from accel.utils.dynamo import guard_module_hooks, make_room_for_recompiles

    guard_module_hooks()  # a hook added later, or on a model that runs another's graphs, must run
    # One graph per static shape (bucket lengths, plus a short last batch of each): room for them all, on top of
    # what earlier models took (Dynamo's limit counts their graphs too, dead models' included).
    make_room_for_recompiles(2 * n_shapes + 2)
    graphs = backend == "cuda" and cuda_graphs
    if inductor_options:  # torch.compile takes a mode or options, not both: "reduce-overhead" is this option
        model.compile(dynamic=False, options={**inductor_options, "triton.cudagraphs": graphs})
    else:
        model.compile(dynamic=False, mode="reduce-overhead" if graphs else None)
    eager_when_decoding(model)  # generate() grows its cache by a token a call: one shape each, uncompiled
    explain_failures_after_a_move(model, device)  # e.g. moved to the XLA device, where Inductor cannot compile
    if hf is not None:  # a classifier's first call writes config.problem_type: done before it, no second compile
        settle_problem_type(model, hf)
        # a masked LM's fused loss cuts its last layer to the labelled positions, counted here: a graph for each
        # of a few counts (two in nearly every run) of each shape
        from accel.compiler.fused_lm_loss import count_labels_before_calls

        if backend == "cpu" and count_labels_before_calls(model, hf):
            make_room_for_recompiles(2 * n_shapes)
    # no loader to watch: the calls, for shapes that keep changing
    call_shapes = watch_call_shapes(model) if watch_shapes else None
    if graphs:  # a .grad kept past its step (zero_grad(set_to_none=False), micro-batches) must outlive replays
        from accel.compiler import cudagraph_skips
        from accel.compiler.graph_pool_grads import keep_grads_out_of_graph_pool

        keep_grads_out_of_graph_pool(model)  # outermost: first in the call
        cudagraph_skips.watch()  # Inductor falling back to a launch per kernel says so only in a log that is off
    return call_shapes


def _models_pad_id(model: nn.Module):
    return getattr(getattr(model, "config", None), "pad_token_id", None)


def _pad_with_models_pad_id(config: Config, pad_id) -> None:
    """input_ids left at the default pad value get the model's own pad token id (config.dataloader.pad_value_dict):
    a decoder's sequence classifier finds each row's last token by it."""
    from accel.config import DEFAULT_PAD_VALUES

    pad_values = config.dataloader.pad_value_dict
    if isinstance(pad_id, int) and pad_id >= 0 and pad_values.get("input_ids") == DEFAULT_PAD_VALUES["input_ids"]:
        pad_values["input_ids"] = pad_id


def _wrap_loader(loader, config: Config, backend: str, device: torch.device, input_sharding=None,
                 drop_full_masks: bool = False, compiled: bool = False):
    from accel.data.bucketing import BucketPaddedLoader
    from accel.data.device_loader import MpDeviceLoader
    from accel.data.resumable import ResumableLoader
    from accel.data.sharding import shard_loader
    from accel.runtime.io.prefetcher import Prefetcher

    dl = config.dataloader
    buckets = dl.bucket_lengths()
    if isinstance(loader, ResumableLoader):
        loader = loader.loader  # packing and sharding build new DataLoaders; the result is made resumable below
    if dl.pack:
        from accel.data.packing import packed_loader_like

        loader = packed_loader_like(loader, dl.max_length, pad_token_id=int(dl.pad_value_dict.get("input_ids", 0)))
    loader = shard_loader(loader, distributed.rank(), distributed.world_size())
    # Innermost, so a resume skips batches by index before anything reads them; it also starts every pass
    # with the sampler's set_epoch. None for loaders that keep their own state or cannot skip by index.
    resumable = ResumableLoader.wrap(loader)
    if resumable is not None:
        loader = resumable
    if buckets is not None and not dl.pack:
        loader = BucketPaddedLoader(loader, buckets, dl.pad_value_dict)
    elif drop_full_masks:
        # Unpadded batches go without their mask of ones (SDPA's unmasked kernels; accel.data.full_mask).
        from accel.data.full_mask import FullMaskDropper

        loader = FullMaskDropper(loader)
    if backend == "xla":
        # SPMD (FSDP on xla): each batch is the global one, uploaded split along dim 0 over the mesh.
        loader = MpDeviceLoader(loader, device, input_sharding=input_sharding)
    else:
        loader = Prefetcher(loader, device=device, background=dl.background_prefetch)
    if (compiled or backend == "xla") and buckets is None and not dl.pack:
        from accel.compiler.batch_shapes import ShapeWatch

        loader = ShapeWatch(loader)  # says so if the batches keep changing shape (each one compiles)
    if config.compute.recompile_guard:
        from accel.compiler.recompile_guard import GuardedLoader, RecompileGuard

        loader = GuardedLoader(loader, RecompileGuard(backend="xla" if backend == "xla" else "dynamo"))
    if resumable is not None:
        # Outermost: the device loaders read ahead; the position must count what the training loop took.
        loader = resumable.counting(loader)
    return loader


def _static_shapes(config: Config) -> int:
    """The batch lengths the loader's batches take: its buckets; packed or unbucketed, one."""
    return len(config.dataloader.bucket_lengths() or ()) or 1


@dataclasses.dataclass(frozen=True)
class _Accelerated:
    """What accelerate() did to a model, kept on the model it returns (attribute _ACCELERATED): a later call
    with that model wraps a loader alone (an evaluation loader), as the first call would have."""
    config: Config
    backend: str
    device: torch.device
    compiled: bool
    reads_no_mask_as_full: bool
    pad_id: object
    call_shapes: object = None  # accel.compiler.batch_shapes.CallShapes: the calls watched, no loader given


_ACCELERATED = "_accel_accelerated"
_MODEL_SECTIONS = ("backend", "compute", "memory", "dist")


def _another_loader(model: nn.Module, dataloader, config: Config, first: _Accelerated):
    """accelerate() of a model it returned already: the loader alone, wrapped as the first call would have with
    this config's dataloader section (the model keeps what the first call did)."""
    if dataloader is None:
        warnings.warn("accelerate(): the model was accelerated already and no dataloader was given: nothing to do",
                      stacklevel=3)
        return model
    changed = [name for name in _MODEL_SECTIONS if getattr(config, name) != getattr(first.config, name)]
    if changed:
        warnings.warn(f"accelerate(): the model was accelerated already; this call wraps the loader alone, so "
                      f"config.{', config.'.join(changed)} of the first call stay", stacklevel=3)
    if config.dataloader.pack and not first.config.dataloader.pack:
        raise ValueError("dataloader.pack: the model was accelerated without packing, so it cannot take packed rows; "
                         "pass dataloader.pack=True to the first accelerate() call (the packed model takes ordinary "
                         "batches as well)")
    if first.compiled:  # this loader's shapes get graphs of their own (no_grad and eval mode: other graphs too)
        from accel.utils.dynamo import make_room_for_recompiles

        make_room_for_recompiles(2 * _static_shapes(config) + 2)
    _pad_with_models_pad_id(config, first.pad_id)
    drop_full_masks = config.dataloader.drop_full_masks and first.reads_no_mask_as_full
    if first.call_shapes is not None:  # the model's calls now come from a loader: its shapes are the loader's to say
        first.call_shapes.stop()
    return model, _wrap_loader(dataloader, config, first.backend, first.device, distributed.input_sharding(model),
                               drop_full_masks, first.compiled)


def accelerate(model: nn.Module, dataloader=None, config: Config | None = None):
    """Apply accel's compiler path, kernels, precision, checkpointing and static-shape loading.

    Args:
        model: the model, built on the CPU or already on the target device.
        dataloader: optional; a DataLoader (or any re-iterable of batches). Bucketing needs batches that
            are mappings with an "input_ids" [B, L] tensor; packing needs a DataLoader over a map-style
            dataset of samples with "input_ids" (see accel.data.packing).
        config: an accel.Config (None: the defaults). It is validated, then copied: later changes to it
            do not reach the returned model.

    A model accelerate() returned may be given again with another loader (an evaluation loader): that call
    wraps the loader alone, with its config's dataloader section, and returns the same model (its compute,
    memory and dist sections stay the first call's, with a warning where they differ).

    Returns:
        (model, loader) when a dataloader is given, else the model. Build the optimizer from the returned
        model's parameters.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise ValueError(f"config: expected an accel.Config or None, got {type(config).__name__}")
    config.validate()
    given = copy.deepcopy(config)  # as the user gave it (below, the working copy takes what this call decides)
    config = copy.deepcopy(config)
    if dataloader is not None and not hasattr(dataloader, "__iter__"):
        raise ValueError(f"dataloader: expected None or an iterable of batches, got {type(dataloader).__name__}")
    first = getattr(model, _ACCELERATED, None)
    if isinstance(first, _Accelerated):
        return _another_loader(model, dataloader, config, first)
    if (config.dataloader.pack or config.dataloader.bucket_lengths()) and dataloader is None:
        warnings.warn("accelerate(): config.dataloader asks for static shapes but no dataloader was given",
                      stacklevel=2)

    backend = resolve_backend(config.backend)
    if config.compute.step_graph and distributed.world_size() > 1:
        raise ValueError(f"compute.step_graph: one process only so far (world size {distributed.world_size()}): "
                         "a whole-step graph would hold DDP's or FSDP's collectives, which accel does not capture yet")
    # Refuse sizes that do not fit before any work. FSDP on xla is SPMD: one process, and the world is the
    # devices it drives; SPMD is switched on here, before the model's first XLA computation.
    if distributed.uses_spmd(backend, config.dist):
        config.dist.sizes(distributed.start_spmd(config.dist), distributed.SPMD_WORLD)
    else:
        config.dist.sizes(distributed.start_process_group(backend))
    device = _device(backend)
    dtype = _autocast_dtype(config, backend)
    # Under autocast the products run in bf16/fp16, where oneDNN is torch's own choice already (asked of every
    # rank all the same: the probe's agreement is a collective).
    onednn_products = _onednn_products(config.compute.cpu_gemm, backend) and dtype is None
    compiled = config.compute.compile and backend != "xla"

    if config.memory.keep_freed_memory and _runs_on_cpu(backend):
        keep_freed_memory()
    model = model.to(device)
    # What accel does to a transformers model it does to the one inside a PEFT (LoRA) model: its forward runs it.
    hf = transformers_model(model)
    name_the_default_loss(hf)  # GPT-2's loss without transformers' per-call warning (a graph break)
    # before any wrapper hides the model's class (and its config)
    no_mask_as_full = reads_no_mask_as_full(hf)
    drop_full_masks = config.dataloader.drop_full_masks and dataloader is not None and no_mask_as_full
    pad_id = _models_pad_id(hf)
    _pad_with_models_pad_id(config, pad_id)
    if onednn_products:  # eager calls; compiled graphs get a graph pass (below)
        from torch.nn.modules.linear import Linear

        from accel.runtime.nn.onednn_mm import OneDNNLinear

        _retype(model, Linear, OneDNNLinear)
    kernels = policy.helpful_kernels(backend, compiled, dtype) if config.compute.kernels else frozenset()
    _apply_kernels(model, kernels)
    if config.memory.gc:
        from accel.checkpoint import auto_checkpoint

        auto_checkpoint(model, block_classes=config.memory.gc_cls, count=config.memory.gc_cnt)
    if config.memory.fused_lm_loss:  # an instance forward: inside the packing and autocast wrappers below
        from accel.compiler.fused_lm_loss import fuse_lm_loss

        fuse_lm_loss(hf)
    # Packed rows always have a mask; "accel_sdpa" still gives their attention the model's own dropout layer.
    plain_training, plain_causal = _plain_training_attention(hf, config.compute.cpu_attention, backend, dtype)
    unpadded_attention(hf, plain_training=plain_training, plain_causal=plain_causal)
    if config.compute.fuse_qkv:
        from accel.compiler.fused_qkv import fuse_qkv

        fuse_qkv(hf)
    if config.dataloader.pack:  # packed rows pool one token per sample: PackedModel cuts the last layer itself
        from accel.compiler.packed import PackedModel

        model = PackedModel(model, first_tokens_only=config.compute.first_token_only,
                            cuda_attention=config.compute.cuda_packed_attention)
    else:
        if config.compute.first_token_only:
            from accel.compiler.first_token import first_token_only

            first_token_only(hf, hooks_on=model)
        if backend in ("cuda", "cpu"):  # rows packed by the user's collator: per-sample attention as pack's rows
            from accel.compiler.flattened_rows import per_sample_flattened_rows

            per_sample_flattened_rows(model, hf, config.compute.cuda_packed_attention)
    if hf is not None:  # a cache hides packed position ids from transformers' masks
        from accel.compiler.decoding import no_cache_when_training

        no_cache_when_training(hf)
    if dtype is not None:  # outermost: PackedModel calls parts of the model, not its forward
        # a forward captured in a CUDA graph (compute.step_graph) must not cache weight casts (torch.cuda.graph's
        # rule for autocast); elsewhere the cache saves a cast per use of a weight
        _AutocastForward(model, device.type, dtype, cache_casts=not config.compute.step_graph).install()
    model = distributed.wrap_model(model, backend, device, config.dist, dtype)
    # no loader given, none asked to make shapes static (that warned above): the model's calls are watched
    watch_shapes = dataloader is None and not (config.dataloader.pack or config.dataloader.bucket_lengths())
    call_shapes = None
    if compiled:
        n_shapes = _static_shapes(config)
        # a whole-step graph (compute.step_graph) cannot hold the model's own graph replays
        cuda_graphs = config.compute.cuda_graphs and not config.compute.step_graph
        inductor_options = dict(config.compute.inductor_options)
        if onednn_products:  # eager calls went to OneDNNLinear above; a compiled graph's products, here
            from accel.compiler.cpu_gemm import SwapCpuGemms

            inductor_options["post_grad_custom_post_pass"] = SwapCpuGemms()
        if backend == "cpu" and policy.DROPOUT in kernels:
            # the dropout masks a model draws with F.dropout (no layer to swap): accel's Philox kernel, as
            # PhiloxDropout's; a pass the user set in compute.inductor_options is kept
            from accel.compiler.cpu_dropout import DrawDropoutMasks

            inductor_options.setdefault("joint_custom_pre_pass", DrawDropoutMasks())
        call_shapes = _compile(model, backend, device, cuda_graphs, n_shapes, inductor_options, watch_shapes, hf)
    elif watch_shapes and backend == "xla":  # XLA compiles a graph per shape by nature
        from accel.compiler.batch_shapes import watch_call_shapes

        call_shapes = watch_call_shapes(model)
    from accel.compiler.optimizer import adopt_optimizers

    adopt_optimizers(model, compile_steps=compiled, reduce_gradients=distributed.reduces_gradients_on_step(model),
                     cuda_graph_steps=backend == "cuda" and config.compute.cuda_graphs
                     and config.compute.optimizer_cuda_graphs,
                     graph_steps=backend == "cuda" and config.compute.step_graph)

    # nn.Module.__setattr__ keeps a plain object as an attribute; a later call finds it (an evaluation loader)
    setattr(model, _ACCELERATED, _Accelerated(given, backend, device, compiled, no_mask_as_full, pad_id, call_shapes))
    if dataloader is None:
        return model
    return model, _wrap_loader(dataloader, config, backend, device, distributed.input_sharding(model),
                               drop_full_masks, compiled)
