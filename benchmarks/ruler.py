"""RULER-style tasks for the benchmark harnesses: the generator lives in fast.tools.ruler (the CLI
uses it too) and is re-exported here; this module adds the harnesses' resume and carry helpers.
"""

from fast.tools.ruler import (  # noqa: F401  (re-exported for the harnesses)
    ANSWER_SLACK, DEFAULT_TASKS, FILLER, HAYSTACKS, TASKS, WORDS, allowance, build, examples, make_example,
    natural_sentences, natural_source, prompt_text, score, split_question)


def resumed(path, settings, keys):
    """(records, seconds) of an earlier, interrupted run in `path` whose settings agree with these on
    `keys` (inputs are deterministic per index: the run continues after its last record); ([], 0.0)
    when there is no file. Different settings -> ValueError (the two runs' inputs would not match)."""
    import json
    from pathlib import Path
    p = Path(path)
    if not p.exists():
        return [], 0.0
    old = json.loads(p.read_text())
    diff = [k for k in keys if old["settings"].get(k) != settings.get(k)]
    if diff:
        raise ValueError(f"--resume: {path} was run with other settings ({', '.join(diff)}); use another --out")
    return old["records"], float(old["seconds"])


def carried(path, settings, keys, exs):
    """Records of an earlier run in `path` for the leading inputs of `exs`, when that run had the
    same settings on `keys` (tasks and n may differ): its inputs are matched by (task, seed, depth,
    haystack), so a run over a subset of its tasks starts from the records it already holds.
    Returns (records, provenance) where provenance names the source; ([], None) if none match."""
    import json
    from pathlib import Path
    old = json.loads(Path(path).read_text())
    diff = [k for k in keys if k not in ("tasks", "n") and old["settings"].get(k) != settings.get(k)]
    if diff:
        raise ValueError(f"--carry: {path} was run with other settings ({', '.join(diff)})")
    same = ("task", "seed", "depth", "haystack")
    have = {tuple(r[k] for k in same): r for r in old["records"]}
    out = []
    for ex in exs:
        r = have.get(tuple(ex[k] for k in same))
        if r is None:
            break
        out.append(r)
    return out, ({"file": Path(path).name, "command": old.get("command"), "records": len(out),
                  "source_seconds": old.get("seconds"), "source_inputs": len(old["records"])} if out else None)

