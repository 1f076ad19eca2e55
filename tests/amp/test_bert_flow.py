"""The TorchAcc guide's AMP flow on a tiny BERT, on the XLA device:
autocast() -> scaler.scale(loss).backward() -> scaler.step(syncfree.Adam) -> scaler.update()."""
from __future__ import annotations

import pytest
import torch

from accel.amp import GradScaler, autocast, syncfree

from ._xla import requires_xla, sync, xla_device

transformers = pytest.importorskip("transformers", reason="the BERT flow needs transformers")

STEPS, BATCH, SEQ, VOCAB = 8, 4, 16, 100


@pytest.mark.slow
@requires_xla
def test_tiny_bert_trains_with_autocast_gradscaler_and_syncfree_adam():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    device = xla_device()
    model = transformers.BertForSequenceClassification(config).to(device)
    model.train()
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device),
        "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long).to(device),
        "labels": torch.randint(0, 2, (BATCH,), generator=g).to(device),
    }
    optimizer = syncfree.Adam(model.parameters(), lr=1e-3)
    scaler = GradScaler()

    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        with autocast():
            outputs = model(**inputs)
            loss = outputs["loss"]
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        sync()
        losses.append(loss.detach())

    values = [float(v.cpu()) for v in losses]  # read once, after training
    assert all(torch.isfinite(torch.tensor(values)))
    # one fixed batch: every step lowers the loss
    assert all(b < a for a, b in zip(values, values[1:])), values
    assert values[-1] < values[0] - 0.05, values
    assert scaler.get_scale() == 2.0**16  # bf16 autocast: no overflow, no growth within 8 steps
    assert all(p.device.type == "xla" for p in model.parameters())
    assert optimizer.state[next(model.parameters())]["step"].device.type == "xla"
