"""Sequence tiling for the two activations that dominate memory at long sequences.

- :class:`TiledMLP` runs a decoder MLP over sequence tiles without autograd, saves only its
  input, and recomputes tile by tile in backward, so the ``[B, S_local, ffn]`` intermediate
  never exists whole (at 625K local tokens and ffn 14336 it is 17.9 GB in bf16).
- :func:`tiled_logits_loss` computes lm_head logits and the cross-entropy tile by tile, so
  the ``[S_local, vocab]`` logits never exist whole (320 GB in fp32 for Llama-3 at 625K). Its
  backward recomputes each tile's logits and produces the hidden-state gradient tile by tile
  and the lm_head weight gradient by accumulation.

Tile counts are an int or ``"auto"`` (the fewest tiles whose per-tile bytes fit a budget).
"auto" is agreed across a process group with a MAX all-reduce: under ZeRO-3 every call of a
wrapped module gathers its parameters, so ranks running different tile counts would issue
different numbers of gathers and deadlock.

Shape legend: B batch, S this rank's sequence piece, E hidden size, F MLP intermediate size,
V vocab, N = B * S tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from arctic.anatomy import decoder_layers, layer_mlp, text_config, token_norms
from arctic.hf_binding import of_callable
from arctic.order import record_apply
from arctic.removal import journaled
from ulysses import trace_shortcuts

IGNORE_INDEX = -100
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


# --- tiled MLP -------------------------------------------------------------------------------

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


def _tile_rows(x: Tensor, rows: int, tiles: int):
    """``(index, start, rows)`` of ``tiles`` near-equal tiles of ``rows`` rows, split as
    ``tensor_split`` does (the first ``rows % tiles`` tiles one row longer). In a memory
    trace, a tile that repeats the two before it is left out (:mod:`ulysses.trace_shortcuts`):
    each tile frees all it allocates, so the planner's traces cost the same at any length."""
    q, r = divmod(rows, tiles)
    start = 0
    for i in range(tiles):
        n = q + (i < r)
        if trace_shortcuts.kept(i, tiles, i < r or i - 2 >= r, x):
            yield i, start, n
        start += n


def _tiles(x_BSE: Tensor, tiles: int):
    """``(index, tile view, start row)`` for ``tiles`` near-equal tiles of the sequence dim
    (see :func:`_tile_rows`)."""
    for i, start, n in _tile_rows(x_BSE, x_BSE.shape[1], tiles):
        yield i, x_BSE[:, start:start + n], start


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
        return _tiled_call(self.mlp, x_BSE, self.tiles, self.intermediate_size,
                           self.budget_bytes, self.group)


def _tiled_call(fn, x_BSE: Tensor, tiles, intermediate_size, budget_bytes, group) -> Tensor:
    if x_BSE.dim() != 3:
        raise ValueError(f"a tiled MLP expects [batch, seq, hidden], got {tuple(x_BSE.shape)}")
    row = 3 * x_BSE.shape[0] * (intermediate_size or 0) * x_BSE.element_size()
    n = resolve_tiles(tiles, x_BSE.shape[1], row, budget_bytes=budget_bytes, group=group)
    if not torch.is_grad_enabled():
        return torch.cat([fn(t) for t in x_BSE.tensor_split(n, dim=1)], dim=1)
    return _TiledMLPFn.apply(x_BSE, fn, n)


class _TiledForward:
    """Replaces one module instance's ``forward``: the original forward, run over tiles.

    A call is bound through the original forward's signature (:mod:`arctic.hf_binding`), so
    the input is found whatever the release names it (``x``, ``hidden_states``); any other
    argument given would have to be split along the sequence too, or not, which the tiles
    cannot tell, so it is refused."""

    def __init__(self, forward, tiles, intermediate_size, budget_bytes, group) -> None:
        self.inner = forward
        self.args = (tiles, intermediate_size, budget_bytes, group)
        owner = type(getattr(forward, "__self__", forward)).__name__
        self.signature = of_callable(forward, owner)

    def __call__(self, *args, **kwargs) -> Tensor:
        bound = self.signature.bind(args, kwargs)
        if bound.given or bound.extra:
            raise ValueError(f"a tiled {self.signature.owner} takes its input only; got "
                             f"{sorted(bound.given | set(bound.extra))} as well, which the "
                             f"tiles cannot split: set tiled_mlp / tiled_norms to false")
        return _tiled_call(self.inner, bound.first, *self.args)


@journaled
def apply_tiled_mlp(model: nn.Module, *, tiles: int | str = "auto",
                    budget_bytes: int = DEFAULT_TILE_BUDGET_BYTES,
                    group: dist.ProcessGroup | None = None) -> nn.Module:
    """Tile the ``mlp`` (Llama4: ``feed_forward``) of every decoder layer of a HF model in
    place.

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
    activation checkpointing. Returns ``model``; ``ValueError`` if it has no decoder layer
    with an ``mlp``.
    """
    intermediate = getattr(text_config(model), "intermediate_size", None)
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layer with an mlp to tile")
    _tile_forwards(model, [layer_mlp(layer) for layer in layers], tiles, intermediate,
                   budget_bytes, group)
    return model


def _tile_forwards(model: nn.Module, modules, tiles, intermediate_size, budget_bytes,
                   group) -> None:
    """Check ``tiles``, record the tiling stage, then give each module (once) the tiled run of
    its own ``forward``."""
    if tiles != "auto":
        resolve_tiles(tiles, 1, 1)  # type check before touching the model
    record_apply(model, "tiling")
    for m in modules:
        if not isinstance(m.forward, _TiledForward):
            m.forward = _TiledForward(m.forward, tiles, intermediate_size, budget_bytes, group)


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
    _tile_forwards(model, norms, tiles, 3 * hidden, budget_bytes, group)
    return model


# --- tiled logits + loss ---------------------------------------------------------------------

def check_logit_transform(scale: float, softcap: float | None) -> None:
    """``ValueError`` unless ``scale`` is a finite real number other than 0 and ``softcap`` is
    ``None`` or a finite real number > 0."""
    def finite(x) -> bool:  # abs(nan) < inf is False too
        return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) < float("inf")

    if not finite(scale) or scale == 0:
        raise ValueError(f"logit_scale must be a finite number other than 0, got {scale!r}; "
                         f"use 1.0 for no scaling")
    if softcap is not None and (not finite(softcap) or softcap <= 0):
        raise ValueError(f"logit_softcap must be None or a finite number > 0, got "
                         f"{softcap!r}; use None for no cap")


def transform_logits_(z: Tensor, *, scale: float = 1.0, softcap: float | None = None) -> Tensor:
    """A causal-LM head's transform of float32 logits, in place on ``z``: ``z * scale``, then
    with a ``softcap``, ``softcap * tanh(z / softcap)``. Returns ``z``.

    Granite divides by ``config.logits_scaling`` (``scale = 1 / logits_scaling``), Cohere
    multiplies by ``config.logit_scale``, Gemma 2/3 cap at ``config.final_logit_softcapping``.
    In place because the tiled loss must not hold a second copy of a tile's logits."""
    if softcap is None:
        return z.mul_(scale) if scale != 1.0 else z
    return z.mul_(scale / softcap).tanh_().mul_(softcap)


def _tile_logits(h_tE: Tensor, weight_VE: Tensor, scale: float,
                 softcap: float | None) -> Tensor:
    """``[t, E] @ [V, E]^T`` -> transformed float32 ``[t, V]`` (the loss is computed in
    float32, as HF's loss upcasts the logits)."""
    # The product is a fresh tensor that nothing else holds, so transforming it (or its
    # float32 copy) in place is safe.
    return transform_logits_((h_tE @ weight_VE.t()).float(), scale=scale, softcap=softcap)


class _TiledLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NE, weight_VE, labels_N, tiles, scale, softcap):
        ctx.tiles, ctx.scale, ctx.softcap = tiles, scale, softcap
        ctx.save_for_backward(h_NE, weight_VE, labels_N)
        total = torch.zeros((), dtype=torch.float32, device=h_NE.device)
        for _, start, n in _tile_rows(h_NE, h_NE.shape[0], tiles):
            h_t, y_t = h_NE[start:start + n], labels_N[start:start + n]
            total += F.cross_entropy(_tile_logits(h_t, weight_VE, scale, softcap), y_t,
                                     ignore_index=IGNORE_INDEX, reduction="sum")
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_NE, weight_VE, labels_N = ctx.saved_tensors
        softcap = ctx.softcap
        dh = torch.empty_like(h_NE)
        dw = torch.zeros(weight_VE.shape, dtype=torch.float32, device=weight_VE.device)
        # Chain rule through c = transform(z): d loss/dz = (softmax(c) - onehot) * dc/dz, with
        # dc/dz = scale * (1 - (c / softcap)^2) (tanh' = 1 - tanh^2), or just scale without a
        # cap. The constant scale joins the upstream gradient.
        upstream = grad_total * ctx.scale
        for _, start, n in _tile_rows(h_NE, h_NE.shape[0], ctx.tiles):
            h_t, y_t = h_NE[start:start + n], labels_N[start:start + n]
            c = _tile_logits(h_t, weight_VE, ctx.scale, softcap)         # [t, V] float32
            g = torch.softmax(c, dim=-1)                                   # [t, V] float32
            # Without nonzero()/boolean indexing: no device->host sync on CUDA, and the step
            # traces under FakeTensorMode (the memory planner) where the labels are unknown.
            valid = y_t != IGNORE_INDEX
            g.scatter_add_(1, y_t.clamp(min=0).unsqueeze(1), -valid.to(g.dtype).unsqueeze(1))
            g.mul_(valid.unsqueeze(1))
            if softcap is not None:
                # 1 - (c / softcap)^2 in place on c: still two [t, V] temporaries per tile.
                g.mul_(c.div_(softcap).square_().neg_().add_(1.0))
            del c
            g *= upstream
            dh[start:start + n] = (g.to(h_NE.dtype) @ weight_VE)
            dw.addmm_(g.t(), h_t.float())
            del g
        return dh, dw.to(weight_VE.dtype), None, None, None, None


def tiled_logits_loss(hidden_BSE: Tensor, weight_VE: Tensor, labels_BS: Tensor, *,
                      tiles: int | str = "auto",
                      budget_bytes: int = DEFAULT_TILE_BUDGET_BYTES,
                      group: dist.ProcessGroup | None = None,
                      logit_scale: float = 1.0,
                      logit_softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of the transformed ``hidden @ weight^T`` against ``labels``, tile
    by tile.

    Args:
        hidden_BSE: final hidden states (after the last norm), this rank's sequence piece.
        weight_VE: the lm_head weight (no bias).
        labels_BS: already shifted labels (``labels[i]`` is the token after position i), with
            ``-100`` where no loss is taken; see :mod:`arctic.data`.
        tiles: an int, or ``"auto"``: enough tiles that one tile's float32 logits and
            softmax fit ``budget_bytes``; agreed over ``group`` (default: the world).
        logit_scale, logit_softcap: the head's transform of the float32 logits ``z``
            (:func:`transform_logits_`): ``z * logit_scale``, then
            ``logit_softcap * tanh(z / logit_softcap)`` unless the cap is ``None``. The
            backward differentiates through both exactly.

    Returns:
        ``(loss_sum, num_valid)``: the float32 sum of token losses (differentiable w.r.t.
        hidden and weight) and the int64 count of labels that are not -100. Combine ranks with
        :func:`arctic.loss.sp_token_loss`.

    Raises ``ValueError`` for mismatched shapes, a scale that is not finite or is 0, or a cap
    that is not > 0.
    """
    check_logit_transform(logit_scale, logit_softcap)
    if hidden_BSE.shape[:-1] != labels_BS.shape:
        raise ValueError(f"hidden {tuple(hidden_BSE.shape)} and labels {tuple(labels_BS.shape)} "
                         f"must agree on [batch, seq]")
    if hidden_BSE.shape[-1] != weight_VE.shape[-1]:
        raise ValueError(f"hidden size {hidden_BSE.shape[-1]} does not match the lm_head "
                         f"weight {tuple(weight_VE.shape)}")
    h_NE, labels_N = hidden_BSE.reshape(-1, hidden_BSE.shape[-1]), labels_BS.reshape(-1)
    n = resolve_tiles(tiles, h_NE.shape[0], 2 * weight_VE.shape[0] * 4,
                      budget_bytes=budget_bytes, group=group)
    loss_sum = _TiledLossFn.apply(h_NE, weight_VE, labels_N, n, float(logit_scale),
                                  None if logit_softcap is None else float(logit_softcap))
    return loss_sum, (labels_N != IGNORE_INDEX).sum()
