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

from fast.tools.inputs import SMOLLM2, Parser, UsageError, check_out_file, integer, one_line, read_prompt, real, write_file_atomic


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
        parser.add_argument("--evict-group-size", type=integer, default=32,
                            help="evicted tokens per group of the eviction certificate's witness")
    if "--evict-gate" not in have:
        parser.add_argument("--evict-gate", type=real, default=None, metavar="TAU",
                            help="the certified eviction gate (fast.EvictionGate): every decode read serves a "
                                 "certified TV <= TAU against the full cache, restoring evicted tokens from the "
                                 "offload tier where needed; the kept keys stay exact (no --scheme, --gate, --page)")
        parser.add_argument("--evict-sketch", default="int4c", choices=SKETCH_CHOICES,
                            help="the resident key sketch of the evicted tokens (with --evict-gate)")
        parser.add_argument("--evict-fetch", action="store_true",
                            help="with --evict-gate: each read fetches its restored tokens and drops them after "
                                 "the read (retain=False), instead of keeping them resident")
    return parser


SKETCH_CHOICES = ("int4c", "int8", "int4", "fp8_e4m3", "fp8_e5m2")


def gate_from_args(args):
    """The EvictionGate of --evict-gate (None without it); ValueError with one line on bad input."""
    tau = getattr(args, "evict_gate", None)
    if tau is None:
        if getattr(args, "evict_fetch", False) or getattr(args, "evict_sketch", "int4c") != "int4c":
            raise ValueError("--evict-sketch and --evict-fetch set up the eviction gate: give --evict-gate too")
        return None
    if not getattr(args, "evict", None):
        raise ValueError("--evict-gate gates an evictor: give --evict too")
    if getattr(args, "page", None) is not None:
        raise ValueError("--evict-gate and --page are two gates for one eviction: give one")
    if getattr(args, "shadow", False) or getattr(args, "box", False):
        raise ValueError("--evict-gate reads exact kept keys: --shadow and --box (quantization options) do not apply")
    from fast.policies.evict_gate import EvictionGate
    return EvictionGate(tau, sketch=args.evict_sketch, retain=not args.evict_fetch)


def gate_trace(out, gate, meta):
    """A run trace (fast.tools.trace.Trace) of a generation through an EvictionGate: evict_bound [T, L, B, H]
    the certified TV of each read served, evict_pre_gate the bound before the gate's restores;
    meta["eviction"]["gate"] the gate's summary."""
    from fast.tools.trace import Trace
    arrays = {}
    if gate.steps:
        arrays["evict_bound"] = torch_stack_np([s["served"] for s in gate.steps])
        arrays["evict_pre_gate"] = torch_stack_np([s["bound"] for s in gate.steps])
    meta = dict(meta)
    ev = {k: v for k, v in (trace_summary(out) or {}).items() if k not in ("bytes_before", "bytes_after", "witness_bytes")}
    meta["eviction"] = {**meta.get("eviction", {}), **ev, "gate": gate.summary()}  # bytes: the gate's resident share
    return Trace(arrays, meta)


def torch_stack_np(tensors):
    import torch
    return torch.stack(tensors).detach().cpu().double().numpy()


def from_args(args):
    """(evictor or None, Page or None); ValueError with a one-line message on bad input."""
    from fast.policies.evictors import make_evictor
    from fast.policies.page import Page
    if not getattr(args, "evict", None):
        if getattr(args, "page", None) is not None:
            raise ValueError("--page gates an evictor: give --evict too")
        return None, None
    if not args.evict.isascii():
        raise ValueError(f"--evict {args.evict!r}: write the budget in ASCII digits")
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
                page = Page(real(args.page))
            except (ValueError, argparse.ArgumentTypeError):
                raise ValueError(f"--page: {args.page!r} is neither a finite number nor a calibration file") from None
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


DEMO_EVICT = "streaming:128"


def demo_eviction(model, tok, ids, key, tau, max_new_tokens):
    """The demo's eviction part: the passkey prompt evicted to DEMO_EVICT, alone and with the certified
    eviction gate (int4c sketches, each read fetching what its certificate needs). Returns the lines
    printed and the two answers."""
    import torch
    from fast.policies.evict_gate import EvictionGate
    from fast.policies.evictors import generate, make_evictor
    lines, answers = [f"eviction: {DEMO_EVICT} of {len(ids)} prompt tokens"], []
    for gate in (None, EvictionGate(tau, sketch="int4c", retain=False)):
        out = generate(model, torch.tensor([ids]), evictor=make_evictor(DEMO_EVICT), gate=gate, certify=False,
                       max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id)
        answer = tok.decode(out["tokens"][0], skip_special_tokens=True).strip()
        answers.append(answer)
        ok = "yes" if str(key) in answer else "NO"
        if gate is None:
            lines.append(f"  evictor alone (no certificate)      correct {ok:<4} {answer!r}")
            continue
        s = gate.summary()
        lines.append(f"  + certified eviction gate, tau {tau:<5g} correct {ok:<4} {answer!r}")
        lines.append(f"    {s['reads']} reads, bound served <= {s['max_served_bound']:.3f} (before the gate up to "
                     f"{s['max_bound_before_gate']:.3f}); KV bytes resident {s['resident_over_full_mean'][0]:.2f} of "
                     f"the full cache (kept tokens, int4c key sketches, one read's fetch); fetched from the offload "
                     f"tier per step: {s['fetch_over_full_per_step_mean'][0]:.2f} of it")
    return lines, answers


def _prompts(args, tok, text=None):
    """Unlabelled prompts: lines of --prompts (text), else RULER-style haystacks (fixed seeds, no answers used)."""
    import torch
    if text is not None:
        from fast.integrations.model import chat_ids
        return [torch.tensor([chat_ids(tok, ln)]) for ln in text.splitlines() if ln.strip()]
    from fast.tools.ruler import build, examples
    return [build(tok, ex, args.tokens)[0] for ex in examples(args.n, seed0=10_000)]


def parse_budget(text):
    """--budget as --evict reads it (fast.policies.evictors.make_evictor): a token count or a ratio."""
    from fast.policies.evictors import make_evictor
    if not text.isascii():
        raise UsageError(f"--budget {text!r}: write it in ASCII digits")
    try:
        return make_evictor(f"snapkv:{text}").budget
    except ValueError as e:
        raise UsageError(f"--budget {text!r}: {e}") from None


MAX_PROMPTS = 10_000  # generated prompts for calibrate-page (one prefill each)


def calibrate_page_main(argv=None):
    """kvcert calibrate-page: tau = the (1 - evict_rate) quantile of the PAGE drops of unlabelled prompts."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _calibrate_page(argv)
    except UsageError as e:
        print(f"kvcert: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvcert: interrupted (nothing written)", file=sys.stderr)
        return 130


def _check_calibration_out(path):
    """--out: writable, and if it exists, an earlier calibration file (it is replaced, never another file)."""
    p = check_out_file(path)
    if p.exists():
        try:
            doc = json.loads(p.read_bytes())
            ours = isinstance(doc, dict) and "tau" in doc and "drops" in doc
        except (OSError, ValueError, RecursionError):
            ours = False
        if not ours:
            raise UsageError(f"--out {path}: exists and is not a calibration file of kvcert calibrate-page; "
                             "give a new file name")
    return p


def _calibrate_page(argv):
    ap = Parser(prog="kvcert calibrate-page", description=calibrate_page_main.__doc__)
    ap.add_argument("--budget", default="256", help="the evictor's budget (tokens or a ratio), as in --evict")
    ap.add_argument("--prompts", default=None, help="a text file, one unlabelled prompt per line (default: generated)")
    ap.add_argument("--n", type=integer, default=12, help=f"generated prompts when --prompts is not given (<= {MAX_PROMPTS})")
    ap.add_argument("--tokens", type=integer, default=768, help="length of the generated prompts")
    ap.add_argument("--evict-rate", type=real, default=0.5, help="share of typical prompts the gate lets evict")
    ap.add_argument("--out", default="page.json")
    args = ap.parse_args(argv)
    from fast.policies.page import calibrate, prompt_drop
    budget = parse_budget(args.budget)
    try:
        calibrate([0.0], args.evict_rate)  # the core's check of evict_rate, before anything loads
    except ValueError as e:
        raise UsageError(f"--evict-rate: {e}") from None
    limit = SMOLLM2.max_position_embeddings
    if not 1 <= args.n <= MAX_PROMPTS:
        raise UsageError(f"--n must lie in [1, {MAX_PROMPTS}], got {args.n}")
    if not 1 <= args.tokens <= limit:
        raise UsageError(f"--tokens must lie in [64, {limit}] (the model's context), got {args.tokens}")
    text = read_prompt(args.prompts, "--prompts file") if args.prompts is not None else None
    _check_calibration_out(args.out)
    from tqdm import tqdm
    from fast.integrations.model import ModelMissing, load_smollm2
    try:
        model, tok = load_smollm2()
        prompts = _prompts(args, tok, text)
        long = [p.shape[1] for p in prompts if p.shape[1] > model.config.max_position_embeddings]
        if long:
            raise UsageError(f"--prompts: a prompt of {long[0]} tokens exceeds the model's context "
                             f"of {model.config.max_position_embeddings}")
        drops = [float(prompt_drop(model, p, budget)[0]) for p in tqdm(prompts, desc="calibrate-page", unit="prompt")]
        tau = calibrate(drops, args.evict_rate)
    except (ValueError, ModelMissing) as e:
        raise UsageError(str(e)) from None
    write_file_atomic(args.out, json.dumps({
        "tau": tau, "budget": budget, "evict_rate": args.evict_rate, "model": "SmolLM2-135M-Instruct",
        "n_prompts": len(prompts), "drops": [d if math.isfinite(d) else None for d in drops],
        "command": "kvcert calibrate-page " + " ".join(argv)}, indent=1))
    print(f"tau = {tau:.4f} from {len(prompts)} prompts (budget {budget}, evict rate {args.evict_rate}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(calibrate_page_main())
