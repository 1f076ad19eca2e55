"""keep_grads_out_of_graph_pool: a .grad that autograd took over from a CUDA-graph replay gets a copy of its own
before the next call of the compiled model, so that the replay writing its memory again changes nothing.

Here the "replay" is simulated: the tensor autograd handed over is overwritten after the next call, as the
next replay would, and the gradients are checked against plain autograd sums (reference: the same model,
uncompiled, no check). The real CUDA-graph case is tests/compiler/test_cuda_step.py (needs a GPU)."""
import copy
import pickle

import pytest
import torch
from torch import nn

from accel.compiler.graph_pool_grads import has_graph_pool_grad_check, keep_grads_out_of_graph_pool


def models():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    guarded = copy.deepcopy(plain)
    guarded.compile(backend="eager")  # Dynamo without codegen: the check wraps whatever compile() set
    keep_grads_out_of_graph_pool(guarded)
    return plain, guarded


def batch(k):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(k))


def test_grads_kept_across_calls_survive_a_write_of_the_memory_autograd_handed_over():
    plain, guarded = models()
    pool = []  # the tensors autograd handed over to a .grad that had none: the graphs' memory
    for k in range(3):  # micro-batches: gradients summed, never reset
        plain(batch(k)).square().sum().backward()
        out = guarded(batch(k))
        for g in pool:
            g.fill_(float("nan"))  # what the next replay does to that memory
        had_none = [p.grad is None for p in guarded.parameters()]
        out.square().sum().backward()
        pool += [p.grad for p, none in zip(guarded.parameters(), had_none) if none]
    assert pool  # the first backward handed over every gradient
    for p, q in zip(plain.parameters(), guarded.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_one_copy_per_gradient_then_in_place_accumulation_and_zeroing():
    _, guarded = models()
    guarded(batch(0)).sum().backward()
    guarded(batch(1)).sum().backward()  # the call copied each .grad; this backward added into the copy
    copies = [p.grad for p in guarded.parameters()]
    guarded.zero_grad(set_to_none=False)
    guarded(batch(2)).sum().backward()
    assert all(p.grad is c for p, c in zip(guarded.parameters(), copies))
    del copies
    guarded.zero_grad(set_to_none=True)  # the check keeps no copy alive: the memory goes with the .grad
    assert all(ref() is None for ref in guarded._compiled_call_impl.copies)


def test_no_grad_no_copy():
    _, guarded = models()
    guarded(batch(0)).sum().backward()
    guarded.zero_grad(set_to_none=True)  # the usual loop
    guarded(batch(1))
    assert all(p.grad is None for p in guarded.parameters())


def test_a_grad_set_by_hand_is_copied_with_its_values_and_strides():
    _, guarded = models()
    w = guarded[0].weight
    w.grad = torch.randn(4, 3).t()  # transposed strides: the copy keeps them
    set_by_hand = w.grad
    guarded(batch(0))
    assert w.grad is not set_by_hand and w.grad.stride() == set_by_hand.stride()
    assert torch.equal(w.grad, set_by_hand)


def test_setup_is_idempotent_and_the_model_still_copies_and_pickles():
    _, guarded = models()
    check = guarded._compiled_call_impl
    keep_grads_out_of_graph_pool(guarded)
    assert guarded._compiled_call_impl is check and has_graph_pool_grad_check(guarded)
    clone = pickle.loads(pickle.dumps(copy.deepcopy(guarded)))  # nn.Module drops the compiled call
    assert not has_graph_pool_grad_check(clone)
    torch.testing.assert_close(clone(batch(0)), guarded(batch(0)))


def test_an_uncompiled_model_is_refused():
    with pytest.raises(ValueError, match=r"model: expected a module compiled with .compile\(\)"):
        keep_grads_out_of_graph_pool(nn.Linear(2, 2))
    assert not has_graph_pool_grad_check(nn.Linear(2, 2))


@pytest.mark.parametrize("backend, cuda_graphs, checked", [("cuda", True, True), ("cuda", False, False),
                                                            ("cpu", True, False)])
def test_accelerate_puts_the_check_where_cuda_graphs_replay(backend, cuda_graphs, checked):
    from accel.accelerate import _compile

    model = nn.Linear(2, 2)
    # compile() is lazy: nothing runs on a device here
    _compile(model, backend, torch.device(backend), cuda_graphs, n_shapes=1, inductor_options={})
    assert has_graph_pool_grad_check(model) is checked
