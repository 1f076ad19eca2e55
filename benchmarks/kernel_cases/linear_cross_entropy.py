"""linear_cross_entropy (a language model's head and loss without the logits) against the same loss through
the logits: F.cross_entropy(F.linear(...).float()) compiled (Inductor fuses the softmax into the loss and its
gradient, keeping the [tokens, vocabulary] product) and eager. Forward + backward (the hidden states' and the
weight's gradients) under bf16 autocast, as accelerate()'s memory.fused_lm_loss runs it. Ours computes the
logits twice (once in each pass) for memory that does not grow with the vocabulary: expect < 1.0 here; the
memory it saves is what benchmarks/causal_lm.py measures. On the CPU also a batch whose first half of every
sample is an ignored prompt (labels -100, as instruction tuning masks them): ours skips those rows' products, the
peers compute them and ignore them."""
import torch

from accel.runtime.nn.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

from . import Case

# (tokens, hidden, vocabulary): a small Llama's packed batch with Llama 2's and Llama 3's vocabularies; on a GPU
# an 8B model's micro-batch
_CPU_SIZES = ((2048, 512, 32000), (3072, 512, 128256))
_CUDA_SIZES = ((2048, 512, 32000), (8192, 4096, 128256))
_QUICK = ((256, 64, 1000),)


def _under_autocast(fn, device):
    def run(hidden, weight, target):
        with torch.autocast(device, dtype=torch.bfloat16):
            return fn(hidden, weight, target)
    return run


def cases(device: str, quick: bool):
    sizes = _QUICK if quick else _CUDA_SIZES if device == "cuda" else _CPU_SIZES
    ours = _under_autocast(linear_cross_entropy, device)
    peers = {"compiled F.cross_entropy(F.linear)": torch.compile(_under_autocast(linear_cross_entropy_reference,
                                                                                   device), dynamic=False),
             "eager F.cross_entropy(F.linear)": _under_autocast(linear_cross_entropy_reference, device)}
    prompts = (False, True) if device == "cpu" else (False,)
    for (tokens, hidden, vocab), prompt in ((size, prompt) for size in sizes for prompt in prompts):
        g = torch.Generator().manual_seed(0)
        h = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
        w = (0.02 * torch.randn(vocab, hidden, generator=g)).to(device).requires_grad_()
        t = torch.randint(0, vocab, (tokens,), generator=g)
        if prompt:  # samples of 256 tokens, the first 128 of each a prompt
            t[torch.arange(tokens) % 256 < 128] = -100
        t = t.to(device)

        def step(fn, h=h, w=w, t=t):
            return torch.autograd.grad(fn(h, w, t), (h, w))

        # what must be moved: the weight read (twice: each pass), its gradient written, the hidden states and
        # their gradient; the logits never reach memory in an ideal kernel
        nbytes = 4 * vocab * hidden * 3 + 2 * tokens * hidden * 2
        name = "linear_cross_entropy bf16 fwd+bwd" + (", prompts ignored (half the rows)" if prompt else "")
        yield Case(name, f"{tokens}x{hidden}->{vocab}", nbytes,
                   lambda step=step: step(ours), {name: lambda fn=fn, step=step: step(fn) for name, fn in peers.items()},
                   memory_bound=False)
