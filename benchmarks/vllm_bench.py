"""kvcert inside vLLM on SmolLM2 (CPU, eager): decode speed, soundness, the gate.

    nice -n 10 python -m benchmarks.vllm_bench            # -> results/vllm.json

One engine per configuration (the plugin reads its settings at start-up), all in this run:
- speed: decode tok/s of one ~1k-token passkey request, (t(1 + n tokens) - t(1 token)) / n (fp32: median of 3),
  for vLLM with an fp32 cache (plugin off), vLLM + vLLM's fp8_e4m3 cast (plugin, no
  certificates) and the same + certificates; the ratio is the certificates' cost. The two codec
  engines run side by side (both started, then --speed-rounds rounds, each one measurement of one
  engine and then of the other, the order swapped each round, seconds apart, so that a machine slowing
  down or speeding up during the run lands on both sides): the cost is the median of the rounds' costs,
  each round's numbers are kept. --speed-only measures just this and
  replaces the speed part of an existing --out file (the rest of it is kept), or writes a speed-only file;
- soundness (shadow mode, fp8_e4m3 and fp8_e5m2): every (row, layer, head) read of a batch of
  passkey prompts (prefill rows and decode rows): checks, violations (true TV > bound),
  coverage at 0.2 (share of reads with bound <= 0.2), median bound / true TV;
- the gate certified:TAU: repairs per request, side-store bytes, passkey accuracy with and
  without the gate (the same prompts, greedy);
- RULER-style tasks (benchmarks/ruler.py, --ruler inputs of ~--ruler-tokens tokens, each task's own
  allowance): accuracy with the fp32 cache, the fp8 cast without and with the gate, 95% Wilson
  intervals and exact McNemar tests between them.
"""

import argparse
import json
import os
import platform
import shlex
import sys
import time


def _engine(model, **kw):
    from fast.integrations.vllm import make_llm
    kw.setdefault("records", 10 ** 7)  # every per-read record is read back (collect)
    return make_llm(model, enforce_eager=True, max_model_len=2048, kv_cache_memory_bytes=512 << 20,
                    max_num_batched_tokens=512, enable_chunked_prefill=True, **kw)


def _plain_engine(model):
    os.environ["KVCERT_VLLM"] = "0"
    from vllm import LLM
    return LLM(model, enforce_eager=True, max_model_len=2048, kv_cache_memory_bytes=512 << 20, dtype="float32",
               max_num_batched_tokens=512, enable_chunked_prefill=True)


def _prompts(tok, n, filler):
    from fast.tools.cli import passkey_prompt
    out = []
    for seed in range(n):
        text, key = passkey_prompt(filler, depth=[0.1, 0.4, 0.7, 0.9][seed % 4], seed=seed)
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(({"prompt_token_ids": list(ids)}, key))
    return out


def soundness(recs):
    """Shadow-mode records -> checks, violations (true TV > bound), share of reads with bound <= 0.2,
    median and p90 bound / true TV (reads with a true TV > 0), median bound and true TV."""
    import numpy as np
    tv = np.concatenate([np.asarray(r["true_tv"], dtype=np.float64).ravel() for r in recs])
    b = np.concatenate([np.asarray(r["bound"], dtype=np.float64).ravel() for r in recs])
    pos = tv > 0
    ratio = b[pos] / tv[pos]
    return {"checks": int(tv.size), "violations": int((tv > b).sum()), "coverage_0.2": float((b <= 0.2).mean()),
            "median_bound_over_tv": float(np.median(ratio)) if pos.any() else None,
            "p90_bound_over_tv": float(np.quantile(ratio, 0.9)) if pos.any() else None,
            "median_bound": float(np.median(b)), "median_true_tv": float(np.median(tv))}


def _decode_speed(llm, prompt, n, repeats=3):
    """Decode tokens/s: n / (t(1 + n tokens) - t(1 token)), the median of `repeats` measurements."""
    from vllm import SamplingParams
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        t1 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1 + n, temperature=0.0, ignore_eos=True))
        t2 = time.perf_counter()
        rates.append(n / ((t2 - t1) - (t1 - t0)))
    return sorted(rates)[len(rates) // 2]


def _speed(model, prompt, n, rounds, codec="fp8_e4m3"):
    """decode_tok_s: the fp32 engine once; then the `codec` engines (KVCERT_CODEC) without and with certificates, both
    started, measured in turn for `rounds` rounds (one measurement each per round, the order swapped every round);
    cert_cost = median over rounds of 1 - cert / no cert."""
    from tqdm import tqdm
    plain, cert = f"vllm_{codec}", f"vllm_{codec}_kvcert"
    llm = _plain_engine(model)
    out = {"vllm_fp32": _decode_speed(llm, prompt, n)}
    del llm
    engines = {plain: _engine(model, codec=codec, certify=False), cert: _engine(model, codec=codec)}
    per_round = []
    for r in tqdm(range(rounds), desc="speed rounds"):
        rec = {}
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            rec[name] = _decode_speed(engines[name], prompt, n, repeats=1)
        rec["cert_cost"] = 1.0 - rec[cert] / rec[plain]
        per_round.append(rec)
    del engines
    med = lambda key: sorted(x[key] for x in per_round)[len(per_round) // 2]
    out.update({name: med(name) for name in (plain, cert)})
    out["cert_cost"] = med("cert_cost")
    out["rounds"] = per_round
    return out


def _answers(llm, prompts, n=12):
    from vllm import SamplingParams
    outs = llm.generate([p for p, _ in prompts], SamplingParams(max_tokens=n, temperature=0.0))
    return [str(k) in o.outputs[0].text for o, (_, k) in zip(outs, prompts)], outs


def _ruler_prompts(llm, n, tokens):
    """n RULER-style inputs (benchmarks/ruler.py: five tasks, synthetic and natural haystacks, fixed
    seeds apart from the eviction/quantization harness's) as token ids, each with its allowance."""
    from benchmarks.ruler import TASKS, allowance, build, examples
    tok = llm.get_tokenizer()
    exs = examples(n, tasks=TASKS, haystacks=("synthetic", "natural"), seed0=50_000)
    return [({"prompt_token_ids": build(tok, ex, tokens)[0][0].tolist()}, ex, allowance(tok, ex)) for ex in exs]


def _ruler_answers(llm, items):
    """0/1 per input: every answer in the greedy continuation within the task's allowance."""
    from vllm import SamplingParams

    from benchmarks.ruler import score
    outs = llm.generate([p for p, _, _ in items], [SamplingParams(max_tokens=a, temperature=0.0) for _, _, a in items])
    return [score(o.outputs[0].text, ex["answers"]) for o, (_, ex, _) in zip(outs, items)]


def _ruler_table(ok, n):
    from benchmarks.stats import mcnemar, wilson
    rows = {}
    for name, v in ok.items():
        rows[name] = {"accuracy": sum(v) / n, "wilson95": wilson(sum(v), n)}
    for a, b in (("fp8_e4m3", "fp8_e4m3_gated"), ("fp32", "fp8_e4m3"), ("fp32", "fp8_e4m3_gated")):
        p, x, y = mcnemar(ok[a], ok[b])
        rows[f"{a} vs {b}"] = {"mcnemar_p": p, f"{a}_only": x, f"{b}_only": y}
    return rows


def _tables(res):
    sp, g, ru = res["decode_tok_s"], res["gate"], res["ruler"]
    costs = sorted(100 * r["cert_cost"] for r in sp.get("rounds", []))
    spread = f"; median of {len(costs)} rounds, range {costs[0]:.0f}% to {costs[-1]:.0f}%" if costs else ""
    speed = {"title": "kvcert inside vLLM (SmolLM2, CPU backend, eager; one ~1k-token request): decode tokens/s "
                      "(fp8 engines: the median over rounds in turn)",
             "header": ["engine", "tokens/s", "certificates' cost"],
             "rows": [["vLLM, fp32 cache (plugin off)", f"{sp['vllm_fp32']:.2f}", "-"],
                      ["vLLM + fp8_e4m3 cast, no certificates", f"{sp['vllm_fp8_e4m3']:.2f}", "-"],
                      ["vLLM + fp8_e4m3 cast + certificates", f"{sp['vllm_fp8_e4m3_kvcert']:.2f}",
                       f"{100 * sp['cert_cost']:.0f}%{spread}"]]}
    sound = {"title": "kvcert inside vLLM: soundness in shadow mode (every row, layer and head of the passkey prompts; "
                      "truth from the exact keys captured before vLLM's cast)",
             "header": ["codec", "checks", "violations", "share of reads with bound <= 0.2", "median bound / true TV"],
             "rows": [[c, r["checks"], r["violations"], f"{r['coverage_0.2']:.3f}",
                       "-" if r["median_bound_over_tv"] is None else f"{r['median_bound_over_tv']:.1f}"]
                      for c, r in res["soundness"].items()]}
    n = ru["inputs"]

    def acc(name):
        r = ru["rows"][name]
        return f"{r['accuracy']:.2f} [{r['wilson95'][0]:.2f}, {r['wilson95'][1]:.2f}]"
    pairs = [k for k in ru["rows"] if " vs " in k]
    gate = {"title": f"kvcert inside vLLM: the gate {g['gate']} ({g['codec']}): accuracy on {n} RULER-style inputs of "
                     f"~{ru['tokens']} tokens ({', '.join(ru['tasks'])}; synthetic and natural haystacks) [95% Wilson] and "
                     f"on {g['prompts']} passkey prompts; repairs per request (RULER mean {ru['repairs_per_request_mean']:.1f}); "
                     f"exact McNemar: " + "; ".join(f"{k} p = {ru['rows'][k]['mcnemar_p']:.2g}" for k in pairs),
            "header": ["engine", "RULER accuracy", "passkey accuracy", "side store bytes"],
            "rows": [["fp32 cache", acc("fp32"), "-", "-"],
                     ["fp8_e4m3 cast, no gate", acc("fp8_e4m3"), f"{g['passkey_accuracy_without_gate']:.2f}", "0"],
                     [f"fp8_e4m3 cast, {g['gate']}", acc("fp8_e4m3_gated"), f"{g['passkey_accuracy_with_gate']:.2f}",
                      f"{g['side_store_bytes_allocated']:,}"]]}
    return [speed, sound, gate]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--filler", type=int, default=40, help="passkey filler sentences (40 ~ 1k tokens)")
    ap.add_argument("--gate", default="certified:0.2")
    ap.add_argument("--ruler", type=int, default=40, help="RULER-style inputs answered with and without the gate")
    ap.add_argument("--ruler-tokens", type=int, default=1024)
    ap.add_argument("--out", default="results/vllm.json")
    ap.add_argument("--speed-rounds", type=int, default=3, help="rounds of the two codec engines in turn, one measurement each (speed)")
    ap.add_argument("--speed-only", action="store_true", help="only the speed part: replaces it in an existing --out, else a speed-only --out")
    ap.add_argument("--speed-codec", default="fp8_e4m3", help="the speed part's codec (KVCERT_CODEC; with --speed-only "
                    "any, e.g. int8: the packed int8 page; the full run's tables need fp8_e4m3)")
    args = ap.parse_args(argv)
    start = time.time()
    import numpy as np
    import torch
    import transformers
    import vllm

    from fast.integrations.vllm import collect, smollm2_dir, summaries
    model = str(smollm2_dir())
    res = {"machine": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count(), "avx512": bool(torch.cpu._is_avx512_supported())},
           "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
           "command": "python -m benchmarks.vllm_bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
           "model": "SmolLM2-135M-Instruct (fp32)", "note": (
               "vLLM's CPU backend refuses fp8 KV caches without AVX-512/AMX; the plugin applies vLLM's fp8 cast "
               "(fast.core.quant fp8_*_rtz, = fast.integrations.vllm_fp8) and stores the decoded values in vLLM's fp32 paged cache, so speed "
               "numbers compare certificate cost, not fp8 memory savings" if args.speed_codec == "fp8_e4m3" else
               f"KVCERT_CODEC={args.speed_codec}: the plugin's packed page in vLLM's own cache (codes, scales and the "
               "witness's log codes), read in place by the fused kernel, with and without certificates")}
    if args.speed_rounds < 1:
        raise SystemExit("--speed-rounds: at least 1")
    if args.speed_codec != "fp8_e4m3" and not args.speed_only:
        raise SystemExit("--speed-codec: another codec than fp8_e4m3 with --speed-only only (the full run's tables are fp8's)")
    from transformers import AutoTokenizer
    prompts = _prompts(AutoTokenizer.from_pretrained(model), args.prompts, args.filler)
    speed = _speed(model, prompts[0][0], args.decode_tokens, args.speed_rounds, args.speed_codec)
    if args.speed_only:  # into an existing full results file (its other parts kept), or a speed-only file
        run = {"command": res["command"], "seconds": round(time.time() - start, 1), "versions": res["versions"],
               "machine": res["machine"]}
        doc = {**res, "decode_tok_s": speed, "speed_run": run}
        if os.path.exists(args.out):
            with open(args.out) as f:
                old = json.load(f)
            if "ruler" in old:  # a full run's file: only its speed part replaced
                doc = {**old, "decode_tok_s": speed, "speed_run": run}
                doc["readme_tables"] = _tables(doc)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
        print(json.dumps(speed, indent=2))
        return
    llm = _plain_engine(model)
    res["prompt_tokens"] = [len(p["prompt_token_ids"]) for p, _ in prompts]
    ruler = _ruler_prompts(llm, args.ruler, args.ruler_tokens)
    ruler_ok = {"fp32": _ruler_answers(llm, ruler)}
    del llm
    llm = _engine(model, codec="fp8_e4m3", certify=False)
    ok_plain, _ = _answers(llm, prompts)
    ruler_ok["fp8_e4m3"] = _ruler_answers(llm, ruler)
    del llm
    res["decode_tok_s"] = speed
    res["soundness"] = {}
    for codec in ("fp8_e4m3", "fp8_e5m2"):
        llm = _engine(model, codec=codec, shadow=True)
        _answers(llm, prompts, n=8)
        recs = [r for p in collect(llm) for r in p["records"]]
        del llm
        res["soundness"][codec] = soundness(recs)
    llm = _engine(model, codec="fp8_e4m3", gate=args.gate)
    ok_gate, outs = _answers(llm, prompts)
    parts = collect(llm)
    ruler_ok["fp8_e4m3_gated"] = _ruler_answers(llm, ruler)
    ruler_parts = collect(llm)
    del llm
    summ = summaries(parts)
    rsumm = summaries(ruler_parts)
    res["ruler"] = {"inputs": len(ruler), "tokens": args.ruler_tokens, "gate": args.gate,
                    "tasks": sorted({ex["task"] for _, ex, _ in ruler}), "haystacks": ["synthetic", "natural"],
                    "rows": _ruler_table(ruler_ok, len(ruler)),
                    "repairs_per_request_mean": float(np.mean([s["repairs"] for s in rsumm.values()])) if rsumm else 0.0,
                    "per_input": {k: v for k, v in ruler_ok.items()}}
    res["gate"] = {"gate": args.gate, "codec": "fp8_e4m3",
                   "repairs_per_request": [summ.get(o.request_id, {}).get("repairs", 0) for o in outs],
                   "side_store_bytes_allocated": sum(p["side_bytes"] for p in parts),
                   "passkey_accuracy_without_gate": float(np.mean(ok_plain)),
                   "passkey_accuracy_with_gate": float(np.mean(ok_gate)), "prompts": len(prompts)}
    res["readme_tables"] = _tables(res)
    res["seconds"] = round(time.time() - start, 1)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
