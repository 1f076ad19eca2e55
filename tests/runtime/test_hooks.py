import io

import pytest
import torch
from torch import nn

from accel.runtime import hooks
from accel.runtime.nn import onednn_mm
from accel.runtime.nn.bias_dropout_add import PhiloxDropout
from accel.runtime.nn.layer_norm import FusedLayerNorm
from accel.runtime.nn.onednn_mm import OneDNNLinear

from ._params import tol

# The true originals, captured before any test can enable a hook.
TORCH_LAYER_NORM = torch.nn.LayerNorm
TORCH_DROPOUT = torch.nn.Dropout
TORCH_ADAM = torch.optim.Adam
TORCH_ADAMW = torch.optim.AdamW
TORCH_LINEAR = torch.nn.Linear


@pytest.fixture(autouse=True)
def _always_restore():
    """Whatever a test does, later tests see torch's own classes."""
    try:
        yield
    finally:
        hooks.disable_fused_layer_norm()
        hooks.disable_philox_dropout()
        hooks.disable_fused_adam()
        hooks.disable_onednn_linear()
        assert torch.nn.LayerNorm is TORCH_LAYER_NORM and torch.nn.Dropout is TORCH_DROPOUT
        assert torch.nn.Linear is TORCH_LINEAR
        assert torch.optim.Adam is TORCH_ADAM and torch.optim.AdamW is TORCH_ADAMW


def test_layer_norm_hook_swaps_and_restores_the_class():
    assert not hooks.fused_layer_norm_enabled()
    hooks.enable_fused_layer_norm()
    assert hooks.fused_layer_norm_enabled()
    assert torch.nn.LayerNorm is FusedLayerNorm and torch.nn.modules.LayerNorm is FusedLayerNorm
    # the defining module keeps the original: pickling original modules still works
    assert torch.nn.modules.normalization.LayerNorm is TORCH_LAYER_NORM
    m = nn.LayerNorm(8, eps=1e-6)
    assert type(m) is FusedLayerNorm and isinstance(m, TORCH_LAYER_NORM) and m.eps == 1e-6
    buf = io.BytesIO()
    torch.save(TORCH_LAYER_NORM(4), buf)  # would fail if the defining module's name were patched
    hooks.disable_fused_layer_norm()
    assert not hooks.fused_layer_norm_enabled()
    assert torch.nn.LayerNorm is TORCH_LAYER_NORM and torch.nn.modules.LayerNorm is TORCH_LAYER_NORM
    assert type(nn.LayerNorm(8)) is TORCH_LAYER_NORM


def test_dropout_hook_swaps_and_restores_the_class():
    assert not hooks.philox_dropout_enabled()
    hooks.enable_philox_dropout()
    hooks.enable_philox_dropout()
    assert hooks.philox_dropout_enabled()
    assert torch.nn.Dropout is PhiloxDropout and torch.nn.modules.Dropout is PhiloxDropout
    assert torch.nn.modules.dropout.Dropout is TORCH_DROPOUT  # pickling torch's own modules still works
    m = nn.Dropout(0.3)
    assert type(m) is PhiloxDropout and isinstance(m, TORCH_DROPOUT) and m.p == 0.3
    buf = io.BytesIO()
    torch.save(TORCH_DROPOUT(0.1), buf)
    hooks.disable_philox_dropout()
    assert not hooks.philox_dropout_enabled()
    assert torch.nn.Dropout is TORCH_DROPOUT and torch.nn.modules.Dropout is TORCH_DROPOUT
    assert type(nn.Dropout(0.3)) is TORCH_DROPOUT


@pytest.mark.skipif(not onednn_mm.onednn_available(), reason="this torch build has no oneDNN linear op")
@pytest.mark.parametrize("speedup, where_faster, on", [(2.0, True, True), (1.0, True, False), (1.0, False, True)],
                         ids=["faster", "slower", "slower_but_asked"])
def test_linear_hook_follows_the_probe_and_restores_the_class(monkeypatch, speedup, where_faster, on):
    monkeypatch.setattr(onednn_mm, "onednn_speedup", lambda: speedup)
    assert hooks.enable_onednn_linear(where_faster) is on and hooks.onednn_linear_enabled() is on
    assert (torch.nn.Linear is OneDNNLinear) is on and (torch.nn.modules.Linear is OneDNNLinear) is on
    assert torch.nn.modules.linear.Linear is TORCH_LINEAR  # pickling torch's own modules still works
    m = nn.Linear(4, 3, bias=False)
    assert (type(m) is OneDNNLinear) is on and isinstance(m, TORCH_LINEAR) and m.bias is None
    hooks.disable_onednn_linear()
    assert not hooks.onednn_linear_enabled() and type(nn.Linear(4, 3)) is TORCH_LINEAR


def test_enable_twice_and_disable_twice_are_harmless():
    hooks.enable_fused_layer_norm()
    hooks.enable_fused_layer_norm()
    hooks.enable_fused_adam()
    hooks.enable_fused_adam()
    assert torch.nn.LayerNorm is FusedLayerNorm
    hooks.disable_fused_layer_norm()
    hooks.disable_fused_adam()
    # one disable after two enables restores the true originals, not our classes
    assert torch.nn.LayerNorm is TORCH_LAYER_NORM
    assert torch.optim.Adam is TORCH_ADAM and torch.optim.AdamW is TORCH_ADAMW
    hooks.disable_fused_layer_norm()
    hooks.disable_fused_adam()
    assert torch.nn.LayerNorm is TORCH_LAYER_NORM and torch.optim.Adam is TORCH_ADAM


def _tiny_bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertModel(config)


def test_bert_built_after_the_hook_uses_fused_layer_norm_and_matches():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = _tiny_bert()
    hooks.enable_fused_layer_norm()
    fused = _tiny_bert()
    hooks.disable_fused_layer_norm()

    norms = [m for m in fused.modules() if isinstance(m, TORCH_LAYER_NORM)]
    # embeddings + (attention output, output) per layer
    assert len(norms) == 5 and all(type(m) is FusedLayerNorm for m in norms)
    assert not any(isinstance(m, FusedLayerNorm) for m in plain.modules())
    assert fused.state_dict().keys() == plain.state_dict().keys()
    # perturb the norms so the comparison is not against the identity init
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    fused.load_state_dict(plain.state_dict())

    ids = torch.randint(0, 97, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    out_plain = plain(input_ids=ids, attention_mask=mask).last_hidden_state
    out_fused = fused(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-5, atol=1e-5)

    out_plain.square().mean().backward()
    out_fused.square().mean().backward()
    grads_plain = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, grads_plain[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def _steps(opt_cls, weight_decay, n_steps=3, **kwargs):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = opt_cls(model.parameters(), lr=1e-2, weight_decay=weight_decay, **kwargs)
    data = torch.randn(n_steps, 4, 6)
    for x in data:
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    return opt, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name,weight_decay", [("Adam", 0.0), ("Adam", 0.1), ("AdamW", 0.05)])
def test_adam_hook_builds_fused_optimizers_that_step_like_torch(name, weight_decay):
    from accel.runtime.optim import FusedAdam, FusedAdamW

    original = {"Adam": TORCH_ADAM, "AdamW": TORCH_ADAMW}[name]
    _, expected = _steps(original, weight_decay, amsgrad=True)
    hooks.enable_fused_adam()
    assert hooks.fused_adam_enabled()
    assert torch.optim.Adam is FusedAdam and torch.optim.AdamW is FusedAdamW
    opt, got = _steps(getattr(torch.optim, name), weight_decay, amsgrad=True)
    hooks.disable_fused_adam()
    assert type(opt) is {"Adam": FusedAdam, "AdamW": FusedAdamW}[name]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **tol(torch.float32))
    assert torch.optim.Adam is TORCH_ADAM and not hooks.fused_adam_enabled()
