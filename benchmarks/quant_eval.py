"""Quantized KV caches on SmolLM2-135M in the eviction harness's tasks: raw vs gated accuracy.

    nice -n 10 .venv/bin/python -m benchmarks.quant_eval [--n 16] [--tokens 512] -> results/quant_eval.json

For every registered scheme (fast.core.schemes.scheme_names(): int8, int8_dither, int4, fp8_e4m3,
fp8_e5m2, kivi2, any scheme registered later; prerope4 names fast.core.prerope's scheme) and every gate (none,
certified:TAU, risk:K): greedy answers of the RULER-style inputs of benchmarks/ruler.py (both
haystacks, depths spread, each task's own allowance, stop at end-of-turn), served from a
CertifiedCache through the kvcert meter. The exact prefill is shared (the prefill reads exact keys
under every scheme); for risk:K the per-(layer, KV head) risk is computed exactly as the meter's
prefill does (the certificate of the last prompt query on the compressed cache), from the queries
captured during the shared prefill. Reported per cell: accuracy and harm rate (wrong where the
full cache is right) with 95 % Wilson intervals, exact McNemar p vs the full cache (Holm over all
cells) and gated vs raw, device bytes per token (codes, scales, witness, exact sinks and window),
repairs per request (KV heads served exact: fresh certified repairs plus risk's K) and repair
traffic. The ungated runs are in shadow mode: per input the mean certificate (min of the forms,
before any repair) and the mean true TV against the exact keys over the first --cert-steps steps,
whose AUROCs against harm feed the harm-predictor study.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks.evict_eval import carried_note, machine
from benchmarks.ruler import DEFAULT_TASKS
from benchmarks.stats import auroc, holm, mcnemar, wilson

ROOT = Path(__file__).resolve().parent.parent
ALPHA = 0.05


class LastQueries:
    """A Collector that keeps the last prompt query of every layer: [B, H, D] (post-RoPE), and its last QWIN
    query rows [B, H, QWIN, D] (the rows the meter's prefill fixes a subspace witness's basis from)."""
    needs = set()
    read = None  # a collector that only observes (fast.policies.evictors.collecting: no read of its own)

    def __init__(self):
        self.q, self.rows, self.scale = {}, {}, None

    def observe(self, module, query, key, attention_mask, scale):
        from fast.core.subspace import QWIN
        if query.shape[2] > 1:
            self.q[module.layer_idx] = query[:, :, -1].float().clone()
            self.rows[module.layer_idx] = query[:, :, -QWIN:].float().clone()
            self.scale = scale


def shared_prefill(model, ids):
    from transformers import DynamicCache

    from fast.policies.evictors import collecting
    cache, col = DynamicCache(config=model.config), LastQueries()
    col.layers = {}
    with torch.no_grad(), collecting(model, col):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    return cache, logits, col


def apply_risk_from_queries(cache, col):
    """What the meter's prefill_step does for risk:K, from the captured last prompt queries."""
    from fast.integrations import hf_meter
    for l, layer in enumerate(cache.layers):
        if layer.nq:
            k, v = layer.served()
            _, cert = hf_meter._certify(layer, col.q[l], k.float(), v.float(), col.scale, layer.valid)
            layer.risk = torch.stack([hf_meter._slot(cert["min"], layer.Hkv), hf_meter._slot(cert["max_c"], layer.Hkv)], -1)
    cache.apply_risk()


def greedy(model, cache, logits, n_new, eos):
    tok = logits.argmax(-1)
    out = [int(tok)]
    with torch.no_grad():
        while len(out) < n_new and out[-1] != eos:
            logits = model(input_ids=tok[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
            tok = logits.argmax(-1)
            out.append(int(tok))
    return out


def run_input(model, tok, ex, args):
    from benchmarks.ruler import allowance, build, score
    from fast.integrations.hf_cache import CertifiedCache
    from fast.integrations.hf_meter import enable, set_current
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids, n = build(tok, ex, args.tokens)
    allow = allowance(tok, ex)
    shared, logits, col = shared_prefill(model, ids)
    import copy
    full = greedy(model, copy.deepcopy(shared), logits, allow, eos)
    rec = {"task": ex["task"], "haystack": ex["haystack"], "seed": ex["seed"], "depth": ex["depth"], "tokens": n,
           "allowance": allow, "full": score(tok.decode(full), ex["answers"]), "full_text": tok.decode(full), "runs": {}}
    enable(model)
    for scheme in args.schemes:
        for gate in args.gates:
            set_current(None)
            spec, *opts = gate.split("/")  # "ladder:0.2/box/keys/sub8": box_form, ladder_values=False, subspace=8
            shadow = spec == "none"
            sub = [int(o[3:]) for o in opts if o.startswith("sub") and o[3:].isdigit()]
            bad = set(opts) - {"box", "keys"} - {f"sub{m}" for m in sub}
            if bad:
                raise SystemExit(f"gate {gate!r}: unknown option(s) {sorted(bad)} (use /box, /keys, /subM)")
            cache = CertifiedCache(model.config, scheme_for(scheme, model.config), gate=spec, shadow=shadow, seed=ex["seed"],
                                   box_form="box" in opts, subspace=sub[0] if sub else 0,
                                   **({"ladder_values": False} if "keys" in opts else {}))
            cache.fill_from(shared)
            for l, layer in enumerate(cache.layers):  # the basis from the prefill's queries, as the meter's prefill does
                layer.set_basis(col.rows[l])
            if gate.startswith("risk"):
                apply_risk_from_queries(cache, col)
            out = greedy(model, cache, logits, allow, eos)
            mem = cache.memory()
            recs = [r for r in cache.records if r["step"] <= args.cert_steps]
            r = {"ok": score(tok.decode(out), ex["answers"]), "text": tok.decode(out),
                 "bytes_per_token": round(mem["device_bytes_per_token"], 2), "fp16_bytes_per_token": mem["fp16_bytes_per_token"],
                 "bytes_per_token_at_fp16": round(mem["device_bytes_fp16_per_token"], 2),
                 "heads_per_rung": cache.heads_per_rung(), "promotions": sum(x["fresh_repairs"] for x in cache.records),
                 "repairs": int(sum(int(layer.repaired.sum()) for layer in cache.layers)),
                 "repair_traffic_bytes": int(mem["repair_traffic_bytes"])}
            if recs:
                pre = torch.stack([x["pre_min"] for x in recs]).double()
                r["cert_mean"] = float(pre.mean())
                r["cert_informative"] = float((pre < 1).double().mean())
                if shadow:
                    true = torch.stack([x["true_tv"] for x in recs]).double()
                    r["true_tv_mean"] = float(true.mean())
                    r["violations"] = int((pre < true * (1 - 1e-6)).sum())
                    r["checks"] = int(pre.numel())
                    r["covered"] = int((pre <= COVER).sum())  # reads certified <= COVER
                    r["looseness_hist"] = log_hist(pre, true)
                    if "dither_estimate" in recs[0]:  # the dither tier: an estimate in decoding (spec A2)
                        est = torch.stack([x["dither_estimate"] for x in recs]).double()
                        r["dither_covered"] = int((est <= COVER).sum())
                        r["dither_hist"] = log_hist(est, true)
                        r["dither_below_true"] = int((est < true * (1 - 1e-6)).sum())
            rec["runs"][f"{scheme}|{gate}"] = r
    model.set_attn_implementation("sdpa")
    return rec


COVER = 0.2
HIST_STEP = 0.01  # looseness histogram: bins of log10(bound / true TV) this wide


def log_hist(bound, true):
    """{bin: count} of log10(bound / true TV) per read in bins of HIST_STEP (reads with true TV 0 left out):
    pooled over inputs, it gives the median and p90 of bound / true TV to within 10^HIST_STEP (2.3%)."""
    ok = true > 0
    b = torch.floor(torch.log10(bound[ok] / true[ok]) / HIST_STEP).long()
    vals, counts = torch.unique(b, return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(vals, counts)}


def hist_quantile(hists, q):
    """The q-quantile of bound / true TV from pooled log_hist bins (the upper edge of the bin holding it)."""
    pooled = {}
    for h in hists:
        for k, c in h.items():
            pooled[int(k)] = pooled.get(int(k), 0) + c
    total = sum(pooled.values())
    if not total:
        return None
    seen = 0
    for k in sorted(pooled):
        seen += pooled[k]
        if seen >= q * total:
            return round(10 ** ((k + 1) * HIST_STEP), 3)


def summarize(records, settings):
    full = [r["full"] for r in records]
    n = len(records)
    ans = [i for i in range(n) if full[i]]
    cells, ps, keys = {}, [], []
    for scheme in settings["schemes"]:
        for gate in settings["gates"]:
            key = f"{scheme}|{gate}"
            runs = [r["runs"][key] for r in records]
            ok = [x["ok"] for x in runs]
            harmed = [i for i in ans if not ok[i]]
            unharmed = [i for i in ans if ok[i]]
            p, a, b = mcnemar(full, ok)
            ps.append(p)
            keys.append(key)
            raw = [r["runs"].get(f"{scheme}|none", {}).get("ok") for r in records]
            pg, ga, gb = mcnemar(raw, ok) if None not in raw else (1.0, 0, 0)  # no raw run: nothing to compare
            cells[key] = {
                "scheme": scheme, "gate": gate, "n": n, "correct": sum(ok), "accuracy": round(sum(ok) / n, 4),
                "accuracy_ci": wilson(sum(ok), n), "harmed": len(harmed), "n_answerable": len(ans),
                "harm_rate_ci": wilson(len(harmed), len(ans)),
                "mcnemar_vs_full": {"p": p, "full_only": a, "scheme_only": b},
                "mcnemar_vs_raw": {"p": pg, "raw_only": ga, "gated_only": gb},
                "bytes_per_token": round(sum(x["bytes_per_token"] for x in runs) / n, 2),
                "fp16_bytes_per_token": runs[0]["fp16_bytes_per_token"],
                "repairs_per_request": round(sum(x["repairs"] for x in runs) / n, 2),
                "bytes_per_token_at_fp16": _mean([x.get("bytes_per_token_at_fp16") for x in runs]),
                "heads_off_base_per_request": _mean([sum(x["heads_per_rung"][1:]) for x in runs if "heads_per_rung" in x]),
                "heads_per_rung_per_request": _rung_means(runs),
                "repair_traffic_per_request": round(sum(x["repair_traffic_bytes"] for x in runs) / n),
                "cert_mean": _mean([x.get("cert_mean") for x in runs]),
                "cert_informative": _mean([x.get("cert_informative") for x in runs]),
                "violations": sum(x.get("violations", 0) for x in runs), "checks": sum(x.get("checks", 0) for x in runs),
            }
            if all("covered" in x for x in runs):
                checks = cells[key]["checks"]
                cells[key].update(coverage=round(sum(x["covered"] for x in runs) / max(checks, 1), 4),
                                  looseness_median=hist_quantile([x["looseness_hist"] for x in runs], 0.5),
                                  looseness_p90=hist_quantile([x["looseness_hist"] for x in runs], 0.9))
            if all("dither_covered" in x for x in runs):
                checks = cells[key]["checks"]
                cells[key].update(dither_coverage=round(sum(x["dither_covered"] for x in runs) / max(checks, 1), 4),
                                  dither_median=hist_quantile([x["dither_hist"] for x in runs], 0.5),
                                  dither_p90=hist_quantile([x["dither_hist"] for x in runs], 0.9),
                                  dither_below_true=sum(x["dither_below_true"] for x in runs))
            if gate.split("/")[0] == "none":  # shadow runs (none, none/box, none/subM...)
                cb = auroc([runs[i].get("cert_mean") for i in harmed], [runs[i].get("cert_mean") for i in unharmed])
                tb = auroc([runs[i].get("true_tv_mean") for i in harmed], [runs[i].get("true_tv_mean") for i in unharmed])
                cells[key].update(auroc_cert_harm=cb, auroc_true_harm=tb, true_tv_mean=_mean([x.get("true_tv_mean") for x in runs]))
    findings = []
    for key, p_adj in zip(keys, holm(ps)):
        c = cells[key]
        c["mcnemar_vs_full"]["p_holm"] = round(p_adj, 5)
        c["mcnemar_vs_full"]["significant"] = p_adj < ALPHA
        if p_adj < ALPHA:
            findings.append(f"{key}: accuracy {c['accuracy']:.2f} vs full {sum(full) / n:.2f}, exact McNemar p = "
                            f"{c['mcnemar_vs_full']['p']:.2g} (Holm {p_adj:.2g})")
    gp = [(k, c["mcnemar_vs_raw"]["p"]) for k, c in cells.items() if c["gate"] != "none"]
    for (k, p), p_adj in zip(gp, holm([p for _, p in gp])):
        cells[k]["mcnemar_vs_raw"]["p_holm"] = round(p_adj, 5)
        if p_adj < ALPHA:
            findings.append(f"{k} vs raw {cells[k]['scheme']}: gated {cells[k]['accuracy']:.2f}, McNemar p = {p:.2g} (Holm {p_adj:.2g})")
    if not findings:
        findings.append("no scheme or gate differs significantly from the full cache or from its raw scheme at this size")
    return cells, findings


def _rung_means(runs):
    """Mean count of (layer, KV head) slots per rung (0 = the scheme, last = exact) at the end of a request."""
    hs = [x["heads_per_rung"] for x in runs if "heads_per_rung" in x]
    return [round(sum(h[i] for h in hs) / len(hs), 2) for i in range(len(hs[0]))] if hs else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def tables(data):
    st, cells = data["settings"], data["cells"]
    n = len(data["records"])
    full = sum(r["full"] for r in data["records"])
    lo, hi = wilson(full, n)

    def rate(k, m):
        if not m:
            return "-"
        a, b = wilson(k, m)
        return f"{k / m:.2f} [{a:.2f}, {b:.2f}]"

    def at16(c):
        b = c.get("bytes_per_token_at_fp16")
        return "-" if b is None else f"{b:.0f} ({b / c['fp16_bytes_per_token']:.2f}x)"

    def ci(x):
        return "-" if not x or x[0] is None else f"{x[0]:.2f} [{x[1][0]:.2f}, {x[1][1]:.2f}]"
    t = {"title": f"Quantized caches on SmolLM2-135M, {n} inputs of ~{st['tokens']} tokens ({', '.join(st['tasks'])}; "
                  f"{', '.join(st['haystacks'])} haystacks); full-cache accuracy {full / n:.2f} [{lo:.2f}, {hi:.2f}]"
                  f"{carried_note(st)}. "
                  "[95% Wilson]; p: exact McNemar vs the full cache, Holm over all rows; bytes: device bytes per token "
                  "and layer-summed (fp16 = "
                  f"{cells[next(iter(cells))]['fp16_bytes_per_token']:.0f})",
         "header": ["scheme", "gate", "accuracy", "harm rate", "p vs full (Holm)", "p gated vs raw", "bytes/token",
                    "repairs/request", "bytes/token at fp16 (x fp16)", "slots per rung (scheme .. exact)",
                    "mean certificate", "AUROC cert vs harm", "AUROC true TV vs harm", "violations/checks",
                    f"reads certified <= {COVER}", "bound / true TV: median [p90]",
                    f"dither estimate (A2): reads <= {COVER}, median [p90] / true TV, reads below true TV"],
         "rows": []}
    for c in cells.values():
        t["rows"].append([c["scheme"], c["gate"], rate(c["correct"], c["n"]), rate(c["harmed"], c["n_answerable"]),
                          f"{c['mcnemar_vs_full']['p_holm']:.2g}",
                          "-" if c["gate"].split("/")[0] == "none" else f"{c['mcnemar_vs_raw']['p']:.2g}",
                          f"{c['bytes_per_token']:.0f}", f"{c['repairs_per_request']:.1f}", at16(c),
                          "-" if c.get("heads_per_rung_per_request") is None else
                          " / ".join(f"{x:g}" for x in c["heads_per_rung_per_request"]),
                          "-" if c["cert_mean"] is None else f"{c['cert_mean']:.3f}",
                          ci(c.get("auroc_cert_harm")), ci(c.get("auroc_true_harm")),
                          f"{c['violations']}/{c['checks']}" if c["gate"].split("/")[0] == "none" else "-",
                          "-" if c.get("coverage") is None else f"{100 * c['coverage']:.1f}%",
                          "-" if c.get("looseness_median") is None else f"{c['looseness_median']:.2f} [{c['looseness_p90']:.2f}]",
                          "-" if c.get("dither_coverage") is None else
                          f"{100 * c['dither_coverage']:.1f}%, {c['dither_median']:.2f} [{c['dither_p90']:.2f}], {c['dither_below_true']}"])
    return [t]


_PREROPE = {}


def scheme_for(name, config):
    """A registered scheme's name, or prerope<bits> (fast.core.prerope.prerope_scheme for this model's RoPE:
    keys quantized before RoPE, per channel, values int8 per token; built once per bits)."""
    if not name.startswith("prerope"):
        return name
    if name not in _PREROPE:
        from fast.core.prerope import prerope_scheme
        bits = int(name[len("prerope"):] or 4)
        _PREROPE[name] = prerope_scheme(config, bits=bits)
    return _PREROPE[name]


def main(argv=None):
    from fast.core.schemes import scheme_names
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="default: the tasks the full cache answers "
                    "(ruler.DEFAULT_TASKS); vartrack is available")
    ap.add_argument("--haystacks", default="synthetic,natural")
    ap.add_argument("--schemes", default="all", help="comma list, or all (every registered scheme); prerope4 / "
                    "prerope8: the pre-RoPE scheme (fast.core.prerope) at that key width")
    ap.add_argument("--gates", default="none,certified:0.2,risk:9", help="comma list of gates (none, certified:TAU, "
                    "ladder:TAU, risk:K); a /box suffix certifies reads that would trip the gate with the box form too; /keys (ladder only): "
                    "the rungs refine the keys only, values stay at the scheme; /subM: the query-subspace witness with m = M "
                    "(fast.core.subspace); none/...: shadow mode (coverage and looseness against the exact keys)")
    ap.add_argument("--cert-steps", type=int, default=3)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "quant_eval.json"))
    ap.add_argument("--resummarize", default=None)
    ap.add_argument("--resume", action="store_true", help="continue the interrupted run in --out (same settings): "
                    "keep its records, run the inputs after them")
    ap.add_argument("--carry", default=None, help="start from the records of this earlier results file for the inputs "
                    "it holds (same settings except --tasks and --n)")
    args = ap.parse_args(argv)
    if args.resummarize:
        data = json.loads(Path(args.resummarize).read_text())
        data["cells"], data["findings"] = summarize(data["records"], data["settings"])
        data["readme_tables"] = tables(data)
        Path(args.resummarize).write_text(json.dumps(data, indent=1))
        return 0
    args.schemes = list(scheme_names()) if args.schemes == "all" else args.schemes.split(",")
    args.gates = args.gates.split(",")
    args.tasks, args.haystacks = args.tasks.split(","), args.haystacks.split(",")
    torch.set_num_threads(args.threads)
    from benchmarks.ruler import carried, examples, resumed
    from fast.integrations.model import load_smollm2
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    model, tok = load_smollm2()
    t0 = time.time()
    records, args.carried = [], None
    now = {"n": args.n, "tokens": args.tokens, "tasks": args.tasks, "haystacks": args.haystacks, "schemes": args.schemes,
           "gates": args.gates, "cert_steps": args.cert_steps, "seed0": args.seed0}
    exs = examples(args.n, tasks=tuple(args.tasks), haystacks=tuple(args.haystacks), seed0=args.seed0)
    if args.resume:
        records, before = resumed(args.out, now, tuple(now))
        t0 -= before
        if records:
            args.carried = json.loads(Path(args.out).read_text())["settings"].get("carried")
            print(f"resuming {args.out}: {len(records)} inputs done", flush=True)
    elif args.carry:
        records, args.carried = carried(args.carry, now, tuple(now), exs)
        print(f"carried {len(records)} inputs from {args.carry}", flush=True)
    for ex in exs[len(records):]:
        records.append(run_input(model, tok, ex, args))
        r = records[-1]
        print(f"[{len(records)}/{args.n}] {ex['task']} full={r['full']} "
              f"{sum(x['ok'] for x in r['runs'].values())}/{len(r['runs'])} ok, {time.time() - t0:.0f}s", flush=True)
        write(args, argv, records, t0)                      # a valid file after every input
    return 0


def write(args, argv, records, t0):
    """The results file for the records so far (`done` < `n` while the run is in progress)."""
    from benchmarks.ruler import natural_source
    settings = {"n": args.n, "done": len(records), "tokens": args.tokens, "tasks": args.tasks, "haystacks": args.haystacks,
                "schemes": args.schemes, "gates": args.gates, "cert_steps": args.cert_steps, "seed0": args.seed0,
                "natural_haystack": natural_source(), "cache": "CertifiedCache defaults: sinks 4, window 32, offload full"}
    if args.carried:
        settings["carried"] = args.carried    # the first records come from this earlier run (same inputs, same settings)
    cells, findings = summarize(records, settings)
    data = {"command": "nice -n 10 .venv/bin/python -m benchmarks.quant_eval " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "machine": machine(), "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, fp32, CPU)",
            "settings": settings, "seconds": round(time.time() - t0, 1),
            "full_accuracy": round(sum(r["full"] for r in records) / len(records), 4),
            "cells": cells, "findings": findings, "records": records}
    data["readme_tables"] = tables(data)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    sys.exit(main())
