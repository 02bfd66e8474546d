"""kvcert: generate with a certified compressed KV cache on the shipped SmolLM2.

    kvcert run --scheme fp8_e5m2 --gate certified:0.2 --prompt-file F [--shadow] [--max-new-tokens N] [--out DIR]
    kvcert run --scheme int8 --evict snapkv:256 --page page.json --prompt-file F   # eviction certificate (T7)
    kvcert report DIR
    kvcert demo
    kvcert calibrate-page --budget 256 --out page.json                              # PAGE tau (fast.tools.evict_cli)

Bad input (unknown scheme, gate or evictor, malformed TAU or budget, a prompt longer than
the model's context, a missing model package) prints one line and exits with status 2.
"""

import argparse
import random
import sys
import time
from pathlib import Path

EXIT_USAGE = 2
DEFAULT_OUT = "runs/latest"


class UsageError(Exception):
    """Reported as one line, no traceback."""


# ---- prompts ----

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def passkey_prompt(n_filler=40, key=None, depth=0.4, seed=0):
    """A passkey-retrieval prompt: the key hidden at `depth` inside n_filler filler sentences
    (40 ~ 1k tokens with SmolLM2's chat template). Returns (text, key)."""
    rng = random.Random(seed)
    key = key if key is not None else rng.randint(10000, 99999)
    pos = int(n_filler * depth)
    parts = [FILLER] * n_filler
    parts.insert(pos, f"The pass key is {key}. Remember it. {key} is the pass key. ")
    text = ("There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it.\n\n" + "".join(parts) +
            "\n\nWhat is the pass key? Answer with the number only.")
    return text, key


# ---- generation ----

def new_cache(model, args):
    from fast.integrations.hf_cache import CertifiedCache
    from fast.integrations.hf_meter import set_current
    set_current(None)
    return CertifiedCache(model.config, args.scheme, gate=args.gate, sinks=args.sinks, window=args.window,
                          shadow=args.shadow, seed=args.seed, delta_req=args.delta_req, offload=args.offload,
                          derived=args.witness == "derived")


def prefill_exact(model, ids, progress=True, desc=""):
    """One exact prefill (DynamicCache) that several runs can share: (cache, last logits [1, V])."""
    import torch
    from tqdm import tqdm
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), tqdm(total=1, desc=f"{desc}prefill {len(ids)} tokens", disable=not progress, leave=False) as bar:
        logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[:, -1]
        bar.update(1)
    return cache, logits


def decode(model, ids, cache, max_new, *, eos=None, progress=True, desc="", shared=None):
    """Greedy decoding with our own loop (progress bars per prefill layer and per token).
    cache=None: a plain DynamicCache. shared=(exact DynamicCache, logits): start from a prefill
    already made (the prefill reads exact keys under every scheme, so it can be shared).
    Returns the new token ids. (Eviction: `decode_evicting`.)"""
    import copy
    import torch
    from tqdm import tqdm
    from transformers import DynamicCache

    plain = cache is None
    if plain:
        cache = copy.deepcopy(shared[0]) if shared else DynamicCache(config=model.config)
    x = torch.tensor([ids])
    L = model.config.num_hidden_layers
    with torch.no_grad():
        if shared is not None:
            if not plain:
                cache.fill_from(shared[0])
            logits = shared[1]
        else:
            bar = tqdm(total=L, desc=f"{desc}prefill", unit="layer", disable=not progress, leave=False)
            if not plain:
                cache.on_layer = lambda phase, l: bar.update(1) if phase == "prefill" else None
            logits = model(input_ids=x, cache=cache, use_cache=True).logits[:, -1]
            bar.update(L - bar.n)
            bar.close()
        tok = logits.argmax(-1)
        out = [int(tok)]
        bar = tqdm(total=max_new, desc=f"{desc}decode", unit="tok", disable=not progress, leave=False)
        bar.update(1)
        while len(out) < max_new and out[-1] != eos:
            logits = model(input_ids=tok[:, None], cache=cache, use_cache=True).logits[:, -1]
            tok = logits.argmax(-1)
            out.append(int(tok))
            bar.update(1)
        bar.close()
    if not plain:
        cache.on_layer = None
    return out


def decode_evicting(model, ids, cache, args, evict, page, *, eos=None, progress=True, desc=""):
    """Greedy decoding with eviction after the prefill (fast.policies.evictors.generate: new tokens keep
    the RoPE positions N + t, the mask follows the kept layout, the eviction certificate of every
    decode step is in out["trace"]). Returns (new token ids, generate's dict)."""
    import torch
    from tqdm import tqdm
    from fast.policies.evictors import generate
    from fast.core.schemes import SchemeError
    L = model.config.num_hidden_layers
    pbar = tqdm(total=L, desc=f"{desc}prefill", unit="layer", disable=not progress, leave=False)
    dbar = tqdm(total=args.max_new_tokens, desc=f"{desc}decode", unit="tok", disable=not progress, leave=False)

    def tick(phase, l):
        if phase == "prefill":
            pbar.update(1)
        elif l == L - 1:
            dbar.update(1)

    cache.on_layer = tick
    try:
        out = generate(model, torch.tensor([ids]), evictor=evict, page=page, cache=cache, max_new_tokens=args.max_new_tokens,
                       eos_token_id=eos, group_size=args.evict_group_size, shadow=args.shadow)
    except (ValueError, SchemeError) as e:   # e.g. a block-quantized scheme cannot drop single tokens
        raise UsageError(f"--evict {args.evict} with --scheme {args.scheme}: {e}") from None
    finally:
        cache.on_layer = None
        pbar.close()
        dbar.close()
    return out["tokens"][0].tolist(), out


def load(args_progress=True):
    from fast.integrations.hf_meter import enable
    from fast.integrations.model import load_smollm2
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model, tok = load_smollm2()
    return enable(model), tok


def check_args(args):
    """Validate scheme, gate and options before loading anything (one-line errors)."""
    from fast.integrations.hf_cache import parse_gate
    from fast.core.schemes import SchemeError, get_scheme
    try:
        get_scheme(args.scheme)
        parse_gate(args.gate)
    except (SchemeError, ValueError) as e:
        raise UsageError(str(e)) from None
    if not 0 < args.delta_req < 1:
        raise UsageError(f"--delta-req must lie in (0, 1), got {args.delta_req}")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    if getattr(args, "evict_group_size", 1) < 1:
        raise UsageError("--evict-group-size must be >= 1")
    from fast.tools.evict_cli import from_args
    try:
        evict, page = from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    scheme = get_scheme(args.scheme)
    if evict is not None and (scheme.block_k > 1 or scheme.dither):
        why = f"quantizes keys in blocks of {scheme.block_k} tokens" if scheme.block_k > 1 else "keeps dither counters that follow contiguous tokens"
        raise UsageError(f"--evict needs a per-token scheme: {args.scheme} {why} (try int8, int4 or fp8_e4m3)")
    return evict, page


def prompt_ids(tok, model, text, max_new):
    from fast.integrations.model import chat_ids
    ids = chat_ids(tok, text)
    limit = model.config.max_position_embeddings
    if len(ids) + max_new > limit:
        raise UsageError(f"prompt of {len(ids)} tokens + {max_new} new tokens exceeds the model's context of {limit}")
    return ids


def run_one(model, tok, ids, args, progress=True, desc="", shared=None):
    """Generate under args.scheme/args.gate (and args.evict/args.page when present); returns (answer, trace)."""
    from fast.tools import trace as T
    from fast.tools.evict_cli import from_args, trace_summary
    from fast.policies.evictors import keep_count
    try:
        evict, page = from_args(args) if hasattr(args, "evict") else (None, None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    cache = new_cache(model, args)
    info = gen = None
    t0 = time.perf_counter()
    if evict is not None and keep_count(evict.budget, len(ids)) >= len(ids):
        # the budget holds the whole prompt: nothing to evict, no eviction certificate needed
        info = {"spec": args.evict, "evicted": False, "note": f"the {len(ids)}-token prompt fits the budget"}
        evict = None
    if evict is not None:
        out, gen = decode_evicting(model, ids, cache, args, evict, page, eos=tok.eos_token_id, progress=progress, desc=desc)
        info = {"spec": args.evict, "group_size": args.evict_group_size, **trace_summary(gen)}
        if page is not None:
            info["page_tau"] = page.tau
    else:
        out = decode(model, ids, cache, args.max_new_tokens, eos=tok.eos_token_id, progress=progress,
                     desc=desc, shared=shared)
    secs = time.perf_counter() - t0
    answer = tok.decode(out, skip_special_tokens=True).strip()
    meta = {"command": " ".join(sys.argv), "answer": answer, "prompt_tokens": len(ids), "new_tokens": len(out),
            "seconds": round(secs, 3), "sinks": args.sinks, "window": args.window, "seed": args.seed,
            "delta_req": args.delta_req, "offload": args.offload, "witness": args.witness, "shadow": args.shadow}
    if info is not None:
        meta["eviction"] = info
    tr = T.from_cache(cache, meta)
    if gen is not None:
        T.add_eviction(tr, gen["trace"])
    return answer, tr


def cmd_run(args):
    check_args(args)
    path = Path(args.prompt_file)
    if not path.is_file():
        raise UsageError(f"prompt file not found: {path}")
    text = path.read_text()
    model, tok = load()
    ids = prompt_ids(tok, model, text, args.max_new_tokens)
    answer, tr = run_one(model, tok, ids, args)
    from fast.tools import trace as T
    out = T.save(tr, args.out)
    print(f"answer: {answer}")
    print(T.format_summary(T.summary(tr)))
    print(f"trace and plots: {out}/")
    return 0


def cmd_report(args):
    from fast.tools import trace as T
    try:
        tr = T.load(args.dir)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    files = T.plots(tr, args.dir)
    if tr.meta.get("answer") is not None:
        print(f"answer: {tr.meta['answer']}")
    print(T.format_summary(T.summary(tr)))
    print(f"plots: {', '.join(str(f) for f in files) or 'none (no decode steps)'}")
    return 0


# Measured on SmolLM2 (greedy, seed 0): at 1052 and 1244 prompt tokens no built-in scheme loses the
# passkey (kivi2 with or without sinks and window, int4 without a window); at 1532 tokens kivi2
# (4 sinks, 32-token window) answers 6048 instead of 60494, and gated it answers right.
DEMO_HARM = "kivi2"


def cmd_demo(args):
    from fast.tools import trace as T
    model, tok = load()
    text, key = passkey_prompt(n_filler=args.filler, seed=args.seed)
    ids = prompt_ids(tok, model, text, args.max_new_tokens)
    print(f"passkey demo: {len(ids)} prompt tokens, the pass key is {key}")
    shared = prefill_exact(model, ids)  # the prefill reads exact keys under every scheme: share it
    base = decode(model, ids, None, args.max_new_tokens, eos=tok.eos_token_id, desc="uncompressed ", shared=shared)
    rows = [("uncompressed", "-", tok.decode(base, skip_special_tokens=True).strip(), None)]
    runs = [(DEMO_HARM, "none", "full"), (DEMO_HARM, f"certified:{args.tau}", "full"),
            (DEMO_HARM, f"certified:{args.tau}", "residual"), ("int8_dither", "none", "full")]
    for scheme, gate, offload in runs:
        a = argparse.Namespace(**vars(args))
        a.scheme, a.gate, a.offload = scheme, gate, offload
        answer, tr = run_one(model, tok, ids, a, desc=f"{scheme}/{gate} ", shared=shared)
        label = gate if gate == "none" else f"{gate}/{offload}"
        T.save(tr, Path(args.out) / f"{scheme}_{label.replace(':', '_').replace('/', '_')}")
        rows.append((scheme, label, answer, T.summary(tr)))
    print()
    print(f"{'scheme':<14}{'gate/offload':<24}{'correct':<9}{'coverage':>9}{'worst':>8}{'repairs':>8}"
          f"{'dev B/tok':>10}{'off B/tok':>10}  answer")
    for scheme, gate, answer, s in rows:
        ok = "yes" if str(key) in answer else "NO"
        if s is None:
            fp16 = 2 * 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * 64
            print(f"{scheme:<14}{gate:<24}{ok:<9}{'-':>9}{'-':>8}{'-':>8}{fp16:>10}{0:>10}  {answer!r}")
        else:
            print(f"{scheme:<14}{gate:<24}{ok:<9}{s['coverage']:>9.1%}{s['worst_bound']:>8.3f}{s['repairs']:>8}"
                  f"{s['device_bytes_per_token']:>10.0f}{s.get('offload_bytes_per_token', 0):>10.0f}  {answer!r}")
    print()
    for scheme, gate, _, s in rows[1:]:
        print(T.format_summary(s))
    print("(bytes per token over all layers; the model runs in fp32 on CPU, so exact copies cost 4 bytes a value;\n"
          f" uncompressed row: an fp16 cache. Traces and plots under {args.out}/)")
    return 0


def parser():
    ap = argparse.ArgumentParser(prog="kvcert", description="Certified compressed KV cache on SmolLM2.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--max-new-tokens", type=int, default=24)
        p.add_argument("--sinks", type=int, default=4, help="first tokens kept exact")
        p.add_argument("--window", type=int, default=32, help="newest tokens kept exact")
        p.add_argument("--seed", type=int, default=0, help="dither seed (per request)")
        p.add_argument("--delta-req", type=float, default=1e-3, help="failure budget of the dither tier")
        p.add_argument("--offload", choices=("full", "residual"), default="full",
                       help="exact tier for repairs: a full copy, or the int8 residual k - k_hat with its witness")
        p.add_argument("--witness", choices=("stored", "derived"), default="stored",
                       help="derived: zero-memory witness from the scales (uniform codecs); stored: 1 byte per band")
        p.add_argument("--shadow", action="store_true", help="also keep the exact cache and record the true TV")

    r = sub.add_parser("run", help="generate and certify")
    r.add_argument("--scheme", default="int8")
    r.add_argument("--gate", default="none", help="none | certified:TAU | risk:K")
    r.add_argument("--prompt-file", required=True)
    r.add_argument("--out", default=DEFAULT_OUT)
    common(r)
    from fast.tools.evict_cli import add_run_arguments
    add_run_arguments(r)            # --evict, --page, --evict-group-size
    r.set_defaults(fn=cmd_run)

    p = sub.add_parser("report", help="re-render the summary and plots of a saved trace")
    p.add_argument("dir")
    p.set_defaults(fn=cmd_report)

    d = sub.add_parser("demo", help="passkey at ~1.5k tokens: uncompressed, harmful scheme raw and gated, int8_dither")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--filler", type=int, default=60, help="filler sentences (60: 1532 prompt tokens)")
    d.add_argument("--tau", type=float, default=0.2)
    common(d)
    d.set_defaults(fn=cmd_demo, shadow=False)

    sub.add_parser("calibrate-page", add_help=False, help="set the PAGE gate's tau on unlabelled prompts "
                   "(kvcert calibrate-page --help)")
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate-page"]:
        from fast.tools.evict_cli import calibrate_page_main
        return calibrate_page_main(argv[1:])
    args = parser().parse_args(argv)
    from fast.integrations.model import ModelMissing
    try:
        return args.fn(args)
    except (UsageError, ModelMissing) as e:
        print(f"kvcert: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
