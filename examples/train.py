"""The main job: sequence-parallel training of a HF causal LM with DeepSpeed.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config configs/cpu_demo.json \
        [--model tiny-llama | path/to/config.json] [--seq-len 1024] [--max-steps 30] \
        [--save-dir checkpoints/demo --save-every 10] [--resume]

The CPU default is a tiny Llama built from a config (random weights), trained on byte-level
tokens (vocab 256) of ``examples/data/corpus.txt``, a generated text shipped in the repo. The
model, SP attention, tiling, loss and ZeRO come from ``arctic.initialize`` and the config's
``"ulysses"`` block. Rank 0 shows a progress bar with the loss, tokens/s and peak memory per
rank (CUDA allocator peak on GPU, peak RSS on CPU) and, with ``offload_activations``, the
host memory holding checkpointed layer inputs; ``--log-file`` gets one JSON line per
step. ``--resume`` continues from the newest checkpoint in ``--save-dir``: same data order,
same losses, step for step, as a run that was never stopped (fp32, same seed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import arctic  # noqa: E402


class ByteCorpus(Dataset):
    """Non-overlapping ``seq_len``-byte windows of a text file; token = byte value."""

    def __init__(self, path: Path, seq_len: int) -> None:
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        n = len(data) // seq_len
        if n == 0:
            raise ValueError(f"{path} holds {len(data)} bytes, fewer than one sequence "
                             f"({seq_len}); lower --seq-len")
        self.windows = data[:n * seq_len].view(n, seq_len).long()

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i]}


def build_model(name: str, seq_len: int):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if name == "tiny-llama":
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=max(seq_len, 2048),
                             tie_word_embeddings=False)
    else:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"--model must be 'tiny-llama' or a config.json path, got {name!r}")
        config = AutoConfig.for_model(**json.loads(path.read_text()))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def show_step(bar, log, record: dict, **extra: str) -> None:
    """Rank 0: one step's loss, tokens/s and per-rank peaks on the bar, and a JSON log line."""
    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                    peak_mib="/".join(f"{p:.0f}" for p in record["peak_mib"]), **extra)
    bar.update(1)
    if log:
        log.write(json.dumps(record) + "\n")
        log.flush()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", "--deepspeed-config", default=str(REPO / "configs" /
                                                                            "cpu_demo.json"))
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--data", type=Path, default=REPO / "examples" / "data" / "corpus.txt")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", type=Path, default=None)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--log-file", type=Path, default=None, help="JSON lines, one per step")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.resume and args.save_dir is None:
        p.error("--resume needs --save-dir")
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    model = build_model(args.model, args.seq_len)
    if torch.cuda.is_available():
        model.cuda(int(os.environ.get("LOCAL_RANK", 0)))
    engine, _, loader, _ = arctic.initialize(model=model, config=args.deepspeed_config,
                                             training_data=ByteCorpus(args.data, args.seq_len))
    rank, device = dist.get_rank(), next(engine.module.parameters()).device
    offload = getattr(engine.module, "activation_offload", None)

    step, epoch, skip = 0, 0, 0
    if args.resume:
        _, client = engine.load_checkpoint(str(args.save_dir))
        if client is None:
            raise ValueError(f"--resume: no checkpoint in {args.save_dir}")
        step, epoch, skip = client["step"], client["epoch"], client["batches_in_epoch"]

    bar = None
    if rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=args.max_steps, initial=step, desc="train", dynamic_ncols=True)
    log = None
    if args.log_file and rank == 0:
        args.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(args.log_file, "a")
    tokens_per_step = args.seq_len * engine.train_micro_batch_size_per_gpu() * \
        (dist.get_world_size() // engine.sp_mesh["sp"].size())
    while step < args.max_steps:
        loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i < skip:  # the batches this epoch had already consumed before the checkpoint
                continue
            start = time.perf_counter()
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
            step += 1
            elapsed = time.perf_counter() - start
            peaks = [torch.zeros((), device=device) for _ in range(dist.get_world_size())]
            dist.all_gather(peaks, torch.tensor(peak_memory_mib(), device=device))
            if rank == 0:
                record = {"step": step, "loss": loss.item(), "tokens_per_s":
                          tokens_per_step / elapsed, "peak_mib": [round(p.item(), 1) for p in peaks]}
                shown = {}
                if offload is not None:  # checkpointed layer inputs held in host memory
                    record["offload_host_peak_mib"] = round(
                        offload.pool.stats.peak_host_bytes / 2**20, 1)
                    shown["host_mib"] = f"{record['offload_host_peak_mib']:.1f}"
                show_step(bar, log, record, **shown)
            if args.save_dir and step % args.save_every == 0:
                engine.save_checkpoint(str(args.save_dir), tag=f"step{step}", client_state={
                    "step": step, "epoch": epoch, "batches_in_epoch": i + 1})
            if step >= args.max_steps:
                break
        else:
            epoch, skip = epoch + 1, 0
            continue
        break
    if bar:
        bar.close()
        print(f"done: {step} steps, final loss {loss.item():.4f}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
