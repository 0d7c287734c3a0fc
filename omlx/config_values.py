"""Config value types: what a source (TOML file, ``OMLX_*`` variable, flag) may write for a key,
and the range a number key accepts. pydantic ``Annotated`` types with before-validators (a
string from the environment -> the value; true/false refused for numbers) and after-validators
(`Bounds`); the parsers behind them (`parse_size`, `parse_pairs`, `parse_peer`).

Must not: import anything of omlx; know about keys or sources (`omlx.config` does).
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable

from pydantic import AfterValidator, BeforeValidator
from pydantic.fields import FieldInfo

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(value: str | int | float) -> int:
    """Parse a byte size such as ``"8GB"``, ``"512MiB"`` or ``1048576``.

    Returns:
        The size in bytes.

    Raises:
        ValueError: if the value is not a size (true/false included).
    """
    if isinstance(value, bool):
        raise ValueError("expected a byte size such as 512MB or 8GB, not true/false")
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"not a byte size: {value!r} (use e.g. 512MB, 8GB)")
    unit = (m.group(2) or "").upper()
    binary = "I" in unit
    letter = unit[:1] if unit and unit != "B" else ""
    mult = (1024 ** "KMGT".index(letter) * 1024 if binary else _UNITS[letter]) if letter else 1
    return int(float(m.group(1)) * mult)


def not_bool(value: Any) -> Any:
    if isinstance(value, bool):  # TOML true would be 1 or 1.0: never what was meant
        raise ValueError("expected a number, not true/false")
    return value


def none_for(*words: Any) -> Callable[[Any], Any]:
    """A before-validator: these values (``"off"``, ``0``, ...) mean None; true/false is refused."""
    def check(value: Any) -> Any:
        value = not_bool(value)
        if value is None or (isinstance(value, str) and value.strip().lower() in words) or (
                not isinstance(value, str) and value in words):
            return None
        return value
    return check


def size_or_none(value: Any) -> int | None:
    return None if value is None or value == "" else parse_size(value)


def as_names(value: Any) -> Any:
    """``"a, b"`` (an environment variable, a TOML string) -> ``("a", "b")``."""
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return value


def parse_pairs(items: str | list[str] | tuple[str, ...]) -> dict[str, str]:
    """``"NAME=TARGET,N2=T2"`` (an environment variable) or ``["NAME=TARGET", ...]`` (``--alias``)
    -> {NAME: TARGET, N2: T2}, names and targets stripped.

    Raises:
        ValueError: an item without ``=``, or with an empty name or target.
    """
    out: dict[str, str] = {}
    for item in items.split(",") if isinstance(items, str) else items:
        if isinstance(items, str) and not item.strip():
            continue
        name, sep, target = item.partition("=")
        if not sep or not name.strip() or not target.strip():
            raise ValueError(f"expected NAME=TARGET, got {item!r}")
        out[name.strip()] = target.strip()
    return out


def parse_peer(text: str, default_port: int) -> tuple[str, int]:
    """A cluster peer ``"host:port"`` -> (host, port), an IPv6 host's brackets dropped
    (``"[fe80::1]:9000"`` -> ``("fe80::1", 9000)``); a bare host gets ``default_port``.

    Raises:
        ValueError: an empty host, or a port that is not an integer from 1 to 65535.
    """
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = text.strip(), str(default_port)
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer {text!r}: expected host or host:port, the port from 1 to 65535")
    return host.strip("[]"), int(port)


def as_pairs(value: Any) -> Any:
    return parse_pairs(value) if isinstance(value, str) else value


@dataclass(frozen=True, slots=True)
class Bounds:
    """The range a number key accepts: ``lo <= v <= hi`` (``lo < v`` when ``open_lo``; None:
    unbounded on that side), NaN and infinities never. An after-validator (None passes: the key
    is unset); `bounds_of` reads it back for the docs and the tests.

    Raises:
        ValueError: from ``__call__``, naming the range ("expected an integer from 1 to 65535").
    """

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False

    def words(self, integer: bool) -> str:
        """The range in words: ``an integer from 1 to 65535``, ``a number > 0``."""
        kind = "an integer" if integer else "a number"
        lo, hi = (None if b is None else str(int(b)) if float(b).is_integer() else f"{b:g}" for b in (self.lo, self.hi))
        if lo is not None and hi is not None:
            return f"{kind} {'>' if self.open_lo else 'from'} {lo} {'and <=' if self.open_lo else 'to'} {hi}"
        if lo is not None:
            return f"{kind} {'>' if self.open_lo else '>='} {lo}"
        return f"{kind} <= {hi}" if hi is not None else kind

    def __call__(self, v: Any) -> Any:
        if v is None:
            return v
        bad = (isinstance(v, float) and not math.isfinite(v)) or (self.hi is not None and v > self.hi) or (
            self.lo is not None and (v <= self.lo if self.open_lo else v < self.lo))
        if bad:
            raise ValueError(f"expected {self.words(isinstance(v, int))}")
        return v


def bounds_of(info: FieldInfo) -> Bounds | None:
    """The `Bounds` a field's type carries, or None."""
    for meta in info.metadata:
        if isinstance(getattr(meta, "func", None), Bounds):
            return meta.func
    return None


def int_in(lo: float | None = None, hi: float | None = None) -> Any:
    """An integer key in [``lo``, ``hi``] (true/false refused); ``| None`` for an optional one."""
    return Annotated[int, BeforeValidator(not_bool), AfterValidator(Bounds(lo, hi))]


def num_in(lo: float | None = None, hi: float | None = None, *, open_lo: bool = False) -> Any:
    """A finite number key in [``lo``, ``hi``] (``(lo, hi]`` with ``open_lo``)."""
    return Annotated[float, BeforeValidator(not_bool), AfterValidator(Bounds(lo, hi, open_lo))]


def optional(tp: Any) -> Any:
    """``tp`` or None; the bounds stay on the number."""
    base, *meta = typing.get_args(tp)
    return Annotated[(base | None, *meta)]


Int = Annotated[int, BeforeValidator(not_bool)]
Num = Annotated[float, BeforeValidator(not_bool)]
Size = Annotated[int, BeforeValidator(parse_size)]
OptSize = Annotated[int | None, BeforeValidator(size_or_none)]
OptInt = Annotated[int | None, BeforeValidator(not_bool)]
OptNum = Annotated[float | None, BeforeValidator(not_bool)]
Names = Annotated[tuple[str, ...], BeforeValidator(as_names)]
#: A TCP port.
Port = int_in(1, 65535)
Positive = int_in(1)
Count = int_in(0)
#: Seconds, > 0.
Seconds = num_in(0, open_lo=True)
#: A fraction of something, in (0, 1].
Share = num_in(0, 1, open_lo=True)
