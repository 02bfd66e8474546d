"""Eviction on SmolLM2-135M: accuracy, harm with and without PAGE, and the eviction certificate.

    nice -n 10 .venv/bin/python -m benchmarks.evict_eval [--n 25] [--tokens 768] -> results/evict_eval.json

Per RULER-style example (benchmarks/ruler.py, fixed seeds): one prefill collecting every score
(copied per configuration), a full-cache answer, then for each evictor x budget an evicted answer
with the certificate traced at every decode step, layer and head (shadow mode: the true evicted
mass too, to count violations). PAGE's tau is calibrated per budget on separate unlabelled
prompts (evict rate 0.5). Harm = answered correctly with the full cache and wrongly with
eviction; the harm rate is over the inputs the full cache answers correctly. 95 % CIs: paired
bootstrap over examples (2000 resamples). Certificate separation: mean log-odds bound
(log U - log L, whose sigmoid is the TV bound) on harmed vs unharmed inputs, and its AUC.
Scoring cost: peak extra memory (resident set sampled every 0.2 ms in a fresh process, above the inputs) and time of the SnapKV and the
EpiKV scoring of one layer as the context grows, on synthetic tensors of SmolLM2's shapes.
"""

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EVICTORS = ("snapkv", "h2o", "tova", "knorm", "random", "streaming", "epikv")
ALL_NEEDS = {"window", "accumulated", "last", "change"}
README_HEADER = ["evictor", "budget", "accuracy", "harm rate", "harm rate with PAGE", "PAGE evicts",
                 "blind gate, same share", "cert log-odds harmed", "cert log-odds unharmed", "cert < 1 share",
                 "violations/checks"]


def bootstrap(values_fn, n, reps=2000, seed=0):
    """95 % percentile interval of values_fn(idx) over resampled example indices."""
    rng = random.Random(seed)
    stats = sorted(values_fn([rng.randrange(n) for _ in range(n)]) for _ in range(reps))
    stats = [s for s in stats if s == s]                       # drop NaN (no eligible example drawn)
    if not stats:
        return [None, None]
    return [round(stats[int(0.025 * len(stats))], 4), round(stats[int(0.975 * len(stats)) - 1], 4)]


def auc(pos, neg):
    """P(score of a harmed input > score of an unharmed one), ties count half."""
    if not pos or not neg:
        return None
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return round(wins / (len(pos) * len(neg)), 4)


def run_example(model, tok, ex, args, taus):
    from benchmarks.ruler import build, score
    from fast.policies.evictors import copy_prefill, decode, evict, make_evictor, prefill
    from fast.policies.page import head_agreement_drop
    ids, n = build(tok, ex, args.tokens)
    pre = prefill(model, ids, needs=ALL_NEEDS)
    L = len(pre.cache.layers)
    full = decode(model, copy_prefill(pre, model.config), None, max_new_tokens=args.max_new, certify=False)
    full_ok = score(tok.decode(full["tokens"][0]), ex["answers"])
    rec = {"task": ex["task"], "seed": ex["seed"], "depth": ex["depth"], "tokens": n, "full": full_ok, "runs": {}}
    windows = [pre.layers[l].window for l in range(L)]
    for budget in args.budgets:
        drop, _ = head_agreement_drop(windows, pre.valid, budget)
        rec.setdefault("page_drop", {})[str(budget)] = float(drop[0])
        for name in args.evictors:
            mine = copy_prefill(pre, model.config)
            ev = evict(mine, make_evictor(f"{name}:{budget}"), shadow=True)
            out = decode(model, mine, ev, max_new_tokens=args.max_new, shadow=True)
            text = tok.decode(out["tokens"][0])
            r = {"ok": score(text, ex["answers"]), "witness_bytes": ev.witness_bytes,
                 "evicted_tokens": sum(w.evicted for w in ev.witnesses if w is not None),
                 "bytes_before": ev.bytes_before, "bytes_after": ev.bytes_after}
            if out["trace"]:
                bound = torch.stack([t["bound"] for t in out["trace"]]).double()
                true = torch.stack([t["true"] for t in out["trace"]])
                lo = torch.stack([t["log_odds"] for t in out["trace"]])
                r.update(bound_mean=float(bound.mean()), informative=float((bound < 1).double().mean()),
                         log_odds_mean=float(lo.clamp(min=-50).mean()), true_mean=float(true.mean()),
                         checks=int(bound.numel()), violations=int((bound < true * (1 - 1e-12)).sum()),
                         worst_ratio=float((true / bound).max()))
            rec["runs"][f"{name}:{budget}"] = r
    return rec


def summarize(records, args, taus):
    rows, cells = [], {}
    full = [r["full"] for r in records]
    n = len(records)
    for budget in args.budgets:
        for name in args.evictors:
            key = f"{name}:{budget}"
            ok = [r["runs"][key]["ok"] for r in records]
            gate = [r["page_drop"][str(budget)] >= taus[str(budget)] for r in records]
            ok_page = [o if g else f for o, g, f in zip(ok, gate, full)]

            def harm(idx, okv):
                elig = [i for i in idx if full[i]]
                return sum(1 for i in elig if not okv[i]) / len(elig) if elig else float("nan")
            all_idx = list(range(n))
            harmed = [i for i in all_idx if full[i] and not ok[i]]
            unharmed = [i for i in all_idx if full[i] and ok[i]]
            lo = [records[i]["runs"][key].get("log_odds_mean") for i in all_idx]
            bd = [records[i]["runs"][key].get("bound_mean") for i in all_idx]
            runs = [records[i]["runs"][key] for i in all_idx]
            cell = {
                "accuracy": round(sum(ok) / n, 4), "accuracy_page": round(sum(ok_page) / n, 4),
                "accuracy_delta_ci": bootstrap(lambda idx: sum(ok[i] - full[i] for i in idx) / n, n),
                "harm_rate": round(harm(all_idx, ok), 4), "harm_rate_ci": bootstrap(lambda idx: harm(idx, ok), n),
                "harm_rate_page": round(harm(all_idx, ok_page), 4),
                "harm_rate_page_ci": bootstrap(lambda idx: harm(idx, ok_page), n),
                "page_evict_share": round(sum(gate) / n, 4),
                # a gate blind to harm that evicts on the same share of inputs (expected harm rate)
                "harm_rate_blind_gate": round(harm(all_idx, ok) * sum(gate) / n, 4),
                "n_harmed": len(harmed), "n_unharmed": len(unharmed),
                "log_odds_harmed": _mean([lo[i] for i in harmed]), "log_odds_unharmed": _mean([lo[i] for i in unharmed]),
                "bound_harmed": _mean([bd[i] for i in harmed]), "bound_unharmed": _mean([bd[i] for i in unharmed]),
                "log_odds_auc": auc([lo[i] for i in harmed if lo[i] is not None], [lo[i] for i in unharmed if lo[i] is not None]),
                "informative_share": _mean([r.get("informative") for r in runs]),
                "checks": sum(r.get("checks", 0) for r in runs), "violations": sum(r.get("violations", 0) for r in runs),
                "worst_true_over_bound": max((r.get("worst_ratio", 0) for r in runs), default=0),
                "witness_over_evicted_fp16": round(sum(r["witness_bytes"] for r in runs)
                                                   / max(1, sum(r["evicted_tokens"] for r in runs) * 2 * 64 * 2), 5),
            }
            cells[key] = cell
            rows.append([name, budget, f"{cell['accuracy']:.2f}", cell["harm_rate"], cell["harm_rate_page"],
                         cell["page_evict_share"], cell["harm_rate_blind_gate"], cell["log_odds_harmed"], cell["log_odds_unharmed"],
                         cell["informative_share"], f"{cell['violations']}/{cell['checks']}"])
    return cells, rows


def resummarize(path):
    """Recompute cells and the README table of a results file from its records."""
    data = json.loads(Path(path).read_text())
    st = data["settings"]
    args = argparse.Namespace(budgets=st["budgets"], evictors=st["evictors"])
    cells, rows = summarize(data["records"], args, data["page_tau"])
    data["cells"], data["readme_table"]["rows"] = cells, rows
    data["readme_table"]["header"] = README_HEADER
    Path(path).write_text(json.dumps(data, indent=1))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


SCORING_PROBE = r"""
import sys, time, torch
torch.set_num_threads(1)
method, N = sys.argv[1], int(sys.argv[2])
H, Hkv, D, HID = 9, 3, 64, 576
g = torch.Generator().manual_seed(0)
if method == "snapkv":
    from fast.policies.evictors import _attention_rows, _gqa_mean
    q = torch.randn(1, H, N, D, generator=g); k = torch.randn(1, Hkv, N, D, generator=g)
else:
    from fast.policies.evictors import rolling_zscore
    h_in = torch.randn(1, N, HID, generator=g); h_out = torch.randn(1, N, HID, generator=g)
import os, threading
PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * PAGE
base, peak, running = rss(), [rss()], [True]
def sample():                       # current RSS every 0.2 ms; the peak above the inputs is the cost
    while running[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.0002)
th = threading.Thread(target=sample); th.start()
t = time.perf_counter()
with torch.no_grad():
    if method == "snapkv":   # obs window of 64 queries over N keys, GQA mean, one layer
        s = _gqa_mean(_attention_rows(q, k, None, 0.125, range(N - 64, N)).mean(2), Hkv)
    else:                    # residual change of one layer, then the z-score of the token scores
        e = (h_out - h_in).float().norm(dim=-1) / h_in.float().norm(dim=-1)
        s = rolling_zscore(e, torch.ones(1, N, dtype=torch.bool), 128)
dt = time.perf_counter() - t
running[0] = False; th.join()
print(dt, peak[0] - base)
"""


def scoring_cost(lengths, cap_bytes):
    """Peak extra memory (bytes above the inputs) and time of one layer's scoring, per method and N."""
    out = {}
    for method in ("snapkv", "epikv"):
        pts = []
        for N in lengths:
            res = subprocess.run([sys.executable, "-c", SCORING_PROBE, method, str(N)], capture_output=True,
                                 text=True, cwd=ROOT, check=True)
            dt, mem = res.stdout.split()
            pts.append({"tokens": N, "seconds": round(float(dt), 5), "peak_extra_bytes": int(float(mem))})
        big = pts[-1]
        per_token = max(big["peak_extra_bytes"], 1) / big["tokens"]
        out[method] = {"points": pts, "bytes_per_token_at_largest": round(per_token, 1),
                       "longest_context_within_cap": int(cap_bytes / per_token)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=25)
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--tasks", default="passkey,needle,multikey,multivalue,vartrack")
    ap.add_argument("--budgets", default="64,128,256,512")
    ap.add_argument("--evictors", default=",".join(EVICTORS))
    ap.add_argument("--calib", type=int, default=10, help="unlabelled prompts for PAGE's tau, per budget")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--scoring-lengths", default="2048,8192,32768")
    ap.add_argument("--cap-mib", type=float, default=256.0)
    ap.add_argument("--out", default=str(ROOT / "results" / "evict_eval.json"))
    ap.add_argument("--resummarize", default=None, help="only recompute the summary of this results file")
    args = ap.parse_args(argv)
    if args.resummarize:
        resummarize(args.resummarize)
        return 0
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.evictors = args.evictors.split(",")
    torch.set_num_threads(1)
    from benchmarks.ruler import build, examples
    from fast.integrations.model import load_smollm2
    from fast.policies.page import calibrate, prompt_drop
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    model, tok = load_smollm2()
    t0 = time.time()
    calib = [build(tok, ex, args.tokens)[0] for ex in examples(args.calib, seed0=10_000)]
    taus, calib_drops = {}, {}
    for budget in args.budgets:
        drops = [float(prompt_drop(model, ids, budget)[0]) for ids in calib]
        taus[str(budget)] = calibrate(drops, 0.5)
        calib_drops[str(budget)] = drops
    records = []
    for i, ex in enumerate(examples(args.n, tasks=tuple(args.tasks.split(",")))):
        records.append(run_example(model, tok, ex, args, taus))
        print(f"[{i + 1}/{args.n}] {ex['task']} full={records[-1]['full']} "
              f"{sum(r['ok'] for r in records[-1]['runs'].values())}/{len(records[-1]['runs'])} ok, {time.time() - t0:.0f}s",
              flush=True)
    cells, rows = summarize(records, args, taus)
    cost = scoring_cost([int(x) for x in args.scoring_lengths.split(",")], args.cap_mib * 2 ** 20)
    data = {
        "command": "nice -n 10 .venv/bin/python -m benchmarks.evict_eval " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "threads": 1},
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, fp32, CPU)",
        "settings": {"n": args.n, "tasks": args.tasks.split(","), "tokens": args.tokens, "budgets": args.budgets, "evictors": args.evictors,
                     "max_new": args.max_new, "group_size": 32, "bands": 8, "page_evict_rate": 0.5,
                     "calib_prompts": args.calib},
        "full_accuracy": round(sum(r["full"] for r in records) / len(records), 4),
        "page_tau": taus, "page_calib_drops": calib_drops, "cells": cells, "scoring_cost": cost,
        "seconds": round(time.time() - t0, 1), "records": records,
        "readme_table": {
            "title": f"Eviction on SmolLM2-135M, {args.n} RULER-style inputs ({args.tasks}) of ~{args.tokens} tokens "
                     f"(full-cache accuracy {sum(r['full'] for r in records) / len(records):.2f})",
            "header": README_HEADER, "rows": rows},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
