"""The ways a user trains with the recipe (:mod:`arctic.recipe`):

- :mod:`~arctic.train.deepspeed`: ``arctic.initialize``, ``deepspeed.initialize`` with SP
  from the DeepSpeed JSON;
- :mod:`~arctic.train.fsdp`: ``apply_fsdp``, FSDP2 over every rank of the mesh;
- :mod:`~arctic.train.trainer`: the HF Trainer plugin (``arctic.trainer`` re-exports it),
  with its field table (:mod:`~arctic.train.fields`), FSDP2 under the Trainer
  (:mod:`~arctic.train.hf_fsdp`) and HF's ALST settings (:mod:`~arctic.train.parallelism`).

The modules import DeepSpeed or transformers where they need them; this package re-exports
nothing eagerly.
"""
