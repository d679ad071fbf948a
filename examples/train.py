"""The main job: sequence-parallel training of a HF causal LM with DeepSpeed.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config configs/cpu_demo.json \
        [--model tiny-llama | path/to/config.json] [--seq-len 1024] [--max-steps 30] \
        [--save-dir checkpoints/demo --save-every 10] [--resume [--convert-universal]]

The CPU default is a tiny Llama built from a config (random weights), trained on byte-level
tokens (vocab 256) of ``examples/data/corpus.txt``, a generated text shipped in the repo. The
model, SP attention, tiling, loss and ZeRO come from ``arctic.initialize`` and the config's
``"ulysses"`` block. Rank 0 shows a progress bar with the loss, tokens/s and peak memory per
rank (CUDA allocator peak on GPU, peak RSS on CPU) and, with ``offload_activations``, the
host memory holding checkpointed layer inputs; ``--log-file`` gets one JSON line per
step. ``--resume`` continues from the newest complete checkpoint in ``--save-dir`` (one whose
writing was interrupted is passed over): same data order, same losses, step for step, as a
run that was never stopped (fp32, same seed). At another world size or ZeRO stage it loads
the checkpoint's universal conversion, or names the command that makes it
(:mod:`arctic.train.ds_checkpoint`, docs/checkpoints.md); with ``--convert-universal`` the
resume runs that command itself first, on rank 0, while the other ranks wait.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

# examples/_common.py, beside this file; importing it puts the checkout on sys.path.
from _common import (REPO, ByteCorpus, Progress, add_job_args, build_model,
                     batches_to_skip, parse_job_args, save_model_config, resumable_batches,
                     split_cpu_threads, run_main)

import arctic  # after _common: from the checkout
from arctic.memory import gather_peak_memory_mib
from arctic.train.ds_checkpoint import (LAYOUT_FILE, CheckpointLayout, complete_tags,
                                        load_checkpoint, save_checkpoint, unfinished_tags)
from ulysses import flat_mesh

CONVERT_FLAG = "--convert-universal"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", "--deepspeed-config", default=str(REPO / "configs" /
                                                                            "cpu_demo.json"))
    add_job_args(p, seq_len=1024)
    p.add_argument(CONVERT_FLAG, action="store_true",
                   help="with --resume: when the checkpoint loads from its universal "
                        "conversion (at another world size or ZeRO stage) and that does not "
                        "exist yet, rank 0 makes it first (DeepSpeed's ds_to_universal) while "
                        "the other ranks wait")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parse_job_args(p)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    split_cpu_threads()
    if args.convert_universal and not args.resume:
        raise ValueError(f"{CONVERT_FLAG} converts the checkpoint that --resume loads: pass "
                         f"--resume too")
    if args.resume and not complete_tags(args.save_dir):  # refused before anything is written
        raise ValueError(f"--resume: no complete checkpoint in {args.save_dir} (a complete one "
                         f"holds {LAYOUT_FILE}, written after every rank's files)")
    model = build_model(args.model, args.seq_len)
    save_model_config(model, args.save_dir)  # before SP changes its attention
    if torch.cuda.is_available():
        model.cuda(int(os.environ.get("LOCAL_RANK", 0)))
    engine, _, loader, _ = arctic.initialize(model=model, config=args.deepspeed_config,
                                             training_data=ByteCorpus(args.data, args.seq_len))
    rank, device = dist.get_rank(), next(engine.module.parameters()).device
    offload = getattr(engine.module, "activation_offload", None)
    layout = CheckpointLayout(world_size=dist.get_world_size(),
                              sequence_parallel_size=flat_mesh(engine.sp_mesh, "sp").size(),
                              zero_stage=engine.zero_optimization_stage(), sp_mpu=True)
    samples_per_batch = engine.train_micro_batch_size_per_gpu() * layout.data_parallel_size

    step, epoch, skip = 0, 0, 0
    if args.resume:
        plan, client = load_checkpoint(engine, args.save_dir, layout=layout,
                                       convert=args.convert_universal, convert_flag=CONVERT_FLAG)
        if rank == 0:
            print(f"resumed from {args.save_dir / plan.tag} (step {client['step']}"
                  + (f", universal, saved at {plan.saved.describe()})" if plan.universal
                     else ")"), flush=True)
            for tag in unfinished_tags(args.save_dir):
                print(f"skipped {args.save_dir / tag}: its save did not finish (no "
                      f"{LAYOUT_FILE})", flush=True)
        step, epoch, skip = client["step"], client["epoch"], batches_to_skip(
            client["samples_in_epoch"], samples_per_batch)

    progress = Progress(desc="train", total=args.max_steps, initial=step,
                        log_file=args.log_file)
    tokens_per_step = args.seq_len * samples_per_batch
    batches = resumable_batches(loader, epoch=epoch, skip=skip)
    while step < args.max_steps:
        epoch, i, batch = next(batches)
        start = time.perf_counter()
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        step += 1
        elapsed = time.perf_counter() - start
        peaks = gather_peak_memory_mib(device)
        if rank == 0:
            record = {"step": step, "loss": loss.item(), "tokens_per_s": tokens_per_step / elapsed,
                      "peak_mib": peaks}
            shown = {}
            if offload is not None:  # checkpointed layer inputs held in host memory
                record["offload_host_peak_mib"] = round(
                    offload.pool.stats.peak_host_bytes / 2**20, 1)
                shown["host_mib"] = f"{record['offload_host_peak_mib']:.1f}"
            progress.show(record, **shown)
        if args.save_dir and step % args.save_every == 0:
            # the data position in samples of the epoch's order, which every layout shares
            save_checkpoint(engine, args.save_dir, tag=f"step{step}", layout=layout,
                            client_state={"step": step, "epoch": epoch,
                                          "samples_in_epoch": (i + 1) * samples_per_batch})
    progress.done(step)
    dist.barrier()
    dist.destroy_process_group()  # before exit: gloo's and NCCL's threads stop here



if __name__ == "__main__":
    run_main(main)
