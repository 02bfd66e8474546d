"""kvcert's evictors against kvpress's on the same inputs, budgets, generation and scoring.

    nice -n 10 .venv/bin/python -m benchmarks.evict_vs_kvpress --kvpress-path DIR [--n 40]
        [--budgets 192,96] [--methods snapkv,streaming,knorm,random,tova] -> results/evict_vs_kvpress.json

kvpress is not a dependency: it needs another transformers (kvpress 0.5.5: transformers < 5.3), so it
is installed beside the project (`pip install --target DIR --no-deps kvpress==0.5.5 transformers==5.2.0
tokenizers==0.22.2 "huggingface-hub<2" datasets pyarrow pandas dill multiprocess xxhash fsspec fire
termcolor`) and run in a child process of this script with DIR first on its PYTHONPATH
(`--kvpress-worker`). Both sides get the same token ids, made here once by benchmarks.ruler.build:
the RULER-style inputs of benchmarks.evict_eval (same seeds, tasks, haystacks, ~--tokens tokens).

kvpress runs its own pipeline code (KVPressTextGenerationPipeline._forward, its greedy decoding):
the context (chat template up to the end of the haystack) is prefilled with the press and
compressed, then the question (the question, end of turn, assistant header, answer prefix) is
prefilled on the compressed cache at the positions after the context, and answered greedily.
Budget K: compression_ratio = 1 - (K + 0.5) / context_len, so that int(context_len * (1 - ratio)) = K
context tokens are kept (the question is never compressed). Only the tokenisation is done here
(the ids of ruler.build split at the question) so that both sides read identical tokens.

kvcert runs fast.policies.evictors the same way (`context` mode: prefill_context, evict the context
to K tokens with kvpress's conventions per method, then prefill the question and decode), and also as
benchmarks.evict_eval runs it (`prompt` mode: the whole prompt, question included, prefilled and
evicted to K tokens with 4 sinks and a recent window of round(K/8), the first answer token from the
full prefill), so the table shows both. Per method and budget: accuracy of each side, and the exact
McNemar test (benchmarks/stats.py) of kvcert against kvpress on the same inputs.
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("snapkv", "streaming", "knorm", "random", "tova")
# kvcert evictor specs with kvpress's conventions (ScorerPress: top-K per KV head, nothing forced
# but what the method itself forces): SnapKV keeps its 64-query window (its scores are padded with
# the max), TOVA averages all query heads and keeps the last token, StreamingLLM keeps 4 sinks.
KVPRESS_LIKE = {"snapkv": "snapkv:{K}:sinks=0,window=64", "streaming": "streaming:{K}:sinks=4,window=0",
                "knorm": "knorm:{K}:sinks=0,window=0", "random": "random:{K}:sinks=0,window=0",
                "tova": "tova:{K}:heads=all,sinks=0,window=1"}


def question_start(tok, ids, ex):
    """Index of the first token of the question part ("\\n\\n" + question + template tail + answer
    prefix) in the ids of ruler.build: the context is ids[:s]."""
    from benchmarks.ruler import split_question
    q = "\n\n" + split_question(ex)[0]
    row = ids[0].tolist()
    for s in range(len(row) - 1, 0, -1):
        if tok.decode(row[s:]).startswith(q):
            return s
    raise ValueError(f"question {q!r} not found in the prompt")


def make_inputs(tok, n, tokens, haystacks=("synthetic", "natural")):
    from benchmarks.ruler import allowance, build, examples
    out = []
    for ex in examples(n, haystacks=haystacks):
        ids, N = build(tok, ex, tokens)
        s = question_start(tok, ids, ex)
        out.append({"task": ex["task"], "seed": ex["seed"], "depth": ex["depth"], "haystack": ex["haystack"],
                    "answers": ex["answers"], "allowance": allowance(tok, ex), "ids": ids[0].tolist(), "split": s})
    return out


def kvpress_ratio(K, context_len):
    """compression_ratio that keeps exactly K of context_len tokens (kvpress keeps int(len * (1 - r)))."""
    if not 0 < K < context_len:
        raise ValueError(f"budget {K} must lie in (0, {context_len})")
    return 1 - (K + 0.5) / context_len


# ---------------------------------------------------------------- the kvpress side (child process)

def kvpress_worker(inp, out):
    """Runs in a process whose PYTHONPATH starts with the kvpress install (its transformers)."""
    import torch
    import transformers
    from kvpress import KnormPress, RandomPress, SnapKVPress, StreamingLLMPress, TOVAPress
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer
    job = json.loads(Path(inp).read_text())
    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype="float32", attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    model.generation_config.eos_token_id = job["eos"]
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device="cpu")
    presses = {"snapkv": lambda r: SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5),
               "streaming": lambda r: StreamingLLMPress(compression_ratio=r, n_sink=4),
               "knorm": lambda r: KnormPress(compression_ratio=r),
               "random": lambda r: RandomPress(compression_ratio=r, seed=0),
               "tova": lambda r: TOVAPress(compression_ratio=r)}
    rows = []
    for i, x in enumerate(job["inputs"]):
        ctx = torch.tensor([x["ids"][:x["split"]]])
        q = torch.tensor([x["ids"][x["split"]:]])
        row = {}
        for key in ["full"] + [f"{m}@{K}" for K in job["budgets"] for m in job["methods"]]:
            press = None
            if key != "full":
                m, K = key.split("@")
                press = presses[m](kvpress_ratio(int(K), ctx.shape[1]))
            with torch.no_grad():
                ans = pipe._forward({"context_ids": ctx, "questions_ids": [q]}, max_new_tokens=x["allowance"], press=press)
            row[key] = ans[0]
        rows.append(row)
        print(f"kvpress [{i + 1}/{len(job['inputs'])}] " + " ".join(f"{k}={int(all(a in t for a in x['answers']))}"
                                                             for k, t in row.items()), flush=True)
        Path(out).write_text(json.dumps({"versions": {"kvpress": _dist("kvpress"), "transformers": transformers.__version__,
                                                      "torch": torch.__version__},
                                         "answers": rows}))             # after every input: --collect reads it


def _dist(name):
    from importlib.metadata import version
    try:
        return version(name)
    except Exception:
        return None


# ---------------------------------------------------------------- the kvcert side

def kvcert_answers(model, tok, inputs, methods, budgets, modes, progress=None):
    """{mode: [ {key: text} per input ]} for modes 'context' (kvpress's protocol) and 'prompt'
    (benchmarks.evict_eval's); progress(out) after every input."""
    import torch
    from benchmarks.evict_eval import parse_spec
    from fast.policies.evictors import copy_prefill, decode, evict, make_evictor, prefill
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out = {m: [] for m in modes}
    for i, x in enumerate(inputs):
        ids = torch.tensor([x["ids"]])
        ctx, q = ids[:, :x["split"]], ids[:, x["split"]:]
        if "context" in modes:
            row = {}
            pre = prefill(model, ctx, needs={"window", "last"})
            for key in ["full"] + [f"{m}@{K}" for K in budgets for m in methods]:
                mine = copy_prefill(pre, model.config)
                ev = None
                if key != "full":
                    m, K = key.split("@")
                    ev = evict(mine, make_evictor(KVPRESS_LIKE[m].format(K=K)), witness=False)
                toks = decode(model, mine, ev, max_new_tokens=x["allowance"], certify=False, eos_token_id=eos,
                              question=q)["tokens"]
                row[key] = tok.decode(toks[0], skip_special_tokens=True)
            out["context"].append(row)
        if "prompt" in modes:
            row = {}
            pre = prefill(model, ids, needs={"window", "last"})
            for key in ["full"] + [f"{m}@{K}" for K in budgets for m in methods]:
                mine = copy_prefill(pre, model.config)
                ev = None
                if key != "full":
                    m, K = key.split("@")
                    ev = evict(mine, make_evictor(parse_spec(m, int(K), 4, 0.125)[1]), witness=False)
                toks = decode(model, mine, ev, max_new_tokens=x["allowance"], certify=False, eos_token_id=eos)["tokens"]
                row[key] = tok.decode(toks[0], skip_special_tokens=True)
            out["prompt"].append(row)
        print(f"kvcert [{i + 1}/{len(inputs)}] " + " ".join(f"{m}:{k}={int(all(a in t for a in x['answers']))}"
                                                           for m in modes for k, t in out[m][-1].items()), flush=True)
        if progress is not None:
            progress(out)
    return out


def kvcert_worker(inp, out):
    import torch
    from transformers.utils import logging as hf_logging
    from fast.integrations.model import load_smollm2
    hf_logging.set_verbosity_error()
    job = json.loads(Path(inp).read_text())
    torch.set_num_threads(job["threads"])
    model, tok = load_smollm2()
    kvcert_answers(model, tok, job["inputs"], job["methods"], job["budgets"], job["modes"],
                   progress=lambda ans: Path(out).write_text(json.dumps({"answers": ans})))


def summarize(inputs, kvp, kvc, methods, budgets):
    from benchmarks.ruler import score
    from benchmarks.stats import mcnemar, wilson
    n = len(inputs)
    ok = lambda rows, key: [score(r[key], x["answers"]) for r, x in zip(rows, inputs)]   # noqa: E731
    cells = {}
    for key in ["full"] + [f"{m}@{K}" for K in budgets for m in methods]:
        a = ok(kvp, key)
        cell = {"kvpress": {"correct": sum(a), "accuracy": round(sum(a) / n, 4), "ci": wilson(sum(a), n)}}
        for mode, rows in kvc.items():
            b = ok(rows, key)
            p, b_only, a_only = mcnemar(b, a)
            cell[f"kvcert_{mode}"] = {"correct": sum(b), "accuracy": round(sum(b) / n, 4), "ci": wilson(sum(b), n),
                                      "mcnemar_vs_kvpress": {"p": round(p, 5), "kvcert_only": b_only,
                                                             "kvpress_only": a_only},
                                      "same_answer_text": sum(1 for r, s in zip(rows, kvp) if r[key].strip() == s[key].strip())}
        cells[key] = cell
    return cells


def findings(data):
    """Sentences for the README, from the cells: per method and budget, each kvcert protocol against
    kvpress (accuracies, exact McNemar p, identical answer texts)."""
    n = data["settings"]["n"]
    out = []
    for key, c in data["cells"].items():
        parts = []
        for m in data["settings"]["kvcert_modes"]:
            k = c[f"kvcert_{m}"]
            mc = k["mcnemar_vs_kvpress"]
            parts.append(f"kvcert ({m}) {k['accuracy']:.2f}, p = {mc['p']:.2g} ({mc['kvcert_only']} inputs right only "
                         f"with kvcert, {mc['kvpress_only']} only with kvpress; the same answer text on "
                         f"{k['same_answer_text']} of {n})")
        out.append(f"{key}: kvpress {c['kvpress']['accuracy']:.2f}; " + "; ".join(parts))
    for m in data["settings"]["kvcert_modes"]:
        sig = [k for k, c in data["cells"].items() if c[f"kvcert_{m}"]["mcnemar_vs_kvpress"]["p"] < 0.05]
        out.append(f"kvcert ({m}) differs from kvpress at p < 0.05 (exact McNemar, not adjusted) in {len(sig)} of "
                   f"{len(data['cells'])} rows" + (f": {', '.join(sig)}" if sig else ""))
    return out


def table(data):
    modes = data["settings"]["kvcert_modes"]
    st = data["settings"]
    head = ["method", "budget", "kvpress"]
    for m in modes:
        head += [f"kvcert ({m})", "p vs kvpress", "kvcert-only/kvpress-only"]
    rows = []
    for key, c in data["cells"].items():
        meth, _, K = key.partition("@")
        r = [meth, K or "-", f"{c['kvpress']['accuracy']:.2f}"]
        for m in modes:
            k = c[f"kvcert_{m}"]
            mc = k["mcnemar_vs_kvpress"]
            r += [f"{k['accuracy']:.2f}", f"{mc['p']:.2g}", f"{mc['kvcert_only']}/{mc['kvpress_only']}"]
        rows.append(r)
    return {"title": f"kvcert's evictors against kvpress {data['versions']['kvpress']['kvpress']} (its pipeline: "
                     f"context compressed, question appended) on the same {st['n']} inputs of ~{st['tokens']} tokens "
                     "(SmolLM2-135M, greedy, ruler.score); budget = context tokens kept; p: exact McNemar, kvcert vs "
                     "kvpress per input (not adjusted); kvcert (context): kvpress's protocol and conventions; "
                     "kvcert (prompt): as benchmarks.evict_eval runs it (question inside the evicted prompt, "
                     "4 sinks + recent K/8 forced)",
            "header": head, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--budgets", default="192,96")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--modes", default="context,prompt", help="kvcert protocols: context (kvpress's), prompt (evict_eval's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kvpress-path", default=os.environ.get("KVPRESS_PATH"),
                    help="a --target install of kvpress and its transformers (see the module doc)")
    ap.add_argument("--procs", type=int, default=1, help="worker processes per side (the inputs split between them)")
    ap.add_argument("--kvpress-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--kvcert-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "results" / "evict_vs_kvpress.json"))
    ap.add_argument("--collect", action="store_true", help="combine what stopped workers finished (same arguments)")
    ap.add_argument("--resummarize", default=None, help="only recompute the summary of this results file from its records")
    args = ap.parse_args(argv)
    if args.resummarize:
        data = json.loads(Path(args.resummarize).read_text())
        st, recs = data["settings"], data["records"]
        kvc = {m: [r[f"kvcert_{m}"] for r in recs] for m in st["kvcert_modes"]}
        data["cells"] = summarize(recs, [r["kvpress"] for r in recs], kvc, st["methods"], st["budgets"])
        data["findings"] = findings(data)
        data["readme_tables"] = [table(data)]
        Path(args.resummarize).write_text(json.dumps(data, indent=1))
        return 0
    if args.kvpress_worker:
        kvpress_worker(*args.kvpress_worker)
        return 0
    if args.kvcert_worker:
        kvcert_worker(*args.kvcert_worker)
        return 0
    if not args.kvpress_path or not Path(args.kvpress_path, "kvpress").is_dir():
        ap.error("--kvpress-path DIR (or $KVPRESS_PATH): a directory holding an install of kvpress (see the module doc)")
    import torch
    import transformers
    from transformers.utils import logging as hf_logging
    from fast.integrations.model import converted_dir, load_smollm2
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in methods if m not in METHODS] + [m for m in modes if m not in ("context", "prompt")]
    if bad:
        ap.error(f"unknown method or mode {bad[0]!r}")
    model, tok = load_smollm2()
    t0 = time.time()
    inputs = make_inputs(tok, args.n, args.tokens)
    if args.collect:
        return collect(args, argv, inputs, None)
    P = max(1, min(args.procs, len(inputs)))
    shards = [list(range(i, len(inputs), P)) for i in range(P)]
    base = Path(args.out).with_suffix("")
    common = {"budgets": budgets, "methods": methods, "modes": modes, "threads": args.threads,
              "model_dir": str(converted_dir()), "eos": tok.convert_tokens_to_ids("<|im_end|>")}
    kvp_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [args.kvpress_path, str(ROOT)])))
    children, files = [], []
    for side, env in (("kvpress", kvp_env), ("kvcert", None)):
        for i, shard in enumerate(shards):
            job, got = Path(f"{base}.{side}{i}.job.json"), Path(f"{base}.{side}{i}.out.json")
            job.write_text(json.dumps(dict(common, inputs=[inputs[j] for j in shard])))
            children.append(subprocess.Popen([sys.executable, "-m", "benchmarks.evict_vs_kvpress", f"--{side}-worker",
                                              str(job), str(got)], cwd=ROOT, env=env))
            files.append((side, shard, job, got))
    failed = [c.args for c in children if c.wait() != 0]
    if failed:
        raise SystemExit(f"a worker failed: {failed[0]} (what the workers finished: --collect)")
    return collect(args, argv, inputs, t0)


def collect(args, argv, inputs, t0):
    """Combine the workers' files; when they were stopped early, keep the longest prefix of inputs
    that both sides finished (the first n' inputs: what `--n n'` runs) and record it."""
    import torch
    import transformers
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    base = Path(args.out).with_suffix("")
    P = max(1, min(args.procs, len(inputs)))
    shards = [list(range(i, len(inputs), P)) for i in range(P)]
    kvp, kvc, kvp_versions = [None] * len(inputs), {m: [None] * len(inputs) for m in modes}, None
    files = []
    for side in ("kvpress", "kvcert"):
        for i, shard in enumerate(shards):
            job, got = Path(f"{base}.{side}{i}.job.json"), Path(f"{base}.{side}{i}.out.json")
            files += [job, got]
            if not got.is_file():
                continue
            res = json.loads(got.read_text())
            if side == "kvpress":
                kvp_versions = res["versions"]
                for k, a in enumerate(res["answers"]):
                    kvp[shard[k]] = a
            else:
                for m in modes:
                    for k, a in enumerate(res["answers"][m]):
                        kvc[m][shard[k]] = a
    done = 0
    while done < len(inputs) and kvp[done] is not None and all(kvc[m][done] is not None for m in modes):
        done += 1
    if done == 0:
        raise SystemExit("no input finished on both sides")
    argv = list(argv if argv is not None else sys.argv[1:])
    argv = [a for a in argv if a != "--collect"]
    if done < len(inputs):                     # the command that makes exactly these inputs
        argv = [a for i, a in enumerate(argv) if a != "--n" and (i == 0 or argv[i - 1] != "--n")] + ["--n", str(done)]
    inputs_all = inputs
    inputs, kvp = inputs[:done], kvp[:done]
    kvc = {m: v[:done] for m, v in kvc.items()}
    kvp = {"answers": kvp, "versions": kvp_versions}
    args.n = done
    data = {"command": "nice -n 10 .venv/bin/python -m benchmarks.evict_vs_kvpress "
                       + shlex.join(a for a in (argv if argv is not None else sys.argv[1:])),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "threads": args.threads},
            "versions": {"kvcert": {"transformers": transformers.__version__, "torch": torch.__version__},
                         "kvpress": kvp["versions"]},
            "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, fp32, CPU, sdpa)",
            "settings": {"n": args.n, "tokens": args.tokens, "budgets": budgets, "methods": methods, "kvcert_modes": modes,
                         "kvcert_specs_context": {m: KVPRESS_LIKE[m] for m in methods},
                         "generation": "greedy, ruler.allowance(task) new tokens, stop at <|im_end|>",
                         "context_tokens": [x["split"] for x in inputs],
                         "question_tokens": [len(x["ids"]) - x["split"] for x in inputs]},
            "seconds": round(time.time() - t0, 1) if t0 else None}
    data["cells"] = summarize(inputs, kvp["answers"], kvc, methods, budgets)
    data["records"] = [{"task": x["task"], "seed": x["seed"], "depth": x["depth"], "haystack": x["haystack"],
                        "answers": x["answers"], "kvpress": a, **{f"kvcert_{m}": kvc[m][i] for m in modes}}
                       for i, (x, a) in enumerate(zip(inputs, kvp["answers"]))]
    data["findings"] = findings(data)
    data["readme_tables"] = [table(data)]
    Path(args.out).write_text(json.dumps(data, indent=1))
    if args.n == len(inputs_all):              # complete: the workers' files go (a partial collect keeps them)
        for f in files:
            f.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
