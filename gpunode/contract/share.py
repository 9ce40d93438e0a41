"""A pod's compute share (gpunode.io/gpu-milli), read once for every part that reads it.

The share is a whole number of thousandths of one GPU (MILLI_PER_GPU is the whole GPU). The
extender reads it to place the pod (where a share of the whole GPU is asked as nvidia.com/gpu
instead), the node agent to write it into the container's memory-cap region; both read it here,
so a value one of them takes the other never refuses. InvalidComputeShare is one line.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from gpunode.contract.names import GPU_MILLI_ANNOTATION, MILLI_PER_GPU
from gpunode.errors import InvalidComputeShare

MAX_SHARE_TEXT = 32  # characters; a share is at most "1000"


def parse_compute_share(value: object, *, what: str = GPU_MILLI_ANNOTATION) -> int:
    """A compute share in thousandths of a GPU (1..1000), from an int or a decimal string.

    Refused with InvalidComputeShare (one line): zero, negative, above one GPU, not a number,
    or finer than the unit (a thousandth of a GPU).
    """
    if isinstance(value, bool):
        raise InvalidComputeShare(f"{what}={value!r} is not a number of thousandths of a GPU")
    if isinstance(value, int):
        number = Decimal(value)
    else:
        text = str(value).strip()
        if len(text) > MAX_SHARE_TEXT:
            raise InvalidComputeShare(
                f"{what}={text[:MAX_SHARE_TEXT]!r}... is not a number of thousandths of a GPU"
            )
        try:
            number = Decimal(text)
        except InvalidOperation:
            raise InvalidComputeShare(f"{what}={text!r} is not a number of thousandths of a GPU") from None
        if not number.is_finite():
            raise InvalidComputeShare(f"{what}={text!r} is not a number of thousandths of a GPU")
    if number != number.to_integral_value():
        raise InvalidComputeShare(f"{what}={value!r} is finer than the unit (one thousandth of a GPU)")
    if number <= 0:
        raise InvalidComputeShare(f"{what}={value!r} must be above zero")
    if number > MILLI_PER_GPU:
        raise InvalidComputeShare(f"{what}={value!r} is more than one GPU ({MILLI_PER_GPU})")
    return int(number)
