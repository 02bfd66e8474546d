"""KV capacity and throughput under load inside vLLM (SmolLM2, CPU, eager): what the packed pages buy.

    nice -n 10 python -m benchmarks.vllm_capacity            # -> results/vllm_capacity.json

Every engine gets the same KV budget (--budget-mib, vLLM's kv_cache_memory_bytes): vLLM divides it into
blocks by its own page size, kvcert's side tensors (exact store, fp32 witness) taken out of it first
(fast.integrations.vllm._kv_budget), so every kvcert byte is inside the budget. Capacity is vLLM's own
block count times the block size (cache_config.num_gpu_blocks, as the engine core reported it), and the
maximum concurrency at the workload's tokens per request. Then one run per engine of the same --requests
requests (passkey prompts of ~--filler sentences, --max-tokens greedy tokens each, all submitted at once):
wall seconds, requests/s, generated tokens/s, and for kvcert the certified reads (every read of a quantized
key, prefill chunks included); every run starts from an empty prefix cache. The int8 page without and with
certificates (the certificates' cost under load) run side by side, --rounds times in turn, the order swapped
every round: their rows are their median rounds, cert_cost the median and range over rounds of
1 - certified / uncertified tokens/s. Engines: vLLM alone with its fp32 cache (the baseline), kvcert's packed
int8 page without certificates (KVCERT_CERTIFY=0, the same codes) and with them, the packed fp8 page
(fp8_per_token_head: e4m3 codes, one fp32 scale per token and KV head) and the packed int4 page
(int4_per_token_head: two codes a byte, one fp16 scale per token and KV head) with them; kvcert's fp8 (the
decoded fp32 store plus its witness: more bytes than vLLM alone) for its capacity only. bf16 is not run (kvcert needs an fp32
model on CPU; vLLM's CPU bf16 path is another kernel): its capacity is the fp32 engine's twice, at
2 x 2 D bytes per (slot, KV head), reported as computed.

    nice -n 10 python -m benchmarks.vllm_capacity --box --out results/vllm_capacity_box.json \
        --engines "kvcert int8, packed page (no certificate)|kvcert int8, packed page, certified"

--box: the certified int8 engine of the pair with the box form too (KVCERT_BOX=1, --box-above its
KVCERT_BOX_ABOVE): the cost of the tighter certificate under the same load. --bands: the band witness's bands per
head of every kvcert engine (KVCERT_BANDS, 8 by default; the certified pages' bytes grow by one per band).
"""

import argparse
import json
import os
import platform
import shlex
import sys
import time

ENGINES = {  # name: (make_llm keywords (None: vLLM without kvcert), run the workload (else capacity only))
    "vLLM fp32 (no kvcert)": (None, True),
    "kvcert int8, packed page (no certificate)": (dict(codec="int8", certify=False), True),
    "kvcert int8, packed page, certified": (dict(codec="int8"), True),
    "kvcert fp8_per_token_head, packed page, certified": (dict(codec="fp8_per_token_head"), True),
    "kvcert int4_per_token_head, packed page, certified": (dict(codec="int4_per_token_head"), True),
    "kvcert fp8_e4m3 (decoded fp32 store), certified": (dict(codec="fp8_e4m3"), False),
}


def _llm(model, kw, budget, max_len, batched):
    common = dict(enforce_eager=True, max_model_len=max_len, kv_cache_memory_bytes=budget, dtype="float32",
                  max_num_batched_tokens=batched, enable_chunked_prefill=True, max_num_seqs=64)
    if kw is None:
        os.environ["KVCERT_VLLM"] = "0"
        from vllm import LLM
        return LLM(model, **common)
    from fast.integrations.vllm import make_llm
    return make_llm(model, records=0, **kw, **common)


def _blocks(llm):
    cc = llm.llm_engine.vllm_config.cache_config
    return int(cc.num_gpu_blocks), int(cc.block_size)


PAIR = ("kvcert int8, packed page (no certificate)", "kvcert int8, packed page, certified")  # the cost's rounds


def _start(model, name, args, per_req, warm):
    """(engine, its row: capacity, kvcert's bytes) after a warm-up request (warm: a prompt)."""
    from vllm import SamplingParams
    kw = ENGINES[name][0]
    if kw is not None and args.bands != 8:
        kw = {**kw, "bands": args.bands}
    if args.box and name == PAIR[1]:  # the certified int8 engine with the box form (its histogram of c, spec T9c)
        kw = {**kw, "box": True, "box_above": args.box_above}
    llm = _llm(model, kw, args.budget_mib << 20, args.max_model_len, args.batched_tokens)
    nb, bs = _blocks(llm)
    row = {"engine": name, "kvcert": kw, "blocks": nb, "block_size": bs, "capacity_tokens": nb * bs,
           "max_concurrency": nb * bs / per_req}
    llm.generate([warm], SamplingParams(max_tokens=2, temperature=0.0))  # kernel build, caches
    if kw is not None:  # after the first write: the plugin counts the bytes as each layer's cache is first used
        (mem,) = llm.collective_rpc("kvcert_memory")
        row["memory"] = {k: mem[k] for k in ("budget", "vllm_share", "vllm_cache_bytes", "kvcert_bytes")}
    return llm, row


def _workload(llm, kw, prompts, params):
    """One timed run of every request at once, from an empty prefix cache: seconds, rates, answers."""
    from fast.integrations.vllm import generate
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, params) if kw is None else generate(llm, prompts, params)  # each with .kvcert
    sec = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    got = {"seconds": sec, "requests_per_s": len(prompts) / sec, "generated_tokens_per_s": gen / sec,
           "generated_tokens": gen, "answers": [list(o.outputs[0].token_ids) for o in outs]}
    if kw is not None and kw.get("certify", True):
        got["certified_reads"] = sum(o.kvcert["reads"] for o in outs)
    return got


def run(model, prompts, args):
    """One row per engine. The int8 pair (PAIR: the same codes without and with certificates) runs side by side,
    --rounds times in turn (the order swapped every round); each row gets its median round (by tokens/s) and
    every round's tokens/s, and cert_cost the median over rounds of 1 - certified / uncertified."""
    from tqdm import tqdm
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    per_req = max(len(p["prompt_token_ids"]) for p in prompts) + args.max_tokens
    names = [n for n in ENGINES if n in args.engines.split("|")] if args.engines else list(ENGINES)
    paired = all(n in names for n in PAIR)
    rows, cost = [], None
    for name in tqdm(names, desc="engines"):
        if paired and name == PAIR[1]:
            continue  # run beside PAIR[0]
        group = PAIR if paired and name == PAIR[0] else (name,)
        started = {n: _start(model, n, args, per_req, prompts[0]) for n in group}
        runs = {n: [] for n in group}
        if ENGINES[name][1]:
            for r in range(args.rounds if len(group) > 1 else 1):
                for n in (group if r % 2 == 0 else group[::-1]):
                    runs[n].append(_workload(started[n][0], started[n][1]["kvcert"], prompts, params))
        for n in group:
            row = started[n][1]
            if runs[n]:
                by_rate = sorted(runs[n], key=lambda x: x["generated_tokens_per_s"])
                row.update(by_rate[len(by_rate) // 2])
                if len(group) > 1:
                    row["rounds_tokens_per_s"] = [x["generated_tokens_per_s"] for x in runs[n]]
            rows.append(row)
        if len(group) > 1 and runs[group[0]]:
            per_round = sorted(1.0 - c["generated_tokens_per_s"] / u["generated_tokens_per_s"]
                               for u, c in zip(runs[PAIR[0]], runs[PAIR[1]]))
            cost = {"median": per_round[len(per_round) // 2], "min": per_round[0], "max": per_round[-1],
                    "rounds": len(per_round)}
        del started
    add_ratios(rows)
    return rows, per_req, cost


def add_ratios(rows):
    """capacity_vs_fp32 and (engines that ran the workload) throughput_vs_fp32 against vLLM without kvcert."""
    base = next((r for r in rows if r["kvcert"] is None), None)
    if base is None:
        return
    for r in rows:
        r["capacity_vs_fp32"] = r["capacity_tokens"] / base["capacity_tokens"]
        if "seconds" in r:
            r["throughput_vs_fp32"] = r["generated_tokens_per_s"] / base["generated_tokens_per_s"]


def table(res):
    rows = []
    for r in res["engines"]:
        ran = "seconds" in r
        rows.append([r["engine"], f"{r['capacity_tokens']:,}", f"{r['max_concurrency']:.1f}",
                     f"{r.get('capacity_vs_fp32', 1.0):.2f}x", f"{r['requests_per_s']:.3f}" if ran else "(capacity only)",
                     f"{r['generated_tokens_per_s']:.1f}" if ran else "-",
                     f"{r.get('throughput_vs_fp32', 1.0):.2f}x" if ran else "-",
                     f"{r['certified_reads']:,}" if "certified_reads" in r else "-"])
    bf16 = res["bf16_equivalent"]
    rows.append(["bf16 cache (computed, not run)", f"{bf16['capacity_tokens']:,}", f"{bf16['max_concurrency']:.1f}",
                 f"{bf16['capacity_vs_fp32']:.2f}x", "-", "-", "-", "-"])
    cost = res.get("cert_cost")
    cost = (f"; int8's certificates cost {100 * cost['median']:.1f}% of tokens/s under this load (median of {cost['rounds']} "
            f"rounds in turn, range {100 * cost['min']:.1f}% to {100 * cost['max']:.1f}%)") if cost else ""
    bands = f", witness of {res['bands']} bands" if res.get("bands", 8) != 8 else ""
    return {"title": f"kvcert inside vLLM: KV capacity and throughput at one KV budget of {res['budget_mib']} MiB{bands} "
                     f"(SmolLM2-135M fp32, CPU; {res['requests']} requests of ~{res['prompt_tokens_median']} prompt "
                     f"tokens + {res['max_tokens']} generated, submitted at once){cost}",
            "header": ["engine", "KV capacity (tokens)", "max concurrency", "capacity vs fp32", "requests/s",
                       "generated tokens/s", "throughput vs fp32", "certified reads"],
            "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=int, default=96)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--filler", type=int, default=8, help="passkey filler sentences (8 ~ 284 tokens, 40 ~ 1k)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--batched-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the int8 pair without / with certificates")
    ap.add_argument("--engines", default="", help="'|'-separated engine names (default: all)")
    ap.add_argument("--box", action="store_true", help="the certified int8 engine with the box form (KVCERT_BOX=1)")
    ap.add_argument("--box-above", type=float, default=0.0, help="KVCERT_BOX_ABOVE of that engine (0: the box on every row)")
    ap.add_argument("--bands", type=int, default=8, help="KVCERT_BANDS of every kvcert engine")
    ap.add_argument("--out", default="results/vllm_capacity.json")
    args = ap.parse_args(argv)
    start = time.time()
    import torch
    import vllm
    from transformers import AutoTokenizer

    from benchmarks.vllm_bench import _prompts
    from fast.integrations.vllm import packed_row_bytes as row, smollm2_dir
    model, nb = str(smollm2_dir()), args.bands
    prompts = [p for p, _ in _prompts(AutoTokenizer.from_pretrained(model), args.requests, args.filler)]
    rows, per_req, cost = run(model, prompts, args)
    lens = sorted(len(p["prompt_token_ids"]) for p in prompts)
    base = next((r for r in rows if r["kvcert"] is None), None)
    res = {"command": "python -m benchmarks.vllm_capacity " + shlex.join(argv if argv is not None else sys.argv[1:]),
           "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
           "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
           "model": "SmolLM2-135M-Instruct (fp32)", "budget_mib": args.budget_mib, "bands": args.bands, "requests": len(prompts),
           "prompt_tokens_median": lens[len(lens) // 2], "max_tokens": args.max_tokens, "tokens_per_request": per_req,
           "bytes_per_slot_kv_head": {"fp32": 2 * 64 * 4, "bf16": 2 * 64 * 2, "int8 packed (certified)": row(64, nb),
                                      "int8 packed (no certificate)": row(64, nb, certify=False),
                                      "fp8_per_token_head packed (certified)": row(64, nb, True, "fp8_per_token_head"),
                                      "int4_per_token_head packed (certified)": row(64, nb, True, "int4_per_token_head")},
           "engines": rows, "cert_cost": cost}
    if base is not None:
        cap = 2 * base["capacity_tokens"]
        res["bf16_equivalent"] = {"capacity_tokens": cap, "max_concurrency": cap / per_req, "capacity_vs_fp32": 2.0}
        res["readme_table"] = table(res)
    res["seconds"] = time.time() - start
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    if "readme_table" in res:
        for r in res["readme_table"]["rows"]:
            print(" | ".join(r))


if __name__ == "__main__":
    main()
