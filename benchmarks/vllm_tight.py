"""Tighter certificates inside vLLM (SmolLM2, CPU, eager): the box form (KVCERT_BOX) and an int8 codec.

    nice -n 10 python -m benchmarks.vllm_tight            # -> results/vllm_tight.json

One engine per (codec, box) in shadow mode, the band witness at --bands bands (KVCERT_BANDS, 8 by default),
over the passkey prompts of benchmarks.vllm_bench (every prefill and decode row, layer and head; truth from the
exact keys captured before the cast): checks, violations, share of reads with bound <= 0.2, median and p90 bound /
true TV, the engine's seconds. Then the gate certified:TAU per codec with the box form: (layer, KV head) repairs
per request (of 90) and passkey accuracy with and without the gate, side-store bytes.
"""

import argparse
import json
import os
import shlex
import sys
import time


def _tables(res):
    sound = {"title": "kvcert inside vLLM, tighter certificates: soundness in shadow mode (every row, layer and head "
                      f"of {res['prompts']} passkey prompts of ~{res['prompt_tokens'][0]} tokens; truth from the exact "
                      f"keys captured before the cast); band witness of {res.get('bands', 8)} bands; box: KVCERT_BOX=1",
             "header": ["codec", "certificate", "checks", "violations", "reads with bound <= 0.2",
                        "bound / true TV: median [p90]", "engine seconds"],
             "rows": [[r["codec"], "band witness + box form" if r["box"] else "band witness (closed forms)", r["checks"],
                       r["violations"], f"{100 * r['coverage_0.2']:.1f}%",
                       f"{r['median_bound_over_tv']:.1f} [{r['p90_bound_over_tv']:.1f}]", f"{r['seconds']:.0f}"]
                      for r in res["soundness"]]}
    gate = {"title": f"kvcert inside vLLM: the gate {res['gate']} with the box form, on the same prompts",
            "header": ["codec", "repairs per request (of 90 layer x KV head)", "passkey accuracy without / with the gate",
                       "side store bytes"],
            "rows": [[g["codec"], f"{sum(g['repairs_per_request']) / len(g['repairs_per_request']):.1f}",
                      f"{g['passkey_accuracy_without_gate']:.2f} / {g['passkey_accuracy_with_gate']:.2f}",
                      f"{g['side_store_bytes_allocated']:,}"] for g in res["gates"]]}
    return [sound, gate]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--filler", type=int, default=40, help="passkey filler sentences (40 ~ 1k tokens)")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--codecs", default="int8,fp8_e4m3")
    ap.add_argument("--gate", default="certified:0.2")
    ap.add_argument("--bands", type=int, default=8, help="KVCERT_BANDS: the band witness's bands per head")
    ap.add_argument("--out", default="results/vllm_tight.json")
    args = ap.parse_args(argv)
    start = time.time()
    from transformers import AutoTokenizer

    from benchmarks.vllm_bench import _answers, _engine, _prompts, soundness
    from fast.integrations.vllm import collect, smollm2_dir, summaries
    from tqdm import tqdm
    model = str(smollm2_dir())
    prompts = _prompts(AutoTokenizer.from_pretrained(model), args.prompts, args.filler)
    codecs = args.codecs.split(",")
    res = {"command": "python -m benchmarks.vllm_tight " + shlex.join(argv if argv is not None else sys.argv[1:]),
           "model": "SmolLM2-135M-Instruct (fp32)", "prompts": len(prompts),
           "prompt_tokens": [len(p["prompt_token_ids"]) for p, _ in prompts], "decode_tokens": args.decode_tokens,
           "gate": args.gate, "bands": args.bands, "soundness": [], "gates": []}
    plain = {}
    runs = [(c, box) for c in codecs for box in (False, True)]
    for codec, box in tqdm(runs, desc="shadow engines"):
        t = time.time()
        llm = _engine(model, codec=codec, shadow=True, box=box, bands=args.bands)
        ok, _ = _answers(llm, prompts, n=args.decode_tokens)  # served: the codec's certified reads, no gate
        plain.setdefault(codec, ok)
        recs = [r for p in collect(llm) for r in p["records"]]
        del llm
        res["soundness"].append({"codec": codec, "box": box, **soundness(recs), "seconds": time.time() - t})
    for codec in tqdm(codecs, desc="gated engines"):
        ok_plain = plain[codec]
        llm = _engine(model, codec=codec, gate=args.gate, box=True, bands=args.bands)
        ok_gate, outs = _answers(llm, prompts, n=args.decode_tokens)
        parts = collect(llm)
        del llm
        summ = summaries(parts)
        res["gates"].append({"codec": codec, "repairs_per_request": [summ.get(o.request_id, {}).get("repairs", 0) for o in outs],
                             "side_store_bytes_allocated": sum(p["side_bytes"] for p in parts),
                             "passkey_accuracy_without_gate": sum(ok_plain) / len(ok_plain),
                             "passkey_accuracy_with_gate": sum(ok_gate) / len(ok_gate)})
    res["readme_tables"] = _tables(res)
    res["seconds"] = round(time.time() - start, 1)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res["readme_tables"], indent=2))


if __name__ == "__main__":
    main()
