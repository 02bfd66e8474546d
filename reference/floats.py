"""Exact mirror of T8 (proofs/Float.v): rounding to a binary format and the proved margin
for sums of nonnegative terms. Plain mpmath at a working precision wide enough that every
sum of two binary64 numbers is exact, so the only roundings are the ones simulated here."""

from mpmath import floor, frexp, iv, ldexp, mp, mpf, workprec

# name: (precision p in bits, exponent of the smallest subnormal), as Flocq's FLT_exp emin p.
FORMATS = {"fp32": (24, -149), "fp64": (53, -1074)}
EXACT_BITS = 2300  # > 1074 + 1024 + 53: every binary64 sum is exact at this precision


def round_nearest(x, fmt="fp32"):
    """T8: x rounded to the nearest number of the binary format, ties to even, with gradual
    underflow (subnormals), no overflow (as Flocq's FLT format)."""
    prec, emin = FORMATS[fmt]
    with workprec(EXACT_BITS):
        x = mpf(x)
        if x == 0:
            return x
        _, e = frexp(x)  # x = m 2^e, 1/2 <= |m| < 1
        quantum = max(int(e) - prec, emin)
        scaled = ldexp(x, -quantum)
        r = floor(scaled)
        frac = scaled - r
        if frac > mpf(1) / 2 or (frac == mpf(1) / 2 and int(r) % 2 == 1):
            r += 1
        return ldexp(r, quantum)


def fsum(values, fmt="fp32"):
    """T8: the left-to-right floating-point sum s_{k+1} = round(s_k + a_k), s_0 = 0."""
    with workprec(EXACT_BITS):
        s = mpf(0)
        for a in values:
            s = round_nearest(s + mpf(a), fmt)
        return s


def gamma(n, fmt="fp32"):
    """T8: gamma_n = n u / (1 - n u), u = 2^-p, as an interval (its upper end is rigorous)."""
    prec, _ = FORMATS[fmt]
    u = iv.mpf(2) ** (-prec)
    return n * u / (1 - n * u)


def sum_upper_bound(computed, n, fmt="fp32"):
    """T8 (exact_sum_le_computed_div_of_nonneg and its tree form): an upper bound on the exact
    sum of n nonnegative terms of the format from the computed floating-point sum, valid for
    any summation order when 2 n u < 1. Returns the upper end of computed / (1 - gamma_n)."""
    prec, _ = FORMATS[fmt]
    if not 2 * n * mpf(2) ** (-prec) < 1:
        raise ValueError(f"sum_upper_bound: n = {n} too large for {fmt} (needs 2 n u < 1)")
    if computed < 0:
        raise ValueError("sum_upper_bound: a sum of nonnegative terms cannot be negative")
    with workprec(EXACT_BITS):
        return (iv.mpf(mpf(computed)) / (1 - gamma(n, fmt))).b


# fp8 formats as Flocq's FLT_exp emin prec (proofs/FloatCast.v): precision with the hidden bit,
# exponent of the smallest subnormal.
FP8_FORMATS = {"fp8_e4m3": (4, -9), "fp8_e5m2": (3, -16)}


def cast_error_bound(c, fmt, mode="nearest"):
    """FloatCast.v: a bound on |c - y| from the cast result c alone, for y rounded to the fp8
    format fmt: (2^(1-p) |c| + 2^emin) / 2 for round to nearest (cast_error_le_of_nearest),
    2^(1-p) |c| + 2^emin for any other rounding, toward zero included
    (cast_error_le_of_valid_rnd). Exact (powers of two times a binary number)."""
    prec, emin = FP8_FORMATS[fmt]
    with workprec(EXACT_BITS):
        bound = ldexp(abs(mpf(c)), 1 - prec) + ldexp(mpf(1), emin)
        if mode == "nearest":
            return bound / 2
        if mode == "toward_zero":
            return bound
        raise ValueError(f"mode: expected 'nearest' or 'toward_zero', got {mode!r}")
