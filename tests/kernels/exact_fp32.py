"""FP32 arithmetic in exact rational arithmetic, each operation rounded once (half to even): the oracle for the
kernels' instruction sequences (test_kda_cuda.py, test_nvfp4_fast_round.py)."""

from __future__ import annotations

import math
from fractions import Fraction


def rn32(x) -> float:
    """x (a Fraction or any exact number) rounded to the nearest FP32 value, ties to even; normal and subnormal
    results, no overflow; a zero comes back +0."""
    x = Fraction(x)
    if x == 0:
        return 0.0
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e += 1 if Fraction(2) ** (e + 1) <= a else 0
    e -= 1 if Fraction(2) ** e > a else 0
    ulp = Fraction(2) ** (max(e, -126) - 23)
    n, r = divmod(a / ulp, 1)
    n += 1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and n % 2) else 0
    return math.copysign(float(n * ulp), x)


def fma32(a: float, b: float, c: float) -> float:
    """a b + c rounded once."""
    return rn32(Fraction(a) * Fraction(b) + Fraction(c))


def quotient_sequence(a: float, b: float) -> float:
    """The kernels' quotient (`rounding.quotient_rn`, kda_cuda.cu's quotient_rn) given y = RN(1 / b): q = RN(a y),
    the residual r = RN(a - b q) (FMA), then RN(q + r y) (FMA)."""
    y = rn32(1 / Fraction(b))
    q = rn32(Fraction(a) * Fraction(y))
    return fma32(fma32(-q, b, a), y, q)
