"""One rank of the distributed memory.fused_lm_loss test, started by xlarun (gloo, CPU).

    python -m accel.launch --nproc_per_node=2 tests/distributed/_lm_worker.py OUT_DIR MODE[,MODE...]

Each mode (ddp, fsdp: dist.fsdp.size=2; *_lora: the model with peft's LoRA adapters, new_lora_lm; *_mlm: the
masked LM new_mlm on masked_samples) trains tests/distributed/_lm_worker.new_lm() through accel.accelerate()
with memory.fused_lm_loss (the loss computed from lm_head's weight, not through lm_head's forward, which is
where FSDP2 would gather it; a masked LM's tied decoder likewise) and writes OUT_DIR/<MODE>.pt from rank 0: the full state dict, and whether
every training call returned no logits; and, through accel.save_model, OUT_DIR/<MODE>_model/ (save_pretrained's
files).
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import accel  # noqa: E402

BATCH = 2  # per rank
LR = 0.5


def new_lm():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, tie_word_embeddings=False)).train()


def new_lora_lm():
    """new_lm() with LoRA adapters on its query and value projections (peft), random from the start (B not zero)."""
    import peft

    model = new_lm()
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      task_type="CAUSAL_LM", init_lora_weights=False)).train()


def new_mlm():
    """A BERT masked LM (its decoder tied to the word embeddings), without dropout."""
    import transformers

    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).train()


def masked_samples():
    """samples() with 4 of each sample's 12 labels kept (a masked LM's labelled tokens), the rest -100: as many
    in every batch, so a rank's mean loss averaged over the ranks is the mean over the concatenated batches."""
    g = torch.Generator().manual_seed(4)
    out = []
    for s in samples():
        labels = torch.full_like(s["labels"], -100)
        kept = torch.randperm(12, generator=g)[:4]
        labels[kept] = s["labels"][kept]
        out.append({"input_ids": s["input_ids"], "labels": labels})
    return out


def samples():
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": x, "labels": x} for x in torch.randint(1, 97, (16, 12), generator=g)]


def run(out_dir, mode):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    config = accel.Config(backend="cpu")
    config.compute.compile = config.compute.kernels = False
    config.memory.fused_lm_loss = True
    if mode.startswith("fsdp"):
        config.dist.fsdp.size = 2
    lm = new_lora_lm() if mode.endswith("lora") else new_mlm() if mode.endswith("mlm") else new_lm()
    data = masked_samples() if mode.endswith("mlm") else samples()
    model, loader = accel.accelerate(lm, DataLoader(data, batch_size=BATCH), config)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    no_logits = True
    for batch in loader:
        out = model(**batch)
        no_logits = no_logits and out.logits is None
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    accel.save_model(model, os.path.join(out_dir, f"{mode}_model"))  # save_pretrained's files, from rank 0
    if dist.get_rank() == 0:
        torch.save({"state": {k: v.cpu() for k, v in state.items()}, "no_logits": no_logits},
                   os.path.join(out_dir, f"{mode}.pt"))
    dist.barrier()


if __name__ == "__main__":
    for mode in sys.argv[2].split(","):
        run(sys.argv[1], mode)
    dist.destroy_process_group()
