"""What each HF hybrid family's mixer forward calls, by class name (:data:`FAMILIES`): the
module-level functions of its file that mix tokens along the sequence, their arguments by
role, and how its scan takes and returns a recurrent state. :mod:`arctic.hf.mixers` makes
those calls sequence-parallel."""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True, slots=True)
class MixerKind:
    """What one family's mixer forward calls: the names, in its module, of its causal
    convolution, of its scan and of a fused convolution + scan kernel it tries first; the
    scan's positional parameters in order, and by role: grouped (key heads, or Mamba2's
    B/C groups), per head (value heads), per-head parameters (``[H]`` vectors, sliced to
    this rank's heads); whether the scan returns ``(out, state)``; and where the head counts
    live on the module."""

    conv: str
    scan: str | None = None
    """None: the mixer is the convolution alone (LFM2's short convolutions)."""
    positional: tuple[str, ...] = ()
    grouped: tuple[str, ...] = ()
    per_head: tuple[str, ...] = ()
    head_params: tuple[str, ...] = ()
    returns_state: bool = True
    fused: str | None = None
    """A kernel doing the convolution, scan, norm and projection at once, which the forward
    calls first and falls back from when it returns None: under SP it returns None."""
    num_heads: str | None = None
    num_grouped: str | None = None
    """The module attribute with the grouped count; None: one group (Mamba1's B/C)."""
    gate: str | None = None
    """A keyword input of the scan that is per head too (Mamba1's gate ``z``, applied inside
    the scan); None: a gate inside the scan is refused."""
    output: str = ""
    """The per-head input the scan's output is shaped like (the values); the planner's trace
    reads it (:func:`ulysses.mixers.traced_scan`)."""
    state_key: str = ""
    """The input whose last dim is the recurrent state's first (keys, or Mamba's ``C``)."""
    channels_first: bool = False
    """Mamba1's layout: per-head inputs ``[B, C, S]`` (every channel its own head), grouped
    ones ``[B, N, S]`` (one group, shared by all channels), the output ``[B, C, S]``."""
    initial: str | None = None
    """The scan's initial-state argument; None: no state passing for this family
    (:mod:`arctic.hf.mixer_state`)."""
    final: str = ""
    """The scan's flag that makes it return its final state beside its output."""
    value_first: bool = False
    """The state is ``[B, H, V, K]`` (Mamba2's ``[.., head_dim, state]``), not ``[B, H, K,
    V]``."""
    diagonal: bool = False
    """Mamba1's state: per channel and state entry, with a diagonal transition; its scan takes
    no initial state, and the incoming state's term is computed beside it in closed form
    (:class:`arctic.hf.mixer_state.SelectiveStates`)."""

    def call(self, fn, given, **extra):
        """``fn`` (the scan) on ``given`` (its inputs and parameters by name): the
        :attr:`positional` ones in order, the rest and ``extra`` by keyword."""
        return fn(*(given[n] for n in self.positional),
                  **{n: v for n, v in given.items() if n not in self.positional}, **extra)

    @property
    def passes_state(self) -> bool:
        """Whether its scan can run by state passing (:mod:`arctic.hf.mixer_state`)."""
        return self.initial is not None or self.diagonal

    @property
    def calls(self) -> list[str]:
        """The roles of the calls one forward makes, in order (the fused try aside)."""
        return ["conv"] + (["scan"] if self.scan else [])


GATED_DELTA_NET = MixerKind(conv="causal_conv1d_fn", scan="torch_chunk_gated_delta_rule",
                            positional=("query", "key", "value", "g", "beta"),
                            grouped=("query", "key"), per_head=("value", "g", "beta"),
                            num_heads="num_v_heads", num_grouped="num_k_heads", output="value",
                            state_key="key", initial="initial_state", final="output_final_state")
"""transformers' gated delta rule: ``(query, key, value, g, beta, ...)``, q/k ``[B, S, K,
dk]``, v ``[B, S, H, dv]``, g/beta ``[B, S, H]``; returns ``(out, state)``."""

MAMBA2 = MixerKind(conv="causal_conv1d_fn", scan="mamba2_chunk_scan",
                   positional=("hidden_states", "dt", "A", "B", "C"),
                   grouped=("B", "C"), per_head=("hidden_states", "dt"),
                   head_params=("A", "D", "dt_bias"), returns_state=False,
                   fused="mamba2_split_conv1d_scan_combined", num_heads="num_heads",
                   num_grouped="n_groups", output="hidden_states", state_key="C",
                   initial="initial_states", final="return_final_states", value_first=True)
"""transformers' Mamba2 chunked scan (SSD): ``(x [B, S, H, P], dt [B, S, H], A [H], B/C [B,
S, G, N], chunk_size, D=[H], dt_bias=[H], ...)``; returns the output alone."""

MAMBA1 = MixerKind(conv="causal_conv1d_fn", scan="mamba_selective_scan",
                   positional=("hidden_states", "dt", "A", "B", "C"),
                   grouped=("B", "C"), per_head=("hidden_states", "dt"),
                   head_params=("A", "D", "delta_bias"), returns_state=False,
                   fused="mamba_inner_fn", num_heads="intermediate_size", gate="z",
                   output="hidden_states", state_key="C", channels_first=True,
                   final="return_last_state", diagonal=True)
"""transformers' Mamba1 selective scan: ``(x [B, C, S], dt [B, C, S], A [C, N], B/C [B, N,
S], D=[C], z=[B, C, S], delta_bias=[C], ...)``, each of the ``C`` channels its own
recurrence; returns the output alone (with ``return_last_state``, and its final state ``[B,
C, N]``)."""

KIMI_DELTA_ATTENTION = MixerKind(conv="causal_conv1d_fn", scan="chunk_kimi_delta_attention",
                                 positional=("query", "key", "value", "g", "beta"),
                                 per_head=("query", "key", "value", "g", "beta"),
                                 num_heads="num_heads", num_grouped="num_heads", output="value",
                                 state_key="key", initial="initial_state",
                                 final="output_final_state")
"""Kimi Linear's KDA: a gated delta rule whose decay ``g`` is per channel, ``(query, key,
value, g [B, S, H, dk], beta [B, S, H], ...)``, every input per head (no grouped heads);
returns ``(out, state)``."""

SHORT_CONVOLUTION = MixerKind(conv="causal_conv1d_fn")
"""LFM2's gated short convolution: ``B * x`` convolved along the sequence, gated by ``C``."""

FAMILIES: dict[str, MixerKind] = {
    "Lfm2ShortConv": SHORT_CONVOLUTION,
    "Lfm2MoeShortConv": SHORT_CONVOLUTION,
    "Qwen3_5GatedDeltaNet": GATED_DELTA_NET,
    "Qwen3_5MoeGatedDeltaNet": GATED_DELTA_NET,
    "Qwen3NextGatedDeltaNet": GATED_DELTA_NET,
    "OlmoHybridGatedDeltaNet": GATED_DELTA_NET,
    "NemotronHMamba2Mixer": MAMBA2,
    "BambaMixer": MAMBA2,
    "GraniteMoeHybridMambaLayer": MAMBA2,
    "Mamba2Mixer": MAMBA2,
    "FalconH1Mixer": MAMBA2,
    "Zamba2MambaMixer": MAMBA2,
    "KimiLinearDeltaAttention": KIMI_DELTA_ATTENTION,
    "MambaMixer": MAMBA1,
    "FalconMambaMixer": MAMBA1,
    "JambaMambaMixer": MAMBA1,
}
"""Mixer class name -> what its forward calls. Other mixers are refused by name
(:func:`check_token_mixers`)."""

SCAN_OPTIONS = ("use_qk_l2norm_in_kernel", "scale", "chunk_size", "dt_softplus", "dt_limit",
                "delta_softplus", "use_mambapy", "use_associative_scan")
"""Arguments of a scan that change what it computes per head, passed on as given."""


__all__ = ["FAMILIES", "GATED_DELTA_NET", "KIMI_DELTA_ATTENTION", "MAMBA1", "MAMBA2",
           "SCAN_OPTIONS", "SHORT_CONVOLUTION", "MixerKind"]
