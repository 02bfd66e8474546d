"""Eviction on SmolLM2-135M: accuracy with intervals and paired tests, PAGE against a blind gate,
and the eviction certificate in shadow mode (bound vs the true evicted mass from exact keys).

    nice -n 10 .venv/bin/python -m benchmarks.evict_eval [--n 40] [--tokens 512] -> results/evict_eval.json

Inputs: RULER-style tasks (benchmarks/ruler.py) on two haystacks (synthetic filler and natural
prose from pydoc_data.topics), needle depths spread over [0.05, 0.95], fixed seeds. Each input
gets its task's own generation allowance (ruler.allowance: its answers plus slack), decoding stops
at end-of-turn. Inputs are prefilled in left-padded batches (--batch); one prefill collects every
score and is copied per configuration.

Budgets: budget K keeps `--sinks` first tokens and a recent window of round(K * --window-frac)
tokens (forced) and K - sinks - window tokens chosen by the evictor's score; each row states its
forced/scored split. Evictor specs may override conventions (`tova:heads=all,sinks=0,window=0`;
window=half means K // 2, H2O's heavy/recent split).

Statistics (benchmarks/stats.py): accuracy over all inputs and harm rate (wrong with eviction
among inputs the full cache answers) with 95 % Wilson intervals; exact McNemar tests against the
full cache and between evictors at the same budget, Holm-adjusted within each family; PAGE
(agreement over the 9 query heads, tau calibrated per budget on separate unlabelled prompts over
all tasks, haystacks and depths, evict rate --page-rate) against a blind gate that evicts the same
number of inputs at random (exact hypergeometric P(blind harms <= PAGE harms)), and the AUROC of
the drop against harm. Certificate: per input the mean over decode steps, layers and query heads
of the log-odds bound log(U/L) and of the true evicted mass (exact keys), the gap in nats between
them, for the default witness (32 consecutive evicted tokens per group) and the variants
(--witness-variants: gN = N consecutive, cN = N clustered by a principal-axis tree; T7c holds for
any partition), witness bytes, and the AUROC of bound and of true mass against harm.
"""

import argparse
import json
import shlex
import math
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks.ruler import DEFAULT_TASKS
from benchmarks.stats import auroc, holm, hypergeom_le, mcnemar, wilson

ROOT = Path(__file__).resolve().parent.parent
EVICTORS = ("snapkv", "h2o", "tova", "knorm", "random", "streaming", "epikv")
PAPER = ("tova:heads=all,sinks=0,window=0", "h2o:sinks=0,window=half", "knorm:sinks=0,window=0")
ALL_NEEDS = {"window", "window_heads", "accumulated", "last", "change"}
ALPHA = 0.05


def parse_spec(spec, K, sinks, frac):
    """'tova:heads=all,window=0' at budget K -> (label, make_evictor spec, forced, scored)."""
    name, _, opts = spec.partition(":")
    kw = dict(item.split("=", 1) for item in filter(None, opts.split(",")))
    kw.setdefault("sinks", str(sinks))
    kw.setdefault("window", str(max(1, round(K * frac))))
    if kw["window"] == "half":
        kw["window"] = str(K // 2)
    forced = min(K, int(kw["sinks"]) + int(kw["window"]))
    label = spec if opts else name
    return label, f"{name}:{K}:" + ",".join(f"{k}={v}" for k, v in kw.items()), forced, K - forced


def batches(items, size):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def left_pad(seqs, pad):
    N = max(s.shape[0] for s in seqs)
    ids = torch.full((len(seqs), N), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), N, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, N - s.shape[0]:] = s
        mask[b, N - s.shape[0]:] = 1
    return ids, mask


def answer_texts(tok, tokens, allow, eos):
    """Per row: the text of its first allow[b] new tokens, cut at end-of-turn; and the token count."""
    out = []
    for b, row in enumerate(tokens.tolist()):
        row = row[:allow[b]]
        if eos in row:
            row = row[:row.index(eos) + 1]
        out.append((tok.decode(row), len(row)))
    return out


def _logit(p):
    p = p.clamp(1e-300, 1 - 1e-16)
    return (p / (1 - p)).log()


def cert_summary(trace, b, steps):
    """Per-input certificate numbers from the decode trace, row b, first `steps` steps."""
    if not trace or steps < 1:
        return {}
    tr = trace[:steps]
    bound = torch.stack([t["bound"][:, b] for t in tr]).double()             # [T, L, H]
    lo = torch.stack([t["log_odds"][:, b] for t in tr]).double()
    true = torch.stack([t["true"][:, b] for t in tr]).double()
    pos = true > 0
    r = {"bound_mean": float(bound.mean()), "informative": float((bound < 1).double().mean()),
         "log_odds_mean": float(lo.clamp(min=-50).mean()), "true_mean": float(true.mean()),
         "true_max": float(true.max()), "checks": int(bound.numel()),
         "violations": int((bound < true * (1 - 1e-12)).sum()),
         "gap_nats": float((lo - _logit(true))[pos].mean()) if bool(pos.any()) else None}
    for name in tr[0].get("variants", {}):
        v = torch.stack([t["variants"][name][:, b] for t in tr]).double()
        r[f"{name}_log_odds_mean"] = float(v.clamp(min=-50).mean())
        r[f"{name}_gap_nats"] = float((v - _logit(true))[pos].mean()) if bool(pos.any()) else None
        r[f"{name}_informative"] = float((torch.sigmoid(v) < 1 - 1e-6).double().mean())
        r[f"{name}_violations"] = int((torch.sigmoid(v) * (1 + 1e-9) < true * (1 - 1e-12)).sum())
    return r


def run_batch(model, tok, exs, args, variants):
    from benchmarks.ruler import allowance, build, score
    from fast.policies.evictors import copy_prefill, decode, evict, make_evictor, prefill
    from fast.policies.page import head_agreement_drop
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    built = [build(tok, ex, args.tokens) for ex in exs]
    ids, mask = left_pad([b[0][0] for b in built], tok.pad_token_id if tok.pad_token_id is not None else 0)
    allow = [allowance(tok, ex) for ex in exs]
    pre = prefill(model, ids, mask, needs=ALL_NEEDS)
    L = len(pre.cache.layers)
    full = decode(model, copy_prefill(pre, model.config), None, max_new_tokens=max(allow), certify=False, eos_token_id=eos)
    recs = []
    for b, ex in enumerate(exs):
        text, _ = answer_texts(tok, full["tokens"], allow, eos)[b]
        recs.append({"task": ex["task"], "haystack": ex["haystack"], "seed": ex["seed"], "depth": ex["depth"],
                     "tokens": built[b][1], "allowance": allow[b], "full": score(text, ex["answers"]),
                     "full_text": text, "runs": {}, "page_drop": {}})
    heads = [pre.layers[l].window_heads for l in range(L)]
    for K in args.budgets:
        w = max(1, round(K * args.window_frac))
        drop, _ = head_agreement_drop(heads, pre.valid, K, sinks=args.sinks, window=w)
        for b in range(len(exs)):
            recs[b]["page_drop"][str(K)] = float(drop[b])
        for spec in args.evictors:
            label, full_spec, forced, scored = parse_spec(spec, K, args.sinks, args.window_frac)
            mine = copy_prefill(pre, model.config)
            ev = evict(mine, make_evictor(full_spec), shadow=True, variants=variants)
            out = decode(model, mine, ev, max_new_tokens=max(allow), shadow=True, eos_token_id=eos,
                         cert_steps=args.cert_steps)
            texts = answer_texts(tok, out["tokens"], allow, eos)
            evicted = sum(w_.evicted for w_ in ev.witnesses if w_ is not None)
            wb = {"g32": ev.witness_bytes}
            wb.update({n: sum(x.nbytes for x in ws if x is not None) for n, ws in ev.variants.items()})
            for b, ex in enumerate(exs):
                text, n_new = texts[b]
                r = {"ok": score(text, ex["answers"]), "text": text, "forced": forced, "scored": scored}
                r.update(cert_summary(out["trace"], b, n_new - 1))
                # witness bytes over the fp16 K+V bytes of the evicted tokens (whole batch: same layout)
                r["witness_over_evicted"] = {n: round(v / max(1, evicted * 2 * 64 * 2), 5) for n, v in wb.items()}
                recs[b]["runs"][f"{label}@{K}"] = r
    return recs


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def _fmt_rate(k, n):
    if n == 0:
        return "-"
    lo, hi = wilson(k, n)
    return f"{k / n:.2f} [{lo:.2f}, {hi:.2f}]"


def summarize(records, settings, taus):
    """cells, significance lists and README tables from the per-input records."""
    full = [r["full"] for r in records]
    n = len(records)
    ans = [i for i in range(n) if full[i]]
    cells, findings = {}, []
    vs_full_p, labels = [], []
    for K in settings["budgets"]:
        for spec in settings["evictors"]:
            label, _, forced, scored = parse_spec(spec, K, settings["sinks"], settings["window_frac"])
            key = f"{label}@{K}"
            runs = [r["runs"][key] for r in records]
            ok = [x["ok"] for x in runs]
            harmed = [i for i in ans if not ok[i]]
            unharmed = [i for i in ans if ok[i]]
            p, a_only, b_only = mcnemar(full, ok)
            vs_full_p.append(p)
            labels.append(key)
            tau = taus[str(K)]
            gate = [r["page_drop"][str(K)] >= tau for r in records]
            ok_page = [o if g else f for o, g, f in zip(ok, gate, full)]
            page_harms = sum(1 for i in ans if gate[i] and not ok[i])
            n_gate_ans = sum(1 for i in ans if gate[i])
            drop_auc = auroc([records[i]["page_drop"][str(K)] for i in harmed],
                             [records[i]["page_drop"][str(K)] for i in unharmed])
            lo_b = auroc([runs[i].get("log_odds_mean") for i in harmed], [runs[i].get("log_odds_mean") for i in unharmed])
            tr_b = auroc([runs[i].get("true_mean") for i in harmed], [runs[i].get("true_mean") for i in unharmed])
            cell = {
                "label": label, "budget": K, "forced": forced, "scored": scored,
                "n": n, "n_answerable": len(ans), "correct": sum(ok), "accuracy": round(sum(ok) / n, 4),
                "accuracy_ci": wilson(sum(ok), n), "harmed": len(harmed),
                "harm_rate": round(len(harmed) / len(ans), 4) if ans else None, "harm_rate_ci": wilson(len(harmed), len(ans)),
                "gained": sum(1 for i in range(n) if ok[i] and not full[i]),
                "mcnemar_vs_full": {"p": p, "full_only": a_only, "evict_only": b_only},
                "page": {"tau": tau, "evicts": sum(gate), "evict_share": round(sum(gate) / n, 4),
                         "accuracy": round(sum(ok_page) / n, 4), "harms": page_harms,
                         "harm_rate": round(page_harms / len(ans), 4) if ans else None,
                         "harm_rate_ci": wilson(page_harms, len(ans)),
                         "blind_expected_harms": round(len(harmed) * n_gate_ans / len(ans), 3) if ans else None,
                         "p_blind_le_page": round(hypergeom_le(page_harms, len(ans), len(harmed), n_gate_ans), 4) if ans else None,
                         "drop_auroc_harm": drop_auc[0], "drop_auroc_ci": drop_auc[1]},
                "cert": {"log_odds_mean": _mean([x.get("log_odds_mean") for x in runs]),
                         "true_mean": _mean([x.get("true_mean") for x in runs]),
                         "gap_nats": _mean([x.get("gap_nats") for x in runs]),
                         "informative": _mean([x.get("informative") for x in runs]),
                         "checks": sum(x.get("checks", 0) for x in runs),
                         "violations": sum(x.get("violations", 0) for x in runs),
                         "auroc_bound_harm": lo_b[0], "auroc_bound_ci": lo_b[1],
                         "auroc_true_harm": tr_b[0], "auroc_true_ci": tr_b[1],
                         "witness_over_evicted": runs[0].get("witness_over_evicted", {}),
                         "variants": {v: {"gap_nats": _mean([x.get(f"{v}_gap_nats") for x in runs]),
                                          "informative": _mean([x.get(f"{v}_informative") for x in runs]),
                                          "violations": sum(x.get(f"{v}_violations", 0) for x in runs),
                                          "auroc_harm": auroc([runs[i].get(f"{v}_log_odds_mean") for i in harmed],
                                                              [runs[i].get(f"{v}_log_odds_mean") for i in unharmed])}
                                      for v in settings["witness_variants"]}},
            }
            cells[key] = cell
    # families: vs the full cache (all cells), and pairwise within each budget
    for key, p_adj in zip(labels, holm(vs_full_p)):
        cells[key]["mcnemar_vs_full"]["p_holm"] = round(p_adj, 5)
        cells[key]["mcnemar_vs_full"]["significant"] = p_adj < ALPHA
        c = cells[key]
        if p_adj < ALPHA:
            findings.append(f"{key}: accuracy {c['accuracy']:.2f} vs full {sum(full) / n:.2f}, exact McNemar "
                            f"p = {c['mcnemar_vs_full']['p']:.2g} (Holm {p_adj:.2g}; {c['mcnemar_vs_full']['full_only']} "
                            f"inputs lost, {c['mcnemar_vs_full']['evict_only']} gained)")
    pairs = {}
    for K in settings["budgets"]:
        keys = [k for k in labels if k.endswith(f"@{K}")]
        ps, names = [], []
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                oa = [r["runs"][a]["ok"] for r in records]
                ob = [r["runs"][b]["ok"] for r in records]
                p, x, y = mcnemar(oa, ob)
                ps.append(p)
                names.append((a, b, x, y))
        for (a, b, x, y), p, p_adj in zip(names, ps, holm(ps)):
            pairs[f"{a} vs {b}"] = {"p": round(p, 5), "p_holm": round(p_adj, 5), "a_only": x, "b_only": y,
                                    "significant": p_adj < ALPHA}
            if p_adj < ALPHA:
                findings.append(f"{a} vs {b}: {x} inputs right only with {a.split('@')[0]}, {y} only with "
                                f"{b.split('@')[0]}; exact McNemar p = {p:.2g} (Holm within budget {K}: {p_adj:.2g})")
    if not any("McNemar" in f for f in findings):
        findings.append(f"no evictor differs significantly (exact McNemar, Holm) from the full cache or from another "
                        f"evictor at this size ({n} inputs, {len(ans)} answerable)")
    ce = [c["cert"] for c in cells.values()]
    below_half = sum(1 for r in records for x in r["runs"].values() if x.get("log_odds_mean") is not None and x["log_odds_mean"] < 0)
    checks, viol = sum(c["checks"] for c in ce), sum(c["violations"] for c in ce)
    gaps = {"g32": _mean([c["gap_nats"] for c in ce])}
    gaps.update({v: _mean([c["variants"][v]["gap_nats"] for c in ce]) for v in settings["witness_variants"]})
    wb = {k: _mean([c["witness_over_evicted"].get(k) for c in ce]) for k in gaps}
    findings.append(f"eviction certificate: {viol} violations in {checks} checks against the exact-key truth; mean "
                    f"bound log-odds {_mean([c['log_odds_mean'] for c in ce])} (TV bound ~1) while the true evicted mass "
                    f"averages {_mean([c['true_mean'] for c in ce])}; looseness in nats (bound minus true log-odds): "
                    + ", ".join(f"{k} {g} at {wb[k]} witness bytes per evicted K+V byte" for k, g in gaps.items())
                    + f"; inputs whose mean bound is below 1/2 (log-odds < 0): {below_half} of {len(records) * len(cells)}")
    page_better = [k for k, c in cells.items() if c["page"]["p_blind_le_page"] is not None and c["page"]["p_blind_le_page"] < ALPHA]
    tested = [k for k, c in cells.items() if c["page"]["p_blind_le_page"] is not None]
    adj = dict(zip(tested, holm([cells[k]["page"]["p_blind_le_page"] for k in tested])))
    for k in tested:
        cells[k]["page"]["p_blind_le_page_holm"] = round(adj[k], 4)
    page_holm = [k for k in tested if adj[k] < ALPHA]
    findings.append("PAGE beats the blind gate (hypergeometric p < 0.05, not adjusted) in "
                    f"{len(page_better)} of {len(cells)} cells" + (f": {', '.join(page_better)}" if page_better else "")
                    + f"; Holm-adjusted over the {len(tested)} cells, in {len(page_holm)}"
                    + (f": {', '.join(f'{k} (Holm p = {adj[k]:.2g})' for k in page_holm)}" if page_holm else ""))
    return cells, pairs, findings


def carried_note(st):
    """'; the first K inputs carried from FILE (...)' when the run started from an earlier one's records."""
    c = st.get("carried")
    return (f"; the first {c['records']} inputs' records carried from {c['file']} (the same inputs and settings, "
            f"run with more tasks: `--carry`)" if c else "")


def tables(data):
    st, cells = data["settings"], data["cells"]
    n = len(data["records"])
    full = [r["full"] for r in data["records"]]
    by_hay = {h: [r["full"] for r in data["records"] if r["haystack"] == h] for h in st["haystacks"]}
    by_task = {t: [r["full"] for r in data["records"] if r["task"] == t] for t in st["tasks"]}
    head = (f"SmolLM2-135M, {n} inputs of ~{st['tokens']} tokens ({', '.join(st['tasks'])}; haystacks "
            + ", ".join(f"{h} {sum(v)}/{len(v)}" for h, v in by_hay.items())
            + f" answered by the full cache; per task " + ", ".join(f"{t} {sum(v)}/{len(v)}" for t, v in by_task.items())
            + f"); full-cache accuracy {_fmt_rate(sum(full), n)}" + carried_note(st))
    acc = {"title": f"Eviction accuracy and harm, {head}. Harm = wrong with eviction among the "
                    f"{sum(full)} inputs the full cache answers; [95% Wilson]; p: exact McNemar vs the full cache, "
                    "Holm-adjusted over all rows",
           "header": ["evictor", "budget", "forced/scored", "accuracy", "harm rate", "lost/gained vs full", "p (Holm)",
                      "significant"],
           "rows": []}
    page = {"title": f"PAGE (query-head agreement, tau per budget at evict rate {st['page_evict_rate']}) vs a blind gate "
                     "evicting as many inputs at random",
            "header": ["evictor", "budget", "PAGE evicts", "harm rate, evictor alone", "harm rate with PAGE",
                       "blind gate, expected harms", "PAGE harms", "P(blind <= PAGE)", "Holm", "AUROC of drop vs harm"],
            "rows": []}
    cert = {"title": "Eviction certificate in shadow mode (truth from exact keys): mean log-odds bound, true evicted "
                     "mass, looseness (nats, bound log-odds minus true log-odds) per witness, witness bytes per fp16 "
                     "K+V byte evicted, AUROC against harm [95%]",
            "header": ["evictor", "budget", "true mass", "bound log-odds", "gap g32"]
            + [f"gap {v}" for v in st["witness_variants"]] + ["bytes g32"] + [f"bytes {v}" for v in st["witness_variants"]]
            + ["AUROC bound", "AUROC true mass", "violations/checks"],
            "rows": []}

    def f(x, d=2):
        return "-" if x is None else f"{x:.{d}f}"

    def ci(a):
        return "-" if a[0] is None else f"{a[0]:.2f} [{a[1][0]:.2f}, {a[1][1]:.2f}]"
    for key, c in cells.items():
        m = c["mcnemar_vs_full"]
        acc["rows"].append([c["label"], c["budget"], f"{c['forced']}/{c['scored']}", _fmt_rate(c["correct"], c["n"]),
                            _fmt_rate(c["harmed"], c["n_answerable"]), f"{m['full_only']}/{m['evict_only']}",
                            f"{m['p_holm']:.2g}", "yes" if m["significant"] else "no"])
        p = c["page"]
        page["rows"].append([c["label"], c["budget"], f"{p['evicts']}/{c['n']}", _fmt_rate(c["harmed"], c["n_answerable"]),
                             _fmt_rate(p["harms"], c["n_answerable"]), f(p["blind_expected_harms"]), p["harms"],
                             f(p["p_blind_le_page"], 3), f(p.get("p_blind_le_page_holm"), 3),
                             ci((p["drop_auroc_harm"], p["drop_auroc_ci"]))])
        ce = c["cert"]
        w = ce["witness_over_evicted"]
        cert["rows"].append([c["label"], c["budget"], f(ce["true_mean"], 3), f(ce["log_odds_mean"], 1), f(ce["gap_nats"], 1)]
                            + [f(ce["variants"][v]["gap_nats"], 1) for v in st["witness_variants"]]
                            + [f(w.get("g32"), 4)] + [f(w.get(v), 4) for v in st["witness_variants"]]
                            + [ci((ce["auroc_bound_harm"], ce["auroc_bound_ci"])), ci((ce["auroc_true_harm"], ce["auroc_true_ci"])),
                               f"{ce['violations']}/{ce['checks']}"])
    return [acc, page, cert]


def calibrate_taus(model, tok, args):
    from benchmarks.ruler import build, examples
    from fast.policies.evictors import prefill
    from fast.policies.page import calibrate, head_agreement_drop
    exs = examples(args.calib, tasks=tuple(args.tasks), seed0=10_000, haystacks=tuple(args.haystacks))
    drops = {str(K): [] for K in args.budgets}
    for ex in exs:
        ids, _ = build(tok, ex, args.tokens)
        pre = prefill(model, ids, needs={"window_heads"})
        heads = [pre.layers[l].window_heads for l in range(len(pre.cache.layers))]
        for K in args.budgets:
            d, _ = head_agreement_drop(heads, pre.valid, K, sinks=args.sinks, window=max(1, round(K * args.window_frac)))
            drops[str(K)].append(float(d[0]))
    taus = {K: calibrate(d, args.page_rate) for K, d in drops.items()}
    depths = sorted(ex["depth"] for ex in exs)
    return taus, drops, {"n": len(exs), "depth_min": depths[0], "depth_max": depths[-1]}


def machine():
    import transformers
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": __import__("os").cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="inputs (cycling over tasks, then haystacks)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="default: the tasks the full cache answers "
                    "(ruler.DEFAULT_TASKS); vartrack is available")
    ap.add_argument("--haystacks", default="synthetic,natural")
    ap.add_argument("--budgets", default="64,128,256")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window-frac", type=float, default=0.125, help="recent window = round(budget * this)")
    ap.add_argument("--evictors", default=",".join(EVICTORS), help="specs separated by ';' or ','-free names")
    ap.add_argument("--paper", action="store_true", help="also run the papers' conventions: " + "; ".join(PAPER))
    ap.add_argument("--witness-variants", default="g8,c32")
    ap.add_argument("--calib", type=int, default=100, help="unlabelled prompts for PAGE's tau")
    ap.add_argument("--page-rate", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--cert-steps", type=int, default=3, help="decode steps certified and traced per input")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "evict_eval.json"))
    ap.add_argument("--resummarize", default=None, help="only recompute the summary of this results file")
    ap.add_argument("--resume", action="store_true", help="continue the interrupted run in --out (same settings): "
                    "keep its records and PAGE taus, run the inputs after them")
    ap.add_argument("--carry", default=None, help="start from the records of this earlier results file for the inputs "
                    "it holds (same settings except --tasks and --n; PAGE is calibrated afresh)")
    args = ap.parse_args(argv)
    if args.resummarize:
        data = json.loads(Path(args.resummarize).read_text())
        data["cells"], data["pairs"], data["findings"] = summarize(data["records"], data["settings"], data["page_tau"])
        data["readme_tables"] = tables(data)
        Path(args.resummarize).write_text(json.dumps(data, indent=1))
        return 0
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.tasks, args.haystacks = args.tasks.split(","), args.haystacks.split(",")
    sep = ";" if ";" in args.evictors else ","
    args.evictors = [e for e in args.evictors.split(sep) if e] + (list(PAPER) if args.paper else [])
    variants = {}
    for v in filter(None, args.witness_variants.split(",")):
        if v[0] not in "gc" or not v[1:].isdigit():
            ap.error(f"--witness-variants: {v!r} is not gN or cN")
        variants[v] = {"group_size": int(v[1:]), "cluster": v[0] == "c"}
    torch.set_num_threads(args.threads)
    from benchmarks.ruler import carried, examples, resumed
    from fast.integrations.model import load_smollm2
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    model, tok = load_smollm2()
    t0 = time.time()
    records, before, args.carried = [], 0.0, None
    keys = ("n", "tasks", "haystacks", "tokens", "budgets", "sinks", "window_frac", "evictors", "witness_variants",
            "page_evict_rate", "batch", "cert_steps")
    now = {"n": args.n, "tasks": args.tasks, "haystacks": args.haystacks, "tokens": args.tokens, "budgets": args.budgets,
           "sinks": args.sinks, "window_frac": args.window_frac, "evictors": args.evictors,
           "witness_variants": list(variants), "page_evict_rate": args.page_rate, "batch": args.batch,
           "cert_steps": args.cert_steps}
    exs = examples(args.n, tasks=tuple(args.tasks), haystacks=tuple(args.haystacks))
    if args.resume:
        records, before = resumed(args.out, now, keys)
    elif args.carry:
        records, args.carried = carried(args.carry, now, keys, exs)
        print(f"carried {len(records)} inputs from {args.carry}", flush=True)
    if records and args.resume:
        old = json.loads(Path(args.out).read_text())
        taus, calib_drops, calib_info = old["page_tau"], old["page_calib_drops"], old["settings"]["calib"]
        args.carried = old["settings"].get("carried")
        t0 -= before
        print(f"resuming {args.out}: {len(records)} inputs done", flush=True)
    else:
        taus, calib_drops, calib_info = calibrate_taus(model, tok, args)
        print(f"calibrated PAGE on {calib_info['n']} prompts in {time.time() - t0:.0f}s: {taus}", flush=True)
    exs = exs[len(records):]
    for batch in batches(exs, args.batch):
        records += run_batch(model, tok, batch, args, variants)
        print(f"[{len(records)}/{args.n}] full {sum(r['full'] for r in records)}/{len(records)}, {time.time() - t0:.0f}s",
              flush=True)
        write(args, argv, records, taus, calib_drops, calib_info, variants, t0)   # a valid file after every batch
    return 0


def write(args, argv, records, taus, calib_drops, calib_info, variants, t0):
    """The results file for the records so far (`done` < `n` while the run is in progress)."""
    from benchmarks.ruler import natural_source
    settings = {"n": args.n, "done": len(records), "tasks": args.tasks, "haystacks": args.haystacks, "tokens": args.tokens,
                "budgets": args.budgets, "sinks": args.sinks, "window_frac": args.window_frac,
                "evictors": args.evictors, "witness_variants": list(variants), "page_evict_rate": args.page_rate,
                "page_heads": "query", "calib": calib_info, "batch": args.batch,
                "natural_haystack": natural_source(), "cert_steps": args.cert_steps,
                "generation": "greedy, ruler.allowance(task) new tokens, stop at <|im_end|>"}
    if args.carried:
        settings["carried"] = args.carried    # the first records come from this earlier run (same inputs, same settings)
    cells, pairs, findings = summarize(records, settings, taus)
    data = {"command": "nice -n 10 .venv/bin/python -m benchmarks.evict_eval "
                       + shlex.join(argv if argv is not None else sys.argv[1:]),
            "machine": machine(), "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, fp32, CPU)",
            "settings": settings, "seconds": round(time.time() - t0, 1),
            "full_accuracy": round(sum(r["full"] for r in records) / len(records), 4),
            "page_tau": taus, "page_calib_drops": calib_drops, "cells": cells, "pairs": pairs, "findings": findings,
            "records": records}
    data["readme_tables"] = tables(data)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    sys.exit(main())
