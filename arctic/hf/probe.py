"""What a weight-free probe of a HF model's forward runs on: its base model and lm_head
replaced by stubs, its hooks set aside.

The SP loss (:mod:`arctic.loss.transform`) and the MoE router loss (:mod:`arctic.loss.router`)
call a causal LM's own ``forward`` with stubs in place of its base model and head, to read what
the forward does around them (a logit transform, a router loss's weight) without computing
anything of the model or issuing a collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn

from ulysses.patching import swapped_method
from ulysses.torch_internals import forward_hooks, set_forward_hooks


@contextmanager
def stubbed(module: nn.Module, forward: Callable) -> Iterator[None]:
    """``module.forward`` replaced by ``forward`` (an instance attribute) and its forward hooks
    set aside, both restored on exit. The hooks must not run in the probe: the SP batch hook of
    :func:`arctic.apply_sequence_parallel` would record the probe as the current batch, and
    FSDP2 or ZeRO-3 hooks gather parameters, while the probe must issue no collective."""
    hooks = forward_hooks(module)
    set_forward_hooks(module, type(hooks[0])(), type(hooks[1])())
    try:
        with swapped_method(module, forward):
            yield
    finally:
        set_forward_hooks(module, *hooks)


class NotVerifiable(Exception):
    """The probe ran but found a forward the tiled loss does not mirror."""


@functools.cache
def probe_output_type():
    from transformers.modeling_outputs import MoeModelOutputWithPast

    class _ProbeOutput(MoeModelOutputWithPast):
        """The stub base model's output: ``last_hidden_state`` and None for any other field a
        causal LM may read (MoE ``router_logits``, Mamba's ``cache_params``, ...)."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return _ProbeOutput
