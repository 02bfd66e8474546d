"""Certified sparse read vs the full read vs a Quest-style top-k page read (issue 22 item 4).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m benchmarks.sparse_read -> results/sparse_read.json

One layer's decode read at the SmolLM2-135M shape (H=9, Hkv=3, D=64, fp32, batch 1) on REAL
keys, values and queries: a natural-haystack RULER prompt (benchmarks.ruler, passkey task) of
N + --reads tokens is run through the shipped SmolLM2 up to layer --layer (plain torch, causal
sdpa prefill); the cache is that layer's post-RoPE keys / values of the first N tokens and the
reads are the queries of the prompt's last --reads tokens (the question; the haystack between is cut so
that positions stay contiguous), each read against the same N-token cache.
Per N, per read, in interleaved rounds (torch threads fixed by --threads):

    full     softmax(q K^T s) V over all N tokens (matmul; sdpa with GQA timed beside it)
    sparse   fast.core.sparse.sparse_read at --tau: the window + pages by box bound, certified
    topk     fast.core.sparse.topk_page_read: the window + the k pages of largest fp32 U_p per KV
             head (Quest-style, no certificate), k = the sparse read's mean pages at this N

Reported: median seconds per read of each (median over reads x rounds), ratios against the full
read of the same run, the fraction of candidate pages read, the certified TV (per read and head:
max, quantiles) against the true TV from the exact fp64 full softmax (and the top-k read's true
TV at the same page count), violations (certified < true), and the index build time.
"""

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def real_cache(n_cache, reads, layer, seed=0):
    """(q [reads, H, D], k [1, Hkv, N, D], v, scale) of SmolLM2 layer `layer` on a natural prompt."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from benchmarks.ruler import build, make_example
    from fast.integrations.model import load_smollm2
    model, tok = load_smollm2()
    ex = make_example("passkey", seed, 0.5, haystack="natural")
    target = n_cache + reads
    ids, n = build(tok, ex, target)
    while n < n_cache + reads:                                             # build trims to at most target
        target = int(target * 1.1) + 64
        ids, n = build(tok, ex, target)
    ids = torch.cat([ids[:, :n_cache], ids[:, -reads:]], 1)                # the prompt's head, then its last tokens
    m, cfg = model.model, model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    with torch.no_grad():
        h = m.embed_tokens(ids)
        pos = torch.arange(ids.shape[1])[None]
        cos, sin = m.rotary_emb(h, pos)
        for i in range(layer):
            out = m.layers[i](h, position_embeddings=(cos, sin), position_ids=pos)
            h = out[0] if isinstance(out, tuple) else out
        att = m.layers[layer].self_attn
        x = m.layers[layer].input_layernorm(h)
        N = ids.shape[1]
        q = att.q_proj(x).view(1, N, H, D).transpose(1, 2)
        k = att.k_proj(x).view(1, N, Hkv, D).transpose(1, 2)
        v = att.v_proj(x).view(1, N, Hkv, D).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    qs = q[0, :, n_cache:].transpose(0, 1).contiguous()                     # [reads, H, D]
    return qs, k[:, :, :n_cache].contiguous(), v[:, :, :n_cache].contiguous(), att.scaling


def full_read(q, k, v, s):
    """q [1, H, D], k / v [1, Hkv, N, D] -> [1, H, D]: the full read (matmul softmax)."""
    B, H, D = q.shape
    qg = q.view(B, k.shape[1], H // k.shape[1], D)
    return torch.matmul(torch.softmax(torch.matmul(qg, k.transpose(-1, -2)) * s, -1), v).view(B, H, D)


def sdpa_read(q, k, v, s):
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=s, enable_gqa=True)[:, :, 0]


def true_tv(q, k, s, tokens):
    """TV(p, p^K) = p(unread) from the exact fp64 softmax over the whole cache: [H]."""
    from fast.core.evict import evicted_mass
    B, Hkv, N, D = k.shape
    gone = torch.ones(B, Hkv, N, dtype=torch.bool)
    gone.scatter_(2, tokens, False)
    return evicted_mass(q, k, s, gone)[0]


def topk_tokens(q, k, index, s, kp, window):
    """The tokens topk_page_read reads (the same selection, for its true TV)."""
    B, H, D = q.shape
    Hkv, N, ps = k.shape[1], k.shape[2], index.page_size
    cand = min(index.pages, max(0, N - max(window, 1)) // ps)
    qg = q.view(B, Hkv, H // Hkv, D)
    lo, hi = index.boxes.lo[:, :, :cand], index.boxes.hi[:, :, :cand]
    u = torch.matmul(qg.clamp(min=0), hi.transpose(-1, -2)) + torch.matmul(qg.clamp(max=0), lo.transpose(-1, -2))
    sel = u.amax(2).topk(min(kp, cand), -1).indices
    tok = (sel[..., None] * ps + torch.arange(ps)).reshape(B, Hkv, -1)
    return torch.cat([torch.arange(cand * ps, N).expand(B, Hkv, -1), tok], -1)


SWEEP = (0.05, 0.2, 0.5, 0.9, 0.99)


def oracle_pages(q, k, s, index, window, tau):
    """Pages an oracle needs (the exact page masses, largest first, one count for every head, as
    sparse_read shares it) for a true TV <= tau: what any certificate with this read plan could reach."""
    B, H, D = q.shape
    Hkv, N, ps = k.shape[1], k.shape[2], index.page_size
    cand = min(index.pages, max(0, N - max(window, 1)) // ps)
    x = s * torch.einsum("bhd,bhnd->bhn", q.double(), k.double().repeat_interleave(H // Hkv, 1))
    p = torch.softmax(x, -1)[..., :cand * ps].view(B, H, cand, ps).sum(-1)  # [B, H, P] page masses
    rest = p.sort(-1, descending=True).values.flip(-1).cumsum(-1).flip(-1)  # mass of pages m.. when m are read
    rest = torch.cat([rest, torch.zeros_like(rest[..., :1])], -1)
    need = (rest > tau).sum(-1)                                             # [B, H]: pages needed per head
    return int(need.max())


def clock(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def quant(x, qs=(0.5, 0.9, 0.99, 1.0)):
    x = sorted(x)
    return {str(p): x[min(len(x) - 1, int(p * (len(x) - 1) + 0.5))] for p in qs}


def run_n(q_all, k_all, v_all, s, N, args):
    from fast.core.sparse import build_sparse_index, sparse_read, topk_page_read
    k, v = k_all[:, :, :N].contiguous(), v_all[:, :, :N].contiguous()
    t0 = time.perf_counter()
    index = build_sparse_index(k, v, page_size=args.page_size)
    build_s = time.perf_counter() - t0
    reads = [q_all[i:i + 1].contiguous() for i in range(q_all.shape[0])]
    # pass 0 (untimed): every read's certificate, pages, truth
    recs = []
    for q in reads:
        r = sparse_read(q, k, v, index, s, args.tau, window=args.window)
        tv_true = true_tv(q, k, s, r.tokens)
        o_full = full_read(q.double(), k.double(), v.double(), s)
        sweep = {str(t): sparse_read(q, k, v, index, s, t, window=args.window).pages_read / max(1, r.pages) for t in SWEEP}
        recs.append({"pages_read": r.pages_read, "pages": r.pages, "tokens_read": int(r.tokens.shape[-1]),
                     "pages_read_at_tau": sweep, "oracle_pages": oracle_pages(q, k, s, index, args.window, args.tau) / max(1, r.pages),
                     "tv_cert": r.tv[0].tolist(), "tv_true": tv_true.tolist(),
                     "out_err_cert": r.out_err[0].tolist(),
                     "out_err_true": (r.out.double() - o_full).norm(dim=-1)[0].tolist()})
    kp = max(0, round(statistics.mean(x["pages_read"] for x in recs)))
    for q, rec in zip(reads, recs):
        rec["topk_tv_true"] = true_tv(q, k, s, topk_tokens(q, k, index, s, kp, args.window)).tolist()
    methods = {
        "full": lambda q: full_read(q, k, v, s),
        "full_sdpa": lambda q: sdpa_read(q, k, v, s),
        "sparse": lambda q: sparse_read(q, k, v, index, s, args.tau, window=args.window),
        "topk": lambda q: topk_page_read(q, k, v, index, s, kp, window=args.window),
    }
    times = {name: [] for name in methods}
    for q in reads[:2]:                                                     # warm up
        for fn in methods.values():
            fn(q)
    for rnd in range(args.rounds):
        names = list(methods) if rnd % 2 == 0 else list(methods)[::-1]      # interleaved, order alternating
        for q in reads:
            for name in names:
                times[name].append(clock(lambda: methods[name](q)))
    med = {name: statistics.median(t) for name, t in times.items()}
    cert = [x for r in recs for x in r["tv_cert"]]
    true = [x for r in recs for x in r["tv_true"]]
    topk_true = [x for r in recs for x in r["topk_tv_true"]]
    return {"N": N, "pages": recs[0]["pages"], "topk_pages": kp, "index_build_s": build_s, "index_bytes": index.nbytes,
            "median_s": med, "speedup_vs_full": {name: med["full"] / med[name] for name in med},
            "pages_read_fraction": {"mean": statistics.mean(r["pages_read"] / max(1, r["pages"]) for r in recs),
                                    **quant([r["pages_read"] / max(1, r["pages"]) for r in recs], (0.0, 0.5, 1.0))},
            "tokens_read_fraction_mean": statistics.mean(r["tokens_read"] / N for r in recs),
            "pages_read_fraction_at_tau": {str(t): statistics.mean(r["pages_read_at_tau"][str(t)] for r in recs) for t in SWEEP},
            "oracle_pages_fraction": {"mean": statistics.mean(r["oracle_pages"] for r in recs),
                                      **quant([r["oracle_pages"] for r in recs], (0.0, 0.5, 1.0))},
            "tv_cert": quant(cert), "tv_true": quant(true), "topk_tv_true": quant(topk_true),
            "reads_cert_le_tau": sum(max(r["tv_cert"]) <= args.tau for r in recs), "reads": len(recs),
            "violations": sum(c < t - 1e-12 for c, t in zip(cert, true)),
            "out_err_cert": quant([x for r in recs for x in r["out_err_cert"]]),
            "out_err_true": quant([x for r in recs for x in r["out_err_true"]]),
            "records": recs}


def readme_tables(data):
    st = data["settings"]
    rows = []
    for c in data["cells"]:
        med, sp = c["median_s"], c["speedup_vs_full"]
        rows.append([c["N"], c["pages"], f"{med['full'] * 1e3:.2f}", f"{med['full_sdpa'] * 1e3:.2f} (x{sp['full_sdpa']:.2f})",
                     f"{med['sparse'] * 1e3:.2f} (x{sp['sparse']:.2f})", f"{med['topk'] * 1e3:.2f} (x{sp['topk']:.2f})",
                     f"{c['pages_read_fraction']['mean']:.3f}", f"{c['tv_cert']['0.5']:.2g} / {c['tv_cert']['1.0']:.2g}",
                     f"{c['tv_true']['0.5']:.2g} / {c['tv_true']['1.0']:.2g}", f"{c['topk_tv_true']['1.0']:.2g}",
                     f"{c['violations']}", f"{c['reads_cert_le_tau']} / {c['reads']}",
                     f"{c['oracle_pages_fraction']['mean']:.3f}",
                     " / ".join(f"{c['pages_read_fraction_at_tau'][str(t)]:.2f}" for t in SWEEP)])
    return [{"title": f"Certified sparse read vs full read, one SmolLM2 layer ({data['keys']}; page {st['page_size']}, "
                      f"window {st['window']}, tau {st['tau']}, {st['threads']} thread): median ms per read (x = full / it, same run); "
                      "pages read = fraction of candidate pages; TV median / max over reads and heads",
             "header": ["N", "pages", "full ms", "sdpa ms", "sparse ms", "top-k ms (Quest, same pages)", "pages read",
                        "certified TV", "true TV", "top-k true TV max", "violations", "reads cert <= tau",
                        "oracle pages (true TV <= tau)", "pages read at tau " + " / ".join(str(t) for t in SWEEP)],
             "rows": rows}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="8192,16384,32768")
    ap.add_argument("--reads", type=int, default=16, help="decode reads (queries of the prompt's last tokens)")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--tau", type=float, default=0.05)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "sparse_read.json"))
    args = ap.parse_args(argv)
    from benchmarks.evict_eval import machine
    ns = [int(x) for x in args.ns.split(",")]
    t0 = time.time()
    torch.set_num_threads(2)                                                # the prefill only: not timed
    q_all, k_all, v_all, s = real_cache(max(ns), args.reads, args.layer)
    prefill_s = time.time() - t0
    torch.set_num_threads(args.threads)
    cells = []
    for N in ns:
        cells.append(run_n(q_all, k_all, v_all, s, N, args))
        c = cells[-1]
        print(f"N={N}: full {c['median_s']['full'] * 1e3:.2f} ms, sparse {c['median_s']['sparse'] * 1e3:.2f} ms "
              f"(x{c['speedup_vs_full']['sparse']:.2f}), topk {c['median_s']['topk'] * 1e3:.2f} ms "
              f"(x{c['speedup_vs_full']['topk']:.2f}), pages read {c['pages_read_fraction']['mean']:.3f}, "
              f"max cert TV {c['tv_cert']['1.0']:.4f}, max true TV {c['tv_true']['1.0']:.4f}, "
              f"topk max true TV {c['topk_tv_true']['1.0']:.4f}", flush=True)
    data = {"command": ("OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m benchmarks.sparse_read "
                        + shlex.join(argv if argv is not None else sys.argv[1:])).strip(),
            "machine": machine(), "model": "SmolLM2-135M-Instruct (shipped)",
            "keys": f"real: layer {args.layer}, natural-haystack passkey prompt, queries of the last {args.reads} tokens",
            "settings": {k: getattr(args, k) for k in ("ns", "reads", "layer", "tau", "page_size", "window", "rounds", "threads")},
            "prefill_s": prefill_s, "seconds": time.time() - t0, "cells": cells}
    data["readme_tables"] = readme_tables(data)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
