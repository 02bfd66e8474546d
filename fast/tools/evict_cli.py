"""What the kvcert CLI calls for eviction: `--evict` / `--page` on `kvcert run`, and
`kvcert calibrate-page` (sets the PAGE threshold tau on unlabelled prompts).

    add_run_arguments(parser)            # adds --evict, --page, --evict-group-size (skips flags already there)
    evictor, page = from_args(args)      # (None, None) without --evict
    out = fast.policies.evictors.generate(model, ids, evictor=evictor, page=page, cache=cache, max_new_tokens=...)
    meta["eviction"] = trace_summary(out)
    sys.exit(calibrate_page_main(argv))  # kvcert calibrate-page --budget 256 --out page.json
"""

import argparse
import json
import math
import sys
from pathlib import Path


def add_run_arguments(parser):
    """Eviction options of `kvcert run`; options the parser already has are left as they are."""
    have = set(getattr(parser, "_option_string_actions", {}))
    if "--evict" not in have:
        parser.add_argument("--evict", default=None, metavar="METHOD:BUDGET",
                            help="evict after the prefill: snapkv|h2o|tova|knorm|random|streaming|epikv with a "
                                 "token budget or a ratio, e.g. snapkv:256 or h2o:0.25")
    if "--page" not in have:
        parser.add_argument("--page", default=None, metavar="TAU|FILE",
                            help="gate the evictor with PAGE: a tau, or the JSON of `kvcert calibrate-page`")
    if "--evict-group-size" not in have:
        parser.add_argument("--evict-group-size", type=int, default=32,
                            help="evicted tokens per group of the eviction certificate's witness")
    return parser


def from_args(args):
    """(evictor or None, Page or None); ValueError with a one-line message on bad input."""
    from fast.policies.evictors import make_evictor
    from fast.policies.page import Page
    if not getattr(args, "evict", None):
        if getattr(args, "page", None) is not None:
            raise ValueError("--page gates an evictor: give --evict too")
        return None, None
    evictor = make_evictor(args.evict)
    page = None
    if args.page is not None:
        if Path(args.page).is_file():
            try:
                page = Page.load(args.page)
            except (ValueError, KeyError, TypeError, OSError) as e:
                raise ValueError(f"--page {args.page}: not a calibration file of `kvcert calibrate-page` "
                                 f"({type(e).__name__}: {e})") from None
        else:
            try:
                page = Page(float(args.page))
            except ValueError:
                raise ValueError(f"--page: {args.page!r} is neither a number nor a calibration file") from None
    return evictor, page


def trace_summary(out):
    """JSON-able summary of fast.policies.evictors.generate's result for the run trace."""
    ev = out["eviction"]
    if ev is None:
        return None
    s = {"evicted": ev.evicted, "bytes_before": ev.bytes_before, "bytes_after": ev.bytes_after,
         "witness_bytes": ev.witness_bytes}
    if ev.page_drop is not None:
        s["page_drop"] = [float(d) for d in ev.page_drop]
        s["page_decision"] = "evict" if ev.evicted else "keep full cache"
    if out["trace"]:
        # per decode step: the largest bound over layers and heads, and its log-odds
        s["bound_max_per_step"] = [float(t["bound"].max()) for t in out["trace"]]
        s["log_odds_max_per_step"] = [float(t["log_odds"].max()) for t in out["trace"]]
        s["bound_per_step_layer"] = [t["bound"].amax((1, 2)).tolist() for t in out["trace"]]   # [T][L]
        if "true" in out["trace"][0]:
            s["true_max_per_step"] = [float(t["true"].max()) for t in out["trace"]]
    return s


def _prompts(args, tok):
    """Unlabelled prompts: lines of --prompts, else RULER-style haystacks (fixed seeds, no answers used)."""
    import torch
    if args.prompts:
        from fast.integrations.model import chat_ids
        lines = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        return [torch.tensor([chat_ids(tok, ln)]) for ln in lines]
    try:
        from benchmarks.ruler import build, examples
    except ImportError:
        raise ValueError("give --prompts FILE: the prompt generator (benchmarks/ruler.py) imports from the "
                         "repository root only") from None
    return [build(tok, ex, args.tokens)[0] for ex in examples(args.n, seed0=10_000)]


def calibrate_page_main(argv=None):
    """kvcert calibrate-page: tau = the (1 - evict_rate) quantile of the PAGE drops of unlabelled prompts."""
    ap = argparse.ArgumentParser(prog="kvcert calibrate-page", description=calibrate_page_main.__doc__)
    ap.add_argument("--budget", default="256", help="the evictor's budget (tokens or a ratio), as in --evict")
    ap.add_argument("--prompts", default=None, help="a text file, one unlabelled prompt per line (default: generated)")
    ap.add_argument("--n", type=int, default=12, help="generated prompts when --prompts is not given")
    ap.add_argument("--tokens", type=int, default=768, help="length of the generated prompts")
    ap.add_argument("--evict-rate", type=float, default=0.5, help="share of typical prompts the gate lets evict")
    ap.add_argument("--out", default="page.json")
    args = ap.parse_args(argv)
    from fast.policies.evictors import keep_count
    from fast.integrations.model import ModelMissing, load_smollm2
    from fast.policies.page import calibrate_model
    try:
        budget = float(args.budget) if "." in args.budget else int(args.budget)
        keep_count(budget, 10 ** 9)
        if not 0 < args.evict_rate < 1:
            raise ValueError(f"--evict-rate must lie in (0, 1), got {args.evict_rate}")
        model, tok = load_smollm2()
        prompts = _prompts(args, tok)
        tau, drops = calibrate_model(model, prompts, budget, evict_rate=args.evict_rate)
    except (ValueError, ModelMissing, OSError) as e:
        print(f"kvcert calibrate-page: error: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps({
        "tau": tau, "budget": budget, "evict_rate": args.evict_rate, "model": "SmolLM2-135M-Instruct",
        "n_prompts": len(prompts), "drops": [d if math.isfinite(d) else None for d in drops],
        "command": "kvcert calibrate-page " + " ".join(argv if argv is not None else sys.argv[1:])}, indent=1))
    print(f"tau = {tau:.4f} from {len(prompts)} prompts (budget {budget}, evict rate {args.evict_rate}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(calibrate_page_main())
