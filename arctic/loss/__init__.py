"""The losses of a sequence cut over an SP group.

- :mod:`~arctic.loss.token`: the token mean over the group (:func:`sp_token_loss`) and HF's
  causal-LM loss on the pieces (:class:`SPCausalLMLoss`, a model's ``loss_function``);
- :mod:`~arctic.loss.tiled`: logits and cross-entropy tile by tile
  (:func:`tiled_logits_loss`);
- :mod:`~arctic.loss.transform`: the head's logit transform, found and verified
  (:func:`find_logit_transform`);
- :mod:`~arctic.loss.head`: the model's forward as the SP loss (:func:`apply_sp_loss`);
- :mod:`~arctic.loss.router`: the MoE router's load-balancing loss over the group;
- :mod:`~arctic.loss.reduction`: how the gradient reduction that trains the model combines
  the SP ranks, which every loss's backward follows.
"""

from arctic.loss.head import apply_sp_loss
from arctic.loss.tiled import IGNORE_INDEX, tiled_logits_loss, transform_logits_
from arctic.loss.token import (
                               SPCausalLMLoss,
                               hf_targets,
                               install_sp_causal_lm_loss,
                               shift_labels_across_pieces,
                               sp_token_loss,
)
from arctic.loss.transform import LogitTransform, find_logit_transform

__all__ = ["IGNORE_INDEX", "LogitTransform", "SPCausalLMLoss", "apply_sp_loss",
           "find_logit_transform", "hf_targets", "install_sp_causal_lm_loss",
           "shift_labels_across_pieces", "sp_token_loss", "tiled_logits_loss",
           "transform_logits_"]
