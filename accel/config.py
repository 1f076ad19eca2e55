"""accel.Config: what accelerate() applies, as a tree of dataclasses validated when built.

    config = accel.Config()
    config.compute.bf16 = True
    config.memory.gc = True
    config.dataloader.buckets = [64, 128, 256, 512]
    model, loader = accel.accelerate(model, loader, config)

TorchAcc's field names are kept so its users' configs carry over (backend, compute.fp16/bf16,
memory.gc/gc_cls/gc_cnt, dataloader.buckets/max_length/num_buckets/pad_value_dict, dist.dp.size,
dist.fsdp.size/wrap_layer_cls/flatten_parameters/cpu_offload, dist.topology); accel's own fields sit
beside them (compute.compile/cuda_graphs/kernels, memory.keep_freed_memory, dataloader.pack).

Every section validates itself in __post_init__ (a bad value raises ValueError naming the field), and
Config.validate() re-checks the whole tree, which accelerate() calls: fields assigned after
construction are checked there. Defaults are built per instance (default_factory), so no two
configs share a list, dict or section.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

BACKENDS = ("auto", "xla", "cuda", "cpu")
CPU_GEMM_LIBRARIES = ("auto", "onednn", "torch")
CPU_ATTENTION = ("auto", "plain", "sdpa")
CUDA_PACKED_ATTENTION = ("auto", "mask", "varlen", "flex")
DEFAULT_PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "labels": -100}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def _check_positive_int(name: str, value, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}: expected {'None or ' if optional else ''}an int >= 1, got {value!r}")


def _check_inductor_options(name: str, value) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a dict of torch._inductor.config names to values, got {value!r}")
    if not value:
        return
    from torch._inductor import config as inductor_config  # only when set: Inductor's config is a big import

    known = inductor_config.get_config_copy()
    for key, setting in value.items():
        if key == "triton.cudagraphs":
            raise ValueError(f"{name}: CUDA graphs are compute.cuda_graphs' to set, not {key!r}")
        if not isinstance(key, str) or key not in known:
            raise ValueError(f"{name}: {key!r} is not a torch._inductor.config setting")
        if not isinstance(setting, (bool, int, float, str)):
            raise ValueError(f"{name}: {key!r} expects a bool, number or string, got {setting!r}")


def _class_names(name: str, value) -> Optional[set]:
    """None, or a non-empty set of class-name strings (a single string is taken as one name)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {value}
    try:
        names = set(value)
    except TypeError:
        raise ValueError(f"{name}: expected None or a set of class names, got {value!r}") from None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{name}: expected a non-empty set of class-name strings, got {value!r}")
    return names


class _Section:
    """Validation shared by every section: __post_init__ and validate() run the section's own _check()."""

    _prefix = ""

    def __post_init__(self) -> None:
        self._check()

    def validate(self) -> None:
        self._check()

    def _name(self, attr: str) -> str:
        return f"{self._prefix}.{attr}" if self._prefix else attr


@dataclass
class ComputeConfig(_Section):
    """How the model computes.

    fp16 / bf16: autocast to that dtype (exclusive). On a CPU without native bf16 (AMX or AVX512-BF16),
        resp. fp16 (AVX512-FP16 or AMX-FP16), the dtype is emulated and many times slower; accelerate()
        then stays in fp32 and says so once.
    compile: run the model as static graphs (torch.compile on cuda/cpu; the XLA device on xla).
    cuda_graphs: replay the compiled step with CUDA graphs (cuda backend only; needs compile).
    optimizer_cuda_graphs: replay the compiled optimizer steps (accel.compiler.optimizer) with CUDA graphs
        too, so that a whole training step is graph replays (cuda backend; needs cuda_graphs). Off until a
        GPU run shows it wins (`bert_base.py --modes accel,accel:compute.optimizer_cuda_graphs=true` with an
        optimizer that is not fused: torch's fused Adam/AdamW, accel's default for them, is never compiled,
        Dynamo does not trace into it): a compiled step costs the host Dynamo's guards over every parameter
        and its state, which matters where the host bounds the step (BERT-base at 32x128).
    kernels: use accel's kernel library where it beats what the backend already does on this device
        (see accel.runtime.policy: decided by measurement, not by default).
    recompile_guard: warn when compilations keep growing after the first steps, naming the input and
        the dimension whose shape changed (accel.compiler.recompile_guard; the returned loader's
        `recompile_guard` attribute holds the report). Off by default: opt in.
    first_token_only: for classifiers that read one token of the last layer's output (BERT, RoBERTa, ELECTRA,
        DistilBERT sequence classification, ViT and DeiT image classification: the first token; Llama, Mistral,
        Qwen2, Qwen3, Gemma and Phi-3 sequence classification: the last token that is not padding;
        accel.compiler.first_token), the last layer computes that token alone; under dataloader.pack, each
        sample's. Same logits, loss and gradients;
        BERT-base 8x128 fwd+bwd 1.10x on a CPU (measured); ViT-base bf16 training 1.07x; DistilBERT-base 1.11x;
        an 8-layer Llama classifier bf16 training at 8x256 1.11-1.13x.
    fuse_qkv: an encoder's self-attention projects query, key and value with one GEMM over the three weights
        concatenated (accel.compiler.fused_qkv); the parameters stay three. Same results up to rounding. Off
        until it wins: BERT-base bf16 training on a 2-core AVX512-BF16 CPU, compiled, alternating steps
        (2026-11-27): 0.96x, 1.02x at 8x128 and 0.97x at 32x128, i.e. noise. To be measured on a GPU, where
        small products leave tensor cores idle (`bert_base.py --modes accel,accel:compute.fuse_qkv=true`).
    cuda_packed_attention: under dataloader.pack on CUDA, how a transformers model's self-attention with "sdpa"
        keeps packed samples apart: "mask" (SDPA over the whole row with the [B, 1, L, L] document mask, whose cost
        grows with the row and not with its samples), "varlen" (each sample alone by torch's FlashAttention varlen
        kernel: torch 2.10+, compute capability 8.0+, accel.runtime.nn.varlen_attention.flash_varlen_attention; 16-bit,
        head sizes up to 256), "flex" (FlexAttention with the rows' document BlockMask, which skips the blocks no
        sample sees: accel.compiler.flex_rows; heads of 16 or more) or "auto" (the default: "flex" for a decoder's
        causal rows of accel.compiler.flex_rows.AUTO_MIN_ROW tokens or more, "mask" otherwise). Sliding windows and
        grouped key/value heads either way; calls a kernel does not take keep the mask (attention dropout while
        training, BERT's and GPT-2's). On an H200 (2026-11-28, bf16 forward + backward, 32 heads of 128): causal
        rows of 1024 and 4096, SDPA with the mask 1.94 / 12.8 ms, varlen 1.35 / 3.57, FlexAttention 0.79 / 2.10;
        bidirectional rows of 512 (heads of 64) 0.57 / 1.34 / 0.80, hence encoders keep the mask. A packed 1B Llama
        (rows of 4096, batch 2, bf16) trained in 84.3 ms a step with the mask, 64.5 varlen, 61.0 flex (1.38x);
        a small host-bound Llama (rows of 1024) varlen 0.84x the mask, flex unmeasured there. The CPU always
        computes packed samples alone (compute.cpu_attention).
    step_graph: the training step will be one CUDA graph, captured by accel.graph_step around the user's
        step function (accel.compiler.step_graph): the model is compiled without graphs of its own (one
        capture cannot hold another's replays) and optimizers built over it get a device-tensor learning rate
        and capturable updates at their first step. cuda backend; opt in: it takes the host's work off the
        step, which pays only where the host is the slower side (an H200, BERT-base 32x128, 2026-11-27: host
        7.0 -> 1.9 ms a step, the step 8.2 ms either way; `bert_base.py --modes accel,accel-step-graph`).
    cpu_gemm: which library computes a model's large fp32 matrix products on the CPU (cpu backend; eager
        nn.Linear layers and compiled graphs alike: accel.runtime.nn.onednn_mm, accel.compiler.cpu_gemm):
        "auto" (where a probe run once per process finds oneDNN at least 1.15x faster than torch's BLAS on this
        CPU), "onednn" (without that probe) or "torch". Either way oneDNN then takes only the products it
        measured at least 1.15x faster for their shape and layout (once per process each). MKL, torch's BLAS on
        x86, runs its AVX-512 code on Intel CPUs only: on a 2-core AMD EPYC with AVX-512 (Zen 5) oneDNN computed
        BERT-base's fp32 products 1.7-2.4x as fast, and a compiled fp32 BERT-base 8x128 training step took
        1.36 s against 2.56 s. Timings near the margin may decide differently in two processes (rounding only):
        set "torch" for runs that must repeat bit for bit. bf16/fp16 products are oneDNN's already.
    cpu_attention: how a training self-attention (unmasked or padded) runs in bf16/fp16 on the CPU (cpu backend,
        transformers models with "sdpa" attention: accel.compiler.unpadded_attention): "plain" (matmul, softmax,
        matmul, which Inductor fuses around the products, as transformers' eager attention), "sdpa" (torch's SDPA,
        its flash kernel) or "auto" (plain where a probe run once per process, per kind of attention the model has,
        finds it at least 1.25x faster than SDPA here, forward + backward). Bidirectional: models without attention
        dropout hit it (ViT, a BERT fine-tuned with attention_probs_dropout_prob=0, BART's encoder and
        cross-attention), up to 1024 tokens. Causal (Llama-like decoders, grouped key/value heads and sliding
        windows too, BART's decoder): up to 512 tokens, where SDPA's causal kernel stops losing (an 8-layer Llama
        classifier's bf16-autocast training at 8x256: 1.22x; a small BART 1.31x, a Mistral 1.24x). fp32 attention
        and calls without gradients keep SDPA. Packed rows (dataloader.pack) compute each sample's attention alone on the
        CPU: where plain, the backward of samples under 384 tokens in plain products, causal or not
        (accel.runtime.nn.varlen_attention). torch's 16-bit CPU flash kernel is slow backwards without AMX: a 2-core
        AMD EPYC with AVX512-BF16 (Zen 5), 2026-11-27: [8, 12, 197, 64] bf16 forward + backward 7.8 ms plain
        against 29.8 ms; ViT-base training steps: see benchmarks/results/vit_base_cpu*.json.
    inductor_options: further torch._inductor.config settings for the model's compiled graphs (torch.compile's
        `options`), e.g. {"max_autotune": True} or {"combo_kernels": True}; each name must be one of
        Inductor's. CUDA graphs stay compute.cuda_graphs' ("triton.cudagraphs" is refused here). None set
        by default: none has yet won a measurement against the defaults (`bert_base.py --modes
        accel,accel:compute.inductor_options.combo_kernels=true`).
    """

    _prefix = "compute"
    fp16: bool = False
    bf16: bool = False
    compile: bool = True
    cuda_graphs: bool = True
    optimizer_cuda_graphs: bool = False
    kernels: bool = True
    recompile_guard: bool = False
    first_token_only: bool = True
    fuse_qkv: bool = False
    cuda_packed_attention: str = "auto"
    step_graph: bool = False
    cpu_gemm: str = "auto"
    cpu_attention: str = "auto"
    inductor_options: dict = field(default_factory=dict)

    def _check(self) -> None:
        for f in fields(self):
            if f.name not in ("cpu_gemm", "cpu_attention", "cuda_packed_attention", "inductor_options"):
                _check_bool(self._name(f.name), getattr(self, f.name))
        if self.cpu_gemm not in CPU_GEMM_LIBRARIES:
            raise ValueError(f"compute.cpu_gemm: expected one of {', '.join(map(repr, CPU_GEMM_LIBRARIES))}, "
                             f"got {self.cpu_gemm!r}")
        if self.cpu_attention not in CPU_ATTENTION:
            raise ValueError(f"compute.cpu_attention: expected one of {', '.join(map(repr, CPU_ATTENTION))}, "
                             f"got {self.cpu_attention!r}")
        if self.cuda_packed_attention not in CUDA_PACKED_ATTENTION:
            raise ValueError("compute.cuda_packed_attention: expected one of "
                             f"{', '.join(map(repr, CUDA_PACKED_ATTENTION))}, got {self.cuda_packed_attention!r}")
        _check_inductor_options("compute.inductor_options", self.inductor_options)
        if self.fp16 and self.bf16:
            raise ValueError("compute.fp16 and compute.bf16 are exclusive: set at most one")
        if self.optimizer_cuda_graphs and not self.cuda_graphs:
            raise ValueError("compute.optimizer_cuda_graphs needs compute.cuda_graphs=True")
        if self.step_graph and self.optimizer_cuda_graphs:
            raise ValueError("compute.step_graph and compute.optimizer_cuda_graphs are exclusive: the step graph "
                             "holds the optimizer step already")


@dataclass
class MemoryConfig(_Section):
    """Activation checkpointing (gradient checkpointing), and the host allocator.

    gc: turn it on. gc_cls: class names of the blocks to checkpoint (e.g. {"BertLayer"}); without
        names accel.auto_checkpoint finds the repeated blocks itself.
    gc_cnt: checkpoint only the first gc_cnt blocks (None: all of them).
    keep_freed_memory: for models that run on the CPU, the freed memory of tensors of 1 MiB or more is kept for
        reuse by accel's caching allocator (accel.runtime.host_memory): large tensors stop costing page faults
        every step; what it keeps stays within a quarter above the peak of its live tensors.
    fused_lm_loss: a causal or masked language model's training calls with labels compute the loss without the
        [B, L, vocabulary] logits, a slice of the vocabulary at a time (accel.compiler.fused_lm_loss); those
        calls' outputs have no logits. Off by default, as memory.gc: it trades time for memory (a Llama with
        hidden 512 and a 128256-word vocabulary on the CPU: peak 3.2 instead of 6.0 GB, 0.83x the tokens/s). On
        the CPU the tokens whose label is ignored (an instruction-tuned model's prompts, the 85% of tokens a
        masked LM does not predict) skip the head's products: with half of every sample a prompt, that Llama
        with a 32000-word vocabulary trains at 1.17x the speed with 0.63x the peak memory (without prompts
        0.92x, 0.64x); BERT-base's masked LM (15% of tokens labelled) at 1.05-1.16x. There a masked LM's last
        layer (BERT, RoBERTa, ELECTRA, DistilBERT) also computes only the labelled positions (the most any row
        has, rounded up to an eighth of the row): BERT-base bf16 forward + backward 1.08x at 8x128, 1.03x at 4x512.
    """

    _prefix = "memory"
    gc: bool = False
    gc_cls: Optional[set] = None
    gc_cnt: Optional[int] = None
    keep_freed_memory: bool = True
    fused_lm_loss: bool = False

    def _check(self) -> None:
        _check_bool("memory.gc", self.gc)
        _check_bool("memory.keep_freed_memory", self.keep_freed_memory)
        _check_bool("memory.fused_lm_loss", self.fused_lm_loss)
        self.gc_cls = _class_names("memory.gc_cls", self.gc_cls)
        _check_positive_int("memory.gc_cnt", self.gc_cnt)
        if not self.gc and (self.gc_cls is not None or self.gc_cnt is not None):
            raise ValueError("memory.gc_cls and memory.gc_cnt take effect only with memory.gc=True")


@dataclass
class DataLoaderConfig(_Section):
    """Static shapes for the loader accelerate() wraps.

    buckets: sequence lengths every batch is padded up to (the smallest that holds it).
    max_length + num_buckets: the same, with num_buckets lengths evenly spaced up to max_length
        (multiples of 8, which tensor cores like); buckets wins when both are given.
    max_length alone: one bucket, every batch padded to max_length.
    pad_value_dict: the value each padded field gets (fields not named are padded with 0). input_ids left at
        the default 0 are padded with the model's config.pad_token_id where it has another one (accelerate()):
        a decoder's sequence classifier (GPT-2, Llama) finds each row's last token by that id, and read a
        bucket's padding as tokens when it was 0 (logits 0.29 off the unpadded batch's).
    pack: pack several samples into each row of max_length tokens instead (accel.data.packing):
        no padding but the row tail; the samples stay apart (see accel.data.packing). Encoders (masked LM,
        token and sequence classification), causal language models and decoders' sequence classifiers
        (accel.compiler.packed.PackedModel).
    drop_full_masks: a batch whose attention_mask is all ones reaches a transformers model without that key
        (accel.data.full_mask), so attention runs unmasked (FlashAttention on CUDA). Opt-in: the training loop
        then sees batches without "attention_mask". Not with buckets or pack, whose batches keep their masks.
    background_prefetch: the loader's Prefetcher reads the next batch and starts its copy on a thread of its
        own (True), or in the training thread as each batch is handed over (False; accel.runtime.io.prefetcher:
        for steps bound by their host's Python work, where the thread competes with the step for the GIL).
        None (the default): a thread where the step runs on an accelerator (cuda), none on the CPU.
        An H200, BERT-base 32x128 (2026-11-27): the same 8.2 ms step either way, 0.10 ms to take a batch from
        the thread against 0.87 ms inline, so cuda reads on a thread. On the CPU the step's own threads use every
        core, so a reading thread has no idle core to work on and only takes one from them: a 2-core Zen 5, a
        small ResNet, 8 images of 224 px, bf16 (benchmarks/model_families.py, 2026-11-28): 61.9 ms a step with
        the thread, 34.0 inline (the peer: 38.0); BERT-base 8x128 tied (1.01x). Either way a loader whose reads draw from the
        global RNGs (num_workers=0 with random masking or augmentation) is read when the loop asks for each batch,
        so that a seed reproduces the run (accel.runtime.io.prefetcher).
    """

    _prefix = "dataloader"
    buckets: Optional[list] = None
    max_length: Optional[int] = None
    num_buckets: Optional[int] = None
    pad_value_dict: dict = field(default_factory=lambda: dict(DEFAULT_PAD_VALUES))
    pack: bool = False
    drop_full_masks: bool = False
    background_prefetch: Optional[bool] = None

    def _check(self) -> None:
        if self.buckets is not None:
            try:
                values = list(self.buckets)
            except TypeError:
                raise ValueError(f"dataloader.buckets: expected None or a list of ints >= 1, got {self.buckets!r}") from None
            if not values or not all(_is_int(b) and b >= 1 for b in values):
                raise ValueError(f"dataloader.buckets: expected a non-empty list of ints >= 1, got {self.buckets!r}")
            self.buckets = sorted(set(values))
        _check_positive_int("dataloader.max_length", self.max_length)
        _check_positive_int("dataloader.num_buckets", self.num_buckets)
        if self.num_buckets is not None and self.max_length is None and self.buckets is None:
            raise ValueError("dataloader.num_buckets needs dataloader.max_length (the largest bucket)")
        if self.buckets is not None and self.max_length is not None and self.buckets[-1] > self.max_length:
            raise ValueError(f"dataloader.buckets: the largest bucket {self.buckets[-1]} exceeds "
                             f"dataloader.max_length={self.max_length}")
        if not isinstance(self.pad_value_dict, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in self.pad_value_dict.items()):
            raise ValueError("dataloader.pad_value_dict: expected a dict of field name -> int or float pad value, "
                             f"got {self.pad_value_dict!r}")
        _check_bool("dataloader.pack", self.pack)
        if self.pack and self.max_length is None:
            raise ValueError("dataloader.pack needs dataloader.max_length (the packed row length)")
        if self.pack and self.buckets is not None:
            raise ValueError("dataloader.pack and dataloader.buckets are exclusive: packed rows have one length")
        _check_bool("dataloader.drop_full_masks", self.drop_full_masks)
        if self.background_prefetch is not None:
            _check_bool("dataloader.background_prefetch", self.background_prefetch)
        if self.drop_full_masks and (self.pack or self.max_length is not None or self.buckets is not None):
            raise ValueError("dataloader.drop_full_masks is for loaders that keep their own shapes: not with "
                             "dataloader.pack, dataloader.buckets or dataloader.max_length (their batches keep "
                             "their masks, one compiled graph per shape)")

    def bucket_lengths(self) -> Optional[list]:
        """The lengths batches are padded to, or None when the loader keeps its own shapes."""
        if self.pack:
            return None
        if self.buckets is not None:
            return list(self.buckets)
        if self.max_length is None:
            return None
        n = self.num_buckets or 1
        out = sorted({min(self.max_length, -(-self.max_length * (i + 1) // n // 8) * 8) for i in range(n)})
        return out


@dataclass
class DPConfig(_Section):
    """Data parallel: size replicas of the model (DDP on cuda/cpu, gradient all-reduce on xla; with
    dist.fsdp.size > 1 on xla, the 'dp' axis of the SPMD mesh).

    size: None means world_size / dist.fsdp.size (on xla with FSDP: the SPMD device count / dist.fsdp.size).
    """

    _prefix = "dist.dp"
    size: Optional[int] = None

    def _check(self) -> None:
        _check_positive_int("dist.dp.size", self.size)


@dataclass
class FSDPConfig(_Section):
    """Fully sharded data parallel over size ranks (torch FSDP2, fully_shard, on cuda/cpu); on xla over
    size devices of the SPMD mesh's 'fsdp' axis, in one process (torch_xla's FSDPv2; accel.xla.fsdp).

    wrap_layer_cls: class names of the blocks that become one FSDP unit each; None: the repeated
        blocks accel.auto_checkpoint finds.
    flatten_parameters: TorchAcc's field, kept so its configs load. FSDP2 and FSDPv2 shard every
        parameter on its own (no flat parameter), so it has no effect there.
    cpu_offload: keep the sharded parameters, gradients and optimizer state in host memory (FSDP2 only:
        refused on xla, where FSDPv2 has no offload).
    """

    _prefix = "dist.fsdp"
    size: int = 1
    wrap_layer_cls: Optional[set] = None
    flatten_parameters: bool = True
    cpu_offload: bool = False

    def _check(self) -> None:
        _check_positive_int("dist.fsdp.size", self.size, optional=False)
        self.wrap_layer_cls = _class_names("dist.fsdp.wrap_layer_cls", self.wrap_layer_cls)
        _check_bool("dist.fsdp.flatten_parameters", self.flatten_parameters)
        _check_bool("dist.fsdp.cpu_offload", self.cpu_offload)


TOPOLOGY_AXES = ("dp", "fsdp")


@dataclass
class DistConfig(_Section):
    """How the ranks of a distributed run share the work (accelerate() starts the process group when
    none exists: xla on the xla backend, nccl on cuda, gloo on cpu).

    topology: the order of the mesh axes, outermost first: ["dp", "fsdp"] (the default) puts the ranks
        of one FSDP group next to each other (ranks 0..fsdp.size-1 shard one replica), so sharding
        traffic stays within a node.
    """

    _prefix = "dist"
    dp: DPConfig = field(default_factory=DPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    topology: list = field(default_factory=lambda: list(TOPOLOGY_AXES))

    def _check(self) -> None:
        for name, kind in (("dp", DPConfig), ("fsdp", FSDPConfig)):
            section = getattr(self, name)
            if not isinstance(section, kind):
                raise ValueError(f"dist.{name}: expected an accel.config.{kind.__name__}, got {type(section).__name__}")
            section.validate()
        if not isinstance(self.topology, (list, tuple)) or sorted(self.topology) != sorted(TOPOLOGY_AXES):
            raise ValueError(f"dist.topology: expected an ordering of {list(TOPOLOGY_AXES)}, got {self.topology!r}")
        self.topology = list(self.topology)

    def sizes(self, world_size: int, world: str = "the world size") -> tuple[int, int]:
        """(dp, fsdp) for a run of world_size ranks; ValueError naming the fields when they do not fit.
        `world` names what world_size counts in the message (the xla FSDP path: the SPMD device count)."""
        fsdp = self.fsdp.size
        if self.dp.size is None:
            if world_size % fsdp:
                raise ValueError(f"dist.fsdp.size={fsdp} does not divide {world} {world_size}")
            return world_size // fsdp, fsdp
        if self.dp.size * fsdp != world_size:
            raise ValueError(f"dist.dp.size * dist.fsdp.size = {self.dp.size} * {fsdp} = {self.dp.size * fsdp}, "
                             f"but {world} is {world_size}")
        return self.dp.size, fsdp


@dataclass
class Config(_Section):
    """The root: backend plus one section per concern.

    backend: 'auto' (cuda when a GPU is present, else xla when torch_xla is installed and runs on an
        accelerator such as a TPU, else cpu), 'xla', 'cuda' or 'cpu'.
    """

    backend: str = "auto"
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def _check(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        for name, kind in (("compute", ComputeConfig), ("memory", MemoryConfig), ("dataloader", DataLoaderConfig),
                           ("dist", DistConfig)):
            section = getattr(self, name)
            if not isinstance(section, kind):
                raise ValueError(f"{name}: expected an accel.config.{kind.__name__}, got {type(section).__name__}")
            section.validate()
