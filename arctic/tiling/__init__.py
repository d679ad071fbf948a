"""Sequence tiling of the activations that dominate memory at long sequences.

- :mod:`~arctic.tiling.tiles`: tile counts (``"auto"`` agreed over a group) and a module's
  forward run over tiles, without autograd, recomputed in backward;
- :mod:`~arctic.tiling.mlp`: the tiled MLP; :mod:`~arctic.tiling.norms`: tiled norms;
- :mod:`~arctic.tiling.layer`: the layer's tail after attention as one tiled unit.

The tiled logits + loss is a loss: :mod:`arctic.loss.tiled`.
"""

from arctic.tiling.layer import apply_tiled_layers
from arctic.tiling.mlp import TiledMLP, apply_tiled_mlp, mlps_to_tile
from arctic.tiling.norms import apply_tiled_norms
from arctic.tiling.tiles import DEFAULT_TILE_BUDGET_BYTES, resolve_tiles

__all__ = ["DEFAULT_TILE_BUDGET_BYTES", "TiledMLP", "apply_tiled_layers", "apply_tiled_mlp",
           "apply_tiled_norms", "mlps_to_tile", "resolve_tiles"]
