"""Harm-predictor study: does the certificate (or the true TV) predict that the answer changes?

    .venv/bin/python -m benchmarks.harm_study -> results/harm_study.json, results/harm_study.png

Reads results/evict_eval.json and results/quant_eval.json (no model run). Harm = the full cache
answers and the compressed cache does not. Per evictor (pooled over budgets: one point per
input and budget) and per quantization scheme (ungated runs): AUROC of the certified bound (mean
log-odds of the eviction bound; mean min-form TV bound for quantization) and of the true quantity
(mean evicted attention mass; mean true TV, both from exact keys) against harm, with 95 %
intervals (Hanley-McNeil). 0.5 = no signal.
"""

import argparse
import json
import sys
from pathlib import Path

from benchmarks.stats import auroc

ROOT = Path(__file__).resolve().parent.parent


def eviction_points(data):
    out = {}
    for key in data["cells"]:
        label = key.split("@")[0]
        pts = out.setdefault(label, {"bound": ([], []), "true": ([], []), "variants": {}})
        for r in data["records"]:
            if not r["full"]:
                continue
            run = r["runs"][key]
            side = 0 if not run["ok"] else 1
            pts["bound"][side].append(run.get("log_odds_mean"))
            pts["true"][side].append(run.get("true_mean"))
            for v in data["settings"].get("witness_variants", []):
                pts["variants"].setdefault(v, ([], []))[side].append(run.get(f"{v}_log_odds_mean"))
    return out


def quant_points(data):
    out = {}
    for scheme in data["settings"]["schemes"]:
        key = f"{scheme}|none"
        pts = out.setdefault(scheme, {"bound": ([], []), "true": ([], [])})
        for r in data["records"]:
            if not r["full"]:
                continue
            run = r["runs"][key]
            side = 0 if not run["ok"] else 1
            pts["bound"][side].append(run.get("cert_mean"))
            pts["true"][side].append(run.get("true_tv_mean"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--evict", default=str(ROOT / "results" / "evict_eval.json"))
    ap.add_argument("--quant", default=str(ROOT / "results" / "quant_eval.json"))
    ap.add_argument("--out", default=str(ROOT / "results" / "harm_study.json"))
    ap.add_argument("--plot", default=str(ROOT / "results" / "harm_study.png"))
    args = ap.parse_args(argv)
    rows, entries = [], []
    sources = {}
    for kind, path, fn in (("eviction", args.evict, eviction_points), ("quantization", args.quant, quant_points)):
        if not Path(path).is_file():
            continue
        data = json.loads(Path(path).read_text())
        rel = Path(path).resolve()
        sources[kind] = {"file": str(rel.relative_to(ROOT)) if rel.is_relative_to(ROOT) else str(rel), "command": data.get("command")}
        for name, pts in fn(data).items():
            b = auroc(*pts["bound"])
            t = auroc(*pts["true"])
            harmed, unharmed = len(pts["bound"][0]), len(pts["bound"][1])
            e = {"kind": kind, "method": name, "harmed": harmed, "unharmed": unharmed,
                 "auroc_bound": b[0], "auroc_bound_ci": b[1], "auroc_true": t[0], "auroc_true_ci": t[1]}
            for v, vp in pts.get("variants", {}).items():
                e[f"auroc_{v}"] = auroc(*vp)
            entries.append(e)

            def ci(a):
                return "-" if a[0] is None else f"{a[0]:.2f} [{a[1][0]:.2f}, {a[1][1]:.2f}]"
            rows.append([kind, name, f"{harmed}/{harmed + unharmed}", ci(b), ci(t)])
    findings = []
    for e in entries:
        for q in ("bound", "true"):
            lo = e[f"auroc_{q}_ci"][0]
            if lo is not None and lo > 0.5:
                findings.append(f"{e['kind']} {e['method']}: the {'certificate' if q == 'bound' else 'true quantity'} "
                                f"predicts harm (AUROC {e[f'auroc_{q}']:.2f}, 95% interval above 0.5)")
    if not any("certificate" in f for f in findings):
        findings.append("no certificate's AUROC against harm has a 95% interval above 0.5 at this size")
    data = {"command": ".venv/bin/python -m benchmarks.harm_study " + " ".join(argv if argv is not None else sys.argv[1:]),
            "sources": sources, "entries": entries, "findings": findings,
            "readme_tables": [{"title": "Harm-predictor study: AUROC against harm (wrong where the full cache is right) "
                                        "[95% Hanley-McNeil]; eviction pooled over budgets; quantization ungated; 0.5 = no signal",
                               "header": ["compression", "method", "harmed/answerable", "AUROC certificate", "AUROC true TV"],
                               "rows": rows}]}
    Path(args.out).write_text(json.dumps(data, indent=1))
    if args.plot and entries:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(entries) + 1.2))
        labelled = set()
        for i, e in enumerate(entries):
            for q, dy, colour in (("bound", -0.15, "tab:red"), ("true", 0.15, "tab:blue")):
                a, (lo, hi) = e[f"auroc_{q}"], e[f"auroc_{q}_ci"]
                if a is None:
                    continue
                ax.errorbar(a, i + dy, xerr=[[a - lo], [hi - a]], fmt="o", color=colour,
                            label=None if q in labelled else {"bound": "certificate", "true": "true TV / mass"}[q])
                labelled.add(q)
        ax.axvline(0.5, color="grey", lw=0.8, ls="--")
        ax.set_yticks(range(len(entries)), [f"{e['kind'][:5]} {e['method']}" for e in entries], fontsize=7)
        ax.set_xlim(0, 1)
        ax.set_xlabel("AUROC against harm (95% interval)")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
