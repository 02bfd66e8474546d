"""The key sketch (fast.core.pagebox.build_key_sketch): evicted keys kept as per-token codes with
their band witness, read as one-token page boxes (T7l). Checked against the evicted mass computed
here in fp64 from the test's own exact keys, for random queries and for queries aligned with the
sketch's error of one token (the worst direction for it); the check has teeth: without the witness
the aligned queries break it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.core.pagebox import build_key_sketch, pagebox_log_odds
from fast.core.quant import dequantize
from fast.core.rope import rope_bands

D, HKV, REP = 32, 2, 2
BANDS = rope_bands(D, 8, "rotate_half")


def split(g, n, n_ev, log_scale, outlier):
    k = torch.randn(1, HKV, n, D, generator=g) * 10 ** log_scale
    k[..., 5] *= outlier
    perm = torch.stack([torch.randperm(n, generator=g) for _ in range(HKV)])[None]
    return k, perm[..., :n_ev].sort(-1).values, perm[..., n_ev:].sort(-1).values


def truth(q, k, ev, kept, s):
    """log(Z_E / Z_K) per (row, query head), fp64 from the exact keys."""
    x = s * torch.einsum("bhd,bhnd->bhn", q.double(), k.double().repeat_interleave(REP, 1))
    pick = lambda idx: x.gather(2, idx.repeat_interleave(REP, 1))
    return pick(ev).logsumexp(-1) - pick(kept).logsumexp(-1)


def log_odds(q, sketch, k, kept, s):
    keys_kept = k.gather(2, kept[..., None].expand(-1, -1, -1, D))
    x = s * torch.einsum("bhd,bhnd->bhn", q.double(), keys_kept.double().repeat_interleave(REP, 1))
    lz = x.logsumexp(-1) - 1e-9 * (1 + x.abs().amax(-1))                    # a lower bound on log Z_K
    return pagebox_log_odds(q, sketch.boxes(), lz, s)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), log_scale=st.floats(-2, 1.5), outlier=st.floats(1, 100),
       scheme=st.sampled_from(["int8", "int4", "fp8_e4m3", "fp8_e5m2", "int4c"]), n_ev=st.integers(1, 40))
def test_sketch_bounds_the_evicted_mass_from_exact_keys(seed, log_scale, outlier, scheme, n_ev):
    g = torch.Generator().manual_seed(seed)
    k, ev, kept = split(g, 48, n_ev, log_scale, outlier)
    sk = build_key_sketch(k, ev, BANDS, scheme=scheme)
    err = k.gather(2, ev[..., None].expand(-1, -1, -1, D)) - sk.boxes().lo                 # k - k^
    j = int(err.norm(dim=-1).sum(1).argmax())
    aligned = err[:, :, j].sign().repeat_interleave(REP, 1)
    s = D ** -0.5
    for q in (torch.randn(1, HKV * REP, D, generator=g), aligned * 3.0, aligned * 30.0 / 10 ** log_scale):
        assert bool((truth(q, k, ev, kept, s) <= log_odds(q, sk, k, kept, s)).all()), (scheme, q.abs().max())


def test_sketch_is_tight_and_the_witness_is_needed():
    """int8 sketch: log X - log Z_E below 0.5 nats for queries of a realistic size (so the bound says
    something), and zeroing the witness (a sketch that claims its codes are exact) is caught."""
    g = torch.Generator().manual_seed(4)
    k, ev, kept = split(g, 64, 40, 0.0, 10.0)
    s = D ** -0.5
    sk = build_key_sketch(k, ev, BANDS, scheme="int8")
    q = torch.randn(1, HKV * REP, D, generator=g) * 2
    gap = log_odds(q, sk, k, kept, s) - truth(q, k, ev, kept, s)
    assert bool((gap >= 0).all()) and float(gap.max()) < 0.5, gap
    broken = build_key_sketch(k, ev, BANDS, scheme="int4")
    broken.rho = torch.zeros_like(broken.rho)
    err = k.gather(2, ev[..., None].expand(-1, -1, -1, D)) - dequantize(broken.codes)
    caught = 0
    for j in range(40):
        q = err[:, :, j].sign().repeat_interleave(REP, 1) * 30
        caught += int((truth(q, k, ev, kept, s) > log_odds(q, broken, k, kept, s)).any())
    assert caught > 0


def test_sketch_bytes_and_bad_input():
    g = torch.Generator().manual_seed(5)
    k, ev, _ = split(g, 48, 20, 0.0, 1.0)
    sk = build_key_sketch(k, ev, BANDS, scheme="int8")
    per = sk.nbytes / (HKV * 20)
    assert per == D + 2 + 8 + 1  # int8 codes, fp16 scale, 8 witness codes, a validity byte: 43 of fp16 K+V's 128
    assert build_key_sketch(k, ev, BANDS, scheme="int4").nbytes / (HKV * 20) == D / 2 + 2 + 8 + 1
    # int4c: 4-bit codes, the witness, validity; fp16 lo and step per channel of the one block of 20 tokens
    assert build_key_sketch(k, ev, BANDS, scheme="int4c").nbytes / (HKV * 20) == D / 2 + 8 + 1 + 2 * 2 * D / 20
    with pytest.raises(ValueError, match="scheme must be one of"):
        build_key_sketch(k, ev, BANDS, scheme="kivi2")
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        build_key_sketch(k.double(), ev, BANDS)
    with pytest.raises(ValueError, match="out of range"):
        build_key_sketch(k, ev + 100, BANDS)
    bad = k.clone()
    bad[0, 0, int(ev[0, 0, 0]), 0] = float("nan")
    with pytest.raises(ValueError):
        build_key_sketch(bad, ev, BANDS)
    with pytest.raises(ValueError, match="bands"):
        build_key_sketch(k, ev, BANDS[:4])


def test_int4c_codes_decode_within_half_a_step():
    """int4c: per block of 32 evicted tokens and channel, lo = the block's min (fp16), 15 steps to its max:
    every valid token decodes within half a step (plus fp16 rounding of lo and step) of its exact key;
    padding slots do not widen the range."""
    from fast.core.pagebox import channel_codes
    g = torch.Generator().manual_seed(6)
    k = torch.randn(2, HKV, 70, D, generator=g) * torch.logspace(-1, 1, D)
    valid = torch.ones(2, HKV, 70, dtype=torch.bool)
    valid[1, :, 60:] = False
    k[1, :, 60:] = 1e4                                        # padding with huge values: ignored
    c = channel_codes(k, valid)
    assert c.lo.shape == (2, HKV, 3, D) and c.codes.shape == (2, HKV, 70, D // 2)
    step = c.step.float().repeat_interleave(32, 2)[:, :, :70]
    err = (c.decode() - k).abs()[valid]
    assert bool((err <= 0.5 * step[valid] + 2e-3 * k.abs()[valid] + 1e-6).all())
    assert float(c.step.float()[1, :, 1].max()) < 10          # the padded block's range is its valid tokens'
