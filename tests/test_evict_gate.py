"""The certified eviction gate (fast.policies.evict_gate) on a random tiny GQA Llama, batch 2 with
left padding. The truth is computed here in fp64 from the exact keys this test copies out of the
cache BEFORE the eviction (and the decode tokens' keys, which the DynamicCache holds exactly):
every read served must have a true evicted mass <= its reported bound <= tau."""

import pytest
import torch

from fast.policies.evict_gate import EvictionGate
from fast.policies.evictors import copy_prefill, decode, evict, make_evictor, prefill
from tiny_model import tiny_llama

T = 8


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(layers=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 120), generator=g)
    mask = torch.ones(2, 120, dtype=torch.long)
    mask[1, :30] = 0                                              # row 1: 90 real tokens, left padding
    pre = prefill(model, ids, mask, needs={"window"})
    full = decode(model, copy_prefill(pre, model.config), None, max_new_tokens=T, certify=False, keep_logits=True)
    return model, pre, full


def run(setup, tau, spec="snapkv:48", **kw):
    model, pre, _ = setup
    mine = copy_prefill(pre, model.config)
    exact = [layer.keys.double().clone() for layer in mine.cache.layers]     # the truth's keys, before eviction
    gate = EvictionGate(tau, keep_queries=True, **kw)
    ev = evict(mine, make_evictor(spec), witness=False, gate=gate)
    out = decode(model, mine, ev, max_new_tokens=T, certify=False, keep_logits=True)
    return gate, ev, out, exact, mine


def true_mass(gate, ev, exact, mine, valid):
    """[T, L, B, H] the attention mass of the tokens each served read did not see, fp64."""
    rows = []
    for t, step in enumerate(gate.steps):
        per_layer = []
        for l, k0 in enumerate(exact):
            B, Hkv, N, D = k0.shape
            H = step["query"].shape[2]
            rep = H // Hkv
            dec = mine.cache.layers[l].keys.double()[:, :, -len(gate.steps):][:, :, :t + 1]   # decode tokens
            k = torch.cat([k0, dec], 2).repeat_interleave(rep, 1)
            ok = torch.cat([valid, torch.ones(B, t + 1, dtype=torch.bool)], 1)
            gone = valid[:, None, :].expand(B, Hkv, N).clone()
            gone.scatter_(2, ev.keep[l], False)
            gone &= ~step["restored"][l]                                  # restored tokens are read again
            gone = torch.cat([gone, torch.zeros(B, Hkv, t + 1, dtype=torch.bool)], 2).repeat_interleave(rep, 1)
            x = torch.einsum("bhd,bhnd->bhn", step["query"][l].double(), k) / D ** 0.5
            x = x.masked_fill(~ok[:, None, :], -float("inf"))
            p = torch.softmax(x, -1)
            per_layer.append((p * gone).sum(-1))
        rows.append(torch.stack(per_layer))
    return torch.stack(rows)


def test_tau_one_is_plain_eviction_and_tau_zero_is_the_full_cache(setup):
    """differential: tau = 1 never restores (the evicted read, same logits as evict without a gate);
    tau = 0 restores every head with an evicted token on the first read (the full cache's logits)."""
    model, pre, full = setup
    mine = copy_prefill(pre, model.config)
    plain = decode(model, mine, evict(mine, make_evictor("snapkv:48"), witness=False), max_new_tokens=T,
                   certify=False, keep_logits=True)
    gate, _, out, _, _ = run(setup, 1.0)
    assert torch.allclose(out["logits"], plain["logits"], atol=1e-4)
    assert not bool(torch.stack([s["restored"] for s in gate.steps]).any())
    assert sum(gate.summary()["evicted_tokens"]) == 3 * 2 * (120 - 48 + 90 - 48)
    assert (out["logits"] - full["logits"]).abs().max() > 0.1             # eviction does change this model
    gate, _, out, _, _ = run(setup, 0.0)
    assert torch.allclose(out["logits"], full["logits"], atol=1e-4)
    s = gate.summary()
    assert s["restored_tokens"] == s["evicted_tokens"] and s["max_served_bound"] == 0


@pytest.mark.parametrize("tau,scope,retain", [(0.05, "tokens", True), (0.3, "tokens", True), (0.6, "tokens", True),
                                              (0.3, "head", True), (0.6, "layer", True), (0.6, "input", True),
                                              (1.0, "tokens", True), (0.3, "tokens", False), (0.6, "head", False)])
def test_every_served_read_is_certified_against_the_exact_keys(setup, tau, scope, retain):
    """soundness: true mass of what each read missed <= served bound <= tau, per (step, layer, row, head);
    retain=False: each read fetches its own tokens (nothing stays from one read to the next)."""
    model, pre, _ = setup
    gate, ev, out, exact, mine = run(setup, tau, scope=scope, retain=retain)
    served = torch.stack([s["served"] for s in gate.steps])
    truth = true_mass(gate, ev, exact, mine, pre.valid)
    assert served.shape == truth.shape == (T - 1, 3, 2, 4)
    assert bool((served <= tau).all())
    assert bool((truth <= served * (1 + 1e-9) + 1e-12).all()), float((truth - served).max())
    restored = torch.stack([s["restored"] for s in gate.steps]).long()    # [T, L, B, Hkv, N] positions
    if retain:
        assert bool((restored[1:] >= restored[:-1]).all())               # a restored token stays restored
    evicted = torch.stack([pre.valid[:, None, :].expand(2, 2, 120).clone().scatter_(2, keep, False)
                           for keep in ev.keep]).long()                  # [L, B, Hkv, N]
    assert bool((restored <= evicted).all())
    if not retain:                                                       # fetched per read, not kept
        assert bool((restored[1:] < restored[:-1]).any()) or tau == 1.0
    dims = {"head": (-1,), "layer": (-2, -1)}.get(scope)
    if dims:                                                             # all of the scope's tokens or none
        n, tot = restored.sum(dims), evicted.sum(dims)
        assert bool(((n == 0) | (n == tot)).all())
    if scope == "input":          # a breach restores every layer of its row: the next step reads them all
        hit = restored[:-1].sum((1, 3, 4)) > 0                           # [T-1, B]
        whole = (restored[1:] == evicted).all(-1).all(-1).all(1)          # [T-1, B]
        assert bool(hit.any()) and bool((whole | ~hit).all())


def test_the_gate_has_teeth(setup):
    """at tau = 1 some served reads miss more than 0.6 of the mass; at 0.6 none does, and some heads
    (not all) were restored: the gate changes what is served where the bound says so."""
    model, pre, _ = setup
    gate, ev, _, exact, mine = run(setup, 1.0)
    assert float(true_mass(gate, ev, exact, mine, pre.valid).max()) > 0.6
    gate, ev, _, exact, mine = run(setup, 0.6)
    assert float(true_mass(gate, ev, exact, mine, pre.valid).max()) <= 0.6
    s = gate.summary()
    assert 0 < sum(s["restored_tokens"]) < 0.5 * sum(s["evicted_tokens"])


def test_bytes(setup):
    """resident bytes: kept slots and decode tokens at 4*D per token and KV head, the sketches of
    heads not restored, the offloaded K+V of restored heads; full = every token."""
    model, pre, _ = setup
    gate, ev, _, _, _ = run(setup, 1.0)
    L, Hkv, D = 3, 2, 32
    res, full = gate.steps[-1]["resident_bytes"], gate.steps[-1]["full_bytes"]
    n_real = pre.valid.sum(-1).double() + T - 1
    assert torch.equal(full, n_real * L * Hkv * 4 * D)
    kept = ev.kept_valid.sum(-1).double() + T - 1
    sketch = sum(st["valid"].sum((1, 2)).double() * st["sketch"].nbytes / st["sketch"].valid.numel() for st in gate.layers)
    assert torch.allclose(res, kept * L * Hkv * 4 * D + sketch)
    assert bool((res < 0.8 * full).all())
    gate, _, _, _, _ = run(setup, 0.6)                                    # some tokens back: their K+V, not their sketch
    back = gate.steps[-1]["restored"].sum((0, 2, 3)).double()
    out = sum(st["valid"].sum((1, 2)).double() for st in gate.layers) - back
    per_slot = gate.layers[0]["sketch"].nbytes / gate.layers[0]["sketch"].valid.numel()
    assert torch.allclose(gate.steps[-1]["resident_bytes"], kept * L * Hkv * 4 * D + back * 4 * D + out * per_slot)
    gate, _, _, _, _ = run(setup, 0.0)
    assert torch.allclose(gate.steps[-1]["resident_bytes"], gate.steps[-1]["full_bytes"])
    gate, _, _, _, _ = run(setup, 0.6, retain=False)                     # resident: kept + sketches + one read's fetch
    st = gate.steps[-1]
    per_token = 4 * D
    assert torch.allclose(st["resident_bytes"], kept * L * Hkv * 4 * D + sketch + st["fetched"].amax(0) * per_token)
    assert torch.allclose(st["fetch_bytes"], st["fetched"].sum(0) * per_token) and bool((st["fetch_bytes"] > 0).any())


def test_bad_input_is_refused(setup):
    model, pre, _ = setup
    for bad in (-0.1, 1.5, float("nan"), float("inf"), True, "0.2", None):
        with pytest.raises(ValueError, match="tau"):
            EvictionGate(bad)
    with pytest.raises(ValueError, match="scope"):
        EvictionGate(0.2, scope="token")
    for bad in ({"retain": 0}, {"retain": False, "scope": "input"}):
        with pytest.raises(ValueError, match="retain"):
            EvictionGate(0.2, **bad)
    with pytest.raises(ValueError, match="sketch"):
        EvictionGate(0.2, sketch="int3")
    mine = copy_prefill(pre, model.config)
    gate = EvictionGate(0.2)
    ev = evict(mine, make_evictor("snapkv:48"), witness=False, gate=gate)
    with pytest.raises(ValueError, match="already holds"):
        evict(copy_prefill(pre, model.config), make_evictor("snapkv:48"), witness=False, gate=gate)
    with pytest.raises(ValueError, match="not gated"):
        decode(model, mine, ev, max_new_tokens=4, evictor=make_evictor("streaming:48"), decode_every=2)
    from fast.policies.page import Page
    with pytest.raises(ValueError, match="without PAGE"):
        evict(copy_prefill(pre, model.config), make_evictor("snapkv:48"), page=Page(0.1), gate=EvictionGate(0.2))
    with pytest.raises(RuntimeError, match="outside a decode step"):
        gate.read(0, torch.zeros(2, 4, 1, 32), torch.zeros(2, 2, 5, 32), torch.zeros(2, 2, 5, 32), 0.1)
    gate.begin_step(ev.kept_valid)                                # a step in which no layer was read
    with pytest.raises(RuntimeError, match="without the eviction gate"):
        gate.end_step()


def test_threads_sharing_one_model_each_read_through_their_own_gate(setup):
    """two threads decode different inputs on one model at once, each with its own gate: each gets the
    logits and the gate records it gets alone (the collectors are per thread, the routing is counted)."""
    from concurrent.futures import ThreadPoolExecutor
    model, pre, _ = setup
    alone = [run(setup, tau)[2]["logits"] for tau in (0.3, 1.0)]
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda tau: run(setup, tau), (0.3, 1.0)))
    for (gate, _, out, _, _), ref in zip(both, alone):
        assert torch.allclose(out["logits"], ref, atol=1e-5) and len(gate.steps) == T - 1
    assert model.config._attn_implementation == "sdpa"            # routing restored once both are done


def test_nothing_evicted_and_no_decode_step(setup):
    """a budget that holds the prompt evicts nothing: every bound is 0 and the logits are the full
    cache's; one new token makes no decode read (the summary says 0 reads)."""
    model, pre, full = setup
    gate, _, out, _, _ = run(setup, 0.1, spec="snapkv:200")
    assert torch.allclose(out["logits"], full["logits"], atol=1e-4)
    s = gate.summary()
    assert s["max_bound_before_gate"] == 0 and sum(s["evicted_tokens"]) == 0 and s["reads"] == (T - 1) * 3 * 2 * 4
    mine = copy_prefill(pre, model.config)
    gate = EvictionGate(0.1)
    decode(model, mine, evict(mine, make_evictor("snapkv:48"), witness=False, gate=gate), max_new_tokens=1)
    assert gate.summary() == {"tau": 0.1, "scope": "tokens", "reads": 0}


def question_truth(gate, ev, exact, mine, valid, Lq):
    """[Lq, L, B, H] the exact attention mass each question row's served read missed (fp64): row t reads
    the context (evicted tokens and all) and the question's tokens up to t; the question's keys are
    exact in the DynamicCache (written after the eviction, at slots K .. K + Lq - 1)."""
    rows = [s for s in gate.steps if "row" in s]
    out = []
    for s in rows:
        t = s["row"]
        per_layer = []
        for l, k0 in enumerate(exact):
            B, Hkv, N, D = k0.shape
            H = s["query"].shape[2]
            rep = H // Hkv
            qk = mine.cache.layers[l].keys.double()[:, :, ev.keep[l].shape[2]:][:, :, :t + 1]   # question keys <= t
            k = torch.cat([k0, qk], 2).repeat_interleave(rep, 1)
            ok = torch.cat([valid, torch.ones(B, t + 1, dtype=torch.bool)], 1)
            gone = valid[:, None, :].expand(B, Hkv, N).clone()
            gone.scatter_(2, ev.keep[l], False)
            gone &= ~s["restored"][l]
            gone = torch.cat([gone, torch.zeros(B, Hkv, t + 1, dtype=torch.bool)], 2).repeat_interleave(rep, 1)
            x = torch.einsum("bhd,bhnd->bhn", s["query"][l].double(), k) / D ** 0.5
            p = torch.softmax(x.masked_fill(~ok[:, None, :], -float("inf")), -1)
            per_layer.append((p * gone).sum(-1))
        out.append(torch.stack(per_layer))
    return torch.stack(out), rows


@pytest.mark.parametrize("tau,retain", [(0.05, True), (0.3, False), (1.0, True)])
def test_a_question_prefilled_over_the_evicted_cache_is_certified_row_by_row(setup, tau, retain):
    """kvpress's protocol through the gate: the context evicted, the question prefilled after it; each of the
    question's rows is a certified read (its true missed mass from the exact keys <= served bound <= tau), the
    decode steps after it as before; tau = 1 serves the plain evicted question (the same first logits)."""
    model, pre, _ = setup
    mine = copy_prefill(pre, model.config)
    exact = [layer.keys.double().clone() for layer in mine.cache.layers]
    gate = EvictionGate(tau, keep_queries=True, retain=retain)
    ev = evict(mine, make_evictor("snapkv:48"), witness=False, gate=gate)
    Lq = 6
    question = torch.randint(3, 128, (2, Lq), generator=torch.Generator().manual_seed(5))
    out = decode(model, mine, ev, max_new_tokens=4, certify=False, keep_logits=True, question=question)
    truth, rows = question_truth(gate, ev, exact, mine, pre.valid, Lq)
    served = torch.stack([s["served"] for s in rows])
    assert [s["row"] for s in rows] == list(range(Lq)) and served.shape == (Lq, 3, 2, 4)
    assert bool((served <= tau).all()) and bool((truth <= served * (1 + 1e-9) + 1e-12).all()), float((truth - served).max())
    assert len(gate.steps) == Lq + 3                                      # the rows, then 3 decode steps
    if tau == 1.0:
        plain = copy_prefill(pre, model.config)
        ref = decode(model, plain, evict(plain, make_evictor("snapkv:48"), witness=False), max_new_tokens=4,
                     certify=False, keep_logits=True, question=question)
        assert torch.allclose(out["logits"], ref["logits"], atol=1e-4)
        assert float(truth.max()) > 0.05                                 # the question does miss mass: teeth below
    else:
        assert float(torch.stack([s["bound"] for s in rows]).max()) > tau   # the gate acted on some row


def test_a_question_read_outside_begin_rows_is_refused(setup):
    model, pre, _ = setup
    mine = copy_prefill(pre, model.config)
    gate = EvictionGate(0.3)
    evict(mine, make_evictor("snapkv:48"), witness=False, gate=gate)
    gate.begin_step(torch.ones(2, 48, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="query rows"):
        gate.read(0, torch.randn(2, 4, 3, 32), torch.randn(2, 2, 48, 32), torch.randn(2, 2, 48, 32), 0.17)
