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


def fdot(q, k, fmt="fp32", fma=False):
    """FloatDot.v: the left-to-right floating-point dot product, each product rounded then
    added (fma=False: DAdd of DLeaf), or fused acc <- round(q_i k_i + acc) (fma=True: DFma)."""
    with workprec(EXACT_BITS):
        if not q:
            return mpf(0)
        acc = round_nearest(mpf(q[0]) * mpf(k[0]), fmt)
        for a, b in zip(q[1:], k[1:]):
            if fma:
                acc = round_nearest(mpf(a) * mpf(b) + acc, fmt)
            else:
                acc = round_nearest(acc + round_nearest(mpf(a) * mpf(b), fmt), fmt)
        return acc


def logit_rounding_bound(q, k, scale, code_scale=None):
    """FloatDot.v logit_rounding_le_code_f32 (spec T8e): an upper bound on |x^ - s <q, k>| for
    the fp32 logit x^ = fl(fl(q . k) * fl32(s)), any summation order, FMA or not, D terms:
        (D + 4) u32 1.01 s sum |q_i k_i|  +  (2.02 D s + 1) 2^-150.
    The first term is the code's e (fast.core.certify.logit_rounding); the second, for
    products below the normal range, is not in it. Returns (relative part, absolute part),
    each an interval upper end.
    code_scale = sc (logit_rounding_le_code_f32_scaled): k are the int8 codes m, k~ = m sc, and
    x^ = fl(fl(fl(q . m) sc) s32): relative (D + 4) u32 1.01 s sc sum |q_i m_i|, absolute
    (2.02 D s sc + 1.01 s + 1) 2^-150."""
    D = len(q)
    if len(k) != D or not 200 * D * mpf(2) ** -24 <= 1:
        raise ValueError(f"logit_rounding_bound: need len(q) == len(k) <= 83886 (got {D}, {len(k)})")
    with workprec(EXACT_BITS):
        s = iv.mpf(mpf(scale))
        if s.a < 0:
            raise ValueError(f"scale must be >= 0 (got {scale})")
        total = iv.mpf(0)
        for a, b in zip(q, k):
            total += abs(iv.mpf(mpf(a)) * iv.mpf(mpf(b)))
        u = iv.mpf(2) ** -24
        if code_scale is None:
            rel = (D + 4) * u * iv.mpf("1.01") * s * total
            absolute = (iv.mpf("2.02") * D * s + 1) * iv.mpf(2) ** -150
        else:
            sc = iv.mpf(mpf(code_scale))
            rel = (D + 4) * u * iv.mpf("1.01") * s * sc * total
            absolute = (iv.mpf("2.02") * D * s * sc + iv.mpf("1.01") * s + 1) * iv.mpf(2) ** -150
        return rel.b, absolute.b


def sum_lower_bound(computed, n, fmt="fp32"):
    """FloatDot.v computed_mul_one_sub_gamma_le_exact (spec T8f): a lower bound on the exact
    sum of n nonnegative terms of the format from the computed sum, any order, n u < 1:
    the lower end of computed * (1 - gamma_n)."""
    prec, _ = FORMATS[fmt]
    if not n * mpf(2) ** (-prec) < 1:
        raise ValueError(f"sum_lower_bound: n = {n} too large for {fmt} (needs n u < 1)")
    if computed < 0:
        raise ValueError("sum_lower_bound: a sum of nonnegative terms cannot be negative")
    with workprec(EXACT_BITS):
        return (iv.mpf(mpf(computed)) * (1 - gamma(n, fmt))).a


def int_codec_round_trip(x, scale, qmax):
    """Codec.v (spec T8g): one coordinate of int8 / int4 with the code's fp32 operations:
    y = fl32(x / scale), m = round half to even of y, x~ = fl32(m * scale) (= m * scale exactly
    for an fp16 scale). Returns (x~, the proved bound scale (1/2 + u qmax (1 + 2^-52) + 2^-150))."""
    with workprec(EXACT_BITS):
        sc = mpf(scale)
        if not sc > 0:
            raise ValueError(f"scale must be > 0 (got {scale})")
        y = round_nearest(mpf(x) / sc, "fp32")
        m = floor(y)
        frac = y - m
        if frac > mpf(1) / 2 or (frac == mpf(1) / 2 and int(m) % 2 == 1):
            m += 1
        xt = round_nearest(m * sc, "fp32")
        u = mpf(2) ** -24
        bound = sc * (mpf(1) / 2 + u * qmax * (1 + mpf(2) ** -52) + mpf(2) ** -150)
        return xt, bound
