"""A drop-in for ``deepspeed.sequence.layer.DistributedAttention``.

Same constructor, same ``forward(query, key, value, batch_dim_idx, rotary_pos_emb=None,
*args, **kwargs)``, same layouts: ``[b, s, H, d]`` when ``batch_dim_idx == 0`` and
``[s, b, H, d]`` when ``batch_dim_idx == 1``. It differs from DeepSpeed where DeepSpeed fails:
fewer kv heads than ranks (kv heads are replicated instead of asserting), and uneven head
counts without DeepSpeed's process-wide sequence-parallel globals.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from einops import rearrange
from torch import Tensor

from ulysses.all_to_all import all_to_all
from ulysses.sharding import head_layout


def _rotate_half(x: Tensor) -> Tensor:
    """[..., (2 d)] -> [..., (2 d)]: (x1, x2) -> (-x2, x1)."""
    x1, x2 = rearrange(x, "... (j d) -> ... j d", j=2).unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` features of ``t``, as DeepSpeed's layer does."""
    rot = cos.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    t_rot = t_rot * cos + _rotate_half(t_rot) * sin
    return t_rot if t_pass.shape[-1] == 0 else torch.cat((t_rot, t_pass), dim=-1)


class DistributedAttention(torch.nn.Module):
    """Ulysses around any local attention module.

    Args:
        local_attention: called as ``local_attention(q, k, v, *args, **kwargs)`` on
            full-sequence, local-head tensors in the input layout; returns the same layout
            with ``d`` as the last dim.
        sequence_process_group: the Ulysses group (e.g. ``mesh["ulysses"].get_group()``).
        scatter_idx: the head dim, 2 (DeepSpeed's default and only meaningful value).
        gather_idx: accepted for compatibility; as in DeepSpeed, the sequence dim follows
            ``batch_dim_idx`` in ``forward``.
        sp_stream: accepted for compatibility and unused; overlap comes from head chunking.
        num_kv_heads: kv head count; when given it must match ``key``'s head dim.
    """

    def __init__(self, local_attention: torch.nn.Module, sequence_process_group: Any,
                 scatter_idx: int = 2, gather_idx: int = 0, sp_stream: Any = None,
                 num_kv_heads: int | None = None) -> None:
        super().__init__()
        if scatter_idx != 2:
            raise ValueError(f"scatter_idx must be 2 (the head dim of [b, s, H, d] and "
                             f"[s, b, H, d]), got {scatter_idx}")
        if gather_idx not in (0, 1):
            raise ValueError(f"gather_idx must be 0 or 1 (a sequence or batch dim), got "
                             f"{gather_idx}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int,
                rotary_pos_emb: tuple[Tensor, Tensor] | None = None, *args: Any,
                **kwargs: Any) -> Tensor:
        """Attend over the full sequence; returns the local-sequence, all-heads context.

        ``rotary_pos_emb`` is DeepSpeed's ``(cos, sin)`` pair of ``[S, b, 1, rot]`` tensors,
        applied to q and k after the all-to-all exactly as DeepSpeed does.
        """
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx must be 0 ([b, s, H, d]) or 1 ([s, b, H, d]), got "
                             f"{batch_dim_idx}")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if key.shape != value.shape:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
        num_kv = key.shape[2]
        if self.num_kv_heads is not None and self.num_kv_heads != num_kv:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) does not match key's head "
                             f"dim ({num_kv})")
        seq_dim = 1 - batch_dim_idx
        degree = dist.get_world_size(self.spg)
        if query.shape[seq_dim] != key.shape[seq_dim]:
            raise ValueError(f"query and key sequence pieces differ: {query.shape[seq_dim]} vs "
                             f"{key.shape[seq_dim]}")
        layout = head_layout(query.shape[2], num_kv, degree)

        if layout.replicated:
            index = torch.tensor(layout.kv_index(), device=key.device)
            key, value = key.index_select(2, index), value.index_select(2, index)
        # [b, s, H, d] -> [b, S, h, d]   (or [s, b, H, d] -> [S, b, h, d])
        q = all_to_all(query, self.spg, scatter_dim=2, gather_dim=seq_dim,
                       scatter_sizes=layout.q_sizes)
        k = all_to_all(key, self.spg, scatter_dim=2, gather_dim=seq_dim,
                       scatter_sizes=layout.kv_sizes)
        v = all_to_all(value, self.spg, scatter_dim=2, gather_dim=seq_dim,
                       scatter_sizes=layout.kv_sizes)
        if rotary_pos_emb is not None:
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)

        context = self.local_attn(q, k, v, *args, **kwargs)
        # [b, S, h, d] -> [b, s, H, d]
        return all_to_all(context, self.spg, scatter_dim=seq_dim, gather_dim=2,
                          gather_sizes=layout.q_sizes)
