"""The certified eviction gate on SmolLM2 (issue 22 item 3): accuracy, KV bytes, restores, and the
soundness of every read served, against the full cache, the evictor alone, PAGE and a blind gate.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m benchmarks.evict_gate [--n 100] -> results/evict_gate.json, .png

The inputs of results/evict_eval.json (benchmarks.ruler.examples: same tasks, haystacks, seeds,
~--tokens tokens, left-padded batches, greedy decoding with ruler.allowance new tokens, stop at
end-of-turn). Per evictor@budget and tau, the prefill is evicted with an EvictionGate(tau, scope)
(fast.policies.evict_gate: int8 key sketch resident, evicted K+V offloaded, every decode read's
certified TV computed before it is served; where it exceeds tau, the fewest evicted tokens of the
KV head come back, --scope tokens) and decoded.

Per input: correct or not, KV bytes resident over the full cache's (fp16 K+V, time-averaged over
the decode steps), evicted tokens restored, and the soundness check of EVERY read served: the true mass
of the tokens the read did not see, computed here in fp64 from exact keys copied out of the cache
before the eviction (never from the gate's data), against the bound the gate reported.

Compared on the same inputs: the full cache (run here), and from --labels (results/evict_eval.json,
the same inputs and evictor code, matched by task, haystack, seed, depth): the evictor alone, PAGE
at that file's calibrated tau (its decision per input: evict or keep the full cache) and a blind
gate that evicts as many inputs at random (expected accuracy). Exact McNemar vs the full cache,
Holm-adjusted over the gate rows.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks.evict_eval import ALL_NEEDS, answer_texts, batches, left_pad, machine, parse_spec
from benchmarks.ruler import DEFAULT_TASKS
from benchmarks.stats import holm, mcnemar, wilson

ROOT = Path(__file__).resolve().parent.parent


def true_missed_mass(gate, ev, exact, cache, valid):
    """[T, L, B, H]: per read served, the exact attention mass of the tokens it did not read (fp64
    from `exact`, the pre-eviction keys, and the decode tokens' keys as the DynamicCache holds them)."""
    T = len(gate.steps)
    out = torch.zeros((T,) + tuple(gate.steps[0]["served"].shape), dtype=torch.float64)
    for l, k0 in enumerate(exact):
        B, Hkv, N, D = k0.shape
        dec = cache.layers[l].keys[:, :, -T:].double()
        gone0 = valid[:, None, :].expand(B, Hkv, N).clone()
        gone0.scatter_(2, ev.keep[l], False)
        for t, step in enumerate(gate.steps):
            q = step["query"][l].double()
            rep = q.shape[1] // Hkv
            k = torch.cat([k0.double(), dec[:, :, :t + 1]], 2).repeat_interleave(rep, 1)
            x = torch.einsum("bhd,bhnd->bhn", q, k) / D ** 0.5
            ok = torch.cat([valid, torch.ones(B, t + 1, dtype=torch.bool)], 1)
            x = x.masked_fill(~ok[:, None, :], -float("inf"))
            gone = torch.cat([gone0 & ~step["restored"][l], torch.zeros(B, Hkv, t + 1, dtype=torch.bool)], 2)
            out[t, l] = (torch.softmax(x, -1) * gone.repeat_interleave(rep, 1)).sum(-1)
    return out


def run_batch(model, tok, exs, args):
    from benchmarks.ruler import allowance, build, score
    from fast.policies.evict_gate import EvictionGate
    from fast.policies.evictors import copy_prefill, decode, evict, make_evictor, prefill
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids, mask = left_pad([build(tok, ex, args.tokens)[0][0] for ex in exs], tok.pad_token_id or 0)
    allow = [allowance(tok, ex) for ex in exs]
    pre = prefill(model, ids, mask, needs=ALL_NEEDS - {"window_heads"})
    full = decode(model, copy_prefill(pre, model.config), None, max_new_tokens=max(allow), certify=False, eos_token_id=eos)
    recs = [{"task": ex["task"], "haystack": ex["haystack"], "seed": ex["seed"], "depth": ex["depth"],
             "full": score(text, ex["answers"]), "runs": {}}
            for ex, (text, _) in zip(exs, answer_texts(tok, full["tokens"], allow, eos))]
    for cell in args.cells:
        name, K = cell.rsplit("@", 1)
        _, spec, _, _ = parse_spec(name, int(K), args.sinks, args.window_frac)
        for tau in args.taus:
            mine = copy_prefill(pre, model.config)
            exact = [layer.keys.clone() for layer in mine.cache.layers]          # the truth's keys
            gate = EvictionGate(tau, scope=args.scope, sketch=args.sketch, retain=not args.fetch, keep_queries=True)
            ev = evict(mine, make_evictor(spec), witness=False, gate=gate)
            out = decode(model, mine, ev, max_new_tokens=max(allow), certify=False, eos_token_id=eos)
            texts = answer_texts(tok, out["tokens"], allow, eos)
            truth = true_missed_mass(gate, ev, exact, mine.cache, pre.valid)       # [T, L, B, H]
            served = torch.stack([s["served"] for s in gate.steps])
            bound = torch.stack([s["bound"] for s in gate.steps])
            ratio = torch.stack([s["resident_bytes"] / s["full_bytes"] for s in gate.steps])   # [T, B]
            fetch = torch.stack([s["fetch_bytes"] / s["full_bytes"] for s in gate.steps])
            for b, ex in enumerate(exs):
                text, n_new = texts[b]
                T = max(1, n_new - 1)                   # steps this row really decoded (later ones are padding)
                restored = int(gate.steps[T - 1]["restored"][:, b].sum())
                evicted = sum(int(st["valid"][b].sum()) for st in gate.layers)
                recs[b]["runs"][f"{cell}/{tau}"] = {
                    "ok": score(text, ex["answers"]), "text": text,
                    "bytes_over_full": round(float(ratio[:T, b].mean()), 5),
                    "fetch_over_full": round(float(fetch[:T, b].mean()), 5),
                    "restored_tokens": restored, "evicted_tokens": evicted,
                    "reads": int(served[:T, :, b].numel()), "max_served": float(served[:T, :, b].max()),
                    "max_bound_before_gate": float(bound[:T, :, b].max()),
                    "true_max": float(truth[:T, :, b].max()),
                    "violations": int((truth[:T, :, b] > served[:T, :, b] * (1 + 1e-9) + 1e-12).sum())}
    return recs


def labels_of(path):
    p = Path(path)
    if not p.exists():
        return None
    data = json.loads(p.read_text())
    return {(r["task"], r["haystack"], r["seed"], r["depth"]): r for r in data["records"]}, data["page_tau"]


def summarize(records, cells, taus, labels):
    n = len(records)
    full = [r["full"] for r in records]
    rows, ps, keys = [], [], []
    lab, page_tau = labels if labels else ({}, {})
    for cell in cells:
        name, K = cell.rsplit("@", 1)
        base = [lab.get((r["task"], r["haystack"], r["seed"], r["depth"])) for r in records]
        have = all(b is not None and cell in b["runs"] for b in base)
        ref = {}
        if have:
            alone = [b["runs"][cell]["ok"] for b in base]
            evicts = [b["page_drop"][K] >= page_tau[K] for b in base]
            page_ok = [a if e else f for a, e, f in zip(alone, evicts, full)]
            page_bytes = [min(1.0, int(K) / b["tokens"]) if e else 1.0 for b, e in zip(base, evicts)]
            share = sum(evicts) / n
            ref = {"alone_accuracy": sum(alone) / n,
                   "alone_bytes_over_full": sum(min(1.0, int(K) / b["tokens"]) for b in base) / n,
                   "page": {"tau": page_tau[K], "evicts": sum(evicts), "accuracy": sum(page_ok) / n,
                            "p_vs_full": mcnemar(full, page_ok)[0], "bytes_over_full_mean": sum(page_bytes) / n},
                   "blind_expected_accuracy": sum(share * a + (1 - share) * f for a, f in zip(alone, full)) / n,
                   "labels_match": all(b["full"] == f for b, f in zip(base, full))}
        for tau in taus:
            runs = [r["runs"][f"{cell}/{tau}"] for r in records]
            ok = [x["ok"] for x in runs]
            p, lost, gained = mcnemar(full, ok)
            ps.append(p)
            keys.append(f"{cell}/{tau}")
            rows.append({"cell": cell, "tau": tau, "accuracy": sum(ok) / n, "wilson": wilson(sum(ok), n),
                         "p_vs_full": p, "lost": lost, "gained": gained,
                         "bytes_over_full_mean": sum(x["bytes_over_full"] for x in runs) / n,
                         "fetch_over_full_mean": sum(x.get("fetch_over_full", 0.0) for x in runs) / n,
                         "restored_share": sum(x["restored_tokens"] for x in runs) / sum(x["evicted_tokens"] for x in runs),
                         "inputs_fully_restored": sum(x["restored_tokens"] == x["evicted_tokens"] for x in runs),
                         "reads": sum(x["reads"] for x in runs), "violations": sum(x["violations"] for x in runs),
                         "max_served": max(x["max_served"] for x in runs), "true_max": max(x["true_max"] for x in runs),
                         **ref})
    for r, ph in zip(rows, holm(ps)):
        r["p_holm"] = ph
    return rows


def table(rows, full_acc, n, retain=False):
    """The README table; with retain=True the restored tokens stay resident, so there is no per-step fetch
    ("-") and the traffic is the one-time restore ("evicted read back")."""
    head = ["evictor@budget", "tau", "accuracy", "p vs full (Holm)", "KV bytes / full", "fetched / step", "evicted read back",
            "evictor alone", "PAGE (bytes)", "blind gate", "violations / reads"]
    body = []
    for r in rows:
        page = r.get("page")
        body.append([r["cell"], r["tau"], f"{r['accuracy']:.2f} [{r['wilson'][0]:.2f}, {r['wilson'][1]:.2f}]",
                     f"{r['p_holm']:.2g}", f"{r['bytes_over_full_mean']:.3f}", "-" if retain else f"{r['fetch_over_full_mean']:.3f}",
                     f"{r['restored_share']:.1%}",
                     f"{r['alone_accuracy']:.2f}" if "alone_accuracy" in r else "-",
                     f"{page['accuracy']:.2f} ({page['bytes_over_full_mean']:.2f})" if page else "-",
                     f"{r['blind_expected_accuracy']:.2f}" if "blind_expected_accuracy" in r else "-",
                     f"{r['violations']}/{r['reads']}"])
    return {"title": f"Certified eviction gate (retain={retain}), SmolLM2-135M, {n} inputs of ~384 tokens "
                     f"(full cache {full_acc:.2f}); "
                     "KV bytes: fp16 K+V resident (kept slots, key sketches, and the restored tokens, or with "
                     "retain=False the largest one-layer fetch buffer of the step) over the full cache's, averaged "
                     "over decode steps; fetched / step: K+V brought from the offload tier per decode step over the "
                     "full cache's bytes (retain=False); evicted read back: share of the evicted tokens read at the "
                     "last step; PAGE bytes: K over the prompt's tokens where it evicts (no certificate), 1 "
                     "where it keeps the full cache; p: exact McNemar vs the full cache, Holm over the rows; "
                     "violations: reads whose true missed mass (exact keys) exceeds the bound served",
            "header": head, "rows": body}


def plot(rows, full_acc, path):
    """Accuracy against KV bytes resident, one panel per evictor@budget: the full cache, the evictor
    alone, PAGE and the blind gate (from --labels), and the certified gate at each tau."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    fig, axes = plt.subplots(1, len(cells), figsize=(3.2 * len(cells), 3.4), squeeze=False, sharey=True)
    for ax, cell in zip(axes[0], cells):
        mine = [r for r in rows if r["cell"] == cell]
        ax.scatter([1.0], [full_acc], marker="s", color="black", label="full cache")
        ref = mine[0]
        if "alone_accuracy" in ref:
            ax.scatter([ref["alone_bytes_over_full"]], [ref["alone_accuracy"]], marker="x", color="gray", label="evictor alone")
            ax.scatter([ref["page"]["bytes_over_full_mean"]], [ref["page"]["accuracy"]], marker="^", color="tab:orange",
                       label="PAGE")
            ax.scatter([ref["page"]["bytes_over_full_mean"]], [ref["blind_expected_accuracy"]], marker="v",
                       color="tab:brown", label="blind gate (expected)")
        ax.plot([r["bytes_over_full_mean"] for r in mine], [r["accuracy"] for r in mine], "o-", color="tab:blue",
                label="certified gate")
        for i, r in enumerate(mine):                          # the taus often land on one point: stack the labels
            ax.annotate(f"tau {r['tau']:g}", (r["bytes_over_full_mean"], r["accuracy"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -10 - 9 * i))
        ax.set_title(cell, fontsize=9)
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("KV bytes resident / full cache")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--cells", default="snapkv@192,streaming@192,epikv@192,streaming@96")
    ap.add_argument("--taus", default="0.05,0.2")
    ap.add_argument("--scope", default="tokens", choices=("tokens", "head", "layer", "input"))
    ap.add_argument("--sketch", default="int8", choices=("int8", "int4", "fp8_e4m3", "fp8_e5m2", "int4c"))
    ap.add_argument("--fetch", action="store_true", help="retain=False: each read fetches its tokens from the "
                    "offload tier and drops them (resident: kept slots, sketches, one read's buffer)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window-frac", type=float, default=0.125)
    ap.add_argument("--labels", default=str(ROOT / "results" / "evict_eval.json"))
    ap.add_argument("--out", default=str(ROOT / "results" / "evict_gate.json"))
    ap.add_argument("--resummarize", default=None, metavar="FILE", help="only recompute the rows and tables of FILE "
                    "from its records (and --labels)")
    args = ap.parse_args(argv)
    if args.resummarize:
        data = json.loads(Path(args.resummarize).read_text())
        st = data["settings"]
        data["rows"] = summarize(data["records"], st["cells"], st["taus"], labels_of(args.labels))
        data["readme_tables"] = [table(data["rows"], data["full_accuracy"], len(data["records"]), st["retain"])]
        Path(args.resummarize).write_text(json.dumps(data, indent=1))
        plot(data["rows"], data["full_accuracy"], Path(args.resummarize).with_suffix(".png"))
        return 0
    args.cells = [c for c in args.cells.split(",") if c]
    args.taus = [float(t) for t in args.taus.split(",")]
    for c in args.cells:
        if "@" not in c or not c.rsplit("@", 1)[1].isdigit():
            ap.error(f"--cells takes evictor@budget, got {c!r}")
    torch.set_num_threads(1)
    from benchmarks.ruler import examples
    from fast.integrations.model import load_smollm2
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    model, tok = load_smollm2()
    exs = examples(args.n, tasks=tuple(DEFAULT_TASKS), haystacks=("synthetic", "natural"))
    records, t0 = [], time.time()
    for batch in batches(exs, args.batch):
        records += run_batch(model, tok, batch, args)
        print(f"[{len(records)}/{args.n}] {time.time() - t0:.0f}s", flush=True)
    labels = labels_of(args.labels)
    rows = summarize(records, args.cells, args.taus, labels)
    full_acc = sum(r["full"] for r in records) / len(records)
    data = {"command": "OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m benchmarks.evict_gate "
                       + shlex.join(argv if argv is not None else sys.argv[1:]),
            "machine": machine(), "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, fp32, CPU)",
            "settings": {"n": args.n, "tokens": args.tokens, "cells": args.cells, "taus": args.taus, "scope": args.scope,
                         "batch": args.batch, "sinks": args.sinks, "window_frac": args.window_frac, "sketch": args.sketch,
                         "retain": not args.fetch,
                         "labels": str(Path(args.labels).relative_to(ROOT)) if labels else None},
            "seconds": round(time.time() - t0, 1), "full_accuracy": full_acc, "rows": rows, "records": records}
    data["readme_tables"] = [table(rows, full_acc, len(records), not args.fetch)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    plot(rows, full_acc, Path(args.out).with_suffix(".png"))
    for r in rows:
        print(r["cell"], r["tau"], f"acc {r['accuracy']:.2f} p {r['p_holm']:.2g} bytes {r['bytes_over_full_mean']:.3f} "
              f"restored {r['restored_share']:.1%} violations {r['violations']}/{r['reads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
