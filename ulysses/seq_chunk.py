"""Sequence-chunked attention inside a head chunk (FPDT-style): O(block) device buffers.

Head chunking (:mod:`ulysses.chunk_loop`) still exchanges full-sequence buffers per chunk:
q, k, v, out (and dout, dq, dk, dv) of ``[B, S, c, D]``. Here each rank's piece of s rows is
cut into N blocks, the same on every rank (as ``torch.tensor_split`` cuts: the first
``s % N`` one row longer), and every exchange moves one block: block t of every rank's piece,
for the chunk's heads, goes seq -> head, so the receiver holds the *exchange block* ``E_t``:
U runs of ``b_t`` rows, global positions ``r s + [a_t, a_t + b_t)`` for r in 0..U-1. Device
buffers are then ``[B, U b, c, D]``.

Attention is exact, block by block, merged by log-sum-exp in float32 for half inputs
(:func:`ulysses.band.merge_into`). Between ``E_t`` and a key block ``E_u`` the kernel calls
are :func:`ulysses.band.band_pieces` of their runs (causal, with or without a sliding
window: under a causal mask ``E_t`` sees keys of every ``E_u``, whose runs of earlier ranks
come first), or one ``full`` piece without a mask, cut at ``kv_len`` (padded keys).

Forward, per step of the head-chunk schedule (kv chunks sent once and shared by their GQA
group's q chunks, replicated kv, idle ranks: :mod:`ulysses.chunk_schedule`):

1. a new kv chunk is exchanged block by block and parked in host memory;
2. per query block t: exchange q_t; for every key block u that t sees, bring ``k_u, v_u``
   back (``u + 1`` is copied while u computes, :mod:`ulysses.host_blocks`) and merge; send
   ``out_t`` back head -> seq into rows ``[a_t, a_t + b_t)`` of ``out``; the block's lse goes
   to its global positions of the ``[B, h, S]`` lse, laid out as the unchunked loop's.

Backward: the kv chunk is parked again, with zeroed float32 dk/dv sums per block on the host;
per query block: exchange q_t, out_t, dout_t, run each piece's kernel backward with the final
``out_t``/lse, sum dq_t on the device and dk_u/dv_u (brought in, added to, written back);
send dq_t back. When the kv chunk is done its summed dk/dv go back head -> seq block by
block. Exchanges are synchronous (no overlap with compute) in this version.

With a ring (hybrid Ulysses x Ring, R > 1) the same runs on each ring rank's ``U s`` rows,
whose positions follow the mesh's layout (zigzag chunks rho and 2R-1-rho, split where a run
crosses from one to the other, or block rho). A new kv chunk's blocks are gathered from every
ring rank to the host in ``R - 1`` hops along the ring, as the ring's own kv blocks travel;
query blocks then see the key blocks of every ring rank (``band_pieces`` of their runs'
positions). In backward each rank sums dk/dv for every ring rank's blocks on the host and,
when the chunk is done, exchanges the sums with each other ring rank, so each owner gets the
total of its blocks. The host then holds the chunk's kv for the ring's ``R U s`` rows.

The :class:`ulysses.chunk_loop.ChunkSource` takes gradients back per block, through its
``take_rows(kind, j, step, blocks, rows)``, and may make each block's rows itself through
an optional ``send_rows(kind, j, step, rows)`` (the fused projections do: no seq-local
tensor of a step's heads); otherwise its ``send`` tensor is sliced.

Shape legend: B batch, s this rank's piece, S = U s, U Ulysses ranks, N blocks per piece,
b rows of one block, L = U b rows of an exchange block, n / ck this rank's q / kv heads of a
chunk, X any head count, D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ulysses import trace_shortcuts
from ulysses.band import acc_dtype, merge_into
from ulysses.band import piece_backward, piece_forward
from ulysses.buffer_pool import BufferPool
from ulysses.chunk_loop import ChunkConfig, ChunkSource, steps_run, as_BSnD, to_heads, to_seq
from ulysses.host_blocks import HostBlocks
from ulysses.sinks import apply_sinks, sinks_grad
from ulysses.ring import Hop
from ulysses.seq_chunk_sizes import (SeqChunking, Blocks, block_bounds, block_buffer_bytes,
                                     check_seq_chunk, resolve_seq_chunk, seq_chunking)

__all__ = ["SeqChunking", "block_bounds", "block_buffer_bytes", "check_seq_chunk",
           "resolve_seq_chunk", "run_backward", "run_forward", "seq_chunking"]
"""The loops, and (re-exported) the checks and sizes of :mod:`ulysses.seq_chunk_sizes`."""


# --- the loops ------------------------------------------------------------------------------

def _sender(src: ChunkSource, kind: str, j: int, st):
    """``rows -> (x_BbXD, ranges)``: what step ``j`` sends for ``kind``, rows ``rows`` of the
    piece. A source with ``send_rows`` makes only those rows (the fused projections: no
    seq-local tensor of the step's heads); otherwise rows of its seq-local tensor."""
    if hasattr(src, "send_rows"):
        return lambda rows: src.send_rows(kind, j, st, rows)
    x_BsXD, ranges = src.send(kind, j, st)
    return lambda rows: (x_BsXD[:, rows], ranges)


def _park_kv(src: ChunkSource, j: int, st, cfg: ChunkConfig, pool, blocks: Blocks,
             host: HostBlocks, out: Tensor) -> dict | None:
    """Step ``st``'s kv exchange, block by block, if any rank needs a new kv chunk. Returns,
    per ring rank (this one alone without a ring) and per block, ``[k_LkD, v_LkD]`` host
    tensors of this rank's new chunk, or None if it keeps its current one (or there was no
    exchange)."""
    if st.kv_sent() is None:
        return None
    me, U, (B, _, _, D) = cfg.rank, blocks.U, out.shape
    mine = st.kv[me][1] if st.kv_new[me] else 0
    parked: dict[int, list[Tensor]] = {}
    for kind in ("k", "v"):
        part = _sender(src, kind, j, st)
        for u in blocks.staged:
            b = blocks.bounds[u][1]
            x_BbXD, ranges = part(blocks.rows(u))
            p = to_heads(x_BbXD, ranges, mine, cfg.group, pool, cfg.comm_dtype)
            del x_BbXD
            if mine:
                parked.setdefault(u, []).append(host.park(as_BSnD(p, (b, B, mine, D), U)
                                                          .to(out.dtype)))
            p.arrive()
            p.release()
        del part
    if not mine:
        return None
    return _ring_gather(blocks.fill(parked, host), blocks, host, out.dtype)


def _ring_gather(own: list, blocks: Blocks, host: HostBlocks, dtype: torch.dtype) -> dict:
    """Every ring rank's kv blocks of the chunk, parked here: ``R - 1`` hops along the ring
    (as the ring's own kv blocks travel), one block at a time. The ring ranks that hold these
    heads run the same schedule, so they all take part."""
    got, ring = {blocks.me: own}, blocks.seq.ring
    comm = dtype if ring is None or ring.comm_dtype is None else ring.comm_dtype
    cur = own
    for h in range(1, blocks.R):
        nxt = []
        for pair in cur:
            sent = tuple(host.fetch(x).get() for x in pair)
            nxt.append([host.park(r.to(dtype)) for r in Hop(sent, None, ring, comm).wait()])
            del sent
        got[(blocks.me - h) % blocks.R] = cur = nxt
    return got


def _ring_sum(dkv: dict, u: int, i: int, blocks: Blocks, host: HostBlocks,
              wire: torch.dtype) -> Tensor:
    """This rank's block u of dk (``i`` 0) or dv (1), summed over the ring: its own sum plus
    what every other ring rank added for it (one exchange of block sums with each)."""
    total = host.fetch(dkv[blocks.me][u][i]).get()
    ring = blocks.seq.ring
    others = blocks.ring_order()[1:]
    if not others:
        return total
    sent = [host.fetch(dkv[rho][u][i]).get().to(wire).contiguous() for rho in others]
    recv = [torch.empty(total.shape, dtype=wire, device=total.device) for _ in others]
    peer = [dist.get_global_rank(ring.group, rho) for rho in others]
    ops = [dist.P2POp(dist.isend, x, g, ring.group) for x, g in zip(sent, peer)]
    ops += [dist.P2POp(dist.irecv, x, g, ring.group) for x, g in zip(recv, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for x in recv:
        total += x.to(total.dtype)
    return total


def _attend(q_LnD: Tensor, kv: dict, t: int, blocks: Blocks, host: HostBlocks,
            dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(out_LnD, lse_BnL)`` of query block t against every key block it sees."""
    B, L, n, D = q_LnD.shape
    seq = blocks.seq
    o_acc = torch.zeros(B, L, n, D, dtype=acc_dtype(dtype), device=q_LnD.device)
    l_acc = torch.full((B, n, L), float("-inf"), dtype=torch.float32, device=q_LnD.device)
    keys = blocks.keys[t]  # (ring rank, block) pairs
    nxt = [host.fetch(h) for h in kv[keys[0][0]][keys[0][1]]] if keys else None
    for i, key in enumerate(keys):
        k_u, v_u = (f.get() for f in nxt)
        if i + 1 < len(keys):
            rho, u = keys[i + 1]
            nxt = [host.fetch(h) for h in kv[rho][u]]
        for rows, pieces in blocks.work(t, key):
            for p in pieces:
                o_p, l_p = piece_forward(q_LnD[rows], k_u[rows], v_u[rows], p, scale=seq.scale,
                                         backend=seq.backend, softcap=seq.softcap)
                merge_into(o_acc[rows, p.q0:p.q1], l_acc[rows, :, p.q0:p.q1], o_p, l_p)
                del o_p, l_p
        del k_u, v_u
    return o_acc.to(dtype), l_acc


def run_forward(src: ChunkSource, out: Tensor, cfg: ChunkConfig, pool: BufferPool,
                seq: SeqChunking, sinks: Tensor | None = None) -> Tensor:
    """Fill ``out_BsHD`` block by block; returns ``lse_BhS`` (fp32, this rank's h query
    heads), as :func:`ulysses.chunk_loop.run_forward` does. ``sinks`` (``[h]``) are applied
    to each query block's merged ``(out, lse)``, as the unchunked loop applies them to a
    chunk's."""
    U, me, steps = len(cfg.layout.q_sizes), cfg.rank, cfg.schedule
    B, s, _, D = out.shape
    blocks, host = Blocks(seq, U, s, out), HostBlocks(out, pool.stats)
    lse = torch.empty(B, cfg.layout.q_sizes[me], s * U, dtype=torch.float32, device=out.device)
    kv = None
    for j, _ in steps_run(steps, out, weighed=False):
        st = steps[j]
        kv = _park_kv(src, j, st, cfg, pool, blocks, host, out) or kv
        n = st.q[me][1]
        part = _sender(src, "q", j, st)
        for t in blocks.queries:
            b = blocks.bounds[t][1]
            q_BbXD, ranges = part(blocks.rows(t))
            p = to_heads(q_BbXD, ranges, n, cfg.group, pool, cfg.comm_dtype)
            del q_BbXD
            q_t = as_BSnD(p, (b, B, n, D), U).to(out.dtype)
            o_t = out.new_empty(B, U * b, 0, D)
            if n:
                o_t, l_t = _attend(q_t, kv, t, blocks, host, out.dtype)
                if sinks is not None:
                    o_t, l_t = apply_sinks(o_t, l_t, sinks[j * n:(j + 1) * n])
                # [B, n, U b] -> rows r s + [a_t, a_t + b) of the [B, n, S] lse
                lse[:, j * n:(j + 1) * n].unflatten(-1, (U, s))[..., blocks.rows(t)] = \
                    l_t.unflatten(-1, (U, b))
                del l_t
            del q_t
            p.release()
            back = to_seq(o_t, st.q, cfg.group, pool, cfg.comm_dtype)
            del o_t
            _place(out[:, blocks.rows(t)], st.q, back.wait())
            back.release()
        del part
        if st.kv_done[me]:
            kv = None
    host.close()
    return lse


def _place(dest_BbXD: Tensor, ranges, blocks: list[Tensor]) -> None:
    """Copy rank r's received block into heads ``ranges[r]`` of ``dest``."""
    if trace_shortcuts.skip(dest_BbXD):
        return
    for (start, n), block in zip(ranges, blocks):
        if n:
            dest_BbXD[:, :, start:start + n].copy_(block)


def _grad_block(dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, kv: dict, dkv: dict,
                t: int, blocks: Blocks, host: HostBlocks, acc: torch.dtype) -> Tensor:
    """dq of query block t (``[B, L, n, D]`` in ``acc``); adds into the host dk/dv sums of
    every key block it sees."""
    seq = blocks.seq
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    keys = blocks.keys[t]

    def fetch(key):
        rho, u = key
        return [host.fetch(h) for h in (*kv[rho][u], *dkv[rho][u])]

    nxt = fetch(keys[0]) if keys else None
    for i, key in enumerate(keys):
        k_u, v_u, dk_u, dv_u = (f.get() for f in nxt)
        nxt = fetch(keys[i + 1]) if i + 1 < len(keys) else None
        for rows, pieces in blocks.work(t, key):
            for p in pieces:
                dq_p, dk_p, dv_p = piece_backward(dout[rows], q[rows], k_u[rows], v_u[rows],
                                                  out[rows], lse[rows], p, scale=seq.scale,
                                                  backend=seq.backend, softcap=seq.softcap)
                dq[rows, p.q0:p.q1] += dq_p
                dk_u[rows, p.k0:p.k1] += dk_p
                dv_u[rows, p.k0:p.k1] += dv_p
                del dq_p, dk_p, dv_p
        host.store(dkv[key[0]][key[1]][0], dk_u)
        host.store(dkv[key[0]][key[1]][1], dv_u)
        del k_u, v_u, dk_u, dv_u
    return dq


def run_backward(src: ChunkSource, out: Tensor, lse: Tensor, cfg: ChunkConfig,
                 pool: BufferPool, seq: SeqChunking,
                 sinks: Tensor | None = None) -> Tensor | None:
    """Per chunk and query block: redo the exchanges of q, out and dout, run the pieces'
    kernel backward with the saved lse, and hand dq (and, once per kv chunk, the summed dk/dv)
    back to the source, as :func:`ulysses.chunk_loop.run_backward` does. With ``sinks`` the
    saved ``out``/lse are the sinks-applied ones (what the kernels' backward takes) and their
    gradient is summed over the query blocks; returns it (float32 ``[h]``), else None."""
    U, me, steps = len(cfg.layout.q_sizes), cfg.rank, cfg.schedule
    B, s, _, D = out.shape
    blocks, host = Blocks(seq, U, s, out), HostBlocks(out, pool.stats)
    # dq and the dk/dv sums in float32 for half inputs (and at least the exchange's width);
    # they travel in the exchange's dtype.
    wire = out.dtype if cfg.comm_dtype is None else cfg.comm_dtype
    acc = torch.promote_types(acc_dtype(out.dtype), wire)
    # What a ring carries of the dk/dv sums: its comm dtype, else the sums' own.
    hop = acc if seq.ring is None or seq.ring.comm_dtype is None else seq.ring.comm_dtype
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32,
                                                    device=sinks.device)
    kv = dkv = None
    for j, _ in steps_run(steps, out, weighed=False):
        st = steps[j]
        new = _park_kv(src, j, st, cfg, pool, blocks, host, out)
        if new is not None:
            kv = new
            dkv = {rho: blocks.fill({u: [host.empty(h, acc, zero=True) for h in mine[u]]
                                     for u in blocks.staged}, host)
                   for rho, mine in kv.items()}
        n = st.q[me][1]
        sent = [_sender(src, kind, j, st) for kind in ("q", "dout")] + [
            lambda rows, st=st: (out[:, rows], st.q)]
        for t in blocks.queries:
            b, rows = blocks.bounds[t][1], blocks.rows(t)
            pend = [to_heads(*part(rows), n, cfg.group, pool, cfg.comm_dtype) for part in sent]
            q_t, dout_t, out_t = (as_BSnD(p, (b, B, n, D), U).to(out.dtype) for p in pend)
            dq_t = out.new_empty(B, U * b, 0, D)
            if n:
                # rows r s + [a_t, a_t + b) of the [B, n, S] lse -> [B, n, U b]
                lse_t = lse[:, j * n:(j + 1) * n].unflatten(-1, (U, s))[..., rows].flatten(-2)
                dq_t = _grad_block(dout_t, q_t, out_t, lse_t, kv, dkv, t, blocks, host, acc)
                if sinks is not None:
                    dsinks[j * n:(j + 1) * n] += sinks_grad(dout_t, out_t, lse_t,
                                                            sinks[j * n:(j + 1) * n])
                del lse_t
            del q_t, dout_t, out_t
            for p in pend:
                p.release()
            back = to_seq(dq_t, st.q, cfg.group, pool, wire)
            del dq_t
            src.take_rows("q", j, st, back.wait(), rows)
            back.release()
        del sent
        ranges = st.kv_returned()
        if ranges is not None:
            for i, kind in enumerate(("k", "v")):
                for u in blocks.staged:
                    b = blocks.bounds[u][1]
                    d = (_ring_sum(dkv, u, i, blocks, host, hop) if st.kv_done[me] else
                         out.new_empty(B, U * b, 0, D))
                    back = to_seq(d, ranges, cfg.group, pool, wire)
                    del d
                    src.take_rows(kind, j, st, back.wait(), blocks.rows(u))
                    back.release()
        if st.kv_done[me]:
            kv = dkv = None
    host.close()
    return dsinks
