"""kv heads for kernels that cannot read grouped-query attention as it is.

Query head ``i`` reads kv head ``i // (H // K)``. A kernel that needs H == K gets each kv
head repeated for its query heads, and the gradients of the replicas are summed back.
"""

from __future__ import annotations

from torch import Tensor


def expand_kv(x_BSKD: Tensor, num_q_heads: int) -> Tensor:
    """[B, S, K, D] -> [B, S, H, D], each kv head repeated for its H // K query heads."""
    rep = num_q_heads // x_BSKD.shape[2]
    return x_BSKD if rep == 1 else x_BSKD.repeat_interleave(rep, dim=2)


def reduce_kv(dx_BSHD: Tensor, num_kv_heads: int) -> Tensor:
    """[B, S, H, D] -> [B, S, K, D]: sum the gradients of a kv head's replicas."""
    if dx_BSHD.shape[2] == num_kv_heads:
        return dx_BSHD
    return dx_BSHD.unflatten(2, (num_kv_heads, -1)).sum(3)
