"""Tiles of the sequence, and a module's forward run over them.

A ``[B, S, E] -> [B, S, E]`` function (an MLP, a norm) runs over sequence tiles without
autograd, saves only its input, and recomputes tile by tile in backward, so its intermediates
never exist whole (an MLP's ``[B, S_local, ffn]`` is 17.9 GB in bf16 at 625K local tokens and
ffn 14336). :class:`TiledForward` gives a module instance that run of its own forward.

Tile counts are an int or ``"auto"`` (the fewest tiles whose per-tile bytes fit a budget).
"auto" is agreed across a process group with a MAX all-reduce: under ZeRO-3 every call of a
wrapped module gathers its parameters, so ranks running different tile counts would issue
different numbers of gathers and deadlock.

Shape legend: B batch, S this rank's sequence piece, E hidden size, F MLP intermediate size.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from arctic.hf.binding import of_callable
from arctic.order import record_apply
from ulysses import trace_shortcuts
from ulysses.patching import replace_method

DEFAULT_TILE_BUDGET_BYTES = 256 << 20
"""Per-tile budget of ``tiles="auto"`` for the tile's largest temporaries (256 MiB)."""


def resolve_tiles(tiles: int | str, rows: int, bytes_per_row: int, *,
                  budget_bytes: int = DEFAULT_TILE_BUDGET_BYTES,
                  group: dist.ProcessGroup | None = None) -> int:
    """The tile count for ``rows`` rows, from an int or ``"auto"``.

    ``"auto"``: ``ceil(rows * bytes_per_row / budget_bytes)``, then the MAX over ``group``
    (every rank of it must call this; skipped when torch.distributed is not initialized). An
    int is used as given. The count is never capped by a rank's own rows: a rank with fewer
    rows than tiles runs empty tiles, so every rank makes the same number of module calls.
    """
    if tiles == "auto":
        n = max(1, -(-rows * bytes_per_row // budget_bytes))
        if dist.is_initialized():
            t = torch.tensor(n, dtype=torch.int64)
            if dist.get_backend(group) == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            n = int(t)
        return n
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles must be a positive int or 'auto', got {tiles!r}")
    return tiles


class _TiledMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSE, mlp, tiles):
        # mlp: any [B, s, E] -> [B, s, E] callable (a module, or a module's own forward).
        ctx.mlp, ctx.tiles = mlp, tiles
        ctx.save_for_backward(x_BSE)
        out = None
        with torch.no_grad():
            for _, x_t, start in _tiles(x_BSE.detach(), tiles):
                y_t = mlp(x_t)                      # [B, s_t, F] lives only inside the call
                if not isinstance(y_t, Tensor):
                    raise ValueError(
                        f"a tiled MLP needs an MLP that returns one tensor; "
                        f"{type(_owner(mlp)).__name__} returns {type(y_t).__name__} (an MoE "
                        f"block's router logits beside its output: GPT-OSS, Llama4). Leave "
                        f"the tiled MLP off (tiled_mlp: null) for this model")
                if out is None:
                    out = x_BSE.new_empty(x_BSE.shape[:2] + y_t.shape[2:], dtype=y_t.dtype)
                out[:, start:start + x_t.shape[1]] = y_t
                del y_t
        return out

    @staticmethod
    def backward(ctx, dout_BSE):
        (x_BSE,) = ctx.saved_tensors
        dx = torch.empty_like(x_BSE)
        module = ctx.mlp if isinstance(ctx.mlp, nn.Module) else getattr(ctx.mlp, "__self__", None)
        params = [p for p in module.parameters() if p.requires_grad] if module is not None else []
        for i, x_t, start in _tiles(x_BSE, ctx.tiles):
            n = x_t.shape[1]
            # DeepSpeed ZeRO reduces a parameter's gradient when its hook fires; with tiles the
            # gradient is complete only after the last one (ZeRO-2 would otherwise reduce the
            # same gradient once per tile and assert). Other frameworks ignore the attribute.
            last = i == ctx.tiles - 1
            for p in params:
                p.ds_grad_is_ready = last
            with torch.enable_grad():
                leaf = x_t.detach().requires_grad_()
                y_t = ctx.mlp(leaf)
            # Parameter gradients accumulate into .grad here, tile by tile.
            torch.autograd.backward(y_t, dout_BSE[:, start:start + n])
            dx[:, start:start + n] = leaf.grad
            del y_t, leaf
        return dx, None, None


def _owner(mlp):
    """The module of a tiled MLP callable (a module, or a module's bound forward)."""
    return mlp if isinstance(mlp, nn.Module) else getattr(mlp, "__self__", mlp)


def tile_rows(x: Tensor, rows: int, tiles: int):
    """``(index, start, rows)`` of ``tiles`` near-equal tiles of ``rows`` rows, split as
    ``tensor_split`` does (the first ``rows % tiles`` tiles one row longer). In a memory
    or work trace, a tile that repeats the two before it is left out
    (:mod:`ulysses.trace_shortcuts`): each tile frees all it allocates, so the planner's
    traces cost the same at any length; in a work trace the tile before counts for it (the
    caller's work between two yields is weighted)."""
    q, r = divmod(rows, tiles)
    for i, times in trace_shortcuts.repeats(tiles, lambda i: i < r or i - 2 >= r, x):
        with trace_shortcuts.weighted(times):
            yield i, i * q + min(i, r), q + (i < r)


def _tiles(x_BSE: Tensor, tiles: int):
    """``(index, tile view, start row)`` for ``tiles`` near-equal tiles of the sequence dim
    (see :func:`tile_rows`)."""
    for i, start, n in tile_rows(x_BSE, x_BSE.shape[1], tiles):
        yield i, x_BSE[:, start:start + n], start


def tiled_call(fn, x_BSE: Tensor, tiles, intermediate_size, budget_bytes, group) -> Tensor:
    if x_BSE.dim() != 3:
        raise ValueError(f"a tiled MLP expects [batch, seq, hidden], got {tuple(x_BSE.shape)}")
    row = 3 * x_BSE.shape[0] * (intermediate_size or 0) * x_BSE.element_size()
    n = resolve_tiles(tiles, x_BSE.shape[1], row, budget_bytes=budget_bytes, group=group)
    if not torch.is_grad_enabled():
        return torch.cat([fn(t) for t in x_BSE.tensor_split(n, dim=1)], dim=1)
    return _TiledMLPFn.apply(x_BSE, fn, n)


class TiledForward:
    """Replaces one module instance's ``forward``: the original forward, run over tiles.

    A call is bound through the original forward's signature (:mod:`arctic.hf.binding`), so
    the input is found whatever the release names it (``x``, ``hidden_states``). Other
    arguments that are not tensors (Zamba2's MLP takes the calling layer's ``layer_idx``, to
    pick its adapter) reach every tile as given; a tensor would have to be split along the
    sequence too, or not, which the tiles cannot tell, so it is refused."""

    def __init__(self, forward, tiles, intermediate_size, budget_bytes, group) -> None:
        self.inner = forward
        self.args = (tiles, intermediate_size, budget_bytes, group)
        owner = type(getattr(forward, "__self__", forward)).__name__
        self.signature = of_callable(forward, owner)

    def __call__(self, *args, **kwargs) -> Tensor:
        bound = self.signature.bind(args, kwargs)
        others = {**{n: bound.named[n] for n in bound.given}, **bound.extra}
        tensors = sorted(n for n, v in others.items() if isinstance(v, Tensor))
        if tensors:
            raise ValueError(f"a tiled {self.signature.owner} takes its input as its only "
                             f"tensor; got {tensors} as well, which the tiles cannot split: "
                             f"set tiled_mlp / tiled_norms to false")
        inner = functools.partial(self.inner, **others) if others else self.inner
        return tiled_call(inner, bound.first, *self.args)


def tile_forwards(model: nn.Module, modules, tiles, intermediate_size, budget_bytes,
                   group) -> None:
    """Check ``tiles``, record the tiling stage, then give each module (once) the tiled run of
    its own ``forward``."""
    if tiles != "auto":
        resolve_tiles(tiles, 1, 1)  # type check before touching the model
    record_apply(model, "tiling")
    for m in modules:
        if not isinstance(m.forward, TiledForward):
            replace_method(m, TiledForward(m.forward, tiles, intermediate_size, budget_bytes,
                                           group))
