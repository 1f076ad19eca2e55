"""accel.accelerate(): each backend present here, config errors, precision choice, kernels, gc, compile,
and static-shape loaders, against the same model trained plainly."""
import copy
import importlib
import pickle
import threading
import warnings

import pytest
import torch
from torch import nn

import accel
import accel.utils.cpu as cpu_module
from accel.checkpoint import checkpoint_plan
from accel.compiler.graph_pool_grads import has_graph_pool_grad_check
from accel.compiler.optimizer import has_compiled_step, has_cuda_graph_step, uses_fused_kernel
from accel.config import Config
from accel.runtime import hooks
from accel.utils.xla import xla_available
from tests._varlen_kernel import varlen_kernel

accelerate_module = importlib.import_module("accel.accelerate")  # accel.accelerate is the function
transformers = pytest.importorskip("transformers", reason="accelerate() is tested on transformers' BERT")
VOCAB = 97


def tiny_bert(seed=0, layers=2):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg).train()


def samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g), "labels": torch.tensor(i % 2)}
            for i, n in enumerate(lengths)]


def pad_to_longest(batch):
    """What transformers' DataCollatorWithPadding does: pad each batch to its longest sample."""
    width = max(len(s["input_ids"]) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, :len(s["input_ids"])] = s["input_ids"]
        mask[i, :len(s["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([s["labels"] for s in batch])}


LENGTHS = [5, 9, 13, 17, 30, 7, 3, 12]


def loader(lengths=LENGTHS, batch_size=2):
    return torch.utils.data.DataLoader(samples(lengths), batch_size=batch_size, collate_fn=pad_to_longest)


def cpu_config(**compute):
    c = Config(backend="cpu")
    for k, v in compute.items():
        setattr(c.compute, k, v)
    return c


@pytest.fixture(autouse=True)
def _restore_hooks():
    yield
    hooks.disable_fused_layer_norm()
    hooks.disable_fused_adam()


def train(model, batches, opt):
    losses = []
    for b in batches:
        loss = model(**b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


# --------------------------------------------------------------------------- arguments and backends

def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="model"):
        accel.accelerate("not a model")
    with pytest.raises(ValueError, match="config"):
        accel.accelerate(nn.Linear(2, 2), config={"backend": "cpu"})
    with pytest.raises(ValueError, match="dataloader"):
        accel.accelerate(nn.Linear(2, 2), 42, cpu_config(compile=False))
    bad = Config(backend="cpu")
    bad.compute.fp16 = bad.compute.bf16 = True  # assigned after construction: caught by validate()
    with pytest.raises(ValueError, match="compute.fp16 and compute.bf16 are exclusive"):
        accel.accelerate(nn.Linear(2, 2), config=bad)


def test_backend_auto_picks_cuda_then_xla_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert accelerate_module.resolve_backend("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(accelerate_module, "xla_available", lambda: True)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert accelerate_module.resolve_backend("auto") == "xla"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # XLA's CPU client is slower than eager: not picked by itself
    assert accelerate_module.resolve_backend("auto") == "cpu"
    monkeypatch.setattr(accelerate_module, "xla_available", lambda: False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert accelerate_module.resolve_backend("auto") == "cpu"
    with pytest.raises(ValueError, match="backend: 'cuda' needs a CUDA GPU"):
        accelerate_module.resolve_backend("cuda")


def test_without_a_loader_returns_the_model_and_keeps_its_outputs():
    ref, model = tiny_bert(), tiny_bert()
    out = accel.accelerate(model, config=cpu_config(compile=False, kernels=False))
    assert out is model
    batch = pad_to_longest(samples([6, 4]))
    # equal up to rounding: the last layer computes its one read token alone (compute.first_token_only),
    # and a product over fewer rows may round differently
    torch.testing.assert_close(model(**batch).logits, ref(**batch).logits, rtol=1e-6, atol=1e-7)


def test_the_config_is_copied_not_shared():
    config = cpu_config(compile=False)
    config.dataloader.buckets = [32]
    model, wrapped = accel.accelerate(tiny_bert(), loader(), config)
    config.dataloader.buckets = [64]  # too late: the loader keeps what accelerate() saw
    assert {b["input_ids"].shape[1] for b in wrapped} == {32}


@pytest.mark.parametrize("keep", [True, False])
def test_keep_freed_memory_for_models_on_the_cpu(monkeypatch, keep):
    calls = []
    monkeypatch.setattr(accelerate_module, "keep_freed_memory", lambda: calls.append("kept") or True)
    config = cpu_config(compile=False, kernels=False)
    config.memory.keep_freed_memory = keep
    accel.accelerate(nn.Linear(2, 2), config=config)
    assert calls == (["kept"] if keep else [])
    assert accelerate_module._runs_on_cpu("cpu") and not accelerate_module._runs_on_cpu("cuda")


# --------------------------------------------------------------------------- precision

def test_bf16_on_a_cpu_without_native_bf16_stays_fp32_and_says_so_once(monkeypatch):
    monkeypatch.setattr(cpu_module, "native_bf16", lambda: False)
    monkeypatch.setattr(cpu_module, "_warned", set())
    config = cpu_config(compile=False, bf16=True)
    with pytest.warns(RuntimeWarning, match="compute.bf16 stays fp32"):
        model = accel.accelerate(tiny_bert(), config=config)
    assert "forward" not in model.__dict__  # no autocast wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accel.accelerate(tiny_bert(), config=config)  # once only


def test_fp16_on_a_cpu_without_native_fp16_stays_fp32_even_with_native_bf16(monkeypatch):
    """A CPU with AVX512-BF16 may still emulate fp16 (AMD EPYC: fp16 matmuls 2.6x slower than fp32)."""
    monkeypatch.setattr(cpu_module, "native_bf16", lambda: True)
    monkeypatch.setattr(cpu_module, "native_fp16", lambda: False)
    monkeypatch.setattr(cpu_module, "_warned", set())
    with pytest.warns(RuntimeWarning, match="compute.fp16 stays fp32.*no native fp16"):
        model = accel.accelerate(tiny_bert(), config=cpu_config(compile=False, fp16=True))
    assert "forward" not in model.__dict__  # no autocast wrapper
    monkeypatch.setattr(cpu_module, "native_fp16", lambda: True)
    model = accel.accelerate(tiny_bert(), config=cpu_config(compile=False, kernels=False, fp16=True))
    assert model(**pad_to_longest(samples([6, 4]))).logits.dtype is torch.float16


def test_bf16_with_native_bf16_runs_the_forward_under_autocast(monkeypatch):
    monkeypatch.setattr(cpu_module, "native_bf16", lambda: True)
    ref, model = tiny_bert(), tiny_bert()
    config = cpu_config(compile=False, kernels=False, bf16=True)
    config.compute.cpu_attention = "sdpa"  # the reference's attention, so that the logits are bit-equal
    accel.accelerate(model, config=config)
    batch = pad_to_longest(samples([6, 4]))
    logits = model(**batch).logits
    assert logits.dtype is torch.bfloat16  # the classifier's Linear ran in bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref(**batch).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert not torch.is_autocast_enabled("cpu")  # the region ends with the forward
    clone = pickle.loads(pickle.dumps(model))    # the wrapper pickles with the model
    torch.testing.assert_close(clone(**batch).logits, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- kernels and gc

def test_packed_model_runs_under_autocast_too(monkeypatch):
    """PackedModel calls the model's parts, not its forward: the autocast must wrap the packed model."""
    monkeypatch.setattr(cpu_module, "native_bf16", lambda: True)
    config = cpu_config(compile=False, kernels=False, bf16=True)
    config.dataloader.pack, config.dataloader.max_length = True, 32
    model, wrapped = accel.accelerate(tiny_bert(), loader(batch_size=4), config)
    assert model(**next(iter(wrapped))).logits.dtype is torch.bfloat16


def test_kernels_the_policy_names_are_applied(monkeypatch):
    """compute.kernels applies what accel.runtime.policy names for the device: LayerNorm modules already
    built switch in place (same parameters and keys), and the Adam hook reaches the optimizer built next."""
    from accel.runtime import policy
    from accel.runtime.nn.layer_norm import FusedLayerNorm
    from accel.runtime.optim import FusedAdamW

    monkeypatch.setattr(policy, "helpful_kernels", lambda *_: frozenset({policy.LAYER_NORM, policy.ADAM}))
    ref, model = tiny_bert(), tiny_bert()
    accel.accelerate(model, config=cpu_config(compile=False))
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(type(m) is FusedLayerNorm for m in norms)
    assert type(torch.optim.AdamW(model.parameters())) is FusedAdamW
    assert model.state_dict().keys() == ref.state_dict().keys()
    batch = pad_to_longest(samples([6, 4]))
    torch.testing.assert_close(model(**batch).logits, ref(**batch).logits, rtol=1e-5, atol=1e-6)


def test_no_kernels_where_torch_wins_or_when_switched_off(monkeypatch):
    from accel.runtime import policy

    accel.accelerate(tiny_bert(), config=cpu_config(compile=False))  # the measured policy: neither wins today
    assert not hooks.fused_layer_norm_enabled() and not hooks.fused_adam_enabled()
    monkeypatch.setattr(policy, "helpful_kernels", lambda *_: frozenset({policy.LAYER_NORM, policy.ADAM}))
    model = accel.accelerate(tiny_bert(), config=cpu_config(compile=False, kernels=False))
    assert all(type(m) is nn.LayerNorm for m in model.modules() if isinstance(m, nn.LayerNorm))
    assert not hooks.fused_adam_enabled()


def dropping_bert(p=0.2):
    """tiny_bert with every dropout layer at p."""
    model = tiny_bert()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
    return model


def test_cpu_dropout_layers_switch_to_philox_dropout_in_this_model_only():
    """The measured policy on the CPU: this model's nn.Dropout layers draw with accel's Philox kernel; no
    process-wide hook, so a model built afterwards (a peer in the same process) keeps torch's dropout."""
    from accel.runtime import policy
    from accel.runtime.nn.bias_dropout_add import PhiloxDropout

    assert policy.helpful_kernels("cpu", True, None) == {policy.DROPOUT} == policy.helpful_kernels("cpu", False, None)
    assert not policy.helpful_kernels("cuda", True, torch.bfloat16) and not policy.helpful_kernels("xla", False, None)

    ref, model = dropping_bert(), dropping_bert()
    accel.accelerate(model, config=cpu_config(compile=False))
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    # embeddings, 3 a layer (attention probabilities, attention output, output), classifier
    assert len(dropouts) == 1 + 3 * 2 + 1 and all(type(m) is PhiloxDropout and m.p == 0.2 for m in dropouts)
    assert not hooks.philox_dropout_enabled() and type(nn.Dropout(0.1)) is nn.Dropout
    assert all(type(m) is nn.Dropout for m in dropping_bert().modules() if isinstance(m, nn.Dropout))
    assert model.state_dict().keys() == ref.state_dict().keys()
    batch = pad_to_longest(samples([6, 4]))
    model.eval(), ref.eval()
    torch.testing.assert_close(model(**batch).logits, ref(**batch).logits, rtol=1e-5, atol=1e-6)
    model.train()
    torch.manual_seed(1)
    first = model(**batch).logits
    assert not torch.allclose(first, model(**batch).logits)  # it drops, a new mask each call
    unswitched = accel.accelerate(dropping_bert(), config=cpu_config(compile=False, kernels=False))
    assert all(type(m) is nn.Dropout for m in unswitched.modules() if isinstance(m, nn.Dropout))


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_checkpointed_blocks_recompute_the_same_philox_masks(compile):
    """memory.gc recomputes each block's forward in the backward: its dropout must draw the masks of the first
    forward (torch's checkpoint restores the generator; compiled, AOTAutograd saves and replays its state around
    accel::dropout_mask), so gradients equal those of the same model without checkpointing. One dropout layer
    draws (inside a checkpointed block): Inductor may order the draws of several layers differently in the two
    compiled graphs, which would change which layer gets which mask, not whether a recompute repeats one."""
    batch = pad_to_longest(samples([6, 4, 5]))
    grads = []
    for gc in (False, True):
        config = cpu_config(compile=compile)
        config.memory.gc = gc
        model = tiny_bert()
        model.bert.encoder.layer[0].output.dropout.p = 0.3
        model = accel.accelerate(model, config=config)
        torch.manual_seed(3)
        model(**batch).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_adam_at_its_defaults_switches_to_the_fused_kernel_and_trains_the_same():
    ref, model = tiny_bert(), tiny_bert()
    accel.accelerate(model, config=cpu_config(compile=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    kept = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)  # an explicit choice stays
    batches = [pad_to_longest(samples([6, 4], seed=s)) for s in range(3)]
    losses, ref_losses = train(model, batches, opt), train(ref, batches, ref_opt)
    kept.step()
    assert uses_fused_kernel(opt) and not uses_fused_kernel(ref_opt) and not uses_fused_kernel(kept)
    assert not has_compiled_step(opt)  # eager model: steps stay eager
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_other_optimizers_get_a_compiled_step_that_trains_like_eager():
    """SGD is not one fused kernel: with compile on, its step is compiled from the second call on."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model = copy.deepcopy(ref)
    accel.accelerate(model, config=cpu_config())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert has_compiled_step(opt) and not has_compiled_step(ref_opt)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_optimizer_cuda_graphs_reach_only_steps_over_cuda_parameters():
    # CUDA graphs replay CUDA work only: on the CPU the option leaves the compiled step a plain compiled one
    model = nn.Linear(4, 2)
    accel.accelerate(model, config=cpu_config(optimizer_cuda_graphs=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert has_compiled_step(opt) and not has_cuda_graph_step(opt)


@pytest.mark.parametrize("gc_cls, gc_cnt, expected", [
    (None, None, ["bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2"]),
    ({"BertLayer"}, 2, ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
])
def test_gc_checkpoints_named_or_found_blocks(gc_cls, gc_cnt, expected):
    config = cpu_config(compile=False, kernels=False)
    config.memory.gc, config.memory.gc_cls, config.memory.gc_cnt = True, gc_cls, gc_cnt
    ref, model = tiny_bert(layers=3), tiny_bert(layers=3)
    accel.accelerate(model, config=config)
    assert checkpoint_plan(model).checkpointed == expected
    batch = pad_to_longest(samples([6, 4]))
    ref(**batch).loss.backward()
    model(**batch).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def tiny_llama_classifier(seed=0, layers=2):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                   num_labels=2, pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.LlamaForSequenceClassification(cfg).train()


# (model builder, the last layer's query projection): an encoder's classifier reads the first token, a decoder's
# the last that is not padding
ONE_TOKEN_CLASSIFIERS = {
    "bert": (tiny_bert, lambda model: model.bert.encoder.layer[-1].attention.self.query),
    "llama": (tiny_llama_classifier, lambda model: model.model.layers[-1].self_attn.q_proj),
}


@pytest.mark.parametrize("gc", [False, True])
@pytest.mark.parametrize("family", sorted(ONE_TOKEN_CLASSIFIERS))
def test_a_one_token_classifier_computes_one_token_in_its_last_layer(family, gc):
    """compute.first_token_only (on by default; accel.compiler.first_token): the last layer's query projection
    sees one token, checkpointed or not, and the gradients are the full model's; off, it sees every token."""
    build, query_projection = ONE_TOKEN_CLASSIFIERS[family]
    batch = pad_to_longest(samples([6, 4]))
    for on in (True, False):
        config = cpu_config(compile=False, kernels=False, first_token_only=on)
        config.memory.gc = gc
        ref, model = build(layers=3), build(layers=3)
        accel.accelerate(model, config=config)
        seen = []
        query_projection(model).register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
        ref(**batch).loss.backward()
        model(**batch).loss.backward()
        assert seen == ([1] if on else [6] * (2 if gc else 1))  # a checkpointed layer runs again in backward
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("compile", [False, True])
def test_fuse_qkv_projects_with_one_gemm_and_trains_the_same(compile):
    """compute.fuse_qkv (off by default; accel.compiler.fused_qkv): every self-attention's forward is the fused
    one, alone or with the first-token last layer, and losses and weights follow the plain model's."""
    from accel.compiler.fused_qkv import _FusedQKVForward
    from accel.utils.instance_forward import installed_forward

    torch._dynamo.reset()
    for on in (False, True):
        ref, model = tiny_bert(layers=3), tiny_bert(layers=3)
        model = accel.accelerate(model, config=cpu_config(compile=compile, fuse_qkv=on))
        inner = model._orig_mod if hasattr(model, "_orig_mod") else model
        attentions = [layer.attention.self for layer in inner.bert.encoder.layer]
        assert [isinstance(installed_forward(a), _FusedQKVForward) for a in attentions] == [on] * 3
        opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for lengths in ([6, 4], [5, 5]):
            batch = pad_to_longest(samples(lengths))
            loss, ref_loss = model(**batch).loss, ref(**batch).loss
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            for o, value in ((opt, loss), (ref_opt, ref_loss)):
                value.backward()
                o.step()
                o.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- loaders

def test_unpadded_batches_reach_an_sdpa_encoder_without_a_mask():
    """Without packing the model's "sdpa" attention becomes "accel_sdpa" (accel.compiler.unpadded_attention);
    with dataloader.drop_full_masks a batch's all-ones mask is dropped on the host (accel.data.full_mask) and a
    padded batch keeps its mask. The losses are the unchanged model's on the loader's own batches."""
    lengths = [6, 6, 4, 9]  # batches (6, 6): no padding; (4, 9): padded
    ref = tiny_bert()
    assert ref.config._attn_implementation == "sdpa"
    config = cpu_config(compile=False, kernels=False)
    model, wrapped = accel.accelerate(tiny_bert(), loader(lengths), config)
    assert model.config._attn_implementation == "accel_sdpa"
    assert all("attention_mask" in b for b in wrapped)  # off by default: the loop sees its own batches
    config.dataloader.drop_full_masks = True
    model, wrapped = accel.accelerate(tiny_bert(), loader(lengths), config)
    batches = list(wrapped)
    assert "attention_mask" not in batches[0] and "attention_mask" in batches[1]
    for got, plain in zip(batches, loader(lengths)):
        torch.testing.assert_close(model(**got).loss, ref(**plain).loss, rtol=1e-5, atol=1e-6)

    packed = cpu_config(compile=False, kernels=False)
    packed.dataloader.pack, packed.dataloader.max_length = True, 32
    model, _ = accel.accelerate(tiny_bert(), loader(lengths), packed)
    # packed rows always carry their document mask (test_packed runs them through accel_sdpa), and their
    # attention applies the model's own dropout layer where accelerate() swapped it
    assert model.model.config._attn_implementation == "accel_sdpa"


def test_bucketed_loader_produces_only_bucket_shapes_with_the_same_data():
    config = cpu_config(compile=False, kernels=False)
    config.dataloader.buckets = [8, 16, 32]
    _, wrapped = accel.accelerate(tiny_bert(), loader(), config)
    seen = []
    for got, plain in zip(wrapped, loader()):
        width, n = got["input_ids"].shape[1], plain["input_ids"].shape[1]
        seen.append(width)
        assert width == min(b for b in (8, 16, 32) if b >= n)
        assert torch.equal(got["input_ids"][:, :n], plain["input_ids"])
        assert torch.equal(got["attention_mask"][:, :n], plain["attention_mask"])
        assert not got["input_ids"][:, n:].any() and not got["attention_mask"][:, n:].any()
        assert torch.equal(got["labels"], plain["labels"])
    assert seen == [16, 32, 32, 16]


def _gpt2_classifier(pad_token_id):
    torch.manual_seed(0)
    return transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, num_labels=2, pad_token_id=pad_token_id, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)).eval()


def test_buckets_pad_input_ids_with_the_models_pad_token():
    """A decoder's classifier takes each row's last token that is not config.pad_token_id: bucket padding with
    TorchAcc's default 0 would be read as tokens. Its loader pads as its tokenizer does (pad id 50)."""
    pad = 50

    def pad_with(batch):
        out = pad_to_longest(batch)
        out["input_ids"] = out["input_ids"].masked_fill(out["attention_mask"] == 0, pad)
        return out

    data = samples(LENGTHS)
    reference = _gpt2_classifier(pad)
    config = cpu_config(compile=False, kernels=False)
    config.dataloader.buckets = [16, 32]
    model, wrapped = accel.accelerate(copy.deepcopy(reference), torch.utils.data.DataLoader(data, batch_size=2, collate_fn=pad_with),
                                      config)
    with torch.no_grad():
        for got, plain in zip(wrapped, torch.utils.data.DataLoader(data, batch_size=2, collate_fn=pad_with)):
            n = plain["input_ids"].shape[1]
            assert (got["input_ids"][:, n:] == pad).all()
            torch.testing.assert_close(model(**got).logits, reference(**plain).logits)
    # a pad value the user set stays, and a model without a pad token keeps TorchAcc's 0
    config.dataloader.pad_value_dict["input_ids"] = 7
    _, wrapped = accel.accelerate(_gpt2_classifier(pad), torch.utils.data.DataLoader(data, batch_size=2, collate_fn=pad_to_longest),
                                  config)
    assert (next(iter(wrapped))["input_ids"][:, 9:] == 7).all()  # the first batch: lengths 5 and 9, bucket 16
    config.dataloader.pad_value_dict["input_ids"] = 0
    _, wrapped = accel.accelerate(_gpt2_classifier(None), torch.utils.data.DataLoader(data, batch_size=2, collate_fn=pad_to_longest),
                                  config)
    assert not next(iter(wrapped))["input_ids"][:, 9:].any()


@pytest.mark.parametrize("background", [True, False, None], ids=["thread", "inline", "default"])
def test_background_prefetch_says_which_thread_reads_the_loader(background):
    # None: no thread on the CPU, whose cores the step's own threads use
    config = cpu_config(compile=False, kernels=False)
    if background is not None:
        config.dataloader.background_prefetch = background
    assert accel.Config().dataloader.background_prefetch is None
    _, wrapped = accel.accelerate(tiny_bert(), loader(), config)
    got, prefetch_thread_alive = [], []
    for batch in wrapped:
        got.append(batch)
        prefetch_thread_alive.append(any(t.name.startswith("accel-Prefetcher") for t in threading.enumerate()))
    expected = list(loader())
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(prefetch_thread_alive) == bool(background)


def test_a_second_call_wraps_an_evaluation_loader_alone():
    # The returned model given again with an evaluation loader: the same model back (not accelerated twice) and
    # the loader wrapped with this call's dataloader section; evaluation gives the plain model's logits.
    config = cpu_config(compile=False)
    config.dataloader.buckets = [16, 32]
    reference = tiny_bert().eval()
    model, _ = accel.accelerate(copy.deepcopy(reference), loader(), config)
    eval_config = cpu_config(compile=False)
    eval_config.dataloader.buckets = [32]
    again, eval_loader = accel.accelerate(model, loader([4, 6, 21, 9]), eval_config)
    assert again is model
    model.eval()
    with torch.no_grad():
        for batch in eval_loader:
            assert batch["input_ids"].shape[1] == 32  # this call's buckets
            torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-5)


def test_a_second_call_makes_room_for_the_evaluation_loaders_graphs():
    # Training graphs for 4 buckets (and shorter last batches), evaluation graphs (no_grad, eval mode) for 4 more:
    # past Dynamo's limit a new training shape would run uncompiled for the rest of the run.
    import torch._dynamo

    # Restored by hand: pytest's monkeypatch undoes it with delattr, which hides a torch config for good.
    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 8
    try:
        config = cpu_config()
        config.dataloader.buckets = [8, 16, 24, 32]
        model, _ = accel.accelerate(tiny_bert(), loader(), config)
        assert torch._dynamo.config.recompile_limit == 8 + 2 * 4 + 2
        eval_config = cpu_config()
        eval_config.dataloader.buckets = [12, 20, 28, 36]
        accel.accelerate(model, loader(), eval_config)
        assert torch._dynamo.config.recompile_limit == 8 + 2 * (4 + 4) + 2 * 2
    finally:
        torch._dynamo.config.recompile_limit = before


def test_model_after_model_in_one_process_each_runs_compiled():
    """A sweep or a test suite accelerates model after model: Dynamo's recompile limit counts the graphs of the
    models gone before (they share the code objects of their forward), so with a fixed limit the ninth ran
    uncompiled; each accelerate() now makes room for its own graphs."""
    import gc

    import torch._dynamo
    from torch._dynamo.utils import counters

    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 8  # Dynamo's default
    try:
        for i in range(10):
            torch.manual_seed(i)
            cfg = tiny_bert().config
            cfg.vocab_size = VOCAB + i  # a graph of its own (a model built alike runs the graphs of the one before)
            model = accel.accelerate(transformers.BertForMaskedLM(cfg), config=cpu_config())
            compiled = counters["frames"]["ok"]
            model(input_ids=torch.ones(2, 8, dtype=torch.long))
            assert counters["frames"]["ok"] > compiled, f"model {i + 1} ran uncompiled"
            del model
            gc.collect()
    finally:
        torch._dynamo.config.recompile_limit = before


@pytest.mark.parametrize("compute", [{}, {"bf16": False}], ids=["default", "fp32"])
def test_a_model_built_like_one_before_runs_its_graphs_with_its_own_weights(compute):
    """A sweep, cross-validation or a notebook cell run again accelerates a model built like the one before: its
    calls run the graphs compiled for the first (Dynamo forbidden to compile), computing with its own weights.
    Each accelerate() used to compile anew (accel's graph passes and instance forwards made every model's
    compiled call differ: 15 s a BERT-base on this CPU)."""
    torch._dynamo.reset()
    batch = {"input_ids": torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0)),
             "labels": torch.tensor([0, 1, 1, 0])}
    first = accel.accelerate(tiny_bert(seed=0), config=cpu_config(**compute))
    first(**batch).loss.backward()
    second = accel.accelerate(tiny_bert(seed=1), config=cpu_config(**compute))
    with torch.compiler.set_stance("fail_on_recompile"):
        out = second(**batch)
        out.loss.backward()
        # the graph the first model compiled, run on the second's weights: not on its own
        first_logits = first(**batch).logits
    eager = accel.accelerate(tiny_bert(seed=1), config=cpu_config(compile=False, **compute))
    expected = eager(**batch)
    expected.loss.backward()
    tol = {"rtol": 1e-4, "atol": 1e-5} if compute else {"rtol": 2e-2, "atol": 1e-3}  # default: bf16 where native
    torch.testing.assert_close(out.logits, expected.logits, **tol)
    assert (first_logits - out.logits).abs().max() > 0.01  # logits of about 0.02
    for (name, p), q in zip(second.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)


def test_a_hook_runs_on_a_model_that_runs_anothers_graphs_and_when_registered_after_a_call():
    """Dynamo skips guards on modules' hooks by default: a forward hook on a layer of a model built like one
    before (which runs that model's graphs), or one registered after the first call, never ran. accelerate()
    turns those guards on (accel.utils.dynamo.guard_module_hooks)."""
    import torch._dynamo

    before = torch._dynamo.config.skip_nnmodule_hook_guards
    torch._dynamo.config.skip_nnmodule_hook_guards = True  # torch's default
    torch._dynamo.reset()
    try:
        batch = {"input_ids": torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0)),
                 "labels": torch.tensor([0, 1, 1, 0])}
        first = accel.accelerate(tiny_bert(seed=0), config=cpu_config())
        first(**batch)
        second, seen = tiny_bert(seed=1), []
        second.bert.encoder.layer[0].register_forward_hook(lambda module, args, out: seen.append(module))
        second = accel.accelerate(second, config=cpu_config())
        second(**batch)
        assert seen == [second.bert.encoder.layer[0]]
        first.bert.encoder.layer[1].register_forward_hook(lambda module, args, out: seen.append(module))
        first(**batch)
        assert seen[1:] == [first.bert.encoder.layer[1]]
    finally:
        torch._dynamo.config.skip_nnmodule_hook_guards = before


@pytest.mark.filterwarnings("ignore:dataloader.pack. the loader's collate_fn")  # packing replaces pad_to_longest
def test_a_second_call_on_a_packed_model_keeps_one_wrapper_and_names_what_it_cannot_do():
    from accel.compiler.packed import PackedModel

    config = cpu_config(compile=False)
    config.dataloader.pack, config.dataloader.max_length = True, 32
    model, _ = accel.accelerate(tiny_bert(), loader(), config)
    again, eval_loader = accel.accelerate(model, loader(), config)
    assert again is model and isinstance(model, PackedModel) and not isinstance(model.model, PackedModel)
    assert "segment_ids" in next(iter(eval_loader))  # packed as asked
    with pytest.warns(UserWarning, match=r"config.compute of the first call stay"):
        _, plain = accel.accelerate(model, loader(), cpu_config(compile=False, kernels=False))
    assert "segment_ids" not in next(iter(plain))  # ordinary batches, which the packed model takes too
    with pytest.warns(UserWarning, match="no dataloader was given"):
        assert accel.accelerate(model) is model
    unpacked, _ = accel.accelerate(tiny_bert(), loader(), cpu_config(compile=False))
    with pytest.raises(ValueError, match="dataloader.pack: the model was accelerated without packing"):
        accel.accelerate(unpacked, loader(), config)


def test_a_batch_longer_than_every_bucket_is_an_error():
    config = cpu_config(compile=False, kernels=False)
    config.dataloader.buckets = [8, 16]
    _, wrapped = accel.accelerate(tiny_bert(), loader(), config)
    with pytest.raises(ValueError, match="longer than the largest bucket 16"):
        list(wrapped)


# --------------------------------------------------------------------------- the compiled path on the CPU

@pytest.mark.slow
def test_compiled_training_matches_eager():
    """torch.compile (Inductor on the CPU) of the model, one graph per bucket, with torch's fused AdamW
    (not compiled on the CPU: one C++ loop already): the same losses and weights as the plain model
    trained on the unpadded batches."""
    torch._dynamo.reset()
    ref, model = tiny_bert(), tiny_bert()
    config = cpu_config()
    config.dataloader.buckets = [16, 32]
    model, wrapped = accel.accelerate(model, loader(), config)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses = train(model, wrapped, opt)
    ref_losses = train(ref, loader(), ref_opt)
    assert uses_fused_kernel(opt) and not has_compiled_step(opt)
    assert not has_graph_pool_grad_check(model)  # no CUDA graphs on the CPU: nothing to copy out of a pool
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)



@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"fallback_random": True}], ids=["defaults", "fallback_random"])
def test_inductor_options_reach_the_compiled_graphs(options):
    """compute.inductor_options are Inductor's settings for the model's graphs: with fallback_random its dropout
    draws torch's own random numbers, so the compiled model gives the uncompiled one's training-mode logits
    under one seed; with Inductor's own random numbers it does not."""
    torch._dynamo.reset()
    models = []
    for compile in (False, True):
        model = tiny_bert()
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.5
        config = cpu_config(compile=compile, kernels=False)
        config.compute.inductor_options = dict(options)
        models.append(accel.accelerate(model, None, config))
    batch = next(iter(loader()))
    logits = []
    for model in models:
        torch.manual_seed(1)
        logits.append(model(**batch)["logits"])
    assert torch.allclose(logits[0], logits[1], rtol=1e-5, atol=1e-6) == bool(options)


@pytest.mark.slow
def test_compiled_bf16_forward_is_one_graph_under_autocast(monkeypatch):
    """compute.bf16 with compile: the autocast region around the forward is traced into the graph (it
    failed inside Dynamo once, found on the first CPU with native bf16), giving eager autocast's logits."""
    monkeypatch.setattr(cpu_module, "native_bf16", lambda: True)
    torch._dynamo.reset()
    ref, model = tiny_bert(), tiny_bert()
    model = accel.accelerate(model, config=cpu_config(kernels=False, bf16=True))
    batch = pad_to_longest(samples([6, 4]))
    logits = model(**batch).logits
    assert logits.dtype is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref(**batch).logits
    torch.testing.assert_close(logits, expected, rtol=0.02, atol=0.02)  # Inductor's bf16 rounding differs
    model(**batch)["logits"].float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype is torch.float32 for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
def test_compiled_fp16_step_with_the_sync_free_scaler_skips_an_inf_step(monkeypatch):
    """The fp16 step of tests/compiler/test_cuda_step.py on the CPU compile path (fp16 autocast forced on):
    compiled forward, accel's GradScaler and a compiled syncfree.AdamW step; an inf loss changes no weight
    and halves the scale."""
    from accel.amp import GradScaler, syncfree

    monkeypatch.setattr(cpu_module, "native_fp16", lambda: True)
    torch._dynamo.reset()
    config = cpu_config(kernels=False, fp16=True)
    config.dataloader.buckets = [32]  # one shape, one graph
    model, wrapped = accel.accelerate(tiny_bert(), loader(LENGTHS * 2, batch_size=2), config)
    opt, scaler = syncfree.AdamW(model.parameters(), lr=1e-3), GradScaler("cpu")
    inf_step = 5
    for i, batch in enumerate(wrapped):
        out = model(**batch)
        assert out["logits"].dtype is torch.float16
        loss = out["loss"] * float("inf") if i == inf_step else out["loss"]
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
        changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
        assert not any(changed) if i == inf_step else any(changed), i
    assert has_compiled_step(opt)
    assert scaler.get_scale() == 2.0**15  # 2^16 halved once, no growth interval reached

# --------------------------------------------------------------------------- xla

@pytest.mark.slow
@pytest.mark.skipif(not xla_available(), reason="the xla backend needs torch_xla")
def test_xla_backend_moves_the_model_and_loads_batches_onto_the_device():
    from accel.data.device_loader import MpDeviceLoader

    ref, model = tiny_bert(), tiny_bert()
    config = Config(backend="xla")
    config.dataloader.buckets = [32]
    model, wrapped = accel.accelerate(model, loader(), config)
    assert isinstance(wrapped.loader, MpDeviceLoader)  # inside the resumable position count
    assert all(p.device.type == "xla" for p in model.parameters())
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for b in wrapped:
        assert b["input_ids"].device.type == "xla" and b["input_ids"].shape[1] == 32
        loss = model(**b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    ref_losses = train(ref, loader(), ref_opt)
    torch.testing.assert_close(torch.stack(losses).cpu(), ref_losses, rtol=1e-4, atol=1e-5)


def test_accelerated_model_deepcopies():
    model = accel.accelerate(tiny_bert(), config=cpu_config(compile=False, kernels=False))
    clone = copy.deepcopy(model)
    batch = pad_to_longest(samples([6, 4]))
    torch.testing.assert_close(clone(**batch).logits, model(**batch).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_recompile_guard_names_the_input_whose_shape_keeps_changing():
    """Opt-in: with no buckets every batch has its own length; after the warm-up the guard names it."""
    from accel.compiler.recompile_guard import RecompileWarning

    torch._dynamo.reset()
    config = cpu_config(kernels=False)
    config.compute.recompile_guard = True
    model, wrapped = accel.accelerate(tiny_bert(), loader([4, 4, 4, 4, 4, 4, 4, 4, 9, 9]), config)
    with pytest.warns(RecompileWarning, match=r"batch\['input_ids'\] dim 1: 4 -> 9"):
        for b in wrapped:
            model(**b)["loss"].backward()
    events = wrapped.recompile_guard.report()
    assert [e.step for e in events if not e.warmup] == [5]


@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_pack_gives_packed_rows_and_the_loss_of_the_samples_alone(fuse_qkv):
    """dataloader.pack: rows of max_length holding several samples; the loss is the mean over samples of
    each sample's loss computed alone (with the projections fused too: the document mask reaches them)."""
    config = cpu_config(compile=False, kernels=False, fuse_qkv=fuse_qkv)
    config.dataloader.pack, config.dataloader.max_length = True, 32
    ref = tiny_bert()
    model, wrapped = accel.accelerate(tiny_bert(), loader(batch_size=4), config)
    seen = []
    for batch in wrapped:
        assert batch["input_ids"].shape[1] == 32 and "segment_ids" in batch
        loss = model(**batch)["loss"]
        per_sample = []
        for row, lens in zip(batch["input_ids"], batch["seq_lens"]):
            start = 0
            for n in lens.tolist():
                if n:
                    sample = row[start:start + n].unsqueeze(0)
                    label = next(s["labels"] for s in samples(LENGTHS) if torch.equal(s["input_ids"], sample[0]))
                    per_sample.append(ref(input_ids=sample, labels=label.view(1)).loss)
                    seen.append(n)
                start += n
        torch.testing.assert_close(loss, torch.stack(per_sample).mean(), rtol=1e-5, atol=1e-6)
    assert sorted(seen) == sorted(LENGTHS)  # every sample exactly once


@pytest.mark.parametrize("cuda_attention", ["mask", "varlen"])
def test_pack_trains_a_causal_lm_on_each_sample_alone(monkeypatch, cuda_attention):
    """dataloader.pack with a causal language model (compiled, as accelerate() runs it by default): each packed
    batch's loss is the loss over the same samples' tokens computed alone, no token learning across a boundary.
    compute.cuda_packed_attention="varlen" reaches the packed model: on the CPU through the varlen kernel's reference
    (tests/_varlen_kernel.py), once a layer ("mask": the CPU's own per-sample attention)."""
    calls = varlen_kernel(monkeypatch) if cuda_attention == "varlen" else []
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).train()
    data = [{"input_ids": s["input_ids"], "labels": s["input_ids"]} for s in samples(LENGTHS)]
    config = cpu_config(kernels=False)
    config.dataloader.pack, config.dataloader.max_length = True, 32
    config.compute.cuda_packed_attention = cuda_attention
    model, wrapped = accel.accelerate(copy.deepcopy(ref), torch.utils.data.DataLoader(data, batch_size=4), config)
    seen = []
    for batch in wrapped:
        loss = model(**batch)["loss"]
        expected, targets = 0.0, 0
        for row, lens in zip(batch["input_ids"], batch["seq_lens"]):
            start = 0
            for n in lens.tolist():
                if n:
                    sample = row[start:start + n].unsqueeze(0)
                    expected = expected + ref(input_ids=sample, labels=sample).loss * (n - 1)
                    targets += n - 1
                    seen.append(n)
                start += n
        torch.testing.assert_close(loss, expected / targets, rtol=1e-4, atol=1e-5)
    assert sorted(seen) == sorted(LENGTHS)
    assert bool(calls) == (cuda_attention == "varlen")


@pytest.mark.parametrize("on", [True, False])
def test_a_packed_classifier_computes_each_samples_first_token_in_its_last_layer(on):
    """dataloader.pack with compute.first_token_only: the last layer's query projection sees one position per
    packed sample (seq_lens' S), not the row; the loss itself is checked against the samples alone above."""
    config = cpu_config(compile=False, kernels=False, first_token_only=on)
    config.dataloader.pack, config.dataloader.max_length = True, 32
    model, wrapped = accel.accelerate(tiny_bert(), loader(batch_size=4), config)
    seen = []
    model.model.bert.encoder.layer[-1].attention.self.query.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[1]))
    batch = next(iter(wrapped))
    model(**batch)["loss"].backward()
    assert seen == [batch["seq_lens"].shape[1] if on else 32] and batch["seq_lens"].shape[1] < 32
