"""Decode tokens/s with the certified cache as a ratio of the uncompressed cache, same run.

One exact prefill of a ~1k-token prompt is shared; then the caches decode the same token
sequence (the uncompressed run's greedy tokens, teacher-forced) with their steps interleaved,
so that load on the machine hits every variant alike. tokens/s = 1 / median step time.
Variants: uncompressed (DynamicCache, sdpa), each scheme served without a certificate
(certify=False: the cost of the compressed storage alone), and certified (the full meter).

    nice -n 10 python -m benchmarks.decode_speed     # writes results/decode_speed.json
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="int8,fp8_e4m3,int4")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--filler", type=int, default=40, help="passkey filler sentences (40 ~ 1k tokens)")
    ap.add_argument("--out", default=str(ROOT / "results" / "decode_speed.json"))
    args = ap.parse_args(argv)
    from transformers import DynamicCache

    from benchmarks.soundness import machine
    from fast.integrations.hf_cache import CertifiedCache
    from fast.tools.cli import load, passkey_prompt
    from fast.integrations.hf_meter import set_current
    from fast.integrations.model import chat_ids

    model, tok = load()
    ids = chat_ids(tok, passkey_prompt(args.filler)[0])
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(input_ids=torch.tensor([ids]), cache=exact, use_cache=True).logits[:, -1].argmax(-1)
    variants = {"uncompressed": copy.deepcopy(exact)}
    for s in args.schemes.split(","):
        variants[f"{s} (no certificate)"] = CertifiedCache(model.config, s, certify=False).fill_from(exact)
        variants[f"{s} certified"] = CertifiedCache(model.config, s).fill_from(exact)
    times = {name: [] for name in variants}
    tok_in = first
    with torch.no_grad():
        for step in range(args.steps):
            nxt = None
            for name, cache in variants.items():
                set_current(None)
                t0 = time.perf_counter()
                logits = model(input_ids=tok_in[:, None], cache=cache, use_cache=True).logits[:, -1]
                times[name].append(time.perf_counter() - t0)
                if name == "uncompressed":
                    nxt = logits.argmax(-1)
            tok_in = nxt
    base = statistics.median(times["uncompressed"])
    rows, res = [], {}
    for name, ts in times.items():
        med = statistics.median(ts)
        res[name] = {"median_step_s": med, "tokens_per_s": 1 / med, "ratio_vs_uncompressed": base / med}
        mem = variants[name].memory() if hasattr(variants[name], "memory") else None
        if mem:
            res[name]["device_bytes_per_token"] = mem["device_bytes_per_token"]
        rows.append([name, f"{1 / med:.2f}", f"{base / med:.2f}x",
                     f"{mem['device_bytes_per_token'] / mem['fp16_bytes_per_token']:.2f}" if mem else "1.00 (fp16)"])
    command = "python -m benchmarks.decode_speed " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = {"command": command, "machine": machine(), "prompt_tokens": len(ids), "steps": args.steps,
           "variants": res,
           "readme_table": {"title": f"Decode speed on SmolLM2-135M, CPU torch path ({len(ids)}-token prompt, "
                                     f"{args.steps} interleaved steps; ratio = tokens/s vs the uncompressed cache, same run)",
                            "header": ["cache", "tokens/s", "ratio", "bytes vs fp16"], "rows": rows}}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
