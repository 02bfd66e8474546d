"""Pre-RoPE key quantization (fast.core.prerope, math.md T3) beside post-RoPE int4/int8 and kivi2 on
SmolLM2, shadow mode, the hardest settings (no sinks, no exact window; every cached token is
served compressed except an unfinished 32-token key block).

Per scheme: decode checks (step, layer, query head), violations of bound >= true TV, coverage
(bound <= 0.2), median bound, the output bound out_err (T5) against ||o - out|| from exact keys and
values, device bytes per token (witness and value witness included), and the key witness
against the true post-RoPE error: per (token, band), rho / ||(k - k~)_b|| (exact fp64 norms), for
the pre-RoPE scheme that is the T3 witness (pre-RoPE error + rotation margins, computed once).

    nice -n 10 python -m benchmarks.prerope           # writes results/prerope.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.soundness import COVER, KINDS, build_prompt, machine, tier_stats

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ("int8", "int4", "kivi2", "prerope_int8", "prerope_int4")


def make_scheme(name, config):
    if name.startswith("prerope_int"):
        from fast.core.prerope import prerope_scheme
        return prerope_scheme(config, bits=int(name[len("prerope_int"):]))
    return name


def witness_ratio(cache):
    """rho / exact ||(k - k~)_b|| over the quantized tokens of every layer (fp64, no rounding up)."""
    out = []
    for layer in cache.layers:
        if not layer.nq:
            continue
        rho, _ = layer.witness_view()
        k, _ = layer.served()
        r = (layer.exact_k[:, :, :layer.nq].double() - k[:, :, :layer.nq].double())[..., cache.bands]
        true = torch.sqrt((r * r).sum(-1))
        w = rho[:, :, :layer.nq].double()
        keep = true > 0
        out.append((w[keep] / true[keep]).numpy())
        if bool((w < true).any()):
            raise AssertionError("key witness below the true post-RoPE error")
    return np.concatenate(out)


def run(model, dyn, first, scheme, steps, derived):
    from fast.integrations.hf_cache import CertifiedCache
    from fast.integrations.hf_meter import set_current
    set_current(None)
    cache = CertifiedCache(model.config, make_scheme(scheme, model.config), sinks=0, window=0, shadow=True,
                           seed=0, value_bound=True, derived=derived)
    cache.fill_from(dyn)
    tok = first
    with torch.no_grad():
        for _ in range(steps):
            tok = model(input_ids=tok[:, None], past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)
    recs = cache.records
    r = {k: np.stack([x[k].numpy() for x in recs]).reshape(-1) for k in ("min", "true_tv", "out_err", "true_out_err")}
    r["witness_ratio"] = witness_ratio(cache)
    r["bytes_per_token"] = cache.memory()["device_bytes_per_token"]
    r["fp16_bytes_per_token"] = cache.memory()["fp16_bytes_per_token"]
    nq = sum(layer.nq for layer in cache.layers)  # key codes + scales + key witness, per quantized token (all layers)
    r["key_bytes_per_token"] = sum(layer.kq.nbytes + layer.rho_codes.nbytes for layer in cache.layers if layer.nq) / max(nq, 1) * len(cache.layers)
    return r


def readme_table(doc):
    """The README table of a results document (rebuilt by --retable from the stored numbers)."""
    rows = []
    for s, st in doc["schemes"].items():
        rows.append([s, st["checks"], st["violations"], f"{st['coverage']:.1%}", f"{st['median_bound']:.3g}",
                     f"{st['out_err_violations']} / {st['out_err_checks']}", f"{st['witness_ratio_median']:.4f}",
                     f"{st['key_bytes_per_token']:.0f}", f"{st['device_bytes_per_token'] / st['fp16_bytes_per_token']:.3f}"])
    return {"title": "Pre-RoPE keys (T3 witness) beside post-RoPE codecs, SmolLM2, shadow mode, no sinks or window",
            "header": ["scheme", "checks", "violations", "coverage (bound <= 0.2)", "median bound", "out_err violations",
                       "key witness / true error (median)", "key bytes/token (30 layers)", "device bytes vs fp16"],
            "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--length", type=int, default=448)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--out", default=str(ROOT / "results" / "prerope.json"))
    ap.add_argument("--retable", action="store_true", help="rebuild the README table of --out from its numbers")
    args = ap.parse_args(argv)
    if args.retable:
        doc = json.loads(Path(args.out).read_text())
        doc.pop("table", None)
        doc["readme_table"] = readme_table(doc)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        return
    from fast.tools.cli import load
    from transformers import DynamicCache

    t0 = time.time()
    model, tok = load()
    command = "python -m benchmarks.prerope " + " ".join(argv if argv is not None else sys.argv[1:])
    schemes = args.schemes.split(",")
    acc = {s: {} for s in schemes}
    for i in range(args.prompts):
        kind = KINDS[i % len(KINDS)]
        ids = build_prompt(tok, kind, args.length, seed=i)
        dyn = DynamicCache(config=model.config)
        with torch.no_grad():
            first = model(input_ids=torch.tensor([ids]), past_key_values=dyn, use_cache=True).logits[:, -1].argmax(-1)
        for s in schemes:
            r = run(model, dyn, first, s, args.steps, derived=False)
            for k, v in r.items():
                acc[s].setdefault(k, []).append(v)
        print(f"[{time.time() - t0:5.0f}s] prompt {i + 1}/{args.prompts} ({kind}, {len(ids)} tokens)", flush=True)
    res = {}
    for s in schemes:
        a = {k: (np.concatenate(v) if isinstance(v[0], np.ndarray) else np.array(v)) for k, v in acc[s].items()}
        st = tier_stats(a["true_tv"], a["min"])
        wr = a["witness_ratio"]
        st.update({
            "out_err_checks": int(a["out_err"].size), "out_err_violations": int((a["true_out_err"] > a["out_err"]).sum()),
            "out_err_median": float(np.median(a["out_err"])), "true_out_err_median": float(np.median(a["true_out_err"])),
            "out_err_ratio_median": float(np.median(a["out_err"] / np.maximum(a["true_out_err"], 1e-30))),
            "witness_ratio_median": float(np.median(wr)), "witness_ratio_max": float(wr.max()),
            "witness_ratio_min": float(wr.min()),
            "device_bytes_per_token": float(a["bytes_per_token"].mean()),
            "key_bytes_per_token": float(a["key_bytes_per_token"].mean()),
            "fp16_bytes_per_token": float(a["fp16_bytes_per_token"].mean())})
        res[s] = st
    doc = {"command": command, "machine": machine(), "seconds": round(time.time() - t0, 1),
           "settings": {"prompts": args.prompts, "length": args.length, "steps": args.steps, "sinks": 0, "window": 0,
                        "witness": "stored (1 byte per band), value witness 4 bytes per token and KV head",
                        "cover": COVER},
           "schemes": res}
    doc["readme_table"] = readme_table(doc)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for row in doc["readme_table"]["rows"]:
        print(" | ".join(str(x) for x in row))


if __name__ == "__main__":
    main()
