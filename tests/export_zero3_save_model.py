"""SequenceParallelTrainer under ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``,
whose ``save_model`` writes the full HF weights (gathered by
:func:`arctic.export.zero3_full_state_dict`, where transformers would write a DeepSpeed
checkpoint). Launched by
``tests/test_arctic_export.py`` with torchrun on 2 ranks:

    torchrun --nproc-per-node 2 tests/export_zero3_save_model.py OUT_DIR

Trains 2 steps, calls ``save_model(OUT_DIR/model)``, and rank 0 writes the trained model's
logits on a whole sequence (the model after training, SP off: ZeRO-3 gathers its parameters)
to ``OUT_DIR/record.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _common import REPO, ByteCorpus, build_model  # noqa: E402  (puts the checkout on the path)

from transformers import TrainingArguments  # noqa: E402

from arctic.train.trainer import SequenceParallelTrainer  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    ds = json.loads((REPO / "configs" / "cpu_trainer.json").read_text())
    ds["zero_optimization"] = {"stage": 3}  # no 16-bit gather on save
    torch.manual_seed(0)
    model = build_model("tiny-llama", 256)
    corpus = ByteCorpus(REPO / "examples" / "data" / "corpus.txt", 256)
    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=1,
                             max_steps=2, learning_rate=1e-2, lr_scheduler_type="constant",
                             logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=not torch.cuda.is_available(), deepspeed=ds,
                             train_sampling_strategy="sequential", seed=0)
    trainer = SequenceParallelTrainer(model=model, args=args,
                                 train_dataset=torch.utils.data.Subset(corpus, range(8)))
    trainer.train()
    trainer.save_model(str(out / "model"))
    ids = corpus[72]["input_ids"][None, :64]
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits
    if trainer.is_world_process_zero():
        (out / "record.json").write_text(json.dumps({"ids": ids.tolist(),
                                                     "logits": logits.tolist()}))


if __name__ == "__main__":
    main()
