"""fuse_qkv: one projection GEMM per self-attention, and nothing the model returns changes beyond rounding. The
reference is the same model, unchanged (a deep copy with the same weights)."""
import copy
import pickle

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="the fused self-attention is a transformers module's")

from accel.compiler.first_token import first_token_only  # noqa: E402
from accel.compiler.fused_qkv import fuse_qkv, fused_projections  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ENCODERS = ["BertForSequenceClassification", "RobertaForSequenceClassification", "ElectraForMaskedLM",
            "BertForMaskedLM"]


def _model(name: str, attention: str = "sdpa", layers: int = 2, dropout: float = 0.0, **extra):
    torch.manual_seed(0)
    config_class = getattr(transformers, name.split("For")[0] + "Config")
    config = config_class(vocab_size=99, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                          intermediate_size=37, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                          max_position_embeddings=64, num_labels=3, embedding_size=32, **extra)
    config._attn_implementation = attention
    return getattr(transformers, name)(config)


def _batch(padded: bool = True, device: str = "cpu"):
    torch.manual_seed(1)
    ids = torch.randint(3, 99, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    if padded:
        mask[1:, 6:] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "labels": torch.randint(0, 3, (3,)).to(device)}


def _step(model, batch):
    if "MaskedLM" in type(model).__name__:
        batch = dict(batch, labels=batch["input_ids"])
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _linear_calls(model) -> list[int]:
    """Counts the calls of every nn.Linear's F.linear (fused or not) through a dispatch-level count of addmm/mm."""
    calls = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
                calls.append(args[-1].shape[-1])
            return func(*args, **(kwargs or {}))

    return calls, Count


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ENCODERS)
def test_same_logits_loss_and_gradients_as_the_unfused_model(name, attention):
    model = _model(name, attention)
    reference = copy.deepcopy(model)
    assert fuse_qkv(model) == 2
    batch = _batch()
    logits, loss, grads = _step(model, batch)
    ref_logits, ref_loss, ref_grads = _step(reference, batch)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_one_projection_gemm_per_layer_forward():
    model = _model("BertForSequenceClassification")
    reference = copy.deepcopy(model)
    fuse_qkv(model)
    batch = {k: v for k, v in _batch(padded=False).items() if k != "labels"}
    widths = {}
    for key, m in (("fused", model), ("reference", reference)):
        calls, Count = _linear_calls(m)
        with Count():
            m(**batch)
        widths[key] = calls
    # two layers: one 96-wide product each instead of three 32-wide ones; everything else unchanged
    assert widths["fused"].count(96) == 2 and widths["reference"].count(96) == 0
    assert len(widths["reference"]) - len(widths["fused"]) == 2 * 2


@pytest.mark.parametrize("device", DEVICES)
def test_fused_projections_equal_the_three_linears(device):
    attn = _model("BertForSequenceClassification").to(device).bert.encoder.layer[0].attention.self
    x = torch.randn(2, 5, 32, device=device)
    q, k, v = fused_projections(attn, x)
    for got, linear in zip((q, k, v), (attn.query, attn.key, attn.value)):
        want = linear(x).view(2, 5, 4, 8).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_training_with_dropout_moves_the_same_parameters():
    """With dropout the random numbers differ only in where they fall: every parameter still gets a gradient,
    and an optimizer step changes the weights of all three projections."""
    model = _model("BertForSequenceClassification", dropout=0.1)
    fuse_qkv(model)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, _batch())
    opt.step()
    for name in ("query", "key", "value"):
        p = f"bert.encoder.layer.0.attention.self.{name}.weight"
        assert not torch.equal(dict(model.named_parameters())[p], before[p]), p


def test_state_dict_hooks_and_pickling_unchanged():
    model = _model("BertForSequenceClassification")
    keys = list(model.state_dict())
    fuse_qkv(model)
    assert fuse_qkv(model) == 2  # a second call changes nothing
    assert list(model.state_dict()) == keys
    clone = pickle.loads(pickle.dumps(model))
    batch = _batch()
    torch.testing.assert_close(clone(**batch).logits, model(**batch).logits)
    # a hook on a projection must see its call: the module's own forward runs
    seen = []
    model.bert.encoder.layer[0].attention.self.key.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    model(**batch)
    assert seen == [torch.Size([3, 9, 32])]


def test_left_alone_where_it_does_not_apply():
    assert fuse_qkv(nn.Linear(2, 2)) == 0
    lm = transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37,
        is_decoder=True))
    assert fuse_qkv(lm) == 0
    # a self-attention with an instance forward of someone else's keeps it
    model = _model("BertForSequenceClassification")
    attn = model.bert.encoder.layer[0].attention.self
    own = type(attn).forward.__get__(attn)
    attn.forward = own
    assert fuse_qkv(model) == 1 and attn.forward is own
    # projections replaced by something else than nn.Linear (a LoRA-like wrapper) stay unfused, per call
    model = _model("BertForSequenceClassification")
    fuse_qkv(model)
    reference = copy.deepcopy(model)

    class Wrapped(nn.Linear):
        pass

    attn = model.bert.encoder.layer[1].attention.self
    wrapped = Wrapped(32, 32)
    wrapped.load_state_dict(attn.value.state_dict())
    attn.value = wrapped
    batch = _batch()
    torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-6)


def test_the_first_token_layer_takes_keys_and_values_from_one_gemm():
    model = _model("BertForSequenceClassification")
    reference = copy.deepcopy(model)
    first_token_only(model)
    fuse_qkv(model)
    batch = _batch()
    calls, Count = _linear_calls(model)
    with Count():
        logits = model(**batch).logits
    # layer 0: query, key and value in one 96-wide product; the last layer: its query alone (32 wide, one
    # token), key and value in one 64-wide product
    assert calls.count(96) == 1 and calls.count(64) == 1, calls
    torch.testing.assert_close(logits, reference(**batch).logits, rtol=1e-5, atol=1e-6)


def test_with_first_token_only_and_compile():
    model = _model("BertForSequenceClassification")
    reference = copy.deepcopy(model)
    first_token_only(model)
    fuse_qkv(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    batch = _batch()
    logits, loss, _ = _step(compiled, batch)
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref_logits, ref_loss, ref_grads = _step(reference, batch)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
