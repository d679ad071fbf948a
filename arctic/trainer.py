"""The HF Trainer plugin, at the path users import it from (:mod:`arctic.train.trainer`)."""

from arctic.train.trainer import SequenceParallelMixin, SequenceParallelTrainer

__all__ = ["SequenceParallelMixin", "SequenceParallelTrainer"]
