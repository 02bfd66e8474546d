"""kvcert inside vLLM (CPU, eager): a tiny random Llama served by a real vLLM engine with the
plugin on. Engines are started once per module (about 30 s each on 2 cores).

Property tests of the cast model (vs torch's float8 dtypes), then engine tests: stored keys and
values match the cast model bit for bit; vLLM's output matches the certified torch read; bound >=
true TV on every (row, head) of a multi-request run with chunked prefill and forced preemption, the
truth from the plugin's exact side store and, independently, from HF transformers' own queries and
keys of the same sequences;
the gate repairs; bad configuration fails before start-up with one line."""

import json

from collections import defaultdict

import numpy as np
import pytest
import torch

from fast.integrations import vllm_fp8

# vLLM is installed by `make install`; a missing vLLM is an import error here, never a skip.
from fast.integrations.vllm import collect, external_id, generate, make_llm, summaries

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# ---------------------------------------------------------------- cast model (property tests)

@pytest.mark.parametrize("codec", vllm_fp8.CODECS)
def test_cast_model_truncates_onto_the_fp8_grid(codec):
    """property: roundtrip(x) is the fp8 value next to x toward zero (|x| clamped at the max):
    a grid value, |rt| <= |x|, and no grid value lies strictly between |rt| and |x|."""
    g = torch.Generator().manual_seed(0)
    fmax = vllm_fp8.FMAX[codec]
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-4, 1e-2, 1.0, 30.0)]
                  + [torch.tensor([0.0, -0.0, fmax, -fmax, 2 * fmax, -3 * fmax, 2.0 ** -9, 2.0 ** -16, 1e-30])])
    rt = vllm_fp8.roundtrip(x, codec)
    grid = rt.to(FP8[codec]).to(torch.float32)
    assert torch.equal(grid, rt), "roundtrip left the fp8 grid"
    xc = x.clamp(-fmax, fmax)
    assert bool((rt.abs() <= xc.abs()).all()) and bool(((rt * xc) >= 0).all())
    # the next grid value away from zero must exceed |x|: step up by one code
    code = vllm_fp8.encode(x, codec)
    up = vllm_fp8.decode(torch.where(rt.abs() < fmax, code + 1, code).to(torch.uint8) & 0x7F, codec)
    assert bool((up.abs() > xc.abs()).where(rt.abs() < fmax, torch.tensor(True)).all())


@pytest.mark.parametrize("codec", vllm_fp8.CODECS)
def test_cast_model_keeps_every_fp8_value(codec):
    """property: every finite fp8 value (all 256 codes but NaN/Inf) survives the cast exactly."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8[codec]).to(torch.float32)
    vals = vals[torch.isfinite(vals)]
    assert torch.equal(vllm_fp8.roundtrip(vals, codec), vals)


@pytest.mark.parametrize("codec", vllm_fp8.CODECS)
def test_plugin_cast_is_the_cast_model(codec):
    """differential: the cast the plugin applies (fast.core.quant's rtz codec) equals the
    independent model of vLLM's kernel (vllm_fp8) bit for bit, clamping and subnormals included."""
    from fast.integrations.vllm import _cast
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(3, 2, 4096, generator=g) * s for s in (1e-5, 1e-2, 1.0, 100.0, 1e5)], -1)
    assert torch.equal(_cast(x, codec).view(torch.int32), vllm_fp8.roundtrip(x, codec).view(torch.int32))


# ---------------------------------------------------------------- engines

def _tiny_model(path, head_dim=64):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=1024,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger q/k weights than the default init: peaked attention, visible errors
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    m.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_model(tmp_path_factory.mktemp("tiny_llama"))


PROMPTS = [list(range(3, 3 + n)) for n in (37, 150, 5, 90)]


def _engine(model, **kw):
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)  # else vLLM reserves 92% of the machine's memory
    return make_llm(model, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=256,
                    enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=4, **kw)


def _generate(llm, n=24):
    from vllm import SamplingParams
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=n, temperature=0.0,
                                                                                  ignore_eos=True))


@pytest.fixture(scope="module")
def shadow_run(tiny):
    """fp8_e4m3, shadow, chunked prefill (64-token budget), 9 blocks of 32 tokens (8 usable) for 4 requests
    of up to 174 tokens: vLLM must preempt and recompute."""
    llm = _engine(tiny, codec="fp8_e4m3", shadow=True, num_gpu_blocks_override=9)
    outs = _generate(llm)
    store = llm.collective_rpc("kvcert_check_store")
    parts = collect(llm)
    yield outs, parts, store
    del llm


def _cat(recs, key):
    return np.concatenate([np.asarray(r[key], dtype=np.float64).ravel() for r in recs])


def test_vllm_bound_holds_on_every_row(shadow_run):
    """property (vs an independent truth): on every (request, row, layer, head) of a real
    multi-request run with chunked prefill and preemption, bound >= TV between attention on the
    exact keys (exact side store) and on the keys vLLM stored."""
    outs, parts, _ = shadow_run
    recs = [r for p in parts for r in p["records"]]
    tv, bound = _cat(recs, "true_tv"), _cat(recs, "bound")
    assert tv.size > 2000
    bad = np.nonzero(tv > bound)[0]
    assert bad.size == 0, f"{bad.size} violations, first tv={tv[bad[0]]} bound={bound[bad[0]]}"
    assert float(tv.max()) > 1e-4  # the run exercises real quantization error
    summ = summaries(parts)
    assert set(summ) == {o.request_id for o in outs}
    assert all(s["violations"] == 0 and s["max_bound"] > 0 for s in summ.values())


def _hf_queries_keys(model_dir, ids):
    """Post-RoPE queries [L][H, n, D] and keys [L][Hkv, n, D] of one sequence from HF transformers
    (eager fp32), captured by an attention function that then runs sdpa: code this project does not
    own computes them."""
    from transformers import AttentionInterface, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    seen = {}

    def capture(module, query, key, value, attention_mask, **kw):
        seen[module.layer_idx] = (query[0].detach().clone(), key[0].detach().clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    AttentionInterface.register("kvcert_test_capture", capture)
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="kvcert_test_capture", dtype=torch.float32)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    return [seen[l] for l in range(len(seen))]


def _int8_model(k):
    """An independent model of the packed page's int8 codec (written here from its definition, not the library's
    code): per (KV head, token) the smallest fp16 scale >= max |k| / 127, codes round-half-even(k / scale)."""
    s = k.abs().amax(-1, keepdim=True).double() / 127
    s16 = s.half()
    s16 = torch.where(s16.double() < s, torch.nextafter(s16, torch.tensor(float("inf"), dtype=torch.float16)), s16)
    return torch.round(k / s16.float()).clamp(-127, 127) * s16.float()


def _fp8_model(k):
    """An independent model of the fp8_per_token_head page (from its definition, not the library's code): per (KV
    head, token) the smallest fp32 scale >= max |k| / 448, codes = e4m3 round to nearest of k / scale (torch's cast),
    decoded as code x scale in fp32."""
    s = k.abs().amax(-1, keepdim=True).double() / 448
    s32 = s.float()
    s32 = torch.where(s32.double() < s, torch.nextafter(s32, torch.tensor(float("inf"))), s32)
    return (k / s32).to(torch.float8_e4m3fn).float() * s32


def _worst_against_transformers(tiny, outs, recs, cast):
    """(checks, max over rows of true TV - bound, max true TV): HF transformers runs each request's whole sequence
    (prompt + generated tokens) through the tiny model and gives the exact post-RoPE queries and keys; the keys
    vLLM attends over are cast(exact keys) [Hkv, n, D] (an independent model of the codec)."""
    checks, worst, top = 0, -1.0, 0.0
    for o in outs:
        seq = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:-1]
        qk = _hf_queries_keys(tiny, seq)
        for r in recs:
            if not r["request"].startswith(o.request_id + "-"):
                continue
            q, k = qk[r["layer"]]
            H, Hkv, D = q.shape[0], k.shape[0], q.shape[-1]
            kc = cast(k)
            bound = np.asarray(r["bound"])
            for i, p in enumerate(np.asarray(r["pos"]).tolist()):
                qq = q[:, p].double()                                        # [H, D]
                ke = k[:, : p + 1].double().repeat_interleave(H // Hkv, 0)  # [H, p + 1, D]
                kq = kc[:, : p + 1].double().repeat_interleave(H // Hkv, 0)
                pe = torch.softmax(torch.einsum("hd,hnd->hn", qq, ke) * D ** -0.5, -1)
                pq = torch.softmax(torch.einsum("hd,hnd->hn", qq, kq) * D ** -0.5, -1)
                tv = 0.5 * (pe - pq).abs().sum(-1).numpy()
                worst = max(worst, float((tv - bound[i]).max()))
                top = max(top, float(tv.max()))
                checks += H
    return checks, worst, top


def test_vllm_bound_holds_against_transformers_truth(shadow_run, tiny):
    """property vs a truth the plugin never touched: HF transformers gives the exact post-RoPE queries and
    keys (_worst_against_transformers); the keys vLLM attends over are vllm_fp8.roundtrip of them (the independent
    model of vLLM's cast, equal bit for bit to what vLLM stores: test below). On every certified row
    (request, position, layer, head): bound >= TV(attention over exact keys, over cast keys) - 1e-5
    (the two engines' fp32 arithmetic differs by ~1e-6: a cast may flip one grid step, so the
    tolerance is stated, not zero)."""
    outs, parts, _ = shadow_run
    recs = [r for p in parts for r in p["records"]]
    checks, worst, top = _worst_against_transformers(tiny, outs, recs, lambda k: vllm_fp8.roundtrip(k, "fp8_e4m3"))
    assert checks > 2000 and top > 1e-4  # real quantization error on real rows
    assert worst <= 1e-5, f"true TV above the bound by {worst} (of {checks} checks, max TV {top})"


def test_vllm_prefill_decode_and_chunks_all_certified(shadow_run):
    """property: every computed position of every request is certified in every layer: prefill
    chunks (rows > 1 per read), decode rows (1), no gap after the prefix-cache hit (the prompts
    share their first block)."""
    outs, parts, _ = shadow_run
    recs = [r for p in parts for r in p["records"]]
    assert max(len(np.asarray(r["pos"])) for r in recs) > 1 and min(len(np.asarray(r["pos"])) for r in recs) == 1
    for o in outs:
        n = len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1  # the last token is never read
        for layer in (0, 1):
            seen = set()
            for r in recs:
                if r["layer"] == layer and r["request"].startswith(o.request_id + "-"):
                    seen.update(np.asarray(r["pos"]).tolist())
            # rows served from the prefix cache are not recomputed (no read): their keys, with the
            # witness written by the request that computed them, are certified at every later read
            c = o.num_cached_tokens or 0
            assert set(range(c, n)) <= seen <= set(range(n)), (o.request_id, layer, c, sorted(set(range(c, n)) - seen)[:5])


def test_vllm_preempted_request_keeps_correct_witnesses(shadow_run):
    """property: preemption happened (some positions were certified twice, after recompute) and
    the bound still holds on the recomputed rows (checked with the rest above); the stored
    cache still matches the cast model slot by slot after blocks were freed and reused."""
    _, parts, store = shadow_run
    recs = [r for p in parts for r in p["records"]]
    counts = {}
    for r in recs:
        for p in np.asarray(r["pos"]).tolist():
            k = (r["request"], r["layer"], p)
            counts[k] = counts.get(k, 0) + 1
    assert max(counts.values()) > 1, "no preemption: shrink num_gpu_blocks_override"
    checked, bad = map(sum, zip(*store))
    assert checked > 0 and bad == 0


def test_vllm_stored_keys_match_the_cast_model_bit_for_bit(shadow_run):
    """differential: every written slot of every layer, read back from vLLM's paged cache, equals
    vllm_fp8.roundtrip(exact key / value) (the independent model of vLLM's kernel cast) bit for bit."""
    _, _, store = shadow_run
    checked, bad = map(sum, zip(*store))
    assert checked >= 8 * 32 * 2 * 2 // 2 and bad == 0, (checked, bad)


def test_vllm_output_matches_torch_reference(shadow_run):
    """differential: vLLM's CPU kernel output vs fast.core.attention.attention_rows on the keys and
    values read from the same cache, every row. Tolerance 1e-4: both fp32, different summation
    orders and exp implementations (measured max ~1e-6)."""
    _, parts, _ = shadow_run
    diffs = [r["out_diff"] for p in parts for r in p["records"]]
    assert max(diffs) < 1e-4


def test_vllm_gate_repairs_from_the_exact_store(tiny):
    """property: certified:TAU repairs the heads whose bound exceeds TAU and serves them exactly
    from then on (served bound 0, true TV 0 there); the side store's bytes are counted."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    llm = _engine(tiny, codec="fp8_e5m2", shadow=True, gate="certified:0.05")
    _generate(llm, n=8)
    parts = collect(llm)
    # per request (SamplingParams.extra_args kvcert_tau), two requests in one batch: each its own threshold
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, extra_args=x)
              for x in ({"kvcert_tau": 1.0}, {"kvcert_tau": 0.0}, None)]
    loose, strict, plain = (o.kvcert for o in generate(llm, [{"prompt_token_ids": p} for p in PROMPTS[:3]], params))
    assert loose["tau"] == 1.0 and loose["repairs"] == 0 and loose["max_bound"] == loose["max_pre_gate"] > 0
    assert strict["tau"] == 0.0 and strict["repairs"] == 2 * 2 and strict["max_bound"] == 0.0  # 2 layers x 2 KV heads
    assert plain["tau"] == 0.05 and all(s["violations"] == 0 for s in (loose, strict, plain))
    for bad in (2.0, "x", True, float("nan")):
        with pytest.raises(VLLMValidationError, match="kvcert_tau"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2, extra_args={"kvcert_tau": bad}))
    del llm
    summ = summaries(parts)
    assert sum(s["repairs"] for s in summ.values()) > 0
    assert all(p["side_bytes"] > 0 for p in parts)
    recs = [r for p in parts for r in p["records"]]
    tv, served = _cat(recs, "true_tv"), _cat(recs, "served")
    assert not (tv > served).any()
    for r in recs:  # once repaired, a head's later reads are served with bound 0
        rep = np.repeat(np.asarray(r["repaired"]), 2)
        assert (np.asarray(r["served"])[:, rep] == 0).all()


def test_request_tau_is_checked():
    """request_tau: None without the argument, the number in [0, 1] (JSON strings of numbers too), else
    one line naming kvcert_tau; refused on a server without a gate."""
    from fast.integrations.vllm import Config, request_tau
    gated = Config({"KVCERT_VLLM": "1", "KVCERT_GATE": "certified:0.2"})
    assert request_tau(None, gated) is None and request_tau({"other": 1}, gated) is None
    assert request_tau({"kvcert_tau": 0}, gated) == 0.0 and request_tau({"kvcert_tau": "0.5"}, gated) == 0.5
    for bad in (True, -1e-9, 1.0000001, float("inf"), "nan", "abc", [0.1], None):
        with pytest.raises(ValueError, match="kvcert_tau"):
            request_tau({"kvcert_tau": bad}, gated)
    with pytest.raises(ValueError, match="KVCERT_GATE=certified"):
        request_tau({"kvcert_tau": 0.1}, Config({"KVCERT_VLLM": "1"}))


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
def test_vllm_fault_is_flagged_and_repaired(tiny, codec):
    """property (issue 21's silent failure): keys stored times 0.1 after the cast (a wrong scale,
    KVCERT_FAULT; int8: the wrong scale written into vLLM's packed page, the write path of every packed codec) are flagged by the certificate
    (bound before the gate near 1, never below the true TV from the exact keys) and the gate serves the
    flagged heads exactly; mutation: the witness taken before the fault would certify the faulty keys as
    fine and fail the first assertion."""
    llm = _engine(tiny, codec=codec, shadow=True, gate="certified:0.2", fault="key_scale:0.1")
    _generate(llm, n=8)
    parts = collect(llm)
    del llm
    recs = [r for p in parts for r in p["records"]]
    assert float(np.median(_cat(recs, "bound"))) > 0.5
    assert not (_cat(recs, "true_tv") > _cat(recs, "served")).any()
    assert sum(s["repairs"] for s in summaries(parts).values()) > 0


def test_plugin_int8_cast_is_one_scale_per_token_head():
    """property of the int8 codec (KVCERT_CODEC=int8): per (token, KV head) the stored values are integer
    multiples of one scale within half a step of the exact ones (step <= max|x| / 127, its fp16 rounding
    allowed); a (token, head) holding NaN/Inf stays non-finite (the certified read refuses it) and leaves
    the other rows as they were."""
    from fast.integrations.vllm import _cast
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 3, 64, generator=g) * torch.logspace(-3, 3, 40)[:, None, None]
    y = _cast(x, "int8")
    step = x.abs().amax(-1, keepdim=True) / 127 * (1 + 2 ** -10)
    assert ((y - x).abs() <= step / 2 + 1e-12).all() and not torch.equal(y, x)
    ratio = y / y.abs().amax(-1, keepdim=True) * 127  # codes, when the largest code is 127
    assert (ratio - ratio.round()).abs().max() < 1e-3
    x2 = x.clone()
    x2[5, 1, 7] = float("nan")
    y2 = _cast(x2, "int8")
    assert not torch.isfinite(y2[5, 1]).all()
    keep = torch.ones(40, 3, dtype=torch.bool)
    keep[5, 1] = False
    assert torch.equal(y2[keep], y[keep])


def _layer0_bounds(outs, parts, n_prompt):
    """{(prompt index, position): bound row [H]} of layer 0's prompt rows (keys there depend on the prompt only)."""
    rows = {}
    for i, o in enumerate(outs):
        for r in (r for p in parts for r in p["records"] if r["layer"] == 0 and r["request"].startswith(o.request_id + "-")):
            for j, pos in enumerate(np.asarray(r["pos"]).tolist()):
                if pos < n_prompt[i]:
                    rows[(i, pos)] = np.asarray(r["bound"])[j]
    return rows


def test_vllm_int8_box_form_is_sound_and_tighter(tiny):
    """property vs the exact side store: KVCERT_CODEC=int8 with and without the box form (KVCERT_BOX),
    chunked prefill and preemption: 0 violations on every row of both engines, and on layer 0's prompt rows
    (the same keys in both) the box form's bound is never above the closed forms' and lower on the whole.
    The box engines read through the fused kernel, the box over each row's histogram of c (spec T9c). A box
    engine without shadow mode (gate certified, each request's tau 1: nothing repaired) serves exactly the shadow box engine's tokens (a read that left vLLM's output buffer
    unwritten would fail here)."""
    from vllm import SamplingParams
    runs = {}
    for box in (False, True):
        llm = _engine(tiny, codec="int8", shadow=True, box=box, num_gpu_blocks_override=9)
        outs = _generate(llm, n=8)
        parts = collect(llm)
        if not box:  # the packed page decodes to fast.core.quant's int8 of every exact key and value written
            ((checked, bad),) = llm.collective_rpc("kvcert_check_store")
            assert checked > 500 and bad == 0, (checked, bad)
            # and vs a truth the plugin never touched: HF's exact keys, the page modelled independently (_int8_model)
            n, worst, top = _worst_against_transformers(tiny, outs, [r for p in parts for r in p["records"]], _int8_model)
            assert n > 1500 and top > 1e-5 and worst <= 1e-5, (n, worst, top)
        del llm
        recs = [r for p in parts for r in p["records"]]
        tv, bound = _cat(recs, "true_tv"), _cat(recs, "bound")
        assert tv.size > 1500 and float(tv.max()) > 1e-5 and not (tv > bound).any(), box
        runs[box] = (outs, parts)
    n_prompt = [len(p) for p in PROMPTS]
    band, box = (_layer0_bounds(*runs[b], n_prompt) for b in (False, True))
    assert band.keys() == box.keys() and len(box) > 150  # prompt rows served from the prefix cache are not read
    b0, b1 = np.stack([band[k] for k in sorted(band)]), np.stack([box[k] for k in sorted(box)])
    assert (b1 <= b0 + 1e-7).all() and b1.mean() < 0.9 * b0.mean(), (b1.mean(), b0.mean())
    llm = _engine(tiny, codec="int8", box=True, gate="certified:0.2", num_gpu_blocks_override=9)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, extra_args={"kvcert_tau": 1.0})
    served = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], params)
    del llm
    assert [list(o.outputs[0].token_ids) for o in served] == [list(o.outputs[0].token_ids) for o in runs[True][0]]
    assert all(o.kvcert["repairs"] == 0 and o.kvcert["reads"] > 0 for o in served)


def test_vllm_int8_owns_the_cache_bytes(tiny):
    """KVCERT_CODEC=int8 packs codes, scales and witness into vLLM's own paged cache: vLLM's block count at a
    fixed KV budget is the budget over the packed page (2 layers x 2 KV heads x 32 slots x packed_row_bytes),
    3.66x the blocks of K and V at fp32 (3.88x without certificates: no witness bytes), every byte of vLLM's
    cache is the packed page and kvcert holds nothing beside it (no gate, no shadow); KVCERT_CERTIFY=0 reads
    the same codes with the same kernel: the same tokens as the certified engine, and no certificate."""
    from vllm import SamplingParams
    from fast.integrations.vllm import packed_row_bytes
    budget, outs = 8 << 20, {}
    assert packed_row_bytes(64, 8) == 140 and packed_row_bytes(64, 8, certify=False) == 132
    for certify in (True, False):
        llm = _engine(tiny, codec="int8", certify=certify, kv_cache_memory_bytes=budget)
        cc = llm.llm_engine.vllm_config.cache_config
        page = 2 * 2 * 32 * packed_row_bytes(64, 8, certify)
        assert cc.num_gpu_blocks == budget // page and cc.num_gpu_blocks > 3.6 * budget // (2 * 2 * 32 * 2 * 64 * 4)
        outs[certify] = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS],
                                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        (mem,) = llm.collective_rpc("kvcert_memory")
        assert mem["vllm_cache_bytes"] == cc.num_gpu_blocks * page and mem["kvcert_bytes"] == 0, mem
        del llm
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]
    assert all(o.kvcert["reads"] > 0 for o in outs[True]) and all(o.kvcert is None for o in outs[False])


def _int4_model(k):
    """An independent model of the int4_per_token_head page (from its definition, not the library's code): per (KV
    head, token) the smallest fp16 scale >= max |k| / 7, codes round-half-even(k / scale) in [-7, 7]."""
    s = k.abs().amax(-1, keepdim=True).double() / 7
    s16 = s.half()
    s16 = torch.where(s16.double() < s, torch.nextafter(s16, torch.tensor(float("inf"), dtype=torch.float16)), s16)
    return torch.round(k / s16.float()).clamp(-7, 7) * s16.float()


@pytest.mark.parametrize("codec, page_bytes, model", [("fp8_per_token_head", 144, _fp8_model),
                                                      ("int4_per_token_head", 76, _int4_model)])
def test_vllm_packed_page_owns_the_cache_bytes_and_is_sound(tiny, codec, page_bytes, model):
    """KVCERT_CODEC=fp8_per_token_head (e4m3 round to nearest, one fp32 scale per token and KV head, as vLLM's GPU
    backends keep it) and int4_per_token_head (two codes a byte, one fp16 scale per token and KV head) pack codes,
    scales and witness into vLLM's page: 144 / 76 bytes per (slot, KV head), every byte of vLLM's cache is that page;
    the page decodes to fast.core.quant's codec of every exact key and value written (kvcert_check_store); under
    chunked prefill and preemption every row's bound is >= the true TV from the exact side store, and >= the TV
    against HF transformers' exact keys with the codec modelled independently (_fp8_model, _int4_model)."""
    from fast.integrations.vllm import packed_row_bytes
    assert packed_row_bytes(64, 8, True, codec) == page_bytes
    page = 2 * 2 * 32 * page_bytes
    llm = _engine(tiny, codec=codec, shadow=True, num_gpu_blocks_override=9)
    outs = _generate(llm, n=8)
    parts = collect(llm)
    ((checked, bad),) = llm.collective_rpc("kvcert_check_store")
    (mem,) = llm.collective_rpc("kvcert_memory")
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    del llm
    assert mem["vllm_cache_bytes"] == blocks * page, (mem, blocks)
    assert checked > 500 and bad == 0, (checked, bad)
    recs = [r for p in parts for r in p["records"]]
    tv, bound = _cat(recs, "true_tv"), _cat(recs, "bound")
    assert tv.size > 1500 and float(tv.max()) > 1e-5 and not (tv > bound).any()
    n, worst, top = _worst_against_transformers(tiny, outs, recs, model)
    assert n > 1500 and top > 1e-5 and worst <= 1e-5, (n, worst, top)


@pytest.mark.parametrize("kw, msg", [
    ({"dtype": "bfloat16"}, "model dtype"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
    ({"attention_backend": "TORCH_SDPA"}, "attention_backend"),
    ({"codec": "int3"}, "codec='int3': expected one of fp8_e4m3, fp8_e5m2, int8, int4_per_token_head, fp8_per_token_head, none"),
    ({"box": True, "certify": False}, "the box form need certificates"),
    ({"gate": "certified:2"}, "TAU must be in [0, 1]"),
    ({"gate": "certfied:0.2"}, "gate='certfied:0.2': unknown gate"),
    ({"fault": "key_scale:-1"}, "fault='key_scale:-1': expected none or key_scale:F"),
    ({"records": -1}, "records='-1': expected an integer >= 0"),
    ({"box": True, "box_above": 1.5}, "box_above='1.5': expected a number in [0, 1)"),
    ({"box": True, "box_above": "nan"}, "box_above='nan': expected a number in [0, 1)"),
    ({"box_above": 0.2}, "box_above='0.2' without box=1"),
])
def test_vllm_bad_configuration_fails_at_startup(tiny, kw, msg):
    with pytest.raises(ValueError) as e:
        make_llm(tiny, **kw)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_vllm_bad_head_size_fails_at_startup(tmp_path):
    path = tmp_path / "cfg"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 80, "num_attention_heads": 2, "head_dim": 40}))
    with pytest.raises(ValueError, match="head size 40 is not a multiple of 2 \\* KVCERT_BANDS = 16"):
        make_llm(str(path))


def test_vllm_tensor_parallel_ranks_certify_their_own_heads(tiny, monkeypatch):
    """property: with tensor_parallel_size=2 (2 CPU worker processes, 1 KV head each) every rank
    certifies its own KV head (distinct head offsets), and bound >= true TV on both ranks."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (one NUMA node here)
    llm = _engine(tiny, codec="fp8_e4m3", shadow=True, tensor_parallel_size=2, distributed_executor_backend="mp")
    _generate(llm, n=4)
    parts = collect(llm)
    del llm
    assert sorted(tuple(p["rank"]) for p in parts) == [(0, 0), (1, 0)]
    offsets = {p["rank"][0]: {r["head_offset"] for r in p["records"]} for p in parts}
    assert offsets == {0: {0}, 1: {2}}
    for p in parts:
        tv, bound = _cat(p["records"], "true_tv"), _cat(p["records"], "bound")
        assert tv.size > 500 and not (tv > bound).any()


def test_vllm_deferred_certificates_hold_against_the_shadow_truth(tiny, shadow_run):
    """No gate, no shadow: the certificates are computed once per step for all layers and requests (one epilogue,
    N = the batch's largest). The same prompts and cache size as shadow_run (preemption included; its prefill
    chunks may fall differently): every (request, layer, position, head) bound of the deferred run is >= the true
    TV the shadow run measured at that read from its exact side store (keys captured before the cast, never read
    by the deferred run; a recomputed position has one truth per computation: the largest is used)."""
    _, shadow_parts, _ = shadow_run
    llm = _engine(tiny, codec="fp8_e4m3", num_gpu_blocks_override=9)
    _generate(llm)
    parts = collect(llm)
    del llm
    def rows(ps, key):  # (prompt index, layer, position) -> [computations, H]
        out = defaultdict(list)
        for p in ps:
            for r in p["records"]:
                req = r["request"].split("-")[0]  # vLLM's ids are "<index>-<random suffix>"
                for pos, row in zip(r["pos"], np.asarray(r[key], dtype=np.float64)):
                    out[(req, r["layer"], pos)].append(row)
        return out
    bound, truth = rows(parts, "bound"), rows(shadow_parts, "true_tv")
    assert bound.keys() == truth.keys()
    checked = 0
    for k, bs in bound.items():
        tv = np.max(truth[k], axis=0)
        for b in bs:
            assert (b >= tv).all(), (k, b, tv)
            checked += b.size
    assert checked > 500, checked


def test_vllm_served_output_is_the_engines_attention(tiny):
    """differential: the plugin serves its fused certified read (vLLM's kernel does not run); the model's
    log-probabilities of the prompts (prefill in 64-token chunks over the cache) and of the generated tokens
    match the same engine serving vLLM's own kernel over the same fp8 cache (KVCERT_CERTIFY=0), within fp32
    summation-order noise."""
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    runs = []
    for certify in (True, False):
        llm = _engine(tiny, codec="fp8_e4m3", certify=certify)
        runs.append((generate if certify else type(llm).generate)(llm, [{"prompt_token_ids": p} for p in PROMPTS], params))
        del llm
    # no gate, no shadow: the certificates are computed once per step for all layers (flush), and still every
    # row of every layer and head is certified: the 5-token prompt computes 5 prefill and 7 decode rows per layer
    for o in runs[0]:
        s = o.kvcert
        assert s["reads"] == s["rows"] * 4 and 0 < s["mean_bound"] <= s["max_bound"] <= 1, s
    assert runs[0][2].kvcert["rows"] == (len(PROMPTS[2]) + 7) * 2
    for ours, theirs in zip(*runs):
        lp = lambda xs: [next(iter(d.values())).logprob for d in xs if d]
        a, b = lp(ours.prompt_logprobs), lp(theirs.prompt_logprobs)
        assert len(a) == len(b) == len(ours.prompt_token_ids) - 1
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3
        t1, t2 = ours.outputs[0].token_ids, theirs.outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(t1, t2)) if x != y), len(t1))
        assert same >= 4, (t1, t2)
        g1, g2 = lp(ours.outputs[0].logprobs[:same]), lp(theirs.outputs[0].logprobs[:same])
        assert max(abs(x - y) for x, y in zip(g1, g2)) < 1e-3


def test_vllm_summary_comes_back_with_each_output(tiny):
    """generate(): each RequestOutput carries its own certificate summary (merged over ranks), and a
    second call reports only its own requests (the ranks' summaries are cleared)."""
    from vllm import SamplingParams
    llm = _engine(tiny, codec="fp8_e4m3", shadow=True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
    second = generate(llm, [{"prompt_token_ids": PROMPTS[2]}], params)
    del llm
    for o in first + second:
        s = o.kvcert
        assert s is not None, o.request_id
        layers, heads = 2, 4  # _tiny_model
        # every computed row of the request, in every layer and query head (no prefix-cache hit across calls
        # is needed for this lower bound: the request's own decode rows are always computed)
        assert s["reads"] >= 6 * layers * heads
        assert s["violations"] == 0 and 0 <= s["mean_bound"] <= s["max_bound"] <= 1
        assert s["reads"] == s["rows"] * heads  # rows summed over the layers, reads over the query heads too
    # the 5-token prompt (no full block: no prefix-cache hit) computes 5 prefill rows and 5 decode rows per layer
    assert second[0].kvcert["rows"] == (len(PROMPTS[2]) + 5) * layers


# ---------------------------------------------------------------- what a new user hit (issue 21)

def _refused(model, env, code):
    """Run `code` (a vllm.LLM start) in a fresh Python with env added -> (return code, stdout + stderr). The
    child imports this checkout's `fast` (PYTHONPATH), as vLLM's own processes do."""
    import os
    import subprocess
    import sys
    import fast
    root = os.path.dirname(os.path.dirname(os.path.abspath(fast.__file__)))
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVCERT_")}
    e.update(env, PYTHONPATH=root + os.pathsep + e.get("PYTHONPATH", ""), KVCERT_VLLM="1")
    r = subprocess.run([sys.executable, "-c", code.format(model=model)], env=e, capture_output=True, text=True,
                       timeout=300)
    return r.returncode, r.stdout + r.stderr


LLM_START = ("from vllm import LLM\n"
             "LLM(model={model!r}, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,"
             " kv_cache_memory_bytes=8 << 20{extra})\n")


def _one_line(out, *needles):
    lines = [line for line in out.splitlines() if "kvcert:" in line]
    assert "Traceback" not in out, out[-3000:]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), out[-3000:]
    assert "Initializing a V1 LLM engine" not in out, "an engine process started"  # refused in the main process


@pytest.mark.parametrize("env, needles", [
    ({"KVCERT_GATE": "certfied:0.2"}, ("KVCERT_GATE='certfied:0.2'", "unknown gate")),
    ({"KVCERT_CODEC": "fp8-e4m3"}, ("KVCERT_CODEC='fp8-e4m3'", "expected one of")),
    ({"KVCERT_GAET": "certified:0.2"}, ("unknown variable KVCERT_GAET",)),
    ({"KVCERT_SHADOW": "yes"}, ("KVCERT_SHADOW='yes'", "expected 0 or 1")),
])
def test_vllm_environment_typo_is_one_line_before_the_engine(tiny, env, needles):
    """A KVCERT_* typo with vLLM's own entry (vllm.LLM, as `vllm serve` does) stops the main process with
    one line naming the variable, exit status 1, no traceback, no engine process started."""
    rc, out = _refused(tiny, env, LLM_START.format(model="{model}", extra=", dtype='float32'"))
    assert rc == 1, (rc, out[-3000:])
    _one_line(out, *needles)


def test_vllm_default_bf16_is_one_line_before_the_engine(tiny):
    """vLLM's default dtype ('auto': bfloat16 on CPU, even for an fp32 checkpoint) is refused in the main
    process when the engine configuration is built: one line that says what to pass, no engine started."""
    rc, out = _refused(tiny, {"KVCERT_GATE": "certified:0.2"}, LLM_START.format(model="{model}", extra=""))
    assert rc == 1, (rc, out[-3000:])
    _one_line(out, "model dtype bfloat16 is not supported", "--dtype float32")


@pytest.fixture(scope="module")
def bounded(tiny):
    """One engine for the records / summaries / memory tests: the gate (exact store), small caps, a fixed KV
    budget of 256 MiB."""
    llm = _engine(tiny, codec="fp8_e4m3", gate="certified:0.2", records=40, max_summaries=3,
                  kv_cache_memory_bytes=BUDGET)
    yield llm
    del llm


BUDGET = 256 << 20


def test_vllm_collect_after_generate_returns_the_records(bounded):
    """generate() hands each request's summary back with its output and leaves the per-read records:
    collect() afterwards returns every record of those requests (it returned none before), and not their
    summaries again (handed back and dropped)."""
    from vllm import SamplingParams
    collect(bounded)  # start empty
    outs = generate(bounded, [{"prompt_token_ids": p} for p in PROMPTS[:2]],
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(o.kvcert and o.kvcert["reads"] > 0 for o in outs)
    parts = collect(bounded)
    recs = [r for p in parts for r in p["records"]]
    assert sorted({external_id(r["request"]) for r in recs}) == sorted(o.request_id for o in outs)
    assert all(p["records_dropped"] == 0 for p in parts)
    # every computed row in both layers: the prompt (less its prefix-cache hit) and 3 decode rows per request
    rows = sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) + 3 for o in outs)
    assert sum(len(np.asarray(r["pos"])) for r in recs) == 2 * rows
    assert all(external_id(k) not in {o.request_id for o in outs} for p in parts for k in p["summary"])


def test_vllm_collect_without_records_says_so(tiny):
    """An engine that keeps no records (records=0, the serving default) answers collect() with one line that
    points to generate() / collect(records=False), not with an empty list."""
    llm = _engine(tiny, codec="fp8_e4m3", records=0, kv_cache_memory_bytes=8 << 20)
    from vllm import SamplingParams
    outs = generate(llm, [{"prompt_token_ids": PROMPTS[2]}], SamplingParams(max_tokens=3, temperature=0.0,
                                                                            ignore_eos=True))
    with pytest.raises(ValueError, match="keeps no per-read records") as e:
        collect(llm)
    assert "\n" not in str(e.value)
    parts = collect(llm, records=False)
    del llm
    assert outs[0].kvcert["reads"] > 0 and all(p["records"] == [] and p["records_dropped"] > 0 for p in parts)


@pytest.mark.parametrize("fault", ["none", "key_scale:10"])
def test_vllm_lean_summaries_are_the_per_request_ones(tiny, fault):
    """Without gate, shadow or records the decode rows of a step are summarised per batch (_finish_batch), not
    one entry per request: the same engine keeping records (one entry per request, _finish_one) gives every
    request the same counts and bounds (four requests decode together; compared within 1e-3: two runs of one
    engine gave sum_bound 4e-5 apart, as vLLM's prefill chunks depend on when its engine process receives the
    requests). And a request's reads are its own: the 5-token request (one prefill chunk) alone gets the tokens and
    summary it got beside the three others, bit for bit (the step's epilogue takes the largest N of its reads, which
    enters the certificate only through fp64 terms, gamma_N, far below fp32's resolution). With keys stored times
    10 (KVCERT_FAULT) the witness is so large that the fp32 epilogue refuses the rows: the batch entry goes back to
    one entry per request, read again by the twin (_unbatch), with the same summaries as the records engine.
    The records engine runs in shadow mode, so the lean summaries also meet a truth from the exact keys (captured
    before the cast, the library's read not involved): each request's max bound >= its largest true TV, and its
    sum of bounds >= the sum of its true TVs over the same reads."""
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = []
    for records in (0, 10_000):
        llm = _engine(tiny, codec="int8", records=records, fault=fault, shadow=bool(records))
        outs = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], params)
        got.append([(list(o.outputs[0].token_ids), o.kvcert, o.num_cached_tokens or 0) for o in outs])
        if records:
            recs = [r for part in collect(llm) for r in part["records"]]
            truth = {o.request_id: [np.asarray(r["true_tv"], dtype=np.float64) for r in recs
                                    if external_id(r["request"]) == o.request_id] for o in outs}
        if not records and fault == "none":
            (alone,) = generate(llm, [{"prompt_token_ids": PROMPTS[2]}], params)
        del llm
    for p, (toks0, s0, c0), (toks1, s1, c1), tv in zip(PROMPTS, *got, truth.values()):
        assert toks0 == toks1 and c0 == c1
        assert all(s0[k] == s1[k] for k in ("rows", "reads", "repairs")), (s0, s1)
        assert all(s0[k] == pytest.approx(s1[k], rel=1e-3) for k in ("max_bound", "max_pre_gate", "sum_bound")), (s0, s1)
        assert s0["rows"] == (len(p) - c0 + 11) * 2 and s0["reads"] == s0["rows"] * 4  # 2 layers, 4 query heads
        assert sum(t.size for t in tv) == s0["reads"] and s1["violations"] == 0
        assert s0["max_bound"] >= max(float(t.max()) for t in tv) and s0["sum_bound"] >= sum(float(t.sum()) for t in tv)
    toks, s, cached = got[0][2]
    if fault != "none":
        assert s["max_bound"] == 1.0  # the fault is flagged
        return
    assert list(alone.outputs[0].token_ids) == toks and cached == 0 == (alone.num_cached_tokens or 0)
    keys = ("rows", "reads", "max_bound", "sum_bound")
    assert {k: alone.kvcert[k] for k in keys} == {k: s[k] for k in keys}


def test_vllm_worker_state_is_bounded(bounded):
    """A server never calls generate(): records stay at the cap (the newest kept, the rest counted), the
    summaries of finished requests at max_summaries (the oldest dropped, counted), the gate's per-request
    state only for requests the runner still holds."""
    from vllm import SamplingParams
    collect(bounded)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = []
    for i in range(7):  # one request at a time, through vLLM's own generate: nothing is handed back
        ids.append(bounded.generate([{"prompt_token_ids": PROMPTS[2]}], params)[0].request_id)
    (mem,) = bounded.collective_rpc("kvcert_memory")
    assert mem["records"] == 40 and mem["gate_requests"] <= 1, mem
    assert mem["summaries"] <= 3 + 1, mem  # 3 finished + the last one (the runner learns it finished next step)
    (part,) = collect(bounded)
    # each request: 1 prefill + 3 decode reads in 2 layers = 8 records; 7 requests = 56, the last 40 kept
    assert part["records_dropped"] == 7 * 8 - 40
    assert [external_id(r["request"]) for r in part["records"]][-8:] == [ids[-1]] * 8
    assert part["summaries_dropped"] >= 7 - 4 and set(map(external_id, part["summary"])) <= set(ids[-4:])


def test_vllm_kvcert_bytes_fit_in_vllms_kv_budget(bounded):
    """kvcert's witness and exact store are counted inside vLLM's KV budget: vLLM's cache + kvcert's side
    tensors <= kv_cache_memory_bytes, and the worker's RSS grows by no more than the budget (+ a quarter of
    it for everything else the requests allocate: ~25 MB measured) from before the caches were allocated;
    before, the exact store alone was as large as the cache (RSS growth ~2x the budget)."""
    from vllm import SamplingParams
    generate(bounded, [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=2, temperature=0.0))
    (mem,) = bounded.collective_rpc("kvcert_memory")
    assert mem["budget"] == BUDGET and mem["kvcert_bytes"] > 0.45 * BUDGET, mem
    assert mem["vllm_cache_bytes"] + mem["kvcert_bytes"] <= BUDGET, mem
    assert mem["rss_now"] - mem["rss_before_kv"] <= BUDGET + BUDGET // 4, mem


def _readme_vllm_snippet():
    import os
    import re
    import fast
    root = os.path.dirname(os.path.dirname(os.path.abspath(fast.__file__)))
    text = open(os.path.join(root, "README.md")).read()
    sec = text[text.index("### Serving with vLLM"):]
    sec = sec[:sec.index("\n### ", 5)]
    return re.findall(r"```python\n(.*?)```", sec, re.S)[0]


def test_readme_vllm_snippet_is_self_contained():
    """README's vLLM snippet compiles, names nothing it does not define or import (it used model_dir, prompts
    and params, never defined), imports only names the module has, and guards the engine start for spawn.
    (The snippet was run as written, SmolLM2 and all: it is the README's, another test runs README code.)"""
    import ast
    import builtins
    import fast.integrations.vllm as kv
    tree = ast.parse(_readme_vllm_snippet())
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
            if isinstance(node, ast.ImportFrom) and node.module == "fast.integrations.vllm":
                assert all(hasattr(kv, a.name) for a in node.names), [a.name for a in node.names]
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used <= bound, f"undefined in README's vLLM snippet: {sorted(used - bound)}"
    guard = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guard and any("make_llm" in ast.unparse(n) for n in guard), "make_llm outside the __main__ guard"


def test_demo_records_each_run_under_its_settings(tmp_path):
    """python -m fast.integrations.vllm --out FILE: each run kept under its own settings, others kept."""
    import argparse
    from types import SimpleNamespace
    from fast.integrations.vllm import _record_run
    path = tmp_path / "fault.json"
    run = lambda certify, text, summary: _record_run(
        argparse.Namespace(out=str(path), codec="fp8_e4m3", fault="key_scale:0.1", no_certify=not certify, prompt="p"),
        "certified:0.2" if certify else "none", [SimpleNamespace(outputs=[SimpleNamespace(text=text)], kvcert=summary)],
        ["--fault", "key_scale:0.1"] + ([] if certify else ["--no-certify"]))
    run(False, "garbage", None)
    run(True, "Paris.", {"repairs": 90})
    runs = json.loads(path.read_text())["runs"]
    assert runs["codec=fp8_e4m3 gate=none fault=key_scale:0.1 certify=False"] == {
        "command": "python -m fast.integrations.vllm --fault key_scale:0.1 --no-certify", "prompt": "p",
        "answer": "garbage", "summary": None}
    assert runs["codec=fp8_e4m3 gate=certified:0.2 fault=key_scale:0.1 certify=True"]["summary"] == {"repairs": 90}
