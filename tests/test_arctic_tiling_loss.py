"""arctic.tiling (TiledMLP, tiled logits+loss) and arctic.loss (token-weighted SP loss).

Tiled modules must match the untiled ones in value and in every gradient; the tiled loss must
never hold whole logits (MemTracker); the SP loss must give single-device gradients after
averaging over ranks, also when a rank holds no valid label.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from ulysses.torch_internals import FakeTensorMode, step_mem_tracker

import dist_pool
from arctic.loss.token import sp_token_loss
from arctic.tiling.mlp import TiledMLP
from arctic.tiling.tiles import resolve_tiles
from arctic.loss.tiled import tiled_logits_loss
from helpers import get_mesh
from ulysses import shard_sequence


class _GatedMLP(nn.Module):
    """Llama's MLP shape: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.intermediate_size = ffn
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("tiles", [1, 3, 7, "auto"])
def test_tiled_mlp_matches_untiled(tiles):
    torch.manual_seed(0)
    mlp = _GatedMLP(16, 64)
    x = torch.randn(2, 50, 16, requires_grad=True)
    dout = torch.randn(2, 50, 16)
    ref = mlp(x)
    ref.backward(dout)
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    out = TiledMLP(mlp, tiles=tiles, budget_bytes=4096)(x)
    out.backward(dout)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for got, want in zip([x.grad] + [p.grad for p in mlp.parameters()], ref_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_tiled_mlp_never_holds_the_whole_intermediate():
    torch.manual_seed(0)
    S, E, Fs = 2048, 32, 1024
    mlp = _GatedMLP(E, Fs)
    x = torch.randn(1, S, E, requires_grad=True)
    peaks = {}
    for name, module in (("plain", mlp), ("tiled", TiledMLP(mlp, tiles=16))):
        mt = step_mem_tracker()
        mt.track_external(x, *mlp.parameters())
        with mt:
            base = mt.get_tracker_snapshot("current")[x.device]["Total"]
            module(x).sum().backward()
        peaks[name] = mt.get_tracker_snapshot("peak")[x.device]["Total"] - base
        x.grad = None
        mlp.zero_grad(set_to_none=False)
    intermediate = S * Fs * 4
    assert peaks["plain"] > 2 * intermediate
    assert peaks["tiled"] < intermediate / 2, peaks


def _loss_inputs(N=300, E=16, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, N, E, generator=g, requires_grad=True)
    w = (torch.randn(V, E, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, V, (1, N), generator=g)
    labels[0, ::7] = -100
    return h, w, labels


@pytest.mark.parametrize("tiles", [1, 4, 9, "auto"])
def test_tiled_loss_matches_cross_entropy(tiles):
    h, w, labels = _loss_inputs()
    ref = F.cross_entropy((h @ w.t()).view(-1, w.shape[0]), labels.view(-1), reduction="sum")
    ref.backward()
    ref_dh, ref_dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss, n = tiled_logits_loss(h, w, labels, tiles=tiles, budget_bytes=2048)
    (loss * 0.5).backward()  # a non-unit upstream gradient
    assert int(n) == int((labels != -100).sum())
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(h.grad, 0.5 * ref_dh, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.grad, 0.5 * ref_dw, atol=1e-6, rtol=1e-5)


def test_tiled_loss_peak_is_a_quarter_of_untiled():
    """vocab 32000, S_local 4096: the tiled loss's MemTracker peak (fwd+bwd) is <= 1/4 of the
    untiled logits + cross_entropy peak. On fake tensors: MemTracker counts the storages the
    ops make, whose bytes a fake tensor has as a real one does (1,572,864,008 and 263,316,492
    bytes both ways, measured; 1.2 s instead of 9.7), and the tiled loss takes no other path
    on them (its repeats are skipped only inside the planner's memory trace). Real tensors:
    the planner's check against benchmarks/memory.py's "+tiling" stack (test_arctic_plan.py).
    (Hidden size 8: the logits' bytes do not depend on it.)"""
    V, S, E = 32000, 4096, 8
    peaks = {}
    with FakeTensorMode():
        h = torch.randn(1, S, E, requires_grad=True)
        w = (torch.randn(V, E) * 0.05).requires_grad_()
        labels = torch.randint(0, V, (1, S))

        def untiled():
            return F.cross_entropy((h @ w.t()).view(S, V), labels.view(-1), reduction="sum")

        def tiled():
            return tiled_logits_loss(h, w, labels, tiles="auto")[0]

        for name, fn in (("untiled", untiled), ("tiled", tiled)):
            mt = step_mem_tracker()
            mt.track_external(h, w, labels)
            with mt:
                base = mt.get_tracker_snapshot("current")[h.device]["Total"]
                fn().backward()
            peaks[name] = mt.get_tracker_snapshot("peak")[h.device]["Total"] - base
            h.grad = w.grad = None
    assert peaks["untiled"] >= S * V * 4  # the whole fp32 logits existed
    assert peaks["tiled"] <= peaks["untiled"] / 4, peaks


def test_resolve_tiles_rejects_bad_values():
    for bad in (0, -1, 2.5, True, "many"):
        with pytest.raises(ValueError, match="tiles must be"):
            resolve_tiles(bad, 10, 1)
    with pytest.raises(ValueError, match="intermediate_size"):
        TiledMLP(nn.Linear(4, 4), tiles="auto")


# --- multi-rank ------------------------------------------------------------------------------

def _rank_auto_tiles(rows_by_rank):
    import torch.distributed as dist

    return resolve_tiles("auto", rows_by_rank[dist.get_rank()], 100, budget_bytes=1000)


def test_auto_tiles_agree_across_ranks():
    """Ranks with different local lengths agree on the largest count (ZeRO-3 gathers)."""
    got = dist_pool.run(_rank_auto_tiles, [10, 95, 40, 1], world_size=4)
    assert got == [10, 10, 10, 10]


def _rank_sp_loss(sp, S, E, V, empty_rank, tiles):
    """An embedding -> lm_head model on a sequence sharded over sp ranks; the rank
    ``empty_rank`` holds only -100 labels. Returns the loss and the sp-averaged grads."""
    import torch.distributed as dist

    mesh = get_mesh(sp, sp)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(V, E, generator=g).requires_grad_()
    head = (torch.randn(V, E, generator=g) * 0.3).requires_grad_()
    tokens = torch.randint(0, V, (1, S), generator=g)
    labels = torch.randint(0, V, (1, S), generator=g)
    n = S // sp
    labels[:, empty_rank * n:(empty_rank + 1) * n] = -100
    labels[:, 3] = -100
    tok, lab = shard_sequence(tokens, mesh), shard_sequence(labels, mesh)
    loss_sum, num_valid = tiled_logits_loss(emb[tok], head, lab, tiles=tiles)
    loss = sp_token_loss(loss_sum, num_valid, group=mesh["ulysses"].get_group())
    loss.backward()
    grads = []
    for p in (emb, head):  # what DDP/ZeRO do: average over every rank
        dist.all_reduce(p.grad)
        grads.append(p.grad / sp)
    # Single-device reference on the whole sequence.
    e, h = emb.detach().requires_grad_(), head.detach().requires_grad_()
    ref = F.cross_entropy(e[tokens[0]] @ h.t(), labels[0], reduction="mean")
    ref.backward()
    return loss.detach(), ref.detach(), grads, [e.grad, h.grad]


@pytest.mark.parametrize("sp,tiles", [(2, 3), (4, "auto")])
def test_sp_loss_equals_single_device_with_an_all_ignored_rank(sp, tiles):
    for loss, ref, grads, ref_grads in dist_pool.run(_rank_sp_loss, sp, 64, 8, 40, 1, tiles,
                                                     world_size=sp):
        assert torch.isfinite(loss)
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _rank_all_ignored(sp):
    mesh = get_mesh(sp, sp)
    h = torch.randn(1, 4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    loss_sum, n = tiled_logits_loss(h, w, torch.full((1, 4), -100), tiles=2)
    loss = sp_token_loss(loss_sum, n, group=mesh["ulysses"].get_group())
    loss.backward()
    return loss.item(), h.grad.abs().max().item(), w.grad.abs().max().item()


def test_sp_loss_with_no_valid_label_anywhere_is_zero_not_nan():
    assert dist_pool.run(_rank_all_ignored, 2, world_size=2) == [(0.0, 0.0, 0.0)] * 2


def _llama(dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)


def test_tiled_norms_match_untiled_and_cut_the_norm_backward_peak():
    """apply_tiled_norms: every RMSNorm (2 per layer + the final one) runs over tiles, the
    loss is identical and the gradients match; one bf16 norm's backward no longer holds its
    float32 [S, E] temporaries whole."""
    pytest.importorskip("transformers")
    from arctic.tiling.norms import apply_tiled_norms
    from arctic.tiling.tiles import TiledForward

    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))

    def run(tiles):
        model = _llama(torch.float32)
        if tiles:
            apply_tiled_norms(model, tiles=tiles)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), model

    loss0, grad0, _ = run(None)
    loss1, grad1, model = run(3)
    # Bit for bit: a norm's sum runs along each token's own 128 values, in the same order
    # whatever the tile (torch's CPU reductions split the rows, not a row); the rest of the
    # step runs on the whole sequence in both runs.
    assert torch.equal(loss0, loss1)
    torch.testing.assert_close(grad1, grad0, atol=1e-6, rtol=1e-5)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 5 and all(isinstance(m.forward, TiledForward) for m in norms)

    # Memory: one norm, bf16 input [1, S, E]; its untiled backward makes float32 [S, E]
    # temporaries (4 bytes per element, several of them); tiled, at most a tile's worth.
    S, E, tiles = 8192, 128, 8
    norm = _llama(torch.bfloat16).model.norm
    x = torch.randn(1, S, E, dtype=torch.bfloat16, requires_grad=True)

    def peak(module):
        mt = step_mem_tracker()
        mt.track_external(module, x)
        with mt:
            module(x).float().sum().backward()
        x.grad = None
        return mt.get_tracker_snapshot("peak")[x.device]["Total"]

    plain = peak(norm)
    wrapper = nn.Module()
    wrapper.config = type("C", (), {"hidden_size": E})()
    wrapper.model = nn.Module()
    wrapper.model.norm = norm
    apply_tiled_norms(wrapper, tiles=tiles)
    tiled = peak(norm)
    fp32_full = S * E * 4
    print(f"\nRMSNorm fwd+bwd peak: untiled {plain / 2**20:.2f} MiB, {tiles} tiles "
          f"{tiled / 2**20:.2f} MiB")
    assert plain - tiled >= 2 * fp32_full


@pytest.mark.parametrize("tiles", [1, 4])
def test_loss_head_matmuls_run_in_the_activation_dtype(tiles):
    """bf16 activations and weight: the head's gradients come from bf16 GEMMs (each tile's
    weight gradient rounded once, summed over tiles in float32). Against the float64
    gradients of the same bf16 inputs, the weight gradient stays within a few bf16 roundings
    of its largest value per tile, and the hidden gradient within one of bf16 itself."""
    from arctic.loss.tiled import tiled_logits_loss

    g = torch.Generator().manual_seed(0)
    N, E, V = 96, 64, 200
    h = torch.randn(1, N, E, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, E, generator=g) / E ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, V, (1, N), generator=g)
    h16, w16 = h.clone().requires_grad_(), w.clone().requires_grad_()
    tiled_logits_loss(h16, w16, y, tiles=tiles)[0].backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    torch.nn.functional.cross_entropy(h64[0] @ w64.t(), y[0], reduction="sum").backward()
    eps = 2.0 ** -8
    for got, want, rounds in ((w16.grad, w64.grad, 2 * tiles), (h16.grad, h64.grad, 2)):
        assert got.dtype == torch.bfloat16
        error = (got.double() - want).abs().max().item()
        assert error <= rounds * eps * want.abs().max().item(), (error, want.abs().max().item())


@pytest.mark.parametrize("tiles", [1, 3])
def test_no_matrix_product_of_a_bf16_loss_head_takes_float32(tiles):
    """Every matrix product of the tiled logits + loss, forward and backward, in place or
    not, reads bf16 operands when the activations and the weight are bf16: none falls back
    to float32 (where a GPU runs them on its CUDA cores, at a tenth of the rate)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from arctic.loss.tiled import tiled_logits_loss

    aten = torch.ops.aten
    products = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.addmm_,
                aten.baddbmm_, aten.addbmm, aten.addbmm_, aten.linear}

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in products:
                self.seen.append((func.__name__, [a.dtype for a in args
                                                  if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 64, 32, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(100, 32, generator=g) / 32 ** 0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 100, (1, 64), generator=g)
    with Products() as mode:
        tiled_logits_loss(h, w, y, tiles=tiles)[0].backward()
    assert len(mode.seen) >= 3 * tiles, mode.seen  # logits, and both gradients per tile
    wide = [(name, dtypes) for name, dtypes in mode.seen if torch.float32 in dtypes]
    assert not wide, wide


class _ScaledMLP(_GatedMLP):
    """An MLP whose forward takes an argument beside its input (as Zamba2's takes the calling
    layer's index): a number every tile needs as given, or a tensor, which no tile can cut."""

    def forward(self, x, scale=1.0, bias=None):
        out = super().forward(x) * scale
        return out if bias is None else out + bias


def test_a_tiled_forward_passes_numbers_to_every_tile_and_refuses_tensors():
    from arctic.tiling.tiles import TiledForward

    torch.manual_seed(0)
    mlp = _ScaledMLP(16, 64)
    x = torch.randn(2, 50, 16)
    ref = mlp(x, 3.0)
    tiled = TiledForward(mlp.forward, 5, 64, 4096, None)
    torch.testing.assert_close(tiled(x, 3.0), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(tiled(x, scale=3.0), ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"got \['bias'\] as well, which the tiles cannot"):
        tiled(x, bias=torch.zeros(16))
