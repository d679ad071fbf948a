"""Memory sizes and token counts as people write them ("80GiB", "5M"), and GiB for reports.

Apart from the CLI because the benchmarks and tests read sizes the same way.
"""

from __future__ import annotations

import re

GiB = 1 << 30


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"1.5TiB"``, ``"80GB"`` (decimal), or a plain byte count -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"not a memory size: {text!r} (e.g. 80GiB, 1.5TiB, 80GB)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = " KMGT".index(unit) if unit else 0
    return int(number * (1024 if binary or not unit else 1000) ** power)


def parse_tokens(text: str) -> int:
    """``"5M"``, ``"512K"``, ``"5000000"`` -> tokens (K = 1024, M = 1024**2 as in "64K")."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?)\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"not a token count: {text!r} (e.g. 5000000, 512K, 4M)")
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " "))


def format_gib(n: float) -> str:
    """Bytes as a right-aligned GiB figure, as the report and the search log print them."""
    return f"{n / GiB:8.2f} GiB"
