"""Units: byte quantities (``parse_quantity``, ``human_bytes``), durations (``parse_duration``)
and RFC 3339 times (``rfc3339``, ``parse_time``)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from fractions import Fraction
from typing import Any, TypeGuard, overload

#: The byte-quantity grammar of every byte field of the CRDs (``spec.budget``, quota limits), as a
#: Go RE2 / Python pattern the CRD schemas carry; :func:`parse_quantity` is its one parser. A
#: decimal number and an optional unit: SI units (k/K, M, G, T, P, E; optional "B") are powers of
#: 1000, binary units (Ki, Mi, Gi, Ti, Pi, Ei; optional "B") powers of 1024, "B" or no unit bytes.
#: Examples: "512MiB", "10Gi", "1G", "1.5TB".
BYTES_PATTERN = r"^[0-9]+(\.[0-9]+)?(B|[kK]B?|Ki|KiB|[MGTPE](i|iB|B)?)?$"


def is_number(v: Any) -> TypeGuard[int | float]:
    """An int or float that is not a bool (JSON numbers)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class QuantityError(ValueError):
    """A byte quantity or duration that cannot be parsed; the message names the fix."""


_DEC = {"": 1, "B": 1, "k": 10**3, "K": 10**3, "kB": 10**3, "KB": 10**3}
for _i, _p in enumerate("MGTPE", start=2):
    _DEC[_p] = _DEC[_p + "B"] = 1000**_i
_BIN = {}
for _i, _p in enumerate("KMGTPE", start=1):
    _BIN[_p + "i"] = _BIN[_p + "iB"] = 1024**_i
UNITS: dict[str, int] = {**_DEC, **_BIN}
_BYTES_RE = re.compile(BYTES_PATTERN)
_NUM_UNIT_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)$")
_UNIT_HELP = (
    "use B, k/K/kB/KB, M/MB, G/GB, T/TB, P/PB, E/EB (powers of 1000) "
    "or Ki/KiB, Mi/MiB, Gi/GiB, Ti/TiB, Pi/PiB, Ei/EiB (powers of 1024)"
)


def parse_quantity(value: Any, *, field: str = "quantity") -> int:
    """Bytes of a quantity: an integer, or a string such as ``"512MiB"``, ``"10Gi"``, ``"1G"``,
    ``"1.5TB"``, ``"4096"``.

    SI units (k, M, G, T, P, E, optionally followed by B) are powers of 1000; binary units (Ki, Mi,
    Gi, Ti, Pi, Ei, optionally followed by B) are powers of 1024; ``B`` or no unit means bytes. The
    result must be a whole number of bytes, >= 0.

    Raises:
        QuantityError: naming ``field`` and the accepted forms.
    """
    if isinstance(value, bool) or value is None:
        raise QuantityError(f"{field}: expected a byte quantity such as 10Gi, 512MiB, 1G or an integer, got {value!r}.")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError(f"{field}: {value} is negative; a byte quantity is >= 0.")
        return value
    if isinstance(value, float):
        raise QuantityError(
            f'{field}: {value!r} is a floating-point number; write an integer number of bytes or a string such as "1.5Gi".'
        )
    if not isinstance(value, str):
        raise QuantityError(f"{field}: expected a byte quantity such as 10Gi, got {type(value).__name__}.")
    s = value
    if s != s.strip() or " " in s:
        raise QuantityError(f'{field}: {value!r} contains spaces; write the number and unit together, e.g. "10Gi".')
    if s.startswith("-"):
        raise QuantityError(f"{field}: {value!r} is negative; a byte quantity is >= 0.")
    if re.match(r"^[0-9.]+[eE][-+]?[0-9]+$", s):
        raise QuantityError(
            f'{field}: {value!r} uses exponent notation, which is not accepted; write e.g. "1G" or an integer.'
        )
    m = _NUM_UNIT_RE.match(s)
    if not m:
        raise QuantityError(
            f'{field}: {value!r} is not a byte quantity; write a number and a unit, e.g. "512MiB" or "10Gi".'
        )
    number, unit = m.groups()
    if unit not in UNITS or not _BYTES_RE.match(s):
        hint = ""
        if unit in ("m", "mb", "mB", "Mb"):
            hint = " (lowercase m means milli in Kubernetes quantities; bits are not accepted)"
        elif unit.lower() in {u.lower() for u in UNITS}:
            hint = " (units are case-sensitive)"
        raise QuantityError(f"{field}: unknown unit {unit!r} in {value!r}{hint}; {_UNIT_HELP}.")
    total = Fraction(number) * UNITS[unit]
    if total.denominator != 1:
        raise QuantityError(f"{field}: {value!r} is not a whole number of bytes.")
    return int(total)


def human_bytes(n: int | None) -> str | None:
    """A short human-readable size: exact binary units when exact (``"10Gi"``), else 3 significant
    digits (``"3.18Gi"``). ``parse_quantity(human_bytes(n)) == n`` for the exact forms."""
    if n is None:
        return None
    if n < 1024:
        return f"{n}B"
    for exp, unit in ((6, "Ei"), (5, "Pi"), (4, "Ti"), (3, "Gi"), (2, "Mi"), (1, "Ki")):
        scale = 1024**exp
        if n >= scale:
            if n % scale == 0:
                return f"{n // scale}{unit}"
            v = n / scale
            return f"{v:.3g}{unit}" if v < 1000 else f"{v:.0f}{unit}"
    return f"{n}B"  # pragma: no cover


_DURATION_RE = re.compile(r"([0-9]+)([smhdw])")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: Any, *, field: str = "duration") -> timedelta:
    """``"30m"``, ``"24h"``, ``"7d"``, ``"1h30m"`` (units s, m, h, d, w) -> timedelta (> 0)."""
    if not isinstance(value, str) or not value or _DURATION_RE.sub("", value) != "":
        raise QuantityError(
            f'{field}: {value!r} is not a duration; write e.g. "24h", "7d" or "1h30m" (units s, m, h, d, w).'
        )
    seconds = sum(int(n) * _DURATION_UNITS[u] for n, u in _DURATION_RE.findall(value))
    if seconds <= 0:
        raise QuantityError(f"{field}: {value!r} is zero; a window must be positive.")
    return timedelta(seconds=seconds)


def rfc3339(t: datetime) -> str:
    """Kubernetes timestamp (UTC, seconds): ``2026-11-22T10:00:00Z``."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


@overload
def parse_time(s: str | datetime) -> datetime: ...
@overload
def parse_time(s: None) -> None: ...
def parse_time(s: str | datetime | None) -> datetime | None:
    """An RFC 3339 time (or a datetime) as an aware datetime (UTC when it has no zone); None stays None."""
    if s is None or isinstance(s, datetime):
        return s if s is None or s.tzinfo else s.replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(s.replace("Z", "+00:00"))
