"""A vision-language model under ``SequenceParallelTrainer``: a tiny Qwen2.5-VL (or Gemma3)
from its config, trained on the demo corpus with one random image per sample.

    torchrun --nproc-per-node 2 examples/vlm_trainer.py --deepspeed configs/cpu_trainer.json
    python3 examples/vlm_trainer.py --plain        # the same run as a plain 1-process Trainer

Each sample is a window of the corpus's bytes with an image's tokens (between its start and
end tokens) somewhere inside; the collator stacks the tokens and concatenates the images'
pixel values as the model's processor would (Qwen: the patches of every image with
``image_grid_thw``; Gemma3: one row per image, with ``token_type_ids`` marking its tokens).
The Trainer cuts each batch with the model's vision inputs (:func:`arctic.vision_inputs`):
every rank encodes only the images its piece of the sequence has tokens of.
``--losses-out`` writes the logged training losses and the eval loss as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

# examples/_common.py, beside this file; importing it puts the checkout on sys.path.
from _common import REPO, ByteCorpus, run_main

from arctic.trainer import SequenceParallelTrainer  # after _common: from the checkout

IMAGE, START, END = 256, 258, 259  # the byte vocabulary's image tokens (video: 257)
TEXT = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
            bos_token_id=None, eos_token_id=None)


def build_vlm(name: str, seq_len: int):
    """A tiny VLM with random weights: its image tokens are 256 and up."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "qwen2_5_vl":
        config = tf.Qwen2_5_VLConfig(
            text_config=dict(**TEXT, max_position_embeddings=seq_len,
                             rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=64, patch_size=2, temporal_patch_size=2,
                               spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1]),
            image_token_id=IMAGE, video_token_id=257, vision_start_token_id=START,
            vision_end_token_id=END)
        return tf.Qwen2_5_VLForConditionalGeneration(config)
    config = tf.Gemma3Config(
        text_config=dict(**TEXT, max_position_embeddings=seq_len, sliding_window=32,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2),
        mm_tokens_per_image=4, image_token_id=IMAGE, boi_token_index=START,
        eoi_token_index=END)
    return tf.Gemma3ForConditionalGeneration(config)


class ImageSamples(torch.utils.data.Dataset):
    """The corpus's windows, each with one image: its tokens from a position that moves with
    the sample (so the SP cut falls before, inside and after images), random pixels."""

    def __init__(self, corpus, name: str, indices) -> None:
        self.corpus, self.name, self.indices = corpus, name, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        j = self.indices[i]
        ids = self.corpus[j]["input_ids"].clone()
        g = torch.Generator().manual_seed(j)
        if self.name == "qwen2_5_vl":
            grid = torch.tensor([[1, 4, 4 * (1 + j % 2)]])  # 4 or 8 tokens
            n = int(grid.prod()) // 4
            sample = {"pixel_values": torch.randn(int(grid.prod()), 3 * 2 * 2 * 2, generator=g),
                      "image_grid_thw": grid}
        else:
            n = 4
            sample = {"pixel_values": torch.randn(1, 3, 16, 16, generator=g)}
        first = 8 + (j * 13) % (len(ids) - n - 16)
        ids[first - 1], ids[first:first + n], ids[first + n] = START, IMAGE, END
        sample.update(input_ids=ids, labels=ids.masked_fill(ids == IMAGE, -100))
        if self.name == "qwen2_5_vl":
            sample["mm_token_type_ids"] = (ids == IMAGE).int()
        else:
            sample["token_type_ids"] = (ids == IMAGE).long()
        return sample


def collate(features: list[dict]) -> dict:
    """Tokens stacked, images concatenated (as the models' processors give them)."""
    out = {}
    for key in features[0]:
        values = [f[key] for f in features]
        joined = key in ("pixel_values", "image_grid_thw")
        out[key] = torch.cat(values) if joined else torch.stack(values)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["qwen2_5_vl", "gemma3"], default="qwen2_5_vl")
    p.add_argument("--deepspeed", default=str(REPO / "configs" / "cpu_trainer.json"))
    p.add_argument("--plain", action="store_true", help="plain Trainer, no SP, no DeepSpeed")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--output-dir", default="/tmp/arctic_vlm_trainer")
    p.add_argument("--losses-out", type=Path, default=None)
    args = p.parse_args()

    model = build_vlm(args.model, args.seq_len)
    corpus = ByteCorpus(REPO / "examples" / "data" / "corpus.txt", args.seq_len)
    train = ImageSamples(corpus, args.model, range(32))
    evaluation = ImageSamples(corpus, args.model, range(64, 68))
    targs = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, max_steps=args.max_steps,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
        train_sampling_strategy="sequential", seed=0,
        deepspeed=None if args.plain else args.deepspeed)
    cls = Trainer if args.plain else SequenceParallelTrainer
    trainer = cls(model=model, args=targs, train_dataset=train, eval_dataset=evaluation,
                  data_collator=collate)
    trainer.train()
    metrics = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(f"losses {losses}\neval_loss {metrics['eval_loss']}", flush=True)
        if args.losses_out:
            args.losses_out.write_text(json.dumps({"loss": losses,
                                                   "eval_loss": metrics["eval_loss"]}))


if __name__ == "__main__":
    run_main(main)
