"""The tiled MLP (:class:`TiledMLP`, :func:`apply_tiled_mlp`): each decoder layer's MLP run
over sequence tiles (:mod:`arctic.tiling.tiles`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from arctic.hf.anatomy import decoder_layers, layer_mlps, text_config
from arctic.tiling.tiles import (
    DEFAULT_TILE_BUDGET_BYTES,
    resolve_tiles,
    tile_forwards,
    tiled_call,
)
from ulysses.patching import journaled


class TiledMLP(nn.Module):
    """Wraps a ``[B, S, E] -> [B, S, E]`` MLP; runs and recomputes it over sequence tiles.

    Args:
        mlp: the module to tile (e.g. a HF ``LlamaMLP``); it is called once per tile in
            forward and again in backward.
        tiles: an int, or ``"auto"``: enough tiles that one tile's ``[B, s, F]``
            intermediates (about 3 of them, in the activation dtype) fit ``budget_bytes``.
        intermediate_size: F for ``"auto"``; read from ``mlp.intermediate_size`` or
            ``mlp.config.intermediate_size`` when not given.
        group: the group that must agree on ``"auto"`` (all ranks sharing ZeRO-3 gathers;
            default: the world).
    """

    def __init__(self, mlp: nn.Module, *, tiles: int | str = "auto",
                 intermediate_size: int | None = None,
                 budget_bytes: int = DEFAULT_TILE_BUDGET_BYTES,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if tiles != "auto":
            resolve_tiles(tiles, 1, 1)  # type check, before any forward
        if intermediate_size is None:
            intermediate_size = getattr(mlp, "intermediate_size", None) or getattr(
                getattr(mlp, "config", None), "intermediate_size", None)
        if tiles == "auto" and intermediate_size is None:
            raise ValueError("tiles='auto' needs intermediate_size (the MLP's F); pass it or "
                             "an int tile count")
        self.mlp, self.tiles, self.intermediate_size = mlp, tiles, intermediate_size
        self.budget_bytes, self.group = budget_bytes, group

    def forward(self, x_BSE: Tensor) -> Tensor:
        return tiled_call(self.mlp, x_BSE, self.tiles, self.intermediate_size,
                           self.budget_bytes, self.group)


@journaled
def apply_tiled_mlp(model: nn.Module, *, tiles: int | str = "auto",
                    budget_bytes: int = DEFAULT_TILE_BUDGET_BYTES,
                    group: dist.ProcessGroup | None = None) -> nn.Module:
    """Tile the MLP of every decoder layer of a HF model in place: its ``mlp`` (Llama4:
    ``feed_forward``), or the block's sublayer where that is an MLP or MoE block (Nemotron-H's
    ``"mlp"`` and ``"moe"`` blocks), or an MoE block and a shared MLP side by side
    (GraniteMoeHybrid: :func:`arctic.hf.anatomy.layer_mlps`). A block whose
    sublayer mixes tokens (a Mamba mixer, attention) has no MLP and is left as it is: a
    sequence tile of it would not see the tokens before the tile.

    Each mlp keeps its class, parameters and state_dict keys (checkpoints stay loadable); only
    the instance's ``forward`` is replaced by the tiled run of the original. The per-tile
    calls and the backward recompute call the original ``forward`` directly, so module hooks
    fire once per layer call, not per tile. That is also why parameter sharding that frees
    parameters after forward works with it: under ZeRO-3 (the mlp's own hooks) and FSDP2 (its
    decoder layer's, the FSDP unit) the parameters are gathered around that one call and
    before its backward, where the tiles run and are recomputed; ZeRO's gradient hooks are
    told that only the last tile completes a gradient (``ds_grad_is_ready``). Gradients equal
    single-device ones under ZeRO 0-3 (``tests/test_arctic_engine.py``) and FSDP2
    (``tests/test_arctic_fsdp.py``). Apply after :func:`arctic.apply_sequence_parallel` and before
    activation checkpointing. Returns ``model``; ``ValueError`` if no decoder layer has an MLP
    (a state-space model: Mamba, Mamba2, FalconMamba), where tiling would have no effect.
    """
    intermediate = getattr(text_config(model), "intermediate_size", None)
    tile_forwards(model, mlps_to_tile(model), tiles, intermediate, budget_bytes, group)
    return model


def mlps_to_tile(model: nn.Module) -> list[nn.Module]:
    """The MLPs :func:`apply_tiled_mlp` tiles: each decoder layer's
    (:func:`arctic.hf.anatomy.layer_mlps`: GraniteMoeHybrid's MoE block and shared MLP both).
    ``ValueError`` naming ``tiled_mlp`` when there is none: the recipe asks this before it
    changes the model."""
    layers = decoder_layers(model)
    mlps = [mlp for layer in layers for mlp in layer_mlps(layer)]
    if not mlps:
        found = sorted({type(layer).__name__ for layer in layers}) or "none"
        raise ValueError(f"{type(model).__name__} has no decoder layer with an MLP to tile "
                         f"(decoder layers: {found}), so tiled_mlp would have no effect; "
                         f"leave it null")
    return mlps
