"""The HuggingFace integration: where a HF model keeps what the recipe acts on, and how its
calls are bound and switched to sequence parallelism.

- :mod:`~arctic.hf.anatomy`: the one place that knows a model's layers, attention modules,
  MLPs, norms and language model (a VLM's text tower);
- :mod:`~arctic.hf.binding`: calls into transformers bound through the installed classes' own
  signatures (a renamed argument is found by its role);
- :mod:`~arctic.hf.features`: the honour-or-refuse table of what a model asks of its
  attention;
- :mod:`~arctic.hf.attention`: ``apply_sequence_parallel`` and the ``"ulysses"`` entry of
  transformers' ``AttentionInterface``;
- :mod:`~arctic.hf.batch`: the per-model batch state (packed documents, Gemma3's image
  blocks) filled by a forward hook on the base model;
- :mod:`~arctic.hf.fused`: fused q/k/v projections inside the head-chunk loop;
- :mod:`~arctic.hf.vlm`: vision-language models (each rank encodes its own images);
- :mod:`~arctic.hf.probe`: stubs for a weight-free probe of a model's forward.

The modules import transformers, so this package re-exports nothing eagerly.
"""
