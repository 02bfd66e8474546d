"""CertifiedCache(subspace=m): the query-subspace witness (spec T4e, fast.core.subspace) in generation.

Truth from the shadow copy's exact keys (captured by the cache before quantizing, never touched by the
witness code): every form of every decode read is >= the true TV, with and without gates, box form,
eviction; the served output is the same as without the witness (it only certifies); the basis is fixed
at the first read; its bytes are counted; on SmolLM2 it tightens the certificate."""

import pytest
import torch

from fast.integrations.hf_cache import CertifiedCache
from fast.integrations.hf_meter import enable
from tests.tiny_model import tiny_ids, tiny_llama

FORMS = ("min", "tanh", "one_minus_b_over_a", "e_form")


@pytest.fixture(scope="module")
def model():
    return enable(tiny_llama())


def gen(model, ids, cache, n=6):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    return torch.stack(out.scores)


def stacked(cache, key):
    return torch.stack([r[key] for r in cache.records])


def check_intervals(cache, seed=0):
    """Every stored token's interval (the layer's subspace_view, as the read gets it) holds the exact shift
    s q . (k - k~) from the shadow copy, for random queries and for queries aimed at each KV head's residual
    errors (where band Cauchy-Schwarz is tight): the witness as stored, gathered and resolved is right."""
    from fast.core.subspace import shift_bounds
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        U, a, tau, sigma = layer.subspace_view()
        served, _ = layer.served()
        r = layer.exact_k.double() - served.double()                     # [B, Hkv, N, D]
        B, Hkv, N, D = r.shape
        G = cache.num_heads // Hkv
        rr = r.repeat_interleave(G, dim=1)                                # per query head
        aimed = rr[:, :, torch.randint(N, (1,), generator=g).item()] * 50
        for q in (torch.randn(B, Hkv * G, D, generator=g) * 3, aimed.float()):
            lo, hi = shift_bounds(q, U, a, tau, sigma, cache.bands, D ** -0.5)
            truth = torch.einsum("bhd,bhnd->bhn", q.double(), rr) * D ** -0.5
            ok = (lo <= truth) & (truth <= hi) | layer.exact_mask().repeat_interleave(G, dim=1) | ~layer.valid.repeat_interleave(G, dim=1)
            assert bool(ok.all()), f"layer {layer.layer_idx}: an exact shift outside its interval"


@pytest.mark.parametrize("scheme,m,box", [("int8", 4, False), ("int4", 8, False), ("fp8_e4m3", 8, True),
                                          ("kivi2", 16, True), ("int4", 32, True)])
def test_every_read_is_sound_and_never_looser(model, scheme, m, box):
    """Shadow mode, no sinks or window, a left-padded batch: true TV <= every form; the subspace certificate is
    never above the band witness's own on the same read (its t = 0 candidate is the band witness narrowed),
    and the model gets the same logits with or without it."""
    ids = tiny_ids(2, 70)
    ids[1, :9] = 0  # left padding in row 1
    mask = (ids != 0).long()
    runs = {}
    for mm in (0, m):
        cache = CertifiedCache(model.config, scheme, sinks=0, window=0, shadow=True, subspace=mm, box_form=box,
                               backend="torch")  # the subspace witness reads through the twin: both runs alike
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=cache,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        runs[mm] = (torch.stack(out.scores), cache)
    logits, cache = runs[m]
    true = stacked(cache, "true_tv")
    assert float(true.max()) > 0
    for form in FORMS:
        assert bool((true <= stacked(cache, form)).all()), f"{scheme}/{form}: true TV above the bound"
    assert torch.equal(logits, runs[0][0])
    check_intervals(cache)
    assert bool((stacked(cache, "min") <= stacked(runs[0][1], "min") * (1 + 1e-5) + 1e-7).all())
    assert all(layer.sub_U is not None and not layer.sub_pending and layer.sub_a.shape[2] == layer.nq for layer in cache.layers)


def test_tighter_where_queries_share_directions(model):
    """With a basis that carries the decode queries (the prefill's own rows repeat them), the subspace
    certificate is well below the band witness's on most reads."""
    ids = torch.tensor([[5, 6, 7, 8] * 20])  # a periodic prompt: few query directions
    mins = {}
    for m in (0, 16):
        cache = CertifiedCache(model.config, "fp8_e4m3", sinks=0, window=0, shadow=True, subspace=m)
        gen(model, ids, cache, n=4)
        mins[m] = stacked(cache, "min")
    assert float((mins[16] < 0.8 * mins[0]).double().mean()) > 0.5


@pytest.mark.parametrize("gate", ["certified:0.05", "ladder:0.05"])
def test_gates_with_the_witness_stay_sound(model, gate):
    """A promoted or repaired KV head serves other keys than its witness is about: its intervals become
    vacuous (the rung's band witness decides), and every read served is still covered (shadow truth)."""
    cache = CertifiedCache(model.config, "int4", gate=gate, sinks=0, window=0, shadow=True, subspace=8)
    gen(model, tiny_ids(1, 70), cache, n=6)
    assert sum(r["fresh_repairs"] for r in cache.records) > 0
    true, bound = stacked(cache, "true_tv"), stacked(cache, "min")
    assert bool((true <= bound).all()) and float(bound.max()) <= 0.05


def test_eviction_keeps_each_tokens_witness(model):
    """keep_tokens gathers the coefficients, scales, tau and sigma with the tokens (a stale row would put
    some token's interval off its shift: the read raises or the truth leaves the bound)."""
    cache = CertifiedCache(model.config, "int8", sinks=0, window=0, shadow=True, subspace=8)
    ids = tiny_ids(1, 70)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(cache.layers):
        idx = torch.sort(torch.randperm(70, generator=g)[:40]).values.expand(1, layer.Hkv, 40)
        cache.keep_tokens(i, idx)
        assert layer.sub_a.shape[2] == layer.sub_tau.shape[2] == layer.nq == 40
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    with torch.no_grad():
        for _ in range(4):
            tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    true, bound = stacked(cache, "true_tv"), stacked(cache, "min")
    assert float(true.max()) > 0 and bool((true <= bound).all())
    check_intervals(cache)


def test_a_stale_witness_is_refused_not_served(model):
    """Coefficients of another token (a corrupt store) give an interval disjoint from the band witness's on
    some token: the read raises instead of certifying."""
    cache = CertifiedCache(model.config, "int4", sinks=0, window=0, subspace=8)
    gen(model, tiny_ids(1, 70), cache, n=2)
    layer = cache.layers[1]
    layer.sub_a.fill_(127)  # every token's coefficients replaced by huge ones
    layer.sub_scale.fill_(60000.0)
    with pytest.raises(RuntimeError, match="disjoint"), torch.no_grad():
        model(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)


def test_bytes_are_counted(model):
    """device_bytes grows by exactly the witness's arrays: m int8 codes + fp16 scale + tau code + NB sigma codes
    per quantized token and KV head, plus the basis."""
    sizes = {}
    for m in (0, 8):
        cache = CertifiedCache(model.config, "int8", sinks=0, window=0, subspace=m, backend="torch")  # same flushes
        gen(model, tiny_ids(1, 70), cache, n=2)
        sizes[m] = sum(layer.device_bytes() for layer in cache.layers)
    layer = cache.layers[0]
    per = layer.B * layer.Hkv * layer.nq * (8 + 2 + 1 + cache.bands.shape[0]) + layer.sub_U.nbytes
    assert sizes[8] - sizes[0] == per * len(cache.layers)


@pytest.mark.parametrize("bad", [-1, 65, True, 2.0, "8"])
def test_bad_m_is_refused(model, bad):
    with pytest.raises(ValueError, match="subspace"):
        CertifiedCache(model.config, "int8", subspace=bad)


def test_fused_path_steps_aside(model):
    """The fused C++ read does not carry the witness: a cache with subspace=m reads through the twin."""
    cache = CertifiedCache(model.config, "int8", subspace=4)
    gen(model, tiny_ids(1, 70), cache, n=2)
    assert cache.fused_reads == 0 and not any(layer.fused_ok() for layer in cache.layers)


def test_a_static_basis_serves_every_request(model):
    """fast.calibrate_basis: one basis [L, Hkv, m, D] from calibration prompts, used by every request (no
    per-request SVD, no pending tokens); sound on another prompt, a 1-token prompt included."""
    import fast
    basis = fast.calibrate_basis(model, [tiny_ids(1, 50, seed=7), tiny_ids(1, 30, seed=8)], m=8)
    assert basis.shape == (2, 2, 8, 32) and basis.dtype == torch.float32
    for ids in (tiny_ids(1, 70), tiny_ids(1, 1)):
        cache = CertifiedCache(model.config, "int4", sinks=0, window=0, shadow=True, subspace=8, basis=basis)
        gen(model, ids, cache, n=40 if ids.shape[1] == 1 else 6)
        assert all(torch.equal(layer.sub_U[0], basis[i]) for i, layer in enumerate(cache.layers))
        assert bool((stacked(cache, "true_tv") <= stacked(cache, "min")).all())
        check_intervals(cache)


@pytest.mark.parametrize("bad", ["shape", "dtype", "nan", "no_m"])
def test_a_bad_basis_is_refused(model, bad):
    basis = torch.randn(2, 2, 8, 32)
    kw = {"subspace": 8}
    if bad == "shape":
        basis = basis[:, :, :4]
    elif bad == "dtype":
        basis = basis.double()
    elif bad == "nan":
        basis[0, 0, 0, 0] = float("nan")
    else:
        kw = {}
    with pytest.raises(ValueError, match="basis"):
        CertifiedCache(model.config, "int8", basis=basis, **kw)


def test_cli_subspace(tmp_path, capsys):
    """kvcert run --subspace M on a local model folder: the same answer, every bound <= the band witness's run."""
    import json
    from fast.tools.cli import main
    from tests.tiny_model import save_tiny_model
    folder = save_tiny_model(tmp_path / "m")
    prompt = tmp_path / "p.txt"
    prompt.write_text("The grass is green. The sky is blue. " * 4 + "What colour is the sky?")
    docs = {}
    for m in ("0", "8"):
        out = tmp_path / f"run{m}"
        assert main(["run", "--model", str(folder), "--scheme", "int4", "--subspace", m, "--prompt-file", str(prompt),
                     "--sinks", "0", "--window", "0", "--max-new-tokens", "4", "--out", str(out)]) == 0
        docs[m] = json.loads((out / "trace.json").read_text())
    assert docs["0"]["new_tokens"] == docs["8"]["new_tokens"]
    assert docs["8"]["summary"]["worst_bound"] <= docs["0"]["summary"]["worst_bound"] + 1e-6
    assert main(["run", "--model", str(folder), "--subspace", "-1", "--prompt-file", str(prompt), "--out", str(tmp_path / "x")]) == 2
    assert "subspace" in capsys.readouterr().err


@pytest.mark.parametrize("box", [False, True])
def test_a_second_turn_is_certified_with_the_witness(model, box):
    """Multi-row reads over the cache (a second generate on the same cache: its prompt rows read the quantized
    keys) take the subspace intervals too (and the box form over each row's visible tokens): every row's true
    TV <= every form, and no row above the band witness's own certificate of the same read."""
    recs = {}
    for m in (0, 8):
        cache = CertifiedCache(model.config, "int4", sinks=0, window=0, shadow=True, subspace=m, box_form=box)
        gen(model, tiny_ids(1, 70), cache, n=3)
        with torch.no_grad():
            model(input_ids=tiny_ids(1, 12, seed=9), past_key_values=cache, use_cache=True)  # a 12-row second turn
        recs[m] = cache.row_records
    rows = recs[8]
    assert len(rows) == 2 and rows[0]["true_tv"].shape == (1, 12, 4)
    for r, r0 in zip(rows, recs[0]):
        for form in FORMS + (("box",) if box else ()):
            assert bool((r["true_tv"] <= r[form]).all()), form
        assert bool((r["min"] <= r0["min"] * (1 + 1e-5) + 1e-7).all())
    assert float(torch.stack([r["min"] for r in rows]).mean()) < float(torch.stack([r["min"] for r in recs[0]]).mean())
