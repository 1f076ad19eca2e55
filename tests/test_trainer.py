"""transformers' Trainer with a model accel.accelerate() returned: it trains as the plain model does (AdamW, and
SGD, whose step accel compiles, under the Trainer's learning-rate schedule; a masked LM whose forward accel
replaced, with the fused loss) and save_model writes what
from_pretrained loads. Run in a subprocess with USE_TORCH_XLA=0, which transformers reads
at import: where torch_xla is installed, Trainer otherwise moves every model to the XLA device (the case
accel.compiler.moved_model explains)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Trainer is transformers'")
pytest.importorskip("accelerate", reason="transformers' Trainer needs HF accelerate (a dependency of peft)")

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json, sys, warnings
import torch, transformers, accel
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

out = sys.argv[1]
config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
g = torch.Generator().manual_seed(0)
data = [{"input_ids": torch.randint(1, 100, (16,), generator=g), "labels": int(i % 2)} for i in range(24)]

graphs = []  # Dynamo's graphs so far, at the end of each training step


class GraphCount(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def train(accelerated, optim="adamw_torch"):
    graphs.clear()
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    if accelerated:
        settings = accel.Config(backend="cpu")
        settings.compute.bf16 = False  # fp32 on both sides, to compare weights
        model = accel.accelerate(model, config=settings)
    args = TrainingArguments(output_dir=out + ("/accel" if accelerated else "/plain"), max_steps=4,
                             per_device_train_batch_size=4, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, seed=0, learning_rate=1e-3, optim=optim,
                             warmup_steps=2)  # a new lr at every step (linear warm-up, then decay)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[GraphCount()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        trainer.evaluate(eval_dataset=data[:10])  # batches of 4, 4 and 2 in eval mode: graphs of their own
    if accelerated:
        trainer.save_model(out + "/saved")
    device = str(next(model.parameters()).device)
    shapes = [str(w.message) for w in caught if type(w.message).__name__ == "ManyShapesWarning"
              or "optimizer.step()" in str(w.message) or "changed between steps" in str(w.message)]
    return accel.unwrap_model(model).state_dict(), device, shapes

torch.manual_seed(0)
initial = BertForSequenceClassification(config).state_dict()
plain, _, _ = train(False)
ours, device, shape_warnings = train(True)
loaded = BertForSequenceClassification.from_pretrained(out + "/saved").state_dict()
# SGD: a step accel compiles, under the Trainer's schedule (its lr reaches the compiled step as a tensor)
plain_sgd, _, _ = train(False, "sgd")
ours_sgd, _, sgd_warnings = train(True, "sgd")
sgd_graphs = list(graphs)  # the model's graph at step 1, the optimizer step's at step 2, then none
# A masked LM with memory.fused_lm_loss: the model's forward an instance forward (as compute.bf16's autocast makes it
# where the CPU has bf16), whose signature Trainer reads to keep the batch's columns (it dropped them all before)
mlm_config = transformers.BertConfig(**{k: v for k, v in config.to_dict().items() if k in (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "max_position_embeddings", "hidden_dropout_prob", "attention_probs_dropout_prob")})
mlm_data = [{"input_ids": d["input_ids"], "labels": torch.where(torch.rand(16, generator=g) < 0.3, d["input_ids"], -100)}
            for d in data]


def train_mlm(accelerated):
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(mlm_config)
    if accelerated:
        settings = accel.Config(backend="cpu")
        settings.compute.bf16 = False
        settings.memory.fused_lm_loss = True
        model = accel.accelerate(model, config=settings)
    args = TrainingArguments(output_dir=out + "/mlm", max_steps=3, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
                             learning_rate=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=mlm_data)
    trainer.train()
    return accel.unwrap_model(model).state_dict(), trainer.evaluate(eval_dataset=mlm_data[:8])["eval_loss"]


plain_mlm, plain_mlm_eval = train_mlm(False)
ours_mlm, ours_mlm_eval = train_mlm(True)
json.dump({"device": device, "shape_warnings": shape_warnings + sgd_warnings,
           "max_diff_mlm": max((plain_mlm[k] - ours_mlm[k]).abs().max().item() for k in plain_mlm),
           "eval_diff_mlm": abs(plain_mlm_eval - ours_mlm_eval),
           "sgd_graphs": sgd_graphs, "max_diff_sgd": max((plain_sgd[k] - ours_sgd[k]).abs().max().item() for k in plain_sgd),
           "max_diff": max((plain[k] - ours[k]).abs().max().item() for k in plain),
           "trained": max((plain[k] - initial[k]).abs().max().item() for k in plain),
           "saved_diff": max((loaded[k] - ours[k]).abs().max().item() for k in loaded),
           "keys_equal": sorted(loaded) == sorted(ours)}, open(out + "/result.json", "w"))
'''


def test_trainer_trains_an_accelerated_model_as_the_plain_one(tmp_path):
    env = dict(os.environ, USE_TORCH_XLA="0", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["device"] == "cpu"  # left where accelerate() put it
    # training's one shape, evaluation's two: nothing to say; nor about the optimizer's step under the schedule
    assert result["shape_warnings"] == []
    assert result["max_diff_sgd"] < 1e-4  # the compiled SGD step followed the scheduled lr...
    graphs = result["sgd_graphs"]
    assert len(graphs) == 4 and graphs[3] == graphs[1], graphs  # ...compiled once (a new lr no longer compiles)
    assert result["trained"] > 1e-3  # the weights did train...
    assert result["max_diff"] < 1e-4  # ...as the plain model's did (compiled fp32 against eager fp32)
    assert result["keys_equal"] and result["saved_diff"] == 0.0  # save_model wrote the trained weights
    # a masked LM whose forward accel replaced (the fused loss) trains under the Trainer as the plain one
    assert result["max_diff_mlm"] < 1e-4 and result["eval_diff_mlm"] < 1e-4
