"""Kubernetes resource quantities ("500m", "2", "1.5Gi", "1e3"), read once for every part that reads them.

The grammar is k8s.io/apimachinery's resource.Quantity: a signed decimal number, then either a binary-SI
suffix (Ki..Ei), a decimal-SI suffix (n u m "" k M G T P E) or an exponent e<int>/E<int>. Reading is
strict and bounded before any arithmetic, so no input builds a huge number: at most MAX_QUANTITY_TEXT
characters, an exponent within ±MAX_EXPONENT, a value of at most 2^63-1 (Kubernetes' own ceiling) and
never negative. The extender's pod requests and the DRA driver's claims both read through here; each
turns QuantityError into its own error with the place named.
"""

from __future__ import annotations

import re
from decimal import Context, Decimal, InvalidOperation, Overflow

from gpunode.errors import QuantityError

_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:[eE](?P<exp>[+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)"
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}  # powers of two
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
MAX_QUANTITY_TEXT = 64  # characters; real quantities are a handful
MAX_EXPONENT = 30  # |e| of the exponent form; anything beyond is refused before any arithmetic
MAX_QUANTITY = 2**63 - 1  # Kubernetes' own ceiling for any quantity, in base units
EXACT = Context(prec=200, Emax=999, Emin=-999, traps=[InvalidOperation, Overflow])


def parse_quantity(value: object, *, where: str) -> Decimal:
    """A quantity as an exact Decimal; QuantityError naming `where` for anything else (see the module)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise QuantityError(f"{where}: expected a quantity, got {_short(value)}")
    text = value if isinstance(value, str) else repr(value)
    if len(text) > MAX_QUANTITY_TEXT:
        raise QuantityError(f"{where}: a quantity of {len(text)} characters is not plausible")
    m = _QUANTITY.fullmatch(text)
    if m is None or not (m["int"] or m["frac"]):
        raise QuantityError(f"{where}: {text!r} is not a resource quantity (e.g. 500m, 2, 16Gi, 1e3)")
    if m["sign"] == "-" and (m["int"] + (m["frac"] or "")).strip("0"):
        raise QuantityError(f"{where}: a resource quantity cannot be negative, got {text!r}")
    exponent = int(m["exp"]) if m["exp"] is not None else _DECIMAL.get(m["suffix"] or "", 0)
    if abs(exponent) > MAX_EXPONENT:
        raise QuantityError(f"{where}: {text!r} has an exponent beyond ±{MAX_EXPONENT}")
    digits = m["int"].lstrip("0")
    binary = _BINARY.get(m["suffix"] or "", 0)
    # A value with d digits before the point is at least 10^(d-1) x 10^exponent x 2^binary: at 10^19
    # or more it is over 2^63-1 for sure, refused before anything is computed.
    if digits and len(digits) - 1 + exponent + binary * 3 // 10 >= 19:
        raise QuantityError(f"{where}: {text!r} is larger than Kubernetes allows (2^63-1)")
    mantissa = Decimal(f"{m['int'] or '0'}.{m['frac'] or '0'}")
    number = EXACT.multiply(EXACT.scaleb(mantissa, exponent), Decimal(2**binary))
    if number > MAX_QUANTITY:
        raise QuantityError(f"{where}: {text!r} is larger than Kubernetes allows (2^63-1)")
    return abs(number)


def ceil(d: Decimal) -> int:
    """The quantity rounded up to a whole number of base units."""
    return int(d.to_integral_value(rounding="ROUND_CEILING"))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
