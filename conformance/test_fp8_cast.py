"""fp8 casts, round to nearest and toward zero (spec T8c, proofs/FloatCast.v): the proved
per-element bound against the truth (torch's casts, and truncation read off the table of all
fp8 values), on random and adversarial inputs."""
import random

import torch
from mpmath import mpf

from reference.floats import cast_error_bound

DTYPES = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def fp8_values(fmt):
    """All finite values of the format, sorted (from the 256 bit patterns)."""
    dtype, _ = DTYPES[fmt]
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
    return sorted({v for v in vals.tolist() if v == v and abs(v) != float("inf")})


def toward_zero(y, table):
    """The fp8 value of largest magnitude <= |y| with y's sign (truncation, as vLLM's CPU cast)."""
    best = 0.0
    for v in table:
        if 0 <= v <= abs(y):
            best = max(best, v)
    return best if y >= 0 else -best


def inputs(fmt, seed=0):
    """fp32 inputs inside the format's range: random, and adversarial ones just below each
    representable value, at midpoints, and in the subnormal range."""
    _, fmax = DTYPES[fmt]
    table = [v for v in fp8_values(fmt) if v >= 0]
    rng = random.Random(seed)
    ys = [rng.uniform(-fmax, fmax) for _ in range(300)] + [rng.uniform(-1, 1) * 2.0 ** rng.randint(-20, 0) for _ in range(300)]
    for a, b in zip(table, table[1:]):
        below = torch.nextafter(torch.tensor(b), torch.tensor(0.0)).item()
        ys += [below, -below, (a + b) / 2, -(a + b) / 2]
    return [float(torch.tensor(y, dtype=torch.float32)) for y in ys if abs(y) <= fmax]


def test_nearest_cast_within_bound():
    """property: torch's round-to-nearest fp8 cast obeys |c - y| <= (2^(1-p)|c| + 2^emin)/2 (T8c)."""
    for fmt, (dtype, _) in DTYPES.items():
        for y in inputs(fmt):
            c = torch.tensor(y).to(dtype).to(torch.float32).item()
            err, bound = abs(mpf(c) - mpf(y)), cast_error_bound(c, fmt, "nearest")
            assert err <= bound, f"{fmt}: y = {y!r}, c = {c!r}, |c - y| = {err} > {bound}"


def test_toward_zero_cast_within_bound():
    """property: truncation toward zero obeys |c - y| <= 2^(1-p)|c| + 2^emin, and comes within
    1% of it on the inputs just below a representable value (T8c: the bound is tight)."""
    for fmt in DTYPES:
        table = fp8_values(fmt)
        worst = mpf(0)
        for y in inputs(fmt, seed=1):
            c = toward_zero(y, table)
            err, bound = abs(mpf(c) - mpf(y)), cast_error_bound(c, fmt, "toward_zero")
            assert err <= bound, f"{fmt}: y = {y!r}, c = {c!r}, |c - y| = {err} > {bound}"
            worst = max(worst, err / bound)
        assert worst > mpf("0.99"), f"{fmt}: the toward-zero bound is never approached ({worst})"


def test_toward_zero_exceeds_the_nearest_step():
    """property: truncation is NOT covered by the round-to-nearest half step the code's fp8 step()
    uses (1.25 (u8 |c| + a8)): a codec for a truncating engine needs the toward-zero bound."""
    u8, a8 = {"fp8_e4m3": (2.0 ** -4, 2.0 ** -10), "fp8_e5m2": (2.0 ** -3, 2.0 ** -17)}["fp8_e4m3"]
    table = fp8_values("fp8_e4m3")
    y = torch.nextafter(torch.tensor(1.125), torch.tensor(0.0)).item()
    c = toward_zero(y, table)
    assert c == 1.0 and abs(c - y) > 1.25 * (u8 * abs(c) + a8)
