"""compute.cuda_packed_attention="flex" (accel.compiler.flex_rows): "accel_sdpa" self-attention over packed rows by
FlexAttention with the rows' document BlockMasks, against the same model with the dense document mask.

On CUDA a training step: logits, loss and gradients under bf16 autocast. On the CPU, where Inductor has no
FlexAttention backward (torch 2.9), the route is let through (flex_runs_on) for forward passes without gradients,
in fp32: which calls take FlexAttention, with which BlockMask, and the logits, are checked exactly.
"""
import copy
import warnings

import pytest
import torch

import accel.compiler.flex_rows as flex_rows
import accel.compiler.unpadded_attention as ua
from accel.compiler.packed import PackedModel
from accel.compiler.unpadded_attention import unpadded_attention
from tests.compiler.test_packed import VOCAB, _causal_samples, _close_in_norm, _decoder, _packed, _samples

transformers = pytest.importorskip("transformers")

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))
# each layer's BlockMask, by its mask_mod (accel.compiler.packed.document_mask)
FAMILIES = {"llama": ["same_segment_causal"] * 2, "bert": ["same_segment"] * 2,
            "mistral_window": ["same_segment_window"] * 2, "gemma3": ["same_segment_window", "same_segment_causal"]}


def flex_calls(monkeypatch, device: str) -> list:
    """The BlockMasks FlexAttention is called with, by mask_mod name; on the CPU the route let through."""
    if device == "cpu":
        monkeypatch.setattr(flex_rows, "flex_runs_on", lambda device: True)
    calls = []

    def recorded(query, key, value, block_mask, scale=None):
        calls.append(block_mask.mask_mod.__name__)
        return flex_rows.flex_document_attention(query, key, value, block_mask, scale=scale)

    monkeypatch.setattr(ua, "flex_document_attention", recorded)
    return calls


def _model(family, attn_pdrop=0.0):
    """An "accel_sdpa" model with heads of 16 (FlexAttention's least on CUDA): a Llama (2 query heads over 1
    key/value head), a BERT masked LM, a Mistral whose window of 4 cuts inside rows of 16, a Gemma 3 with a local
    and a global layer; GPT-2 with attention dropout."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                  max_position_embeddings=32)
    if family == "llama":
        model = _decoder("llama", "sdpa")
    elif family == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            **common, num_attention_heads=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    elif family == "mistral_window":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            **common, num_attention_heads=2, num_key_value_heads=1, sliding_window=4))
    elif family == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
            sliding_window_pattern=2))
        assert model.config.layer_types == ["sliding_attention", "full_attention"]
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, attn_pdrop=attn_pdrop))
    model.config._attn_implementation = "sdpa"
    assert unpadded_attention(model)
    return model.train()


def _pair(family, device, **kwargs):
    """(the flex PackedModel, its masked twin with the same weights), and a packed batch on device."""
    model = _model(family, **kwargs).to(device)
    packed, masked = PackedModel(model, cuda_attention="flex"), PackedModel(copy.deepcopy(model))
    masked._passes_kwargs = False  # the document mask alone
    samples = _samples("token") if family == "bert" else _causal_samples(seed=2)
    if family in ("mistral_window", "gemma3"):
        assert max(len(s["input_ids"]) for s in samples) > model.config.sliding_window
    return packed, masked, _packed(samples, device)[1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_rows_take_flex_attention_with_each_layers_block_mask(monkeypatch, family):
    calls = flex_calls(monkeypatch, "cpu")
    packed, masked, batch = _pair(family, "cpu")
    with torch.no_grad():
        out = packed(**batch)
        assert calls == FAMILIES[family]
        want = masked(**batch)
    assert len(calls) == len(FAMILIES[family])  # the masked twin never calls it
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("device", [CUDA])
def test_a_cuda_training_step_matches_the_document_mask(monkeypatch, family, device):
    """bf16 autocast: logits, loss and every gradient within 16-bit rounding of the masked twin's."""
    calls = flex_calls(monkeypatch, device)
    packed, masked, batch = _pair(family, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = packed(**batch)
        want = masked(**batch)
    assert calls == FAMILIES[family]
    out.loss.backward()
    want.loss.backward()
    _close_in_norm(out.logits, want.logits, 2e-2)
    _close_in_norm(out.loss, want.loss, 1e-2)
    reference = dict(masked.model.named_parameters())
    largest = max(param.grad.float().norm() for param in masked.model.parameters())
    for name, param in packed.model.named_parameters():
        _close_in_norm(param.grad, reference[name].grad, 5e-2, floor=1e-3 * largest)


def test_calls_flex_attention_cannot_take_keep_the_mask(monkeypatch):
    """Attention dropout while training (GPT-2's attn_pdrop: FlexAttention has none) keeps the mask, eval takes
    FlexAttention; heads narrower than 16 (a BERT of 4 heads of 8) keep the mask; a model told "mask" or
    "varlen" builds no BlockMask."""
    calls = flex_calls(monkeypatch, "cpu")
    packed, _, batch = _pair("gpt2", "cpu", attn_pdrop=0.1)
    with torch.no_grad():
        packed(**batch)
        assert calls == []
        packed.eval()(**batch)
        assert calls == ["same_segment_causal"] * 2
    calls.clear()
    narrow = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))
    assert unpadded_attention(narrow)
    _, token_batch = _packed(_samples("token"), "cpu")
    with torch.no_grad():
        want = PackedModel(copy.deepcopy(narrow))(**token_batch).logits
        torch.testing.assert_close(PackedModel(narrow, cuda_attention="flex")(**token_batch).logits, want)
        packed, _, batch = _pair("llama", "cpu")
        packed.cuda_attention = "mask"
        packed(**batch)
    assert calls == []
    with pytest.raises(ValueError, match="cuda_attention: expected one of 'auto', 'mask', 'varlen', 'flex', got 'dense'"):
        PackedModel(_model("llama"), cuda_attention="dense")


def test_auto_takes_flex_for_long_causal_rows_only(monkeypatch):
    """"auto" (the default): FlexAttention for a decoder's rows of AUTO_MIN_ROW tokens or more, the mask for shorter
    rows and for an encoder's rows of any length."""
    assert flex_rows.AUTO_MIN_ROW == 1024
    assert [flex_rows.route_for("auto", True, n) for n in (1023, 1024, 4096)] == ["mask", "flex", "flex"]
    assert flex_rows.route_for("auto", False, 4096) == "mask"
    assert [flex_rows.route_for(r, True, 4096) for r in ("mask", "varlen", "flex")] == ["mask", "varlen", "flex"]
    calls = flex_calls(monkeypatch, "cpu")
    llama, bert = PackedModel(_model("llama")), PackedModel(_model("bert"))
    assert llama.cuda_attention == bert.cuda_attention == "auto"
    _, llama_batch = _packed(_causal_samples(seed=2), "cpu")
    _, bert_batch = _packed(_samples("token"), "cpu")
    with torch.no_grad():
        llama(**llama_batch), bert(**bert_batch)
        assert calls == []  # rows of 16
        monkeypatch.setattr(flex_rows, "AUTO_MIN_ROW", llama_batch["input_ids"].shape[1])
        llama(**llama_batch), bert(**bert_batch)
    assert calls == FAMILIES["llama"]


def test_flex_fits_asks_for_cuda_heads_of_16_and_one_length(monkeypatch):
    q, k = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    assert flex_rows.flex_runs_on(torch.device("cuda")) and not flex_rows.flex_runs_on(torch.device("cpu"))
    assert not flex_rows.flex_fits(q, k)  # the CPU
    monkeypatch.setattr(flex_rows, "flex_runs_on", lambda device: True)
    assert flex_rows.flex_fits(q, k)  # grouped key/value heads
    assert not flex_rows.flex_fits(q[..., :8], k[..., :8])  # heads of 8
    assert not flex_rows.flex_fits(q, k[:, :, :4])  # keys of another length (cross-attention, a cut query)
    assert not flex_rows.flex_fits(q, torch.zeros(1, 3, 8, 16))  # 3 key heads do not divide 4


@pytest.mark.parametrize("device", [CUDA])
def test_uncompiled_calls_of_ever_changing_lengths_stay_fused(device):
    """Outside a compiled graph (compute.compile=False) FlexAttention is called compiled, and rows of a new length
    every call (flattened rows without buckets) reuse one graph of symbolic lengths from the second length on: no
    recompilation per length, so no fall back to the unfused reference past Dynamo's recompile limit (8), which
    dynamic=False reached (also in a process that imported torch_xla, which turns automatic dynamic shapes off).
    Forward and backward, each length's output and gradients against SDPA with the dense document mask. CUDA only:
    on the CPU, where only tests let FlexAttention through, Inductor's template cannot compile symbolic lengths
    (torch 2.9 and 2.14) and the calls stay static."""
    from torch._dynamo.utils import counters

    from accel.compiler.packed import FLEX, document_mask

    torch._dynamo.reset()  # the earlier tests' graphs of flex_attention count against the same limit
    graphs = counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without torch.compile.*")  # the unfused reference
        for length in range(64, 64 + 12 * 24, 24):  # 12 lengths
            segments = (torch.arange(length, device=device) // 40 + 1).expand(2, length).contiguous()
            q, k, v = (torch.randn(2, 4, length, 16, device=device, requires_grad=True) for _ in range(3))
            out = flex_rows.flex_document_attention(q, k, v, document_mask(segments, FLEX, causal=True))
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            expected = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=document_mask(segments, "sdpa", causal=True))
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            for grad, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
                torch.testing.assert_close(grad, want, rtol=1e-3, atol=1e-3)
    # the first length; symbolic lengths within one block of 128 (a dimension of 1 is never symbolic); then any
    assert counters["stats"]["unique_graphs"] - graphs <= 3


@pytest.mark.parametrize("device", [CUDA])
def test_accelerate_trains_with_flex_attention_as_with_the_mask(device):
    """Through accelerate() (compiled, CUDA graphs, fp32): the BlockMasks built inside the compiled graph, the same
    losses step after step as compute.cuda_packed_attention="mask"."""
    import accel

    data = [{"input_ids": s["input_ids"], "labels": s["input_ids"]} for s in _causal_samples(seed=2)]
    losses = {}
    for route in ("mask", "flex"):
        config = accel.Config(backend=device)
        config.compute.kernels = False
        config.compute.cuda_packed_attention = route
        config.dataloader.pack, config.dataloader.max_length = True, 16
        model, loader = accel.accelerate(_model("llama"), torch.utils.data.DataLoader(data, batch_size=4), config)
        assert [m.cuda_attention for m in model.modules() if isinstance(m, PackedModel)] == [route]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[route] = []
        for batch in loader:
            loss = model(**batch)["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[route].append(loss.item())
    assert len(losses["flex"]) >= 2
    torch.testing.assert_close(losses["flex"], losses["mask"], rtol=1e-3, atol=1e-4)
