"""TRL's ``SFTTrainer`` with sequence parallelism: ``SequenceParallelMixin`` in front of it.

    torchrun --nproc-per-node 2 examples/trl_sft.py --deepspeed configs/cpu_trainer.json
    python3 examples/trl_sft.py --plain         # the same run as a plain 1-process SFTTrainer
    python3 examples/trl_sft.py --plain --documents-apart --model qwen3_5   # a hybrid's reference

Packed supervised fine-tuning (``SFTConfig(packing=True)``: TRL packs the documents into rows
of ``--max-length`` tokens and its padding-free collator restarts the position ids at each
document) of the demo model on documents cut from the shipped corpus, tokenized byte by byte
(a byte-level tokenizer built here, nothing from a hub). ``--completion-only`` gives each
document a prompt (its first quarter) and a completion, and trains on the completions only.
``--losses-out`` writes the logged losses as JSON.

``--model qwen3_5`` trains a tiny Qwen3.5 instead of the Llama (random weights, from a config
built here): a hybrid, its gated delta net layers beside attention. Under SP each document
restarts their convolution and recurrent state; HF's torch path does not (it carries the state
from one packed document into the next), so a plain packed run is not the hybrid's reference:
``--plain --documents-apart`` is, the same packed batches with each document run on its own
(:func:`documents_apart`), TRL's loss unchanged. (transformers 5.24 refuses the packed plain
run of a hybrid without the ``causal_conv1d`` kernel; ``--plain --state-across-documents``
runs it without the varlen arguments that it refuses: attention still keeps the documents
apart, from the position ids, but the gated delta nets carry their state across them. It is
what the reference is there to rule out.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# examples/_common.py, beside this file; importing it puts the checkout on sys.path.
from _common import REPO, build_model, run_main

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


def tiny_model(name: str, max_length: int):
    """``"llama"``: the demo model (``build_model("tiny-llama")``); ``"qwen3_5"``: a Qwen3.5
    of 2 layers, a gated delta net (4 value heads over 2 key heads, width-4 convolution) then
    attention, over the 256 bytes. Random weights from the seed set before, at a wider
    initialisation (std 0.05, HF's default 0.02) so that the mixers' state weighs on the loss:
    carried across documents, it moves every step's loss by 1e-4 or more (measured)."""
    if name == "llama":
        return build_model("tiny-llama", max_length)
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=max(max_length, 2048), tie_word_embeddings=False,
        initializer_range=0.05)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def documents_apart(inputs: dict, pad_token_id: int) -> dict:
    """TRL's padding-free batch (one row ``[1, T]``, the position ids restarting at each
    document) as a batch of its documents, one per row ``[n_docs, longest]``, right-padded
    (``pad_token_id``, labels -100, ``attention_mask`` 0), each at positions from 0.

    Every document is then run on its own, whatever its layers mix: right padding reaches no
    earlier token. Its label targets are the packed row's, so TRL's loss (the summed token
    loss over ``num_items_in_batch``, counted on the packed labels) is the same sum over the
    same count: the per-document reference for the packed SP run."""
    (pos,), (ids,), (labels,) = inputs["position_ids"], inputs["input_ids"], inputs["labels"]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    rows = len(lengths), max(lengths)
    out = {"input_ids": ids.new_full(rows, pad_token_id), "labels": labels.new_full(rows, -100),
           "attention_mask": ids.new_zeros(rows),
           "position_ids": torch.arange(rows[1], device=ids.device).expand(rows)}
    for r, (a, n) in enumerate(zip(starts, lengths)):
        out["input_ids"][r, :n] = ids[a:a + n]
        out["labels"][r, :n] = labels[a:a + n]
        out["attention_mask"][r, :n] = 1
    return out


VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""The padding-free collator's varlen arguments (TRL 1.16): documents for the kernels."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed", default=str(REPO / "configs" / "cpu_trainer.json"))
    p.add_argument("--plain", action="store_true", help="plain SFTTrainer, no SP, no DeepSpeed")
    p.add_argument("--documents-apart", action="store_true",
                   help="with --plain: each packed document run on its own (a hybrid's reference)")
    p.add_argument("--state-across-documents", action="store_true",
                   help="with --plain: no varlen arguments, a hybrid's mixers cross documents")
    p.add_argument("--model", choices=("llama", "qwen3_5"), default="llama")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--completion-only", action="store_true")
    p.add_argument("--output-dir", default="/tmp/arctic_trl_sft")
    p.add_argument("--losses-out", type=Path, default=None)
    args = p.parse_args()
    if (args.documents_apart or args.state_across_documents) and not args.plain:
        p.error("--documents-apart and --state-across-documents are plain runs' (add --plain)")
    if args.documents_apart and args.state_across_documents:
        p.error("pick one of --documents-apart and --state-across-documents")

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    class SPSFTTrainer(SequenceParallelMixin, SFTTrainer):
        """TRL's SFTTrainer, sequence-parallel."""

    class DocumentsApartSFTTrainer(SFTTrainer):
        """TRL's SFTTrainer on the same packed batches, each document in a row of its own."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = documents_apart(inputs, self.processing_class.pad_token_id)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class StateAcrossSFTTrainer(SFTTrainer):
        """TRL's SFTTrainer, the packed batches without their varlen arguments."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = {k: v for k, v in inputs.items() if k not in VARLEN_KEYS}
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    torch.manual_seed(0)
    model = tiny_model(args.model, args.max_length)
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
    cls = (SPSFTTrainer if not args.plain else
           DocumentsApartSFTTrainer if args.documents_apart else
           StateAcrossSFTTrainer if args.state_across_documents else SFTTrainer)
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
    run_main(main)
