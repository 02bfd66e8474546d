"""Triton kernels against their torch twins, under the interpreter (TRITON_INTERPRET=1, CPU).

Shapes are small: the interpreter runs each program in Python. The interpreter mode must be
on before anything imports triton, which other test modules of a full run may already have
done; so this file runs itself in a child pytest process with TRITON_INTERPRET=1 (one test,
test_triton_kernels_under_interpreter, in the parent run; the kernel tests in the child).
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.triton
CHILD = os.environ.get("KVCERT_TRITON_CHILD") == "1"

if not CHILD:
    def test_triton_kernels_under_interpreter():
        """Runs the kernel tests below in a fresh interpreter-mode process; fails with their report."""
        env = dict(os.environ, TRITON_INTERPRET="1", KVCERT_TRITON_CHILD="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-8000:]}\n{r.stderr[-3000:]}"
        assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-3000:]

if CHILD:
    import math

    import numpy as np
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from mpmath import mpf

    import fast
    import fast.core.triton_kernels as tk
    from reference import band as ref_band
    from reference import softmax as ref

    assert tk.INTERPRET, "the child process must run with TRITON_INTERPRET=1"
    pytestmark = pytest.mark.triton

    @pytest.mark.parametrize("seed,layer,start,Hkv,N,D,rows,stream", [
        (0, 0, 0, 1, 5, 32, 1, 0), (1, 1, 1, 2, 4, 16, 2, 1), (7, 3, 1000, 3, 33, 64, 1, 1),
        (2**31 - 1, 40, 2**32 - 7, 2, 17, 16, 3, 0), (123, 1, 2**40, 1, 9, 128, 1, 0),
        (2**64 - 1, 2**32 - 1, 2**63 - 20, 2, 17, 16, 2, 1), (2**32 + 5, 2**31, 2**32 + 3, 1, 5, 32, 2, 0)])
    def test_dither_bit_identical(seed, layer, start, Hkv, N, D, rows, stream):
        """Triton and torch generate the same dither bits (int64 hash, exact float conversion),
        batch rows and both streams included, with counters beyond 32 bits (two words each)."""
        a = tk.dither_noise(seed, layer, Hkv, start, N, D, rows=rows, stream=stream)
        b = fast.dither_noise(seed, layer, Hkv, start, N, D, rows=rows, stream=stream)
        assert torch.equal(a, b), (seed, layer, start)

    def test_dither_kernel_refuses_out_of_range_counters():
        for kw in (dict(seed=2**64), dict(layer=2**32), dict(token_start=2**63 - 3)):
            args = dict(seed=0, layer=0, token_start=0) | kw
            with pytest.raises(ValueError):
                tk.dither_noise(args["seed"], args["layer"], 1, args["token_start"], 5, 16)

    def test_dequantized_dither_cache_bit_identical():
        """The fused kernel's in-register dequantization equals fast.dequantize bit for bit:
        attention over one token of a dithered cache returns that token's value row exactly."""
        x = torch.randn(1, 2, 1, 32)
        vq = fast.quantize(x, "int8_dither", group_size=8, seed=11, layer=4, token_start=77)
        q = torch.zeros(1, 2, 32)
        out, _ = tk.decode_attention(q, x, vq, torch.zeros(1, 2, 1, 4), 0.5, fast.rope_bands(32, 4), None, None, False)
        assert torch.equal(out, fast.dequantize(vq)[:, :, 0])
        # batch rows, the value stream and a 64-bit seed: still the same bits
        x = torch.randn(3, 2, 1, 32)
        vq = fast.quantize(x, "int8_dither", group_size=8, seed=2**63 + 11, layer=4, token_start=2**33, stream=1)
        out, _ = tk.decode_attention(torch.zeros(3, 2, 32), x, vq, torch.zeros(3, 2, 1, 4), 0.5, fast.rope_bands(32, 4), None, None, False)
        assert torch.equal(out, fast.dequantize(vq)[:, :, 0])

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_witness_kernel_matches_twin(dtype):
        g = torch.Generator().manual_seed(1)
        k = torch.randn(2, 3, 7, 64, generator=g).to(dtype)
        kh = (k.float() + 0.01 * torch.randn(2, 3, 7, 64, generator=g)).to(dtype)
        for NB, layout in ((8, "rotate_half"), (2, "interleaved")):
            bands = fast.rope_bands(64, NB, layout)
            a = fast.witness(k, kh, bands, backend="triton")
            b = fast.witness(k, kh, bands, backend="torch")
            # both fp64 with the same margin; a different summation order can move the fp32 result by one ulp
            torch.testing.assert_close(a, b, rtol=2.5e-7, atol=0)
            want = ref_band.witness([float(v) for v in k[1, 2, 6].double()], [float(v) for v in kh[1, 2, 6].double()], bands.tolist())
            assert all(mpf(float(a[1, 2, 6, i])) >= w for i, w in enumerate(want))

    def test_logit_error_bound_kernel_matches_twin():
        g = torch.Generator().manual_seed(2)
        q = torch.randn(2, 6, 32, generator=g)
        rho = torch.rand(2, 2, 70, 4, generator=g)
        bands = fast.rope_bands(32, 4)
        a = fast.logit_error_bound(q, rho, bands, 0.17, backend="triton")
        b = fast.logit_error_bound(q, rho, bands, 0.17, backend="torch")
        torch.testing.assert_close(a, b, rtol=2.5e-7, atol=0)  # summation order only, see above
        want = ref_band.logit_error_bound([float(v) for v in q[1, 5].double()], [float(v) for v in rho[1, 1, 69].double()], bands.tolist(), 0.17)
        assert mpf(float(a[1, 5, 69])) >= want


    CASE = st.fixed_dictionaries({
        "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "Hkv": st.integers(1, 2), "G": st.integers(1, 3),
        "N": st.integers(1, 40), "D": st.sampled_from([16, 32]), "NB": st.sampled_from([1, 2, 4]),
        "cache": st.sampled_from(["float", "int8", "int8_dither", "int4", "fp8_e4m3"]),
        "padding": st.booleans(), "exact": st.booleans(), "mag": st.sampled_from([1e-2, 1.0, 30.0]),
        "group": st.sampled_from([8, 16, 32])})

    def build(case):
        g = torch.Generator().manual_seed(case["seed"])
        B, Hkv, N, D, G = case["B"], case["Hkv"], case["N"], case["D"], case["G"]
        k = torch.randn(B, Hkv, N, D, generator=g)
        v = torch.randn(B, Hkv, N, D, generator=g)
        q = torch.randn(B, Hkv * G, D, generator=g) * case["mag"]
        bands = fast.rope_bands(D, case["NB"])
        if case["cache"] == "float":
            kc, vc = (k + 0.01 * torch.randn(B, Hkv, N, D, generator=g)), v
            rho = fast.witness(k, kc, bands)
        else:
            gs = min(case["group"], D)
            kc = fast.quantize(k, case["cache"], group_size=gs, seed=case["seed"], layer=2, token_start=5)
            vc = fast.quantize(v, case["cache"], group_size=gs, seed=case["seed"] + 1, layer=2, token_start=5)
            rho = fast.witness_from_step(kc.step(), bands) if case["seed"] % 2 else None  # None: the zero-memory path
        valid = exact = None
        if case["padding"] and N > 1:
            valid = torch.ones(B, N, dtype=torch.bool)
            valid[-1, : N // 2] = False
        if case["exact"]:
            exact = torch.zeros(B, Hkv, N, dtype=torch.bool)
            exact[..., -2:] = True
        return q, kc, vc, rho, bands, valid, exact

    @settings(max_examples=40)
    @given(case=CASE)
    def test_decode_attention_kernel_matches_twin(case):
        """Fused kernel vs torch twin: output within fp32 summation-order noise; the certificates
        within the fp32 logit rounding each side pays for (both fp64 upper bounds of their own logits)."""
        q, kc, vc, rho, bands, valid, exact = build(case)
        s = 1 / math.sqrt(case["D"])
        o1, c1 = fast.decode_attention(q, kc, vc, rho, s, bands=bands, valid=valid, exact=exact, backend="triton")
        o2, c2 = fast.decode_attention(q, kc, vc, rho, s, bands=bands, valid=valid, exact=exact, backend="torch")
        # different summation order (online blocks vs one matmul) in fp32: a few ulps of the output scale
        torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5, msg=lambda m: f"{m}\ncase {case}")
        # Each side certifies its own fp32 logits, which differ by the summation order: by at most
        # 2e (fast.core.certify.logit_rounding), so A, B move by a factor within e^{+-4e}, A^2 by e^{+-8e}.
        kmax = fast.core.quant.max_abs(kc if isinstance(kc, fast.QTensor) else kc.float())
        e = float(fast.core.certify.logit_rounding(q, kmax, s).max())
        # the TV forms also carry each side's served-weight rounding r_w (fast.core.certify.weight_rounding): the
        # kernel's counts its rescales (one per block of 16 tokens under the interpreter), the twin's none
        N, D = kc.shape[2], case["D"]
        r_gap = float(fast.core.certify.weight_rounding(np.array([e]), N, D, drift=0.0, rescales=-(-N // 16))[0])
        for name in c2:
            atol = 1e-12 + (r_gap if name in fast.core.certify.FORMS else 0.0)
            torch.testing.assert_close(c1[name], c2[name], rtol=1e-6 + 16 * e, atol=atol, msg=lambda m: f"{name}: {m}\ncase {case}")

    def test_decode_attention_kernel_ge_reference():
        """Differential: the kernel's certificate >= reference forms on exact p~ and c (one row)."""
        g = torch.Generator().manual_seed(5)
        q, k = torch.randn(1, 2, 32, generator=g), torch.randn(1, 1, 24, 32, generator=g)
        kq = fast.quantize(k, "int8_dither", group_size=32, seed=9)
        bands = fast.rope_bands(32, 4)
        rho = fast.witness(k, fast.dequantize(kq), bands)
        _, cert = fast.decode_attention(q, kq, kq, rho, 0.25, bands=bands, backend="triton")
        kd = fast.dequantize(kq)
        logits = [0.25 * sum(mpf(float(a)) * mpf(float(b)) for a, b in zip(q[0, 1].double(), kd[0, 0, j].double())) for j in range(24)]
        c = ref_band.logit_error_bound([float(v) for v in q[0, 1].double()], [[float(v) for v in rho[0, 0, j].double()] for j in range(24)], bands.tolist(), 0.25)
        want = ref.tv_bound_forms(ref.softmax(logits), c)
        for name in fast.core.certify.FORMS:
            assert mpf(float(cert[name][0, 1])) >= want[name], name

    def test_decode_attention_kernel_covers_served_weights():
        """Issue 19 (2): every TV form >= TV(exact softmax, the weights the kernel serves): p_j = exp(x_j - m)
        in fp32 at the block's running max, times the later rescales alpha = exp(m_old - m_new) (replicated
        here in numpy, the interpreter's exp). Exact keys, |q| ~ 3.5e-5, exact fp32 logits (integers x 2^-24, s = 1/8)."""
        import numpy as np
        g = torch.Generator().manual_seed(3)
        N, D = 64, 64
        k = torch.randint(-8, 9, (1, 1, N, D), generator=g).float()
        q = torch.randint(-128, 129, (1, 1, D), generator=g).float() * 2.0 ** -24
        x = (q[0, 0].double() @ k[0, 0].double().T) * 0.125
        assert torch.equal(x.float().double(), x)
        _, cert = fast.decode_attention(q, k, k, torch.zeros(1, 1, N, 1), 0.125, bands=fast.rope_bands(D, 1), backend="triton")
        x32 = x.float().numpy()
        m, w = np.float32(-np.inf), np.zeros(0)
        for start in range(0, N, 16):  # the interpreter's BLOCK_N
            xb = x32[start:start + 16]
            m_new = np.maximum(m, xb.max())
            alpha = np.exp(np.float32(m - m_new))
            w = np.concatenate([w * np.float64(alpha), np.exp(xb - m_new).astype(np.float64)])
            m = m_new
        p = torch.softmax(x, -1).numpy()
        true = 0.5 * np.abs(p - w / w.sum()).sum()
        assert true > 1e-9
        for name in fast.core.certify.FORMS:
            assert true <= float(cert[name][0, 0]), (name, float(cert[name][0, 0]), true)
        assert float(cert["min"][0, 0]) < 1e-4

    def test_decode_attention_kernel_out_err_is_the_served_outputs():
        """Issue 19 (1): with v_err, out_err bounds ||o - out|| for the kernel's own output (the twin's bound
        plus ||out_twin - out||), here on values near the fp32 subnormal range (one token at logit 0, 63
        at -7.5: the products w_j 2^-140 round to 0)."""
        N, D = 64, 16
        k = torch.zeros(1, 1, N, D)
        k[..., 0] = -7.5
        k[..., 0, 0] = 0.0
        q = torch.zeros(1, 1, D)
        q[..., 0] = 8.0
        v = torch.full((1, 1, N, D), 2.0 ** -140)
        v[..., 1::2, 1] = 3.0 * 2.0 ** -141
        out, cert = fast.decode_attention(q, k, v, torch.zeros(1, 1, N, 1), 0.125, bands=fast.rope_bands(D, 1),
                                          v_err=torch.zeros(1, 1, N), backend="triton")
        p = torch.softmax((q[0, 0].double() @ k[0, 0].double().T) * 0.125, -1)
        o = p @ v[0, 0].double()  # exact logits; fp64 products of values 2^-140 do not underflow
        true = float((o - out[0, 0].double()).norm())
        assert true > 3e-44 and true <= float(cert["out_err"][0, 0]), (true, float(cert["out_err"][0, 0]))

    @pytest.mark.parametrize("where", ["q", "k", "v"])
    def test_decode_attention_kernel_rejects_nan(where):
        args = {"q": torch.randn(1, 2, 16), "k": torch.randn(1, 1, 5, 16), "v": torch.randn(1, 1, 5, 16)}
        args[where] = args[where].clone()
        args[where].view(-1)[3] = float("nan")
        with pytest.raises(ValueError):
            fast.decode_attention(args["q"], args["k"], args["v"], torch.rand(1, 1, 5, 2), 0.25, bands=fast.rope_bands(16, 2), backend="triton")

    def test_auto_backend_is_torch_on_cpu(monkeypatch):
        def boom(*a, **k):
            raise AssertionError("Triton called on CPU with backend='auto'")
        monkeypatch.setattr(tk, "decode_attention", boom)
        q, k = torch.randn(1, 2, 16), torch.randn(1, 1, 5, 16)
        out, cert = fast.decode_attention(q, k, k, torch.rand(1, 1, 5, 2), 0.25, bands=fast.rope_bands(16, 2))
        assert out.shape == (1, 2, 16) and cert["min"].shape == (1, 2)
        out, cert = fast.decode_attention(q, k, k, torch.rand(1, 1, 5, 2), 0.25, bands=fast.rope_bands(16, 2), certify=False)
        assert cert is None

    def test_decode_attention_kernel_saturates_on_huge_witness():
        """A finite but absurd witness gives min = 1 and A = inf from the kernel too."""
        q, k = torch.randn(1, 2, 16), torch.randn(1, 1, 5, 16)
        _, cert = fast.decode_attention(q, k, k, torch.full((1, 1, 5, 2), 1e17), 0.25, bands=fast.rope_bands(16, 2), backend="triton")
        assert bool((cert["min"] == 1).all()) and bool(torch.isinf(cert["A"]).all())
