"""Tiled norms (:func:`apply_tiled_norms`): each decoder layer's RMSNorms and the final norm
run over sequence tiles (:mod:`arctic.tiling.tiles`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from arctic.hf.anatomy import text_config, token_norms
from arctic.tiling.tiles import DEFAULT_TILE_BUDGET_BYTES, tile_forwards
from ulysses.patching import journaled


@journaled
def apply_tiled_norms(model: nn.Module, *, tiles: int | str = "auto",
                      budget_bytes: int = DEFAULT_TILE_BUDGET_BYTES,
                      group: dist.ProcessGroup | None = None) -> nn.Module:
    """Tile each decoder layer's RMSNorms and the final norm over the sequence, as
    :func:`apply_tiled_mlp` tiles the MLP: forward without autograd, input saved, backward
    recomputed tile by tile.

    HF's RMSNorm computes in float32: for a bf16 ``[B, S, E]`` input its backward makes about
    five float32 ``[B, S, E]`` temporaries, 10 GB each at 625K local tokens of an 8B model.
    The memory planner (``python -m arctic.plan``) found them to be the step's peak once the
    MLP and the loss were tiled; per tile they are ``1 / tiles`` of that. The norm is per
    row, so tiling changes nothing in the result. ``"auto"`` sizes tiles so that about four
    float32 rows of the tile fit ``budget_bytes``. Returns ``model``.
    """
    hidden = text_config(model).hidden_size
    norms = token_norms(model)
    if not norms:
        raise ValueError(f"{type(model).__name__} has no decoder-layer norms to tile")
    # _tiled_call sizes "auto" tiles by 3 x F elements of the input dtype per row; four float32
    # copies of a row of E are 16 E bytes.
    tile_forwards(model, norms, tiles, 3 * hidden, budget_bytes, group)
    return model
