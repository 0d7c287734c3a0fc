"""Sizes and rates for people: the one formatter behind every log line, message and table.

Owns the convention: decimal SI units, 1 KB = 1000 bytes and 1 GB = 10^9 bytes, spelled ``B``,
``KB``, ``MB``, ``GB``, ``TB`` (rates the same with ``/s``). Decimal because the sizes omlx reads
are decimal (``memory_ceiling = "12GB"`` is 12 * 10^9 bytes; ``GiB`` is accepted for binary), so a
size is shown in the unit it was set in; disk and download sizes are quoted decimal (the Hugging
Face hub, Finder), and so are bandwidths (GB/s), so a size over a rate reads as seconds. The
dashboard's ``fmtBytes`` (omlx/api/static/admin.html) follows the same rules;
tests/unit/test_units.py checks that the two agree and that nothing else formats sizes.

Must not: import anything of omlx (every layer imports it, the bench client included).
"""

from __future__ import annotations

BYTES_PER_UNIT: dict[str, int] = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
"""Bytes in one of each unit, smallest first."""


def _unit_for(num_bytes: float) -> str:
    for unit in ("TB", "GB", "MB", "KB"):
        if abs(num_bytes) >= BYTES_PER_UNIT[unit]:
            return unit
    return "B"


def bytes_in(num_bytes: float, unit: str) -> float:
    """``num_bytes`` counted in ``unit`` (a key of ``BYTES_PER_UNIT``), for a table column whose
    header names the unit: ``bytes_in(1.5e9, "GB") == 1.5``.

    Raises:
        KeyError: ``unit`` is not one of B, KB, MB, GB, TB.
    """
    return num_bytes / BYTES_PER_UNIT[unit]


def format_bytes(num_bytes: float, unit: str | None = None, digits: int = 2) -> str:
    """A size for people: ``1234567890`` -> ``"1.23 GB"``, ``512`` -> ``"512 B"``.

    Args:
        num_bytes: the size in bytes (may be negative, e.g. a shortfall).
        unit: ``B``, ``KB``, ``MB``, ``GB`` or ``TB``; fix it where a message compares sizes, so
            they read in one unit. None: the largest unit the size reaches.
        digits: digits after the point (none for ``B``); thousands are grouped with ``,``.

    Raises:
        KeyError: ``unit`` is not one of the above.
    """
    unit = unit or _unit_for(num_bytes)
    if unit == "B":
        return f"{num_bytes:,.0f} B"
    return f"{bytes_in(num_bytes, unit):,.{digits}f} {unit}"


def format_rate(bytes_per_s: float, unit: str | None = None, digits: int = 2) -> str:
    """A rate for people: ``4e8`` -> ``"400.00 MB/s"`` (``format_bytes``'s rules, then ``/s``)."""
    return format_bytes(bytes_per_s, unit, digits) + "/s"
