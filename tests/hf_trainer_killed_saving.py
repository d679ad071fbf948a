"""``examples/hf_trainer.py`` whose rank 1 is killed (SIGKILL, no clean shutdown) while the
trainer writes ``checkpoint-N`` (``KILL_SAVING_STEP=N``): after the model's and the
optimizer's shards, the weights and the scheduler, before the RNG states and
``trainer_state.json``. Launched with torchrun by ``tests/test_arctic_hf_checkpoints.py``."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))  # hf_trainer.py imports _common from beside it

from _common import REPO  # noqa: E402,F401  (puts the checkout on sys.path)

from arctic.train.trainer import SequenceParallelMixin  # noqa: E402

KILL_AT = int(os.environ["KILL_SAVING_STEP"])
_save_rng_state = SequenceParallelMixin._save_rng_state


def _dies_saving(self, output_dir):
    if self.state.global_step == KILL_AT and self.args.process_index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _save_rng_state(self, output_dir)


SequenceParallelMixin._save_rng_state = _dies_saving
sys.argv[0] = str(EXAMPLES / "hf_trainer.py")
runpy.run_path(sys.argv[0], run_name="__main__")
