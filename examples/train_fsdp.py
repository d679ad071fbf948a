"""Sequence-parallel training of a HF causal LM with FSDP2, launched by torchrun.

    torchrun --nproc-per-node 2 examples/train_fsdp.py --sequence-parallel-size 2 \
        [--ring-degree 1] [--head-chunk-size C] [--seq-len 256] [--max-steps 30] [--lr 1e-3] \
        [--save-dir checkpoints/fsdp --save-every 10] [--resume] \
        [--no-activation-checkpointing] [--offload-activations] [--offload-params] \
        [--config ds.json] [--log-file log.jsonl]

The same job as ``examples/train.py`` (the tiny Llama, byte tokens of the shipped corpus, the
progress bar with loss, tokens/s and peak memory per rank: ``examples/_common.py``), with
DeepSpeed swapped for FSDP2: ``arctic.recipe.apply_sp_recipe`` makes the model
sequence-parallel, then ``arctic.apply_fsdp`` shards it over every rank (dp x sp), and a
plain AdamW steps the sharded parameters. The SP loss is built with ``averaged_over_sp=True``
because FSDP2 averages gradients over all ranks, SP ranks included (see :mod:`arctic.train.fsdp`).
``--offload-params`` passes FSDP2's ``CPUOffloadPolicy`` to ``apply_fsdp``: the parameter
shards, their gradients and the AdamW state stay on the host, and AdamW steps on the CPU.

``--config`` takes the SP settings from a DeepSpeed JSON (``sequence_parallel_size`` and the
``"ulysses"`` block) instead of the SP flags; one that turns on ZeRO is refused, on every
rank, before training. Checkpoints are ``torch.distributed.checkpoint`` directories
``--save-dir/step{N}``: the sharded model and optimizer, the step, the data position and each
rank's RNG. ``--resume`` continues from the newest one, so the loss trajectory continues
step for step as if the run had never stopped (fp32, same seed).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy

# examples/_common.py, beside this file; importing it puts the checkout on sys.path.
from _common import (ByteCorpus, Progress, add_job_args, build_model,
                     batches_to_skip, parse_job_args, save_model_config, resumable_batches,
                     split_cpu_threads, run_main)

from arctic import SequenceParallelConfig, SequenceParallelDataLoader, apply_fsdp  # noqa: E402
from arctic.memory import allocator, gather_peak_memory_mib  # noqa: E402
from arctic.config import load_ds_config  # noqa: E402
from arctic.recipe import apply_sp_recipe  # noqa: E402
from arctic.train.fsdp import check_no_zero  # noqa: E402
from arctic.order import STAGES, applied_stages  # noqa: E402
from arctic.memory.placement import Placement, offload_pool_limit  # noqa: E402
from ulysses import flat_mesh  # noqa: E402

SP_FLAGS = ("sequence_parallel_size", "ring_degree", "head_chunk_size", "tiled_mlp",
            "no_activation_checkpointing", "offload_activations")


def _int_or_auto(value: str):
    return value if value == "auto" else int(value)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sp = p.add_argument_group("sequence parallelism (or --config)")
    sp.add_argument("--sequence-parallel-size", type=int, default=None, help="default 1")
    sp.add_argument("--ring-degree", type=int, default=None, help="default 1")
    sp.add_argument("--head-chunk-size", type=_int_or_auto, default=None)
    sp.add_argument("--tiled-mlp", type=_int_or_auto, default=None, help="default auto")
    sp.add_argument("--no-activation-checkpointing", action="store_true", default=None)
    sp.add_argument("--offload-activations", action="store_true", default=None)
    p.add_argument("--offload-params", action="store_true",
                   help="FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state on "
                        "the host")
    p.add_argument("--config", type=Path, default=None,
                   help="DeepSpeed JSON with sequence_parallel_size and the ulysses block")
    add_job_args(p, seq_len=256)
    p.add_argument("--batch-size", type=int, default=1, help="samples per dp rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip; default off")
    p.add_argument("--dump-grads", type=Path, default=None,
                   help="torch.save the full gradients of this run's first step (rank 0)")
    args = parse_job_args(p)
    given = [f"--{n.replace('_', '-')}" for n in SP_FLAGS if getattr(args, n) is not None]
    if args.config is not None and given:
        p.error(f"--config sets sequence parallelism; drop {', '.join(given)} or --config")
    return args


def sp_config(args: argparse.Namespace, world_size: int) -> SequenceParallelConfig:
    """The SP settings from ``--config`` or the flags; ``ValueError`` for a bad combination.

    Runs before the process group exists, so every rank raises the same error and none hangs.
    """
    if args.config is not None:
        ds = load_ds_config(args.config)
        check_no_zero(ds)
        return SequenceParallelConfig.from_ds_config(ds, world_size=world_size)
    config = SequenceParallelConfig(
        sequence_parallel_size=args.sequence_parallel_size or 1,
        ring_degree=args.ring_degree or 1, head_chunk_size=args.head_chunk_size,
        tiled_mlp="auto" if args.tiled_mlp is None else args.tiled_mlp,
        activation_checkpointing=not args.no_activation_checkpointing,
        offload_activations=bool(args.offload_activations))
    config.dims(world_size)
    return config


def newest_checkpoint(save_dir: Path) -> Path | None:
    """The highest ``step{N}`` directory that DCP finished (its ``.metadata`` is written
    last, by the coordinator, after every rank's shards)."""
    steps = [int(d.name[4:]) for d in save_dir.glob("step*")
             if d.name[4:].isdigit() and (d / ".metadata").is_file()]
    return save_dir / f"step{max(steps)}" if steps else None


def unfinished_checkpoints(save_dir: Path) -> list[Path]:
    """The ``step{N}`` directories a resume skips: DCP did not finish them (no
    ``.metadata``)."""
    return sorted(d for d in save_dir.glob("step*")
                  if d.name[4:].isdigit() and not (d / ".metadata").is_file())


def save_checkpoint(path: Path, model, optimizer, progress: list[int]) -> None:
    """Sharded model + optimizer, ``progress`` = [step, epoch, samples_in_epoch] (the data
    position in samples of the epoch's order, which every layout shares), and this rank's RNG
    state (under a per-rank key)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "progress": torch.tensor(progress),
              f"rng_rank{dist.get_rank()}": torch.get_rng_state()}, checkpoint_id=str(path))


def load_checkpoint(path: Path, model, optimizer) -> list[int]:
    """Load what :func:`save_checkpoint` wrote into ``model`` and ``optimizer`` (resharded if
    the world size changed); returns ``[step, epoch, samples_in_epoch]``."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "progress": torch.zeros(3, dtype=torch.long)}
    rng_key = f"rng_rank{dist.get_rank()}"
    # A rank that did not exist when the checkpoint was written keeps its seeded RNG.
    if rng_key in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata:
        state[rng_key] = torch.get_rng_state()
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    return state["progress"].tolist()


def grad_norm(model, device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients. Each element lives in exactly one rank's local shard (FSDP2
    over every rank), so the local sums of squares add up over the world. The sum is reduced
    on ``device``, not where the gradients are: with ``--offload-params`` they are on the host,
    where NCCL cannot reduce."""
    sq = sum(p.grad.to_local().float().pow(2).sum() for p in model.parameters()
             if p.grad is not None)
    sq = torch.as_tensor(sq, device=device)
    dist.all_reduce(sq)
    return sq.sqrt()


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    config = sp_config(args, world)  # before any collective
    allocator.use_expandable_segments()  # before anything is on the GPU (arctic.memory.allocator)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    split_cpu_threads()
    backend = "nccl" if cuda else "gloo"
    if cuda and args.offload_params:
        # Offloaded gradients and parameters are DTensors with host-side shards, and
        # full_tensor() (--dump-grads) runs its all-gather where they are; NCCL has no CPU
        # backend, so CPU tensors go to gloo (pytorch/pytorch#148532, as torchtune#2108 does).
        backend = "cuda:nccl,cpu:gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    mesh = config.dims(world).build_mesh(device.type)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    if args.resume and newest_checkpoint(args.save_dir) is None:  # before anything is written
        raise ValueError(f"--resume: no finished checkpoint (step*/.metadata) in "
                         f"{args.save_dir}")
    model = build_model(args.model, args.seq_len).to(device)
    save_model_config(model, args.save_dir)  # before SP changes its attention
    host_limit = None
    if args.offload_params and config.activation_checkpointing and config.offload_activations:
        # CPUOffloadPolicy puts the state on the host beside the offloaded layer inputs: the
        # pool gets what the state leaves of its budget, as the planner counts them.
        host_limit = offload_pool_limit(Placement("fsdp2"),
                                        sum(p.numel() for p in model.parameters()), world,
                                        group=flat_mesh(mesh, "dp_sp").get_group())
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True,
                    host_memory_limit=host_limit)
    offload_policy = None
    if args.offload_params:
        # Pinned host memory makes the copies to and from the GPU faster and lets them overlap
        # compute, but pinning needs an accelerator: a CPU-only run must not pin (and there the
        # host is the device, so nothing moves; apply_fsdp refuses pin_memory=True).
        offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    apply_fsdp(model, mesh=mesh, offload_policy=offload_policy)
    if rank == 0:
        stages = sorted(applied_stages(model), key=STAGES.index)
        print(f"applied: {' -> '.join(stages)} (dp={mesh['dp'].size()}, "
              f"sp={flat_mesh(mesh, 'sp').size()})", flush=True)
        if offload_policy is not None:
            print(f"offload: parameters, gradients and optimizer state on the host "
                  f"({offload_policy})", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    loader = SequenceParallelDataLoader(ByteCorpus(args.data, args.seq_len), mesh,
                                        batch_size=args.batch_size, seed=args.seed)
    dp, dp_group = mesh["dp"].size(), mesh["dp"].get_group()

    step, epoch, skip = 0, 0, 0
    if args.resume:
        path = newest_checkpoint(args.save_dir)
        step, epoch, samples = load_checkpoint(path, model, optimizer)
        if rank == 0:
            print(f"resumed from {path} (step {step})", flush=True)
            for skipped in unfinished_checkpoints(args.save_dir):
                print(f"skipped {skipped}: its save did not finish (no .metadata)", flush=True)
        skip = batches_to_skip(samples, args.batch_size * dp)
    first_step = step + 1

    progress = Progress(desc="train fsdp", total=args.max_steps, initial=step,
                        log_file=args.log_file)
    tokens_per_step = args.seq_len * args.batch_size * dp
    offload = getattr(model, "activation_offload", None)  # set by checkpointing with offload
    batches = resumable_batches(loader, epoch=epoch, skip=skip)
    while step < args.max_steps:
        epoch, i, batch = next(batches)
        start = time.perf_counter()
        loss = model(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
        loss.backward()
        step += 1
        if args.dump_grads and step == first_step:
            full = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}
            if rank == 0:
                torch.save(full, args.dump_grads)
        norm = grad_norm(model, device)
        if args.max_grad_norm is not None:
            coef = min(1.0, args.max_grad_norm / (norm.item() + 1e-6))
            for p in model.parameters():
                p.grad.mul_(coef)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start

        # The loss is already the SP group's; the mean over dp is the global batch's.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=dp_group)
        peaks = gather_peak_memory_mib(device)
        if rank == 0:
            record = {"step": step, "loss": mean_loss.item() / dp,
                      "grad_norm": norm.item(), "tokens_per_s": tokens_per_step / elapsed,
                      "peak_mib": peaks}
            if offload is not None:  # rank 0's layer inputs moved to the host this step
                record["offloaded_mib"] = round(offload.pool.stats.bytes_offloaded / 2**20, 3)
            progress.show(record)
        if offload is not None:
            offload.pool.reset_stats()
        if args.save_dir and step % args.save_every == 0:
            save_checkpoint(args.save_dir / f"step{step}", model, optimizer,
                            [step, epoch, (i + 1) * args.batch_size * dp])
    progress.done(step)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
