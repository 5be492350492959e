"""Integer arithmetic shared by the KV-cache calculator, the simulator and the server."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers: blocks needed for ``a`` tokens of ``b`` per block.

    Exact for integers of any size, where ``math.ceil(a / b)`` goes through a float.
    """
    return -(-a // b)
