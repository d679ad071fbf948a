"""The peer stack of ``benchmarks/memory.py``: DeepSpeed's ALST pieces, as DeepSpeed ships them.

Arctic Long Sequence Training lives in ``deepspeed/runtime/sequence_parallel/ulysses_sp.py``:

- ``UlyssesSPAttentionHF.register_with_transformers``: Ulysses attention in place of the
  model's ``"sdpa"`` (the model object is passed, so nothing is read from the hub);
- ``TiledMLP``: each decoder MLP over sequence tiles, recomputed in backward;
- ``TiledFusedLogitsLoss``: lm_head + cross-entropy over tiles, its backward run in forward;
- ``UlyssesSPDataLoaderAdapter``: contiguous sequence shards, used here only to check that
  they are the shards ``arctic.data.prepare_sp_batch`` gives the other stacks;

plus HF's non-reentrant gradient checkpointing. DeepSpeed ships no activation offload for this
path (ArcticTraining has one, outside DeepSpeed), so the peer has none.

Two things are forced by DeepSpeed's API rather than chosen:

- ``register_with_transformers`` takes no ``mpu``: it builds its SP group in the module
  globals of ``parallel_state_sp`` (once per process) and replaces ``"sdpa"`` in
  transformers' attention table for the whole process. Our stacks use ``"ulysses_sdpa"`` and
  so are untouched; :func:`apply_alst` checks that DeepSpeed's group holds the same ranks as
  the mesh's ``"sp"`` axis.
- ``TiledFusedLogitsLoss`` computes the lm_head's gradient inside forward with an incoming
  gradient of 1 and applies the real incoming gradient to the hidden states only. The SP
  scale ``sp / N`` (``N`` valid tokens in the group; the ``averaged_over_sp`` convention of
  ``arctic.loss.sp_token_loss``) therefore goes inside the tiled loss function, and the
  group reduction (the all-gather of ArcticTraining's recipe) hands it exactly 1.

The tile functions given to ``TiledMLP`` and ``TiledFusedLogitsLoss`` are ours to write (as
in DeepSpeed's examples); two details in them only keep MemTracker's module hooks working on
CPU (see ``_mlp_tile`` and ``loss_fn``) and leave the computation as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

import deepspeed
import deepspeed.comm as ds_dist
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter)

from ulysses import flat_mesh

IGNORE_INDEX = -100


def init_deepspeed_comm() -> None:
    """Let ``deepspeed.comm`` wrap the process group torchrun's ranks already share."""
    if not ds_dist.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)


def _mlp_tile(mlp: nn.Module, x_tE: Tensor) -> Tensor:
    """The MLP class's own forward on one tile. ``TiledMLP`` runs its forward tiles under
    no_grad on views of an input that requires grad; those views have no grad_fn, which
    MemTracker's module hooks cannot follow (AssertionError "Expected gradient function to be
    set"). Detaching them there changes nothing else."""
    return type(mlp).forward(mlp, x_tE if torch.is_grad_enabled() else x_tE.detach())


class _TiledMLPForward:
    """A decoder MLP instance's forward through DeepSpeed's ``TiledMLP``."""

    def __init__(self, mlp: nn.Module, tiles: int) -> None:
        self.mlp, self.tiles = mlp, tiles
        self.params = list(mlp.parameters())

    def __call__(self, x_BSE: Tensor) -> Tensor:
        return TiledMLP.apply(_mlp_tile, self.mlp, x_BSE, self.tiles, self.params)


class _ALSTLoss:
    """A causal LM's forward, replaced by the SP token-mean loss of one sharded batch."""

    def __init__(self, model: nn.Module, group, loss_tiles: int) -> None:
        self.model, self.group, self.tiles = model, group, loss_tiles
        self.sp = dist.get_world_size(group)

    def __call__(self, input_ids: Tensor, position_ids: Tensor, shift_labels: Tensor) -> Tensor:
        hidden_BsE = self.model.model(input_ids=input_ids, position_ids=position_ids,
                                      use_cache=False).last_hidden_state
        num_valid = (shift_labels != IGNORE_INDEX).sum()
        dist.all_reduce(num_valid, group=self.group)
        scale = self.sp / num_valid.clamp(min=1).item()

        def loss_fn(head: nn.Module, x_TE: Tensor, y_T: Tensor) -> Tensor:
            # Summed token loss of one tile, already scaled: see the module docstring. The head
            # (no bias) is applied as F.linear, not called as a module: TiledFusedLogitsLoss
            # runs backward inside forward, after which MemTracker's module tracking takes a
            # second head call for a new iteration and raises NotImplementedError.
            return F.cross_entropy(F.linear(x_TE, head.weight).float(), y_T,
                                   reduction="sum") * scale

        head = self.model.get_output_embeddings()
        scaled_sum = TiledFusedLogitsLoss.apply(loss_fn, head, hidden_BsE, shift_labels, None,
                                                self.tiles, [head.weight], "sum")
        # Forward: sum over ranks / sp = the group's token mean. Backward: each rank's
        # scaled_sum gets sp x (1 / sp) = 1 (the all-gather's backward sums over the group).
        gathered = dist_fn.all_gather(scaled_sum.reshape(1), group=self.group)
        return torch.cat(gathered).sum() / self.sp


def apply_alst(model: nn.Module, *, mesh, seq_len: int, mlp_tiles: int,
               loss_tiles: int) -> nn.Module:
    """Turn a HF Llama built with ``attn_implementation="sdpa"`` into the ALST peer.

    Args:
        model: the causal LM; its ``"sdpa"`` attention becomes DeepSpeed's Ulysses.
        mesh: the benchmark's mesh; DeepSpeed's SP group must match its ``"sp"`` axis.
        seq_len: the full (padded) sequence length, fixed for every batch.
        mlp_tiles, loss_tiles: the tile counts, as given to our ``+tiling`` stack.

    Returns ``model``, whose ``forward(input_ids=, position_ids=, shift_labels=)`` (this
    rank's contiguous shard ``[1, seq_len / sp]`` each) returns the SP token-mean loss.
    """
    init_deepspeed_comm()
    sp_mesh = flat_mesh(mesh, "sp")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa",
        sequence_parallel_size=sp_mesh.size(), micro_batch_size=1, seq_length=seq_len,
        seq_length_is_variable=False)
    group = mpu.get_sequence_parallel_group()
    ours = dist.get_process_group_ranks(sp_mesh.get_group())
    if dist.get_process_group_ranks(group) != ours:
        raise RuntimeError(f"DeepSpeed's SP group {dist.get_process_group_ranks(group)} is not "
                           f"the mesh's sp axis {ours}")
    for layer in model.model.layers:
        layer.mlp.forward = _TiledMLPForward(layer.mlp, mlp_tiles)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.forward = _ALSTLoss(model, group, loss_tiles)
    return model


def check_shards(input_ids_BS: Tensor, batch: dict[str, Tensor], mesh) -> None:
    """Raise unless DeepSpeed's data adapter cuts ``input_ids_BS`` (the same on every rank)
    into exactly ``batch``'s shards (``input_ids``, ``position_ids``, ``shift_labels``)."""
    init_deepspeed_comm()
    sp_mesh = flat_mesh(mesh, "sp")
    S = input_ids_BS.shape[1]
    sample = {"input_ids": input_ids_BS, "labels": input_ids_BS.clone(),
              "position_ids": torch.arange(S).expand_as(input_ids_BS)}
    adapter = UlyssesSPDataLoaderAdapter(
        DataLoader([sample], batch_size=None), sp_rank=sp_mesh.get_local_rank(),
        sp_group=sp_mesh.get_group(), sp_world_size=sp_mesh.size(),
        device=input_ids_BS.device)
    theirs = next(adapter)
    for key, ours in batch.items():
        if not torch.equal(theirs[key].to(ours.device), ours):
            raise RuntimeError(f"UlyssesSPDataLoaderAdapter's {key} shard differs from "
                               f"prepare_sp_batch's")
