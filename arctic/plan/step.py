"""The training step the planner traces, and the named stacks it plans.

One definition of the step serves two callers: the planner traces it under FakeTensorMode,
and ``benchmarks/scale_gpu.py`` runs it on a real GPU to check the planner. It is
``examples/train_fsdp.py``'s recipe at scale; kept apart from the tracing, what is planned is
what trains.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from arctic.config import SequenceParallelConfig
from arctic.data.batch import prepare_sp_batch
from arctic.hf.anatomy import text_config_of
from arctic.plan.models import is_vlm_config
from arctic.recipe import apply_sp_recipe
from arctic.train.fsdp import apply_fsdp
from ulysses.chunk_schedule import resolve_chunk_size
from ulysses.seq_chunk import resolve_seq_chunk
from ulysses.sharding import head_layout
from ulysses.torch_internals import detect_fake_mode


def build(config, sp: SequenceParallelConfig, mesh, *, device, shard: bool = True,
          host_memory_limit: int | None = None, compute_dtype: torch.dtype = torch.bfloat16):
    """The training setup of ``examples/train_fsdp.py`` at scale: the model from ``config``
    (fp32 parameters), :func:`arctic.recipe.apply_sp_recipe`, FSDP2 over every rank with
    ``compute_dtype`` (bf16) compute and fp32 gradient reduction, AdamW. ``shard=False``
    keeps the parameters whole, in ``compute_dtype`` (single-device references). Returns
    ``(model, optimizer)``."""
    import contextlib

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights


    auto = AutoModelForImageTextToText if is_vlm_config(config) else AutoModelForCausalLM
    # A trace needs no initial values (SigLIP's truncated normal reads them back)
    init = no_init_weights() if detect_fake_mode() is not None else contextlib.nullcontext()
    with torch.device(device), init:
        try:
            model = auto.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        except ValueError:  # e.g. Gemma2 with attention softcapping: transformers refuses
            # sdpa; the recipe swaps in the sequence-parallel attention either way
            model = auto.from_config(config, attn_implementation="eager", dtype=torch.float32)
    apply_sp_recipe(model, config=sp, mesh=mesh, averaged_over_sp=True,
                    host_memory_limit=host_memory_limit)
    if shard:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        apply_fsdp(model, mesh=mesh, reshard_after_forward=True,
                   mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype,
                                                  reduce_dtype=torch.float32))
        # The trace stands for DeepSpeed ZeRO-3 too, which gathers the input embedding for
        # its backward (prefetched in the first layer's); apply_fsdp does not: planned as
        # the former, the FSDP2 plan is one vocabulary-by-hidden tensor high at most.
        embedding = model.get_input_embeddings()
        if hasattr(embedding, "set_unshard_in_backward"):  # an FSDP unit (not when tied)
            embedding.set_unshard_in_backward(True)
    else:
        model.to(compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, optimizer


def pinned_blocks(sp: SequenceParallelConfig, config, seq_len: int, *,
                  compute_dtype: torch.dtype = torch.bfloat16) -> SequenceParallelConfig:
    """``sp`` with ``seq_chunk="auto"`` replaced by the block count it resolves to at
    ``seq_len`` (:func:`ulysses.seq_chunk.resolve_seq_chunk`, as the attention calls it: the
    text config's heads over the Ulysses degree, one row, this rank's piece). A fixed count
    cuts every length into blocks of a fixed share of it, so the block buffers grow with the
    length, as everything else the line through the anchors reads; ``"auto"`` cuts each
    length into blocks of at most a fixed number of rows, whose buffers stop growing past
    it: read off anchors shorter than that, they bend the line upwards, which neither reads
    the length nor bounds it from below. An ``"auto"`` head chunk size is pinned with it (the
attention resolves it before the blocks). ``sp`` itself when ``seq_chunk`` is not ``"auto"``."""
    if sp.seq_chunk != "auto":
        return sp
    text = text_config_of(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if getattr(text, "qk_nope_head_dim", None) is not None:  # latent attention: q/k's dim
        kv_heads, dim = heads, text.qk_nope_head_dim + text.qk_rope_head_dim
    else:
        dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    local = seq_len // sp.sequence_parallel_size
    layout = head_layout(heads, kv_heads, sp.ulysses_degree)
    c = resolve_chunk_size(sp.head_chunk_size, layout, 1, local * sp.ulysses_degree, dim,
                           compute_dtype)
    # an "auto" head chunk is pinned with them: its size too is the target length's
    return replace(sp, head_chunk_size=c,
                   seq_chunk=resolve_seq_chunk("auto", layout, c, 1, local, dim, compute_dtype))


def init_optimizer_state(model: nn.Module, optimizer) -> None:
    """Create AdamW's state (as after the first step) so the planned step is a steady one:
    zero gradients, one step, gradients dropped."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_batch(seq_len: int, vocab: int, mesh, device) -> dict:
    """This rank's shard of one packed sequence of ``seq_len`` tokens (``arctic.data``)."""
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    return {k: v.to(device) if torch.is_tensor(v) else v  # max_length_q/k are ints
            for k, v in prepare_sp_batch({"input_ids": ids}, mesh).items()}


def train_step(model: nn.Module, optimizer, batch: dict, *, on_phase=None) -> torch.Tensor:
    """One training step: the SP loss, backward, AdamW, gradients dropped. ``on_phase(name)``
    is called as "forward", "backward" and "optimizer" end (the planner's per-phase peaks)."""
    mark = on_phase or (lambda name: None)
    loss = model(**batch)
    mark("forward")
    loss.backward()
    mark("backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("optimizer")
    return loss.detach()


PLANNED_FIELDS = ("sequence_parallel_size", "ring_degree", "ring_layout", "head_chunk_size",
                  "seq_chunk",
                  "fuse_projections", "tiled_mlp", "tiled_norms", "tiled_layer", "loss_tiles",
                  "activation_checkpointing", "offload_activations", "offload_prefetch",
                  "recompute_attention",
                  "mixer_parallelism", "mixer_chunk")
"""The :class:`SequenceParallelConfig` fields that change what the planner traces (the rest,
the attention kernel and the exchanges' dtype, do not change memory; ``mixer_parallelism``
changes a hybrid's linear mixers' path, the all-to-all or state passing, and
``mixer_chunk`` their working set). The step is traced on
one document per row (a packed batch's documents only shorten the attention's kernel calls),
so ``ring_layout`` counts through the padding it asks for (``2 R U`` or ``R U``)."""

STACKS: dict[str, dict] = {
    # name -> SequenceParallelConfig fields (sequence_parallel_size comes from the world)
    "ulysses": dict(loss_tiles=1),
    "alst": dict(tiled_mlp="auto", tiled_norms=False, loss_tiles="auto",
                 activation_checkpointing=True, offload_activations=True),
    "ours": dict(head_chunk_size=1, fuse_projections=True, tiled_mlp="auto", tiled_layer=True,
                 loss_tiles="auto", activation_checkpointing=True, offload_activations=True),
    "ours-unfused": dict(head_chunk_size=1, tiled_mlp="auto", loss_tiles="auto",
                         activation_checkpointing=True, offload_activations=True),
    "ours-no-offload": dict(head_chunk_size=1, tiled_mlp="auto", loss_tiles="auto",
                            activation_checkpointing=True),
    "ours-keep-attention": dict(head_chunk_size=1, fuse_projections=True, tiled_mlp="auto",
                                tiled_layer=True, loss_tiles="auto", activation_checkpointing=True,
                                offload_activations=True, recompute_attention=False),
    "hybrid": dict(ring_degree=2, head_chunk_size=1, fuse_projections=True, tiled_mlp="auto",
                   tiled_layer=True, loss_tiles="auto", activation_checkpointing=True,
                   offload_activations=True),
}
"""Named stacks. ``ulysses``: SP attention alone (one loss tile: the full logits).
``alst``: DeepSpeed ALST's recipe (Ulysses without head chunking, tiled MLP and loss,
checkpointing with the layer inputs offloaded), built from our code. ``ours``: the same with
head chunking (one head per chunk) and the q/k/v/o projections fused into the chunk loop;
``ours-unfused`` without that fusion (nor the tiled layer tail); ``ours-keep-attention``
keeps each layer's attention output and lse on the host instead of recomputing attention in
backward. ``hybrid``:
``ours`` over ring 2 x Ulysses W/2. Ours also tile the RMSNorms
(:func:`arctic.tiling.apply_tiled_norms`) and, all but ``ours-unfused`` and ``ours-no-offload``,
run each layer's tail after attention as one tiled unit (:mod:`arctic.tiling.layer`); ALST
does neither."""


def stack_config(stack: str | dict, *, world: int) -> SequenceParallelConfig:
    """A named stack (:data:`STACKS`) or a dict of fields as a config over ``world`` ranks."""
    fields = STACKS[stack] if isinstance(stack, str) else stack
    check_plannable(fields)
    return SequenceParallelConfig(**{"sequence_parallel_size": world, **fields})


def check_plannable(fields: dict) -> None:
    """``ValueError`` for settings the planner's step cannot run: ``loss_tiles`` null (no SP
    loss, a loss of the user's own, which the planner does not know)."""
    if "loss_tiles" in fields and fields["loss_tiles"] is None:
        raise ValueError("loss_tiles is null (no SP loss: the model returns its logits for a "
                         "loss of your own), which the planner cannot trace; plan with "
                         "loss_tiles 1, the untiled logits and loss, for a close bound")
