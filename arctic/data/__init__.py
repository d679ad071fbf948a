"""The data path: ordinary causal-LM batches cut into sequence-parallel ones.

- :mod:`~arctic.data.batch`: :func:`prepare_sp_batch` (positions, labels shifted before the
  cut, padding, the documents' geometry, the cut in the mesh's layout);
- :mod:`~arctic.data.loader`: :class:`SequenceParallelDataLoader` (every rank of an SP group
  reads the same samples);
- :mod:`~arctic.data.same_batch`: :func:`sp_sampler` for a loader of one's own (it deals over
  the data-parallel axis only), and the check that an SP group's ranks hold one batch;
- :mod:`~arctic.data.vision`: a VLM's vision inputs, numbered and cut with the tokens.
"""

from arctic.data.batch import BATCH_KEYS, IGNORE_INDEX, prepare_sp_batch
from arctic.data.loader import SequenceParallelDataLoader
from arctic.data.same_batch import sp_sampler

__all__ = ["BATCH_KEYS", "IGNORE_INDEX", "SequenceParallelDataLoader", "prepare_sp_batch",
           "sp_sampler"]
