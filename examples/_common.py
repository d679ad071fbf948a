"""What the training examples share: the demo model and data, the job's command-line flags,
the resumable data loop, and rank 0's progress bar and JSON log.

``examples/train.py`` (DeepSpeed) and ``examples/train_fsdp.py`` (FSDP2) run the same job
with a different sharding engine, so everything but the engine lives here, once: a change to
the model, the data order or what is logged reaches both, and their losses stay comparable.
Importing this module puts the checkout on ``sys.path``, so the examples run from a checkout
without installing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing


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
    """``"tiny-llama"`` (the CPU demo: 2 layers, byte vocab, random weights), a name of the
    planner's catalogue (:data:`arctic.plan.MODELS`, random weights) or a HF ``config.json``
    path; built from the config with ``attn_implementation="sdpa"``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from arctic.plan.models import MODELS, model_config

    if name == "tiny-llama":
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=max(seq_len, 2048),
                             tie_word_embeddings=False)
    elif name in MODELS:  # the planner's catalogue (python -m arctic.plan prints these)
        config = model_config(name, max_positions=seq_len)
    else:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"--model must be 'tiny-llama', one of {sorted(MODELS)} or a "
                             f"config.json path, got {name!r}")
        config = model_config(name)  # the file's own positions; no cache
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def save_model_config(model, save_dir: Path | None) -> None:
    """Rank 0 writes the model's HF ``config.json`` into ``save_dir`` (made if missing), as
    built, before sequence parallelism changes its attention implementation: what
    ``python -m arctic.export`` builds the model from. Nothing without ``save_dir``."""
    if save_dir is None or int(os.environ.get("RANK", 0)) != 0:
        return
    save_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(save_dir)


def add_job_args(p: argparse.ArgumentParser, *, seq_len: int) -> None:
    """The flags of the job itself: model, data, length, steps, seed, checkpoints, log."""
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--data", type=Path, default=REPO / "examples" / "data" / "corpus.txt")
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", type=Path, default=None)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--log-file", type=Path, default=None, help="JSON lines, one per step")


def parse_job_args(p: argparse.ArgumentParser) -> argparse.Namespace:
    """``p.parse_args()``, refusing ``--resume`` without ``--save-dir``."""
    args = p.parse_args()
    if args.resume and args.save_dir is None:
        p.error("--resume needs --save-dir")
    return args


REFUSAL_GRACE_S = 5.0
"""How long a rank other than 0 waits before it reports a refusal of its own: rank 0's
failure ends the job sooner (the launchers look every 0.1 s to 1 s)."""


def run_main(main) -> None:
    """Run a launched script's ``main``. A ``ValueError`` (a refusal, raised alike on every
    rank, before any collective) prints one line, ``error: ...``, on rank 0 and no traceback;
    the script exits 1. A rank other than 0 waits :data:`REFUSAL_GRACE_S`: when rank 0 refused
    too, the launcher ends it first; if it is still running, the refusal was its own and it
    prints it, naming its rank. ``ARCTIC_TRACEBACK=1`` shows every rank's traceback instead.
    Any other exception (a bug, not a refusal) keeps its traceback."""
    try:
        main()
        # The interpreter's last collections would walk every object torch, transformers
        # and DeepSpeed made (about 1.5 s per rank on 2 cores). What main made is freed by
        # reference counts and the atexit handlers (which still run); only that walk stops.
        gc.freeze()
    except ValueError as e:
        if os.environ.get("ARCTIC_TRACEBACK") == "1":
            raise
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0:
            time.sleep(REFUSAL_GRACE_S)
        where = "" if rank == 0 else f" (rank {rank})"
        print(f"error{where}: {e}\n(ARCTIC_TRACEBACK=1 shows the traceback)", file=sys.stderr,
              flush=True)
        sys.exit(1)


def split_cpu_threads() -> None:
    """On CPU, give each local rank its share of the cores: every rank defaulting to all of
    them would oversubscribe the machine."""
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def batches_to_skip(samples_in_epoch: int, samples_per_batch: int) -> int:
    """The batches of the epoch already trained on, for a checkpoint ``samples_in_epoch``
    samples into its epoch: the epoch's order of samples is the same at every layout
    (``DistributedSampler`` deals one permutation over the dp ranks), so the position is a
    count of samples, whole batches of this layout's (``samples_per_batch``: micro batch x
    data parallel size). ``ValueError`` when it is not."""
    if samples_in_epoch % samples_per_batch:
        raise ValueError(f"--resume: the checkpoint is {samples_in_epoch} samples into its "
                         f"epoch, not a whole number of this layout's steps of "
                         f"{samples_per_batch} samples (micro batch x data parallel size); "
                         f"resume with a data parallel size that divides it")
    return samples_in_epoch // samples_per_batch


def resumable_batches(loader, *, epoch: int, skip: int) -> Iterator[tuple[int, int, dict]]:
    """``(epoch, index in the epoch, batch)`` without end, starting at a checkpoint's data
    position: the first ``skip`` batches of ``epoch`` are the ones it had already consumed.
    The loader's ``set_epoch`` gives each epoch its own order, so a resumed run sees the same
    batches, in the same order, as one that never stopped."""
    while True:
        loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield epoch, i, batch
        epoch, skip = epoch + 1, 0


class Progress:
    """Rank 0's progress bar (loss, tokens/s, per-rank peak memory) and its JSON-lines log,
    one record per step; other ranks show nothing."""

    def __init__(self, *, desc: str, total: int, initial: int, log_file: Path | None) -> None:
        self.bar = self.log = self.last = None
        if dist.get_rank() != 0:
            return
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
        if log_file:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            self.log = open(log_file, "a")

    def show(self, record: dict, **extra: str) -> None:
        """Rank 0: one step's ``record`` (``loss``, ``tokens_per_s``, ``peak_mib``, ...) on
        the bar, with ``extra`` fields, and as a line of the log."""
        self.last = record
        self.bar.set_postfix(loss=f"{record['loss']:.4f}",
                             tok_s=f"{record['tokens_per_s']:.0f}",
                             peak_mib="/".join(f"{p:.0f}" for p in record["peak_mib"]), **extra)
        self.bar.update(1)
        if self.log:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def done(self, step: int) -> None:
        """Rank 0: close the bar and print the step count and the last logged loss."""
        if self.bar:
            self.bar.close()
            last = f", final loss {self.last['loss']:.4f}" if self.last else ""
            print(f"done: {step} steps{last}", flush=True)
