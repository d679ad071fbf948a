"""Packed documents in a few calls (:mod:`ulysses.packing`): one call per length group gives
each document's output as its own call does, for causal functions along either sequence
dim, with lengths of every group within a factor of two."""

from __future__ import annotations

import math

import torch

from ulysses.packing import batched, length_groups


def _spans(seed: int, rows: int, seq: int):
    g = torch.Generator().manual_seed(seed)
    spans = []
    for row in range(rows):
        cuts = sorted({0, seq, *torch.randint(1, seq, (12,), generator=g).tolist()})
        spans += [(row, a, e) for a, e in zip(cuts, cuts[1:])]
    return spans


def test_length_groups_stay_within_twice_their_shortest():
    spans = [(0, 0, n) for n in (1, 2, 3, 5, 9, 17, 33, 64, 2, 1, 40)]
    groups = length_groups(spans)
    assert sorted(i for grp in groups for i in grp) == list(range(len(spans)))
    for grp in groups:
        lengths = [spans[i][2] for i in grp]
        assert max(lengths) <= 2 * min(lengths), lengths
    assert len(groups) <= math.ceil(math.log2(64)) + 1


def test_batched_equals_one_call_per_document():
    """A causal recurrence (a decayed cumulative sum, with a per-row weight) along dim 1 and a
    causal convolution along the last dim: each span batched equals the span alone, and a
    non-causal function (centring on the mean over the sequence) does not, so the check can
    fail."""
    x = torch.randn(3, 200, 4)
    spans = _spans(0, 3, 200)
    calls = []

    def decayed(x, w):
        calls.append(x.shape[0])
        out, state = [], torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            state = 0.9 * state + x[:, t]
            out.append(state * w)
        return torch.stack(out, dim=1)

    w = torch.tensor(2.0)
    got = batched(decayed, {"x": x}, spans, whole={"w": w})
    assert len(calls) == len(length_groups(spans)) < len(spans)
    for (row, a, e), o in zip(spans, got):
        torch.testing.assert_close(o, decayed(x[row:row + 1, a:e], w))

    y = torch.randn(3, 4, 200)
    weight = torch.randn(4, 1, 3)

    def conv(y):
        return torch.nn.functional.conv1d(y, weight, padding=2, groups=4)[..., :y.shape[-1]]

    for (row, a, e), o in zip(spans, batched(conv, {"y": y}, spans, dim=-1)):
        torch.testing.assert_close(o, conv(y[row:row + 1, :, a:e]))

    def centred(x):
        return x - x.mean(dim=1, keepdim=True)

    wrong = [(s, o) for s, o in zip(spans, batched(centred, {"x": x}, spans))
             if not torch.allclose(o, centred(x[s[0]:s[0] + 1, s[1]:s[2]]))]
    assert wrong
