"""kvcert inside vLLM on SmolLM2 (CPU, eager): decode speed, soundness, the gate.

    nice -n 10 python -m benchmarks.vllm_bench            # -> results/vllm.json

One engine per configuration (the plugin reads its settings at start-up), all in this run:
- speed: decode tok/s of one ~1k-token passkey request, (t(1 + n tokens) - t(1 token)) / n,
  for vLLM with an fp32 cache (plugin off), vLLM + vLLM's fp8_e4m3 cast (plugin, no
  certificates) and the same + certificates; the ratio is the certificates' cost;
- soundness (shadow mode, fp8_e4m3 and fp8_e5m2): every (row, layer, head) read of a batch of
  passkey prompts (prefill rows and decode rows): checks, violations (true TV > bound),
  coverage at 0.2 (share of reads with bound <= 0.2), median bound / true TV;
- the gate certified:TAU: repairs per request, side-store bytes, passkey accuracy with and
  without the gate (the same prompts, greedy).
"""

import argparse
import json
import os
import platform
import sys
import time


def _engine(model, **kw):
    from fast.integrations.vllm import make_llm
    return make_llm(model, enforce_eager=True, max_model_len=2048, kv_cache_memory_bytes=512 << 20,
                    max_num_batched_tokens=512, enable_chunked_prefill=True, **kw)


def _plain_engine(model):
    os.environ["KVCERT_VLLM"] = "0"
    from vllm import LLM
    return LLM(model, enforce_eager=True, max_model_len=2048, kv_cache_memory_bytes=512 << 20, dtype="float32",
               max_num_batched_tokens=512, enable_chunked_prefill=True)


def _prompts(llm, n, filler):
    from fast.tools.cli import passkey_prompt
    tok = llm.get_tokenizer()
    out = []
    for seed in range(n):
        text, key = passkey_prompt(filler, depth=[0.1, 0.4, 0.7, 0.9][seed % 4], seed=seed)
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(({"prompt_token_ids": list(ids)}, key))
    return out


def _decode_speed(llm, prompt, n):
    from vllm import SamplingParams
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    t1 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1 + n, temperature=0.0, ignore_eos=True))
    t2 = time.perf_counter()
    return n / ((t2 - t1) - (t1 - t0))


def _answers(llm, prompts, n=12):
    from vllm import SamplingParams
    outs = llm.generate([p for p, _ in prompts], SamplingParams(max_tokens=n, temperature=0.0))
    return [str(k) in o.outputs[0].text for o, (_, k) in zip(outs, prompts)], outs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--filler", type=int, default=40, help="passkey filler sentences (40 ~ 1k tokens)")
    ap.add_argument("--gate", default="certified:0.2")
    ap.add_argument("--out", default="results/vllm.json")
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    import transformers
    import vllm

    from fast.integrations.vllm import collect, smollm2_dir, summaries
    model = str(smollm2_dir())
    res = {"machine": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count(), "avx512": bool(torch.cpu._is_avx512_supported())},
           "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
           "command": "python -m benchmarks.vllm_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": "SmolLM2-135M-Instruct (fp32)", "note": (
               "vLLM's CPU backend refuses fp8 KV caches without AVX-512/AMX; the plugin applies vLLM's fp8 cast "
               "(fast.core.quant fp8_*_rtz, = fast.integrations.vllm_fp8) and stores the decoded values in vLLM's fp32 paged cache, so speed "
               "numbers compare certificate cost, not fp8 memory savings")}
    speed = {}
    llm = _plain_engine(model)
    prompts = _prompts(llm, args.prompts, args.filler)
    res["prompt_tokens"] = [len(p["prompt_token_ids"]) for p, _ in prompts]
    speed["vllm_fp32"] = _decode_speed(llm, prompts[0][0], args.decode_tokens)
    del llm
    llm = _engine(model, codec="fp8_e4m3", certify=False)
    speed["vllm_fp8_e4m3"] = _decode_speed(llm, prompts[0][0], args.decode_tokens)
    ok_plain, _ = _answers(llm, prompts)
    del llm
    llm = _engine(model, codec="fp8_e4m3")
    speed["vllm_fp8_e4m3_kvcert"] = _decode_speed(llm, prompts[0][0], args.decode_tokens)
    collect(llm)
    del llm
    speed["cert_cost"] = 1.0 - speed["vllm_fp8_e4m3_kvcert"] / speed["vllm_fp8_e4m3"]
    res["decode_tok_s"] = speed
    res["soundness"] = {}
    for codec in ("fp8_e4m3", "fp8_e5m2"):
        llm = _engine(model, codec=codec, shadow=True)
        _answers(llm, prompts, n=8)
        recs = [r for p in collect(llm) for r in p["records"]]
        del llm
        tv = np.concatenate([np.asarray(r["true_tv"], dtype=np.float64).ravel() for r in recs])
        b = np.concatenate([np.asarray(r["bound"], dtype=np.float64).ravel() for r in recs])
        pos = tv > 0
        res["soundness"][codec] = {"checks": int(tv.size), "violations": int((tv > b).sum()),
                                   "coverage_0.2": float((b <= 0.2).mean()),
                                   "median_bound_over_tv": float(np.median(b[pos] / tv[pos])) if pos.any() else None,
                                   "median_bound": float(np.median(b)), "median_true_tv": float(np.median(tv))}
    llm = _engine(model, codec="fp8_e4m3", gate=args.gate)
    ok_gate, outs = _answers(llm, prompts)
    parts = collect(llm)
    del llm
    summ = summaries(parts)
    res["gate"] = {"gate": args.gate, "codec": "fp8_e4m3",
                   "repairs_per_request": [summ.get(o.request_id, {}).get("repairs", 0) for o in outs],
                   "side_store_bytes_allocated": sum(p["side_bytes"] for p in parts),
                   "passkey_accuracy_without_gate": float(np.mean(ok_plain)),
                   "passkey_accuracy_with_gate": float(np.mean(ok_gate)), "prompts": len(prompts)}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
