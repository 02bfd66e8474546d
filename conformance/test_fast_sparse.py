"""Certified sparse read, fast vs reference (spec T7i-T7k, T8e; fast.core.sparse).

differential: for the set fast.sparse_read actually read, its certificate is >= the exact
(60-digit) reference.evict.sparse_read_bound of the same read set (exact Z_K, exact boxes of
the unread pages) and not looser than the fp32 logits' margin explains; its output equals the
exact attention over the read tokens (reference.evict.attention_over) to fp32 accuracy.
property: the certificate is >= the true TV (reference.evict.evict_tv of the exact logits),
<= tau unless every page was read (then 0), and the read set is the window plus whole pages,
for random queries, keys at their page's box corner (the box bound attained) and all the mass
on one far page.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import fsum, mpf, workdps

from conformance._check import DPS, expect, le, replay
from fast.core.sparse import build_sparse_index, sparse_read
from reference.evict import attention_over, evict_tv, sparse_read_bound

# The fast certificate uses L = logsumexp(x^) - e from the fp32 logits (e ~ (D + 4) 2^-24 s sum|q| kmax)
# and REL = 1e-9 margins, then one fp32 rounding up: fast <= ref e^{2e + 1e-6} (1 + 2^-22) here.
LOOSE_REL, LOOSE_ABS = mpf("1e-3"), mpf("1e-30")


@st.composite
def cases(draw):
    Hkv, rep, half, N = draw(st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.integers(1, 3), st.integers(2, 20)))
    H, D = Hkv * rep, 2 * half
    vec = st.lists(st.floats(-3, 3, width=32), min_size=D, max_size=D)
    return {"H": H, "Hkv": Hkv, "D": D, "page_size": draw(st.integers(1, 4)), "window": draw(st.sampled_from([0, 1, 3])),
            "keys": draw(st.lists(st.lists(vec, min_size=N, max_size=N), min_size=Hkv, max_size=Hkv)),
            "values": draw(st.lists(st.lists(vec, min_size=N, max_size=N), min_size=Hkv, max_size=Hkv)),
            "q": draw(st.lists(vec, min_size=H, max_size=H)), "gain": draw(st.floats(0.5, 8)),
            "aim": draw(st.sampled_from(["random", "corner", "far"])),
            "tau": draw(st.sampled_from([1e-9, 0.05, 0.3, 1.0])), "scale": draw(st.sampled_from([0.25, 0.5, 1.0]))}


def build(case):
    """q [1, H, D], keys / values [1, Hkv, N, D]; "corner": every page's last key moved to the corner
    of its box that query head 0 of its KV head favours; "far": page 0 aligned with the query."""
    D, Hkv, H, P = case["D"], case["Hkv"], case["H"], case["page_size"]
    keys = torch.tensor(case["keys"], dtype=torch.float32)[None]
    values = torch.tensor(case["values"], dtype=torch.float32)[None]
    q = case["gain"] * torch.tensor(case["q"], dtype=torch.float32)[None]
    N = keys.shape[2]
    for g in range(Hkv):
        qg = q[0, g * (H // Hkv)]
        if case["aim"] == "corner":
            for a in range(0, N, P):
                page = keys[0, g, a:min(a + P, N)]
                keys[0, g, min(a + P, N) - 1] = torch.where(qg >= 0, page.amax(0), page.amin(0))
        elif case["aim"] == "far":
            keys[0, g, :P] = qg / max(1e-3, float(qg.norm())) * 3
    return q, keys, values


@workdps(DPS)
def check_sparse_read(case):
    q, keys, values = build(case)
    s, H, Hkv, P, tau = case["scale"], case["H"], case["Hkv"], case["page_size"], case["tau"]
    index = build_sparse_index(keys, values, page_size=P)
    r = sparse_read(q, keys, values, index, s, tau, window=case["window"])
    N = keys.shape[2]
    for h in range(H):
        g = h // (H // Hkv)
        read = sorted(r.tokens[0, g].tolist())
        expect(len(set(read)) == len(read) and N - 1 in read, check_sparse_read, case, f"head {h}: read set {read}")
        q_row, k_rows = q[0, h].tolist(), keys[0, g].tolist()
        ref = sparse_read_bound(q_row, k_rows, read, P, s)                  # raises if a page is partly read
        got = mpf(r.tv[0, h].item())
        expect(le(ref, got), check_sparse_read, case, f"head {h}: fast {got} < reference {ref}")
        expect(got <= ref * (1 + LOOSE_REL) + LOOSE_ABS, check_sparse_read, case, f"head {h}: fast {got} looser than {ref}")
        logits = [mpf(s) * fsum(mpf(a) * mpf(b) for a, b in zip(q_row, k)) for k in k_rows]
        truth = evict_tv(logits, read)
        expect(le(truth, got), check_sparse_read, case, f"head {h}: fast {got} < true TV {truth}")
        unread = r.pages - r.pages_read
        expect(got <= tau if unread else got == 0, check_sparse_read, case,
               f"head {h}: certificate {got} with tau {tau}, {unread} pages unread")
        o_ref = attention_over(q_row, k_rows, values[0, g].tolist(), read, s)
        for c, (a, b) in enumerate(zip(r.out[0, h].tolist(), o_ref)):      # fp32 softmax and matmul: a few ulp
            expect(abs(mpf(a) - b) <= mpf("1e-5") * (1 + max(abs(v) for v in o_ref)), check_sparse_read, case,
                   f"head {h} channel {c}: out {a} != exact {b}")


@settings(max_examples=80, deadline=None)
@replay("test_fast_sparse_read_ge_reference")
@given(case=cases())
def test_fast_sparse_read_ge_reference(case):
    """differential: certificate >= the exact reference bound of the same read set, within the
    margins; output = exact attention over the read set; property: >= the true TV, <= tau
    unless everything was read (then 0), random / corner / far-page keys."""
    check_sparse_read(case)
