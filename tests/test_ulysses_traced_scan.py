"""The planner's stand-in for a chunked scan kernel (:func:`ulysses.mixers.traced_scan`):
on fake tensors it allocates the kernel's output, keeps its inputs and one block matrix for
the backward, and gives every input a gradient; a hybrid model's SP forward takes it only
inside a trace."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ulysses.mixers import KERNEL_CHUNK, traced_scan


def test_shapes_saved_tensors_and_gradients():
    B, S, K, H, dk, dv = 1, 1000, 2, 4, 16, 8
    with FakeTensorMode():
        q, k = (torch.empty(B, S, K, dk, requires_grad=True) for _ in range(2))
        v = torch.empty(B, S, H, dv, dtype=torch.bfloat16, requires_grad=True)
        g, beta = (torch.empty(B, S, H, requires_grad=True) for _ in range(2))
        out = traced_scan(dict(query=q, key=k, value=v, g=g, beta=beta), out="value",
                          key="key", heads=H)
        assert out.shape == v.shape and out.dtype == torch.bfloat16
        saved = out.grad_fn.saved_tensors
        assert [tuple(t.shape) for t in saved[:5]] == [tuple(t.shape) for t in (q, k, v, g, beta)]
        assert tuple(saved[5].shape) == (B, S, H, KERNEL_CHUNK)
        assert saved[5].dtype == torch.float32
        out.sum().backward()
        for t in (q, k, v, g, beta):
            assert t.grad is not None and t.grad.shape == t.shape


def test_real_tensors_never_take_it():
    """Outside the planner's fake tensors the model's own scan runs (the parity tests of
    tests/test_arctic_hybrid_models.py compare its values); here: the check it relies on."""
    from ulysses.trace_shortcuts import is_traced

    assert not is_traced(torch.zeros(2))
    with FakeTensorMode():
        assert is_traced(torch.zeros(2))
