"""What happens after selection (issue 22): the evicted cache is read with the right RoPE positions,
the right mask and each KV head's own kept tokens, with the question inside the evicted prompt
(benchmarks.evict_eval) or appended after the evicted context (kvpress's protocol, decode(question=)).

differential: a reference that never compacts anything. The model runs over the FULL cache with an
eager attention of its own that hides, per KV head, the tokens the evictor dropped (a keep mask
[B, Hkv, N] over the original slots); positions are the original ones by construction. Greedy
tokens and logits of the compacted run must equal the reference's. Tiny random GQA Llama, batch 2
with left padding, questions of different lengths (left-padded within the question).
"""
import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from fast.policies.evictors import copy_prefill, decode, evict, make_evictor, prefill

VOCAB = 128
HIDE = []          # the per-KV-head keep masks of the reference, one per layer: [B, Hkv, N_ctx] bool


def _hiding_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Eager attention over the full cache, with the evicted slots of each KV head masked out."""
    B, H, q, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    rep = H // Hkv
    k = key.repeat_interleave(rep, 1)
    v = value.repeat_interleave(rep, 1)
    logits = (query @ k.transpose(-1, -2)) * (scaling if scaling is not None else module.scaling)
    allowed = torch.ones(B, H, q, N, dtype=torch.bool)
    if attention_mask is not None:
        m = attention_mask[:, :, :, :N]
        allowed &= m if m.dtype == torch.bool else (m == 0)
    if HIDE:
        keep = HIDE[module.layer_idx]                           # [B, Hkv, n_ctx]: later slots are always kept
        full = torch.ones(B, Hkv, N, dtype=torch.bool)
        full[:, :, :keep.shape[2]] = keep
        allowed &= full.repeat_interleave(rep, 1)[:, :, None, :]
    p = torch.softmax(logits.masked_fill(~allowed, -float("inf")), -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2).contiguous(), p


AttentionInterface.register("hide_evicted", _hiding_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("hide_evicted", eager_mask)


def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():              # peaked attention: a wrong position or mask moves the argmax
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


def inputs():
    g = torch.Generator().manual_seed(11)
    ctx = torch.randint(3, VOCAB, (2, 120), generator=g)
    cmask = torch.ones(2, 120, dtype=torch.long)
    cmask[1, :30] = 0                                           # row 1: 90 real context tokens
    q = torch.randint(3, VOCAB, (2, 9), generator=g)
    qmask = torch.ones(2, 9, dtype=torch.long)
    qmask[0, :3] = 0                                            # row 0: a question of 6 tokens
    return ctx, cmask, q, qmask


def keep_masks(ev, n, B):
    """Per layer [B, Hkv, n] bool: the original slots each KV head kept."""
    out = []
    for idx in ev.keep:
        m = torch.zeros(B, idx.shape[1], n, dtype=torch.bool)
        m.scatter_(2, idx, True)
        out.append(m)
    return out


def reference(model, chunks, hide, steps):
    """Greedy decoding over the full cache: the prompt is fed in `chunks` [(ids, mask)],
    the first one always seen whole (it is the prefill the evictor scored), later chunks and every
    decode step with `hide` [B, Hkv, n] per layer masking the evicted slots. Positions: the
    original ones (the cumulative count of real tokens)."""
    model.set_attn_implementation("hide_evicted")
    try:
        cache, m, nxt = None, None, None
        for i, (ids, mask) in enumerate(chunks):
            HIDE[:] = hide if i else []
            m = mask if m is None else torch.cat([m, mask], 1)
            pos = (m.cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1]:]
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
        HIDE[:] = hide
        nxt = m.sum(-1)
        tok = out.logits[:, -1].argmax(-1)
        toks, logits = [tok], [out.logits[:, -1]]
        for _ in range(steps - 1):
            m = torch.cat([m, torch.ones(m.shape[0], 1, dtype=m.dtype)], 1)
            with torch.no_grad():
                o = model(input_ids=tok[:, None], attention_mask=m, position_ids=nxt[:, None], past_key_values=cache,
                          use_cache=True)
            nxt = nxt + 1
            tok = o.logits[:, -1].argmax(-1)
            toks.append(tok)
            logits.append(o.logits[:, -1])
        return torch.stack(toks, 1), torch.stack(logits, 1)
    finally:
        HIDE.clear()
        model.set_attn_implementation("sdpa")


SPECS = ["snapkv:60", "tova:60", "knorm:60:sinks=0,window=0", "random:60", "streaming:60", "h2o:60"]


@pytest.mark.parametrize("spec", SPECS)
def test_question_inside_prompt_matches_hidden_full_cache(spec):
    """differential (evict_eval's protocol): prompt = context + question, evicted per KV head to 60
    slots; 8 greedy tokens and their logits equal those of the full cache with the evicted slots hidden per head."""
    model = tiny()
    ctx, cmask, q, qmask = inputs()
    ids = torch.cat([ctx, q], 1)
    mask = torch.cat([cmask, torch.ones_like(qmask)], 1)       # one left-padded prompt per row
    ev_ = make_evictor(spec)
    pre = prefill(model, ids, mask, needs=ev_.needs)
    ev = evict(pre, ev_, witness=False)
    assert pre.cache.layers[0].keys.shape[2] == 60
    got = decode(model, pre, ev, max_new_tokens=8, certify=False, keep_logits=True)
    want, want_logits = reference(model, [(ids, mask)], keep_masks(ev, ids.shape[1], 2), 8)
    assert torch.equal(got["tokens"], want)
    assert torch.allclose(got["logits"], want_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec", SPECS)
def test_question_after_context_matches_hidden_full_cache(spec):
    """differential (kvpress's protocol, decode(question=)): the context alone is prefilled and
    evicted to 60 slots, the question (left-padded, 6 and 9 tokens) is prefilled after it at the
    context's original positions and never evicted; 8 greedy tokens and their logits equal the reference's: the full
    prompt over the full cache with only the evicted context slots hidden."""
    model = tiny()
    ctx, cmask, q, qmask = inputs()
    ev_ = make_evictor(spec)
    pre = prefill(model, ctx, cmask, needs=ev_.needs)
    ev = evict(pre, ev_, witness=False)
    got = decode(model, pre, ev, max_new_tokens=8, certify=False, question=q, question_mask=qmask, keep_logits=True)
    want, want_logits = reference(model, [(ctx, cmask), (q, qmask)], keep_masks(ev, ctx.shape[1], 2), 8)
    assert torch.equal(got["tokens"], want)
    assert torch.allclose(got["logits"], want_logits, atol=1e-4, rtol=0)


def test_question_after_context_without_eviction_is_plain_decoding():
    """differential: with nothing evicted, decode(question=) gives the tokens of HF generate on the
    whole prompt (batch 1)."""
    model = tiny()
    ctx, _, q, _ = inputs()
    pre = prefill(model, ctx[:1])
    got = decode(model, pre, None, max_new_tokens=8, certify=False, question=q[:1])["tokens"]
    ids = torch.cat([ctx[:1], q[:1]], 1)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          pad_token_id=0)[:, ids.shape[1]:]
    assert torch.equal(got, want)


def test_question_after_context_certificate_holds():
    """property: shadow mode with the question appended: the question's keys join the exact copy as
    kept tokens; zero violations of bound >= true evicted mass over 5 steps."""
    model = tiny()
    ctx, cmask, q, qmask = inputs()
    ev_ = make_evictor("snapkv:60")
    pre = prefill(model, ctx, cmask, needs=ev_.needs)
    ev = evict(pre, ev_, shadow=True)
    out = decode(model, pre, ev, max_new_tokens=6, shadow=True, question=q, question_mask=qmask)
    bound = torch.stack([s["bound"] for s in out["trace"]]).double()
    true = torch.stack([s["true"] for s in out["trace"]])
    assert bound.shape == (5, 3, 2, 4) and float(true.min()) > 0
    assert int((bound < true * (1 - 1e-12)).sum()) == 0


def test_question_bad_input():
    model = tiny()
    ctx, cmask, q, qmask = inputs()
    pre = prefill(model, ctx, cmask)
    with pytest.raises(ValueError):
        decode(model, pre, None, max_new_tokens=2, certify=False, question=q[:1])            # batch differs
    bad = qmask.clone()
    bad[0, -1] = 0
    with pytest.raises(ValueError):
        decode(model, pre, None, max_new_tokens=2, certify=False, question=q, question_mask=bad)  # right padding
