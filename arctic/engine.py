"""``arctic.initialize`` and ``apply_sp_recipe`` at the path earlier releases documented
(:mod:`arctic.train.deepspeed`, :mod:`arctic.recipe`)."""

from arctic.recipe import apply_sp_recipe
from arctic.train.deepspeed import initialize

__all__ = ["apply_sp_recipe", "initialize"]
