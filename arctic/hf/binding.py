"""A call to a HF module's forward, bound through the installed class's own signature.

transformers renames the arguments of its modules' forwards between releases: 5.24 renamed
the attention modules' and decoder layers' ``past_key_values`` to ``cache`` (and keeps the
old name working through ``@deprecate_kwarg``), 5.x dropped ``cache_position`` from them.
Wherever arctic replaces or wraps a HF forward (fused projections, the tiled layer tail, the
tiled MLP and norms, the SP loss, the batch hook, checkpointing), the call is bound here
through the signature of the installed ``forward`` and each argument is found by its role,
whatever this release calls it:

- the first parameter is the module's input (the hidden states);
- a KV cache is a parameter annotated with transformers' ``Cache``, or named as one;
- the other roles (:data:`ROLE_NAMES`) by the names each has had.

A caller may use a name the installed forward renamed: its ``deprecate_kwarg`` wrappers
(transformers' own record of the rename) and the other names of a role the forward has are
bound to the forward's own name, as the stock forward would bind them; both names at once is
a ``ValueError``. Nothing is dropped silently: what is not bound to a role is either passed
on as the stock forward passes it, or refused by the site (:meth:`BoundCall.unknown`).
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ROLE_NAMES: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "cache": ("cache", "past_key_values", "past_key_value", "layer_past"),
    "position_embeddings": ("position_embeddings",),
    "attention_mask": ("attention_mask",),
    "position_ids": ("position_ids",),
    "use_cache": ("use_cache",),
    "cache_position": ("cache_position",),
})
"""role -> the names HF forwards have given it (the first is the newest). What each role
means to a wrapped forward is the site's: ``cache`` not None is refused by the fused forward
and dropped under checkpointing (as HF's own checkpointing drops it); ``cache_position`` and
``use_cache`` only steer a cache."""


def _is_cache_annotation(annotation) -> bool:
    """Whether a parameter annotation names transformers' ``Cache`` (``Cache | None``,
    ``Optional[Cache]``, a subclass)."""
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):  # postponed annotations
        return "Cache" in annotation
    if isinstance(annotation, type):
        return any(c.__name__ == "Cache" for c in annotation.__mro__)
    return any(_is_cache_annotation(a) for a in typing.get_args(annotation))


def _deprecated_renames(func) -> dict[str, str]:
    """``old -> new`` from the ``deprecate_kwarg`` wrappers around ``func`` (outermost first),
    read from each wrapper's closure; a wrapper that is not one contributes nothing."""
    renames = {}
    while func is not None:
        code, cells = getattr(func, "__code__", None), getattr(func, "__closure__", None)
        if code is not None and cells:
            free = dict(zip(code.co_freevars, cells))
            if "old_name" in free and "new_name" in free:
                old, new = free["old_name"].cell_contents, free["new_name"].cell_contents
                if isinstance(old, str) and isinstance(new, str):
                    renames[old] = new
        func = getattr(func, "__wrapped__", None)
    return renames


@dataclass(frozen=True, slots=True)
class ForwardSignature:
    """The installed signature of one forward, with its parameters' roles."""

    owner: str
    """The class (or callable) name, for messages."""
    signature: inspect.Signature
    """Without ``self``."""
    first: str | None
    """The input's parameter name (None: the forward takes ``*args`` only)."""
    roles: Mapping[str, str]
    """role -> this forward's parameter name."""
    renames: Mapping[str, str]
    """A name a caller may use -> the name this forward binds it to."""
    var_keyword: str | None
    """The ``**kwargs`` parameter's name, if any."""
    var_positional: str | None
    """The ``*args`` parameter's name, if any."""

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> BoundCall:
        """Bind a call as the stock forward would: ``TypeError`` where it would raise one."""
        kw = dict(kwargs)
        for old, new in self.renames.items():
            if old in kw:
                if new in kw:
                    raise ValueError(f"{self.owner}.forward got both {old!r} and {new!r} (the "
                                     f"same argument under its old and new name); pass {new!r}")
                kw[new] = kw.pop(old)
        try:
            bound = self.signature.bind(*args, **kw)
        except TypeError as e:
            raise TypeError(f"{self.owner}.forward: {e}") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        extra = values.pop(self.var_keyword, {}) if self.var_keyword else {}
        first = values.pop(self.first) if self.first else None
        if self.var_positional and values.pop(self.var_positional):
            raise TypeError(f"{self.owner}.forward: extra positional arguments are not "
                            f"supported by the wrapped forward")
        given = {n for n, v in values.items()
                 if _differs(v, self.signature.parameters[n].default)}
        return BoundCall(self, first, values, dict(extra), frozenset(given))

    def name_of(self, role: str) -> str | None:
        return self.roles.get(role)


def _differs(value, default) -> bool:
    if default is inspect.Parameter.empty:
        return True
    return value is not default and not (isinstance(value, (bool, int, float, str))
                                         and type(value) is type(default) and value == default)


@dataclass(slots=True)
class BoundCall:
    """One call, bound: its input, its other named arguments (defaults applied), and what
    went to ``**kwargs``."""

    signature: ForwardSignature
    first: Any
    named: dict[str, Any]
    extra: dict[str, Any]
    given: frozenset[str]
    """The named arguments whose value is not the parameter's default."""

    def role(self, role: str, default=None):
        """The value of ``role`` (a named parameter, else a ``**kwargs`` entry under any of
        its names), or ``default``."""
        name = self.signature.roles.get(role)
        if name is not None:
            return self.named[name]
        for alias in ROLE_NAMES[role]:
            if alias in self.extra:
                return self.extra[alias]
        return default

    def unknown(self) -> list[str]:
        """Named arguments that were given (not their default) and have no role."""
        roled = set(self.signature.roles.values())
        return sorted(n for n in self.given if n not in roled)

    def keywords_for(self, callee: ForwardSignature) -> dict[str, Any]:
        """The named and ``**kwargs`` arguments as keywords for ``callee``, each role under
        ``callee``'s name for it (e.g. a layer's ``past_key_values`` as its attention's
        ``cache``); the rest under their own names, as HF decoder layers pass them on."""
        out: dict[str, Any] = {}
        by_name = {n: r for r, n in self.signature.roles.items()}
        for name, value in self.named.items():
            role = by_name.get(name)
            out[callee.roles.get(role, name) if role else name] = value
        for name, value in self.extra.items():
            out[callee.renames.get(name, name)] = value
        return out


def undeclared_wrapped(fn: Callable) -> Callable | None:
    """The function a pass-through wrapper ``(self, *args, **kwargs)`` holds in its closure when
    it does not declare it (no ``functools.wraps``): transformers 5.13's
    ``force_accelerate_hooks`` wraps Qwen3.5's gated delta net's forward so, and the
    ``kernels`` package's module of a function (``use_kernel_forward_from_hub`` on a function,
    transformers 5.25's ``causal_conv1d_forward``) calls it so. Exactly one function in the
    closure, or None."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells or hasattr(fn, "__wrapped__"):
        return None
    passing = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    if code.co_argcount + code.co_kwonlyargcount > 1 or code.co_flags & passing != passing:
        return None
    held = [c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)]
    return held[0] if len(held) == 1 else None


def module_function(value):
    """The function the ``kernels`` package's module of a function calls (transformers 5.25,
    with ``kernels`` installed, makes one of each function it decorates with
    ``use_kernel_forward_from_hub`` or ``use_kernel_func_from_hub_with_fallback``; it calls the
    function until the model is kernelized); ``value`` itself when it is not a module, None
    for another module."""
    from torch import nn

    return undeclared_wrapped(type(value).forward) if isinstance(value, nn.Module) else value


def _declared(fn: Callable) -> Callable:
    """``fn`` with every undeclared pass-through wrapper (:func:`undeclared_wrapped`) under its
    declared ones replaced by what it wraps; a bound method stays bound."""
    owner = fn.__self__ if inspect.ismethod(fn) else None
    inner = undeclared_wrapped(inspect.unwrap(fn))
    if inner is None:
        return fn
    inner = _declared(inner)
    return types.MethodType(inner, owner) if owner is not None else inner


def _build(fn: Callable, owner: str, skip_self: bool) -> ForwardSignature:
    renames_from = fn
    fn = _declared(fn)
    sig = inspect.signature(fn)  # follows __wrapped__: the forward under its decorators
    params = list(sig.parameters.values())
    if skip_self:
        params = params[1:]
    sig = sig.replace(parameters=params)
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    first = positional[0].name if positional else None
    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    roles: dict[str, str] = {}
    for p in params:
        if p.name == first or p.kind in var:
            continue
        role = "cache" if _is_cache_annotation(p.annotation) else next(
            (r for r, names in ROLE_NAMES.items() if p.name in names), None)
        if role is not None and role not in roles:
            roles[role] = p.name
    found = _deprecated_renames(renames_from) | _deprecated_renames(fn)
    renames = {old: new for old, new in found.items() if new in sig.parameters}
    for role, name in roles.items():
        for alias in ROLE_NAMES[role]:
            if alias != name and alias not in sig.parameters:
                renames.setdefault(alias, name)
    var_kw = next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    var_pos = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    return ForwardSignature(owner, sig, first, types.MappingProxyType(roles),
                            types.MappingProxyType(renames), var_kw, var_pos)


@functools.cache
def class_forward(cls: type) -> ForwardSignature:
    """The signature of ``cls.forward`` as installed (decorators followed), without ``self``."""
    return _build(cls.forward, cls.__name__, skip_self=True)


def of_module(module) -> ForwardSignature:
    """:func:`class_forward` of the module's class: the stock forward, even when the
    instance's ``forward`` is replaced."""
    return class_forward(type(module))


def of_callable(fn: Callable, owner: str) -> ForwardSignature:
    """The signature of any forward callable (a bound method: without ``self``)."""
    return _build(fn, owner, skip_self=False)


__all__ = ["ROLE_NAMES", "BoundCall", "ForwardSignature", "class_forward", "of_callable",
           "module_function", "of_module", "undeclared_wrapped"]
