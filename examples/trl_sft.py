"""TRL's ``SFTTrainer`` with sequence parallelism: ``SequenceParallelMixin`` in front of it.

    torchrun --nproc-per-node 2 examples/trl_sft.py --deepspeed configs/cpu_trainer.json
    python3 examples/trl_sft.py --plain         # the same run as a plain 1-process SFTTrainer

Packed supervised fine-tuning (``SFTConfig(packing=True)``: TRL packs the documents into rows
of ``--max-length`` tokens and its padding-free collator restarts the position ids at each
document) of the demo model on documents cut from the shipped corpus, tokenized byte by byte
(a byte-level tokenizer built here, nothing from a hub). ``--completion-only`` gives each
document a prompt (its first quarter) and a completion, and trains on the completions only.
``--losses-out`` writes the logged losses as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# examples/_common.py, beside this file; importing it puts the checkout on sys.path.
from _common import REPO, build_model

from arctic.trainer import SequenceParallelMixin  # after _common: from the checkout


def byte_tokenizer():
    """A tokenizer of the 256 byte values (the demo model's vocabulary), byte 0 as padding and
    end of text, built from ``tokenizers`` alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = _byte_to_unicode()
    vocab = {c: b for b, c in byte_char.items()}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    end = byte_char[0]
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=end, eos_token=end)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ``ByteLevel`` pre-tokenizes to)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def documents(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` documents of 20 to 120 bytes cut from the shipped corpus."""
    text = (REPO / "examples" / "data" / "corpus.txt").read_bytes()
    g = torch.Generator().manual_seed(seed)
    docs, pos = [], 0
    for _ in range(n):
        length = int(torch.randint(20, 121, (1,), generator=g))
        docs.append(list(text[pos:pos + length]))
        pos += length
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed", default=str(REPO / "configs" / "cpu_trainer.json"))
    p.add_argument("--plain", action="store_true", help="plain SFTTrainer, no SP, no DeepSpeed")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--completion-only", action="store_true")
    p.add_argument("--output-dir", default="/tmp/arctic_trl_sft")
    p.add_argument("--losses-out", type=Path, default=None)
    args = p.parse_args()

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    class SPSFTTrainer(SequenceParallelMixin, SFTTrainer):
        """TRL's SFTTrainer, sequence-parallel."""

    torch.manual_seed(0)
    model = build_model("tiny-llama", args.max_length)
    docs = documents(96)
    data = {"input_ids": docs}
    if args.completion_only:  # the prompt: the first quarter of each document
        data["completion_mask"] = [[int(i >= len(d) // 4) for i in range(len(d))] for d in docs]
    config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size, learning_rate=1e-3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), bf16=False, seed=0, optim="adamw_torch",
        gradient_checkpointing=False, packing=True, max_length=args.max_length,
        completion_only_loss=args.completion_only or None,
        deepspeed=None if args.plain else args.deepspeed)
    cls = SFTTrainer if args.plain else SPSFTTrainer
    trainer = cls(model=model, args=config, train_dataset=Dataset.from_dict(data),
                  processing_class=byte_tokenizer())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(f"losses {losses}", flush=True)
        if args.losses_out:
            args.losses_out.write_text(json.dumps({"loss": losses,
                                                   "global_step": trainer.state.global_step}))


if __name__ == "__main__":
    main()
