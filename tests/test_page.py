"""PAGE gate (our reconstruction, anchors.md section 2): agreement, drop, decision, calibration."""
import math

import pytest
import torch
from tests.tiny_model import tiny_evict_llama

from fast.policies.evictors import generate, make_evictor
from fast.policies.page import Page, calibrate, calibrate_model, head_agreement_drop, layer_agreement


def test_agreement_is_one_for_identical_heads_and_chance_for_independent():
    """property: identical top-k sets give 1; independent random sets average ~0 (chance-corrected)."""
    cand = torch.ones(1, 200, dtype=torch.bool)
    same = torch.randn(1, 1, 200).expand(1, 3, 200)
    assert abs(float(layer_agreement(same, cand, 50)[0]) - 1) < 1e-12
    g = torch.Generator().manual_seed(0)
    vals = [float(layer_agreement(torch.rand(1, 4, 200, generator=g), cand, 50)[0]) for _ in range(200)]
    assert abs(sum(vals) / len(vals)) < 0.02
    disjoint = torch.zeros(1, 2, 200)
    disjoint[0, 0, :50] = 1
    disjoint[0, 1, 50:100] = 1
    j0 = 50 / (400 - 50)
    assert abs(float(layer_agreement(disjoint, cand, 50)[0]) - (0 - j0) / (1 - j0)) < 1e-12


def test_drop_sign_follows_where_heads_agree():
    """property: heads that agree early and disagree late give a large positive drop; reversed, negative."""
    N = 300
    valid = torch.ones(1, N, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    agree = [torch.rand(1, 1, N, generator=g).expand(1, 3, N).clone() for _ in range(3)]
    disagree = [torch.rand(1, 3, N, generator=g) for _ in range(3)]
    d, per_layer = head_agreement_drop(agree + disagree, valid, 150, sinks=4, window=16)
    assert per_layer.shape == (6, 1) and float(d[0]) > 0.5
    d_rev, _ = head_agreement_drop(disagree + agree, valid, 150, sinks=4, window=16)
    assert float(d_rev[0]) < -0.5
    d_all, _ = head_agreement_drop(agree + disagree, valid, 10_000)  # nothing to evict
    assert math.isinf(float(d_all[0]))
    with pytest.raises(ValueError):
        head_agreement_drop(agree[:2], valid, 150)


def test_calibrate_quantile_and_validation():
    """property: tau is the (1 - evict_rate) quantile of the finite drops."""
    drops = [0.1 * i for i in range(11)] + [math.inf]
    assert abs(calibrate(drops, 0.5) - 0.5) < 1e-12
    assert abs(calibrate(drops, 0.2) - 0.8) < 1e-12
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError):
            calibrate(drops, bad)
    with pytest.raises(ValueError):
        Page(float("nan"))


def tiny():
    return tiny_evict_llama()


def test_gate_on_tiny_model_decides_and_exposes_drop():
    """property: the gate keeps the full cache when drop < tau and evicts when drop >= tau; the
    drop is exposed; calibration on unlabelled prompts returns a tau between the drops."""
    model = tiny()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (1, 200), generator=g)
    keep_all = generate(model, ids, evictor=make_evictor("snapkv:100"), page=Page(1e9), max_new_tokens=2)
    e = keep_all["eviction"]
    assert not e.evicted and math.isfinite(float(e.page_drop[0]))
    assert keep_all["prefill"].cache.layers[0].keys.shape[2] == 201
    full = generate(model, ids, max_new_tokens=2)
    assert keep_all["tokens"].tolist() == full["tokens"].tolist()
    gated = generate(model, ids, evictor=make_evictor("snapkv:100"), page=Page(-1e9), max_new_tokens=2)
    assert gated["eviction"].evicted and gated["prefill"].cache.layers[0].keys.shape[2] == 101
    assert float(gated["eviction"].page_drop[0]) == float(e.page_drop[0])
    prompts = [torch.randint(0, 128, (1, 200), generator=g) for _ in range(4)]
    tau, drops = calibrate_model(model, prompts, 100, evict_rate=0.5)
    assert min(drops) <= tau <= max(drops) and len(drops) == 4


def test_cli_calibrate_page_and_run_arguments(tmp_path):
    """property: `kvcert calibrate-page` writes a tau between the drops on SmolLM2; bad input is
    a one-line error (exit 2); --evict/--page parse into an evictor and a gate."""
    import argparse
    import json

    from fast.tools.evict_cli import add_run_arguments, calibrate_page_main, from_args
    out = tmp_path / "page.json"
    assert calibrate_page_main(["--budget", "64", "--n", "2", "--tokens", "256", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert min(data["drops"]) <= data["tau"] <= max(data["drops"]) and data["budget"] == 64
    assert calibrate_page_main(["--budget", "1.5", "--out", str(out)]) == 2
    ap = add_run_arguments(argparse.ArgumentParser())
    ev, page = from_args(ap.parse_args(["--evict", "snapkv:256", "--page", str(out)]))
    assert ev.name == "snapkv" and ev.budget == 256 and page.tau == data["tau"]
    assert from_args(ap.parse_args([])) == (None, None)
    with pytest.raises(ValueError):
        from_args(ap.parse_args(["--page", "0.1"]))


def test_page_measures_query_heads_and_decides_per_row():
    """property: heads="query" measures agreement over the 4 query heads of the tiny model (not its
    2 KV heads, whose agreement differs); in a batch of 2 with tau between the two rows' drops,
    exactly one row evicts: its answer equals the row evicted alone, the other row's equals
    the full cache; the certificate of the mixed batch (and of the clustered witness) is sound
    against the exact keys in shadow mode."""
    from fast.policies.evictors import copy_prefill, decode, evict, prefill
    model = tiny()
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 128, (2, 200), generator=g)
    pre = prefill(model, ids, needs={"window", "window_heads"})
    L = len(pre.cache.layers)
    ev = make_evictor("snapkv:100")
    dq, _ = head_agreement_drop([pre.layers[l].window_heads for l in range(L)], pre.valid, 100, sinks=ev.sinks, window=ev.window)
    dk, _ = head_agreement_drop([pre.layers[l].window for l in range(L)], pre.valid, 100, sinks=ev.sinks, window=ev.window)
    assert pre.layers[0].window_heads.shape == (2, 4, 200) and not torch.allclose(dq, dk)
    assert float(dq[0]) != float(dq[1])
    tau = float(dq.mean())
    hi = int(dq.argmax())
    mixed = copy_prefill(pre, model.config)
    e = evict(mixed, make_evictor("snapkv:100"), page=Page(tau), shadow=True, variants={"c8": {"group_size": 8, "cluster": True}})
    assert e.rows.tolist() == [b == hi for b in range(2)] and e.evicted
    assert e.kept_valid[hi].sum() == 100 and e.kept_valid[1 - hi].sum() == 200
    out = decode(model, mixed, e, max_new_tokens=4, shadow=True)
    alone = generate(model, ids[hi:hi + 1], evictor=make_evictor("snapkv:100"), max_new_tokens=4)
    full = generate(model, ids[1 - hi:2 - hi], max_new_tokens=4)
    assert out["tokens"][hi].tolist() == alone["tokens"][0].tolist()
    assert out["tokens"][1 - hi].tolist() == full["tokens"][0].tolist()
    for step in out["trace"]:
        true = step["true"].double()
        assert bool((step["bound"].double() >= true * (1 - 1e-12)).all())
        assert bool((torch.sigmoid(step["variants"]["c8"]) * (1 + 1e-9) >= true * (1 - 1e-12)).all())
        assert float(step["true"][:, 1 - hi].abs().max()) == 0.0              # the full row evicted nothing
