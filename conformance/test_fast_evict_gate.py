"""The certified eviction gate's read, fast vs reference (spec T7a, T7b, T7j, T7k, T7l; fast.policies.evict_gate).

differential: on one gated read, the bound served for each query head is >= the exact (60-digit)
reference.evict.page_box_bound on the same stored sketch (one-token boxes lo = hi = the decoded code,
widened by the unpacked witness) over the tokens the read left out, with L = the exact log mass of
the tokens it read; and the output served is the exact attention over the tokens it read
(reference.evict.attention_over). property: the bound served is <= tau and >= the exact missed mass
from the exact keys (reference.evict.evict_tv); the read set is the kept slots plus what came back.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import exp, fsum, log, mpf, workdps

from conformance._check import DPS, expect, le, replay
from fast.core.rope import rope_bands
from fast.core.witness import unpack_witness
from fast.policies.evict_gate import EvictionGate
from reference.evict import attention_over, evict_tv, page_box_bound

F32 = st.floats(-3, 3, width=32)


@st.composite
def cases(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    rep = draw(st.sampled_from([1, 2]))
    N = draw(st.integers(3, 10))
    K = draw(st.integers(1, N - 1))
    vec = st.lists(F32, min_size=8, max_size=8)
    return {"Hkv": Hkv, "H": Hkv * rep, "N": N,
            "keys": draw(st.lists(st.lists(vec, min_size=N, max_size=N), min_size=Hkv, max_size=Hkv)),
            "values": draw(st.lists(st.lists(vec, min_size=N, max_size=N), min_size=Hkv, max_size=Hkv)),
            "keep": [sorted(draw(st.permutations(range(N)))[:K]) for _ in range(Hkv)],
            "q": draw(st.lists(vec, min_size=Hkv * rep, max_size=Hkv * rep)), "gain": draw(st.floats(0.5, 6)),
            "tau": draw(st.sampled_from([0.0, 0.05, 0.3, 0.7, 1.0])), "sketch": draw(st.sampled_from(["int8", "int4c", "int4"])),
            "scope": draw(st.sampled_from(["tokens", "head"])), "scale": draw(st.sampled_from([0.35, 1.0]))}


@workdps(DPS)
def check_gate_read(case):
    Hkv, H, N = case["Hkv"], case["H"], case["N"]
    rep, s = H // Hkv, case["scale"]
    keys = torch.tensor([case["keys"]], dtype=torch.float32)              # [1, Hkv, N, 8]
    values = torch.tensor([case["values"]], dtype=torch.float32)
    keep = torch.tensor([case["keep"]])
    q = torch.tensor([case["q"]], dtype=torch.float32) * case["gain"]     # [1, H, 8]
    gate = EvictionGate(case["tau"], scope=case["scope"], sketch=case["sketch"], num_bands=2)
    gate.offload(keys, values, torch.ones(1, N, dtype=torch.bool), keep)
    take = lambda t: t.gather(2, keep[..., None].expand(-1, -1, -1, 8))
    gate.begin_step(torch.ones(1, keep.shape[2], dtype=torch.bool))
    out = gate.read(0, q[:, :, None], take(keys), take(values), s)[0, 0]  # [H, 8]
    rec = gate._step[0][0]                                                 # layer 0, its one row
    st_ = gate.layers[0]
    sk = st_["sketch"]
    k_hat = sk.boxes().lo[0].double()                                      # [Hkv, E, 8] decoded codes
    widen = unpack_witness(sk.rho)[0].double()                             # [Hkv, E, NB]
    bands = [b.tolist() for b in rope_bands(8, 2, "rotate_half")]
    for h in range(H):
        g = h // rep
        read = sorted(set(case["keep"][g]) | set(torch.nonzero(rec["restored"][0, g]).flatten().tolist()))
        qh = [mpf(float(x)) for x in q[0, h]]
        logit = lambda k: mpf(s) * fsum(a * mpf(float(b)) for a, b in zip(qh, k))
        z_read = fsum(exp(logit(keys[0, g, j])) for j in read)
        e_out = [i for i in range(st_["index"].shape[2])
                 if bool(st_["valid"][0, g, i]) and int(st_["index"][0, g, i]) not in read]
        pages = [(1, k_hat[g, i].tolist(), k_hat[g, i].tolist(), widen[g, i].tolist()) for i in e_out]
        ref = page_box_bound(qh, pages, log(z_read), s, bands=bands)
        served = mpf(float(rec["served"][0, h]))
        expect(le(ref, served), check_gate_read, case, f"head {h}: served {served} < reference {ref}")
        expect(served <= case["tau"], check_gate_read, case, f"head {h}: served {served} > tau {case['tau']}")
        missed = evict_tv([logit(keys[0, g, j]) for j in range(N)], read)
        expect(le(missed, served), check_gate_read, case, f"head {h}: missed mass {missed} > served {served}")
        exact = attention_over(qh, [list(map(float, keys[0, g, j])) for j in range(N)],
                               [list(map(float, values[0, g, j])) for j in range(N)], read, s)
        err = max(abs(mpf(float(o)) - e) for o, e in zip(out[h], exact))
        scale_v = max(abs(float(v)) for v in values[0, g].flatten()) + 1e-30
        expect(err <= 1e-5 * scale_v, check_gate_read, case, f"head {h}: output off by {err} from the exact read")


@replay("test_fast_evict_gate_read_ge_reference")
@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_fast_evict_gate_read_ge_reference(case):
    check_gate_read(case)
