"""Regenerate the generated sections of README.md from spec/ and results/.

    python -m spec.readme --write    # rewrite README.md in place
    python -m spec.readme --check    # exit 1 when README.md is stale
"""

import argparse
import json
import sys
from pathlib import Path

from spec import load

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "results"


def verified_table():
    theorems, assumptions = load()
    lines = ["| id | statement | proof | reference | fast |", "|---|---|---|---|---|"]
    for r in theorems:
        coq = ", ".join(f"`{n}`" for n in r["coq"])
        fast = f"`{r['fast']}`" if r["fast"] else "-"
        statement = r["statement"].replace("|", "\\|")
        lines.append(f"| {r['id']} | {statement} | {r['proof']}: {coq} | `{r['reference']}` | {fast} |")
    lines += ["", "Trusted, not proven:", ""]
    lines += [f"- {a['id']}: {a['text']}" for a in assumptions]
    return "\n".join(lines)


def results_tables():
    """One table per results/*.json that carries a `readme_table` (header + rows)."""
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        tables = data.get("readme_tables") or ([data["readme_table"]] if data.get("readme_table") else [])
        for table in tables:
            out.append(f"**{table['title']}** (`{path.relative_to(ROOT)}`, from `{data.get('command', '?')}`)")
            out.append("")
            out.append("| " + " | ".join(table["header"]) + " |")
            out.append("|" + "---|" * len(table["header"]))
            out += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
            out.append("")
    return "\n".join(out) if out else "(no results yet: run `make bench`)"


EVAL_FILES = ("evict_eval.json", "evict_vs_kvpress.json", "quant_eval.json", "quant_eval_prerope.json", "harm_study.json")


def eval_findings():
    """What the evaluation results say is significant (the `findings` of the eval results files),
    with the size and machine of each run."""
    out = []
    for name in EVAL_FILES:
        path = RESULTS / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        m = data.get("machine")
        c = data.get("settings", {}).get("carried")
        took = (f"{data.get('seconds', '?')} s for the last {len(data.get('records', [])) - c['records']} (the first "
                f"{c['records']} carried from {c['file']}, whose {c['source_inputs']} inputs took {c['source_seconds']} s)"
                if c else f"{data.get('seconds', '?')} s")
        size = (f"{len(data['records'])} inputs, {took} on {m.get('cpus', '?')} shared CPU cores; "
                if m and data.get("records") else "")
        out.append(f"- `{path.relative_to(ROOT)}` ({size}`{data.get('command', '?')}`):")
        out += [f"  - {f}" for f in data.get("findings", [])]
    return "\n".join(out) if out else "(no evaluation results yet)"


def chain_section():
    """From theorem to number: spec/chains.toml, one block per reported quantity."""
    import tomllib
    chains = tomllib.loads((ROOT / "spec" / "chains.toml").read_text())["quantity"]
    theorems, assumptions = load()
    known = {r["id"] for r in theorems} | {a["id"] for a in assumptions}
    out = []
    for q in chains:
        out += [f"**{q['name']}**: {q['reported']}.", "", "| step | function | rests on |", "|---|---|---|"]
        for st in q["step"]:
            missing = [i for i in st["rests_on"] if i not in known]
            if missing:
                raise ValueError(f"spec/chains.toml: unknown ids {missing}")
            ids = ", ".join(st["rests_on"])
            out.append(f"| {st['what']} | `{st['function']}` | {ids} |")
        out.append("")
    return "\n".join(out)


SECTIONS = {"verified": verified_table, "results": results_tables, "evalfindings": eval_findings, "chain": chain_section}


def render(text):
    for name, fn in SECTIONS.items():
        begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
        if begin not in text or end not in text:
            raise ValueError(f"README.md lacks the markers {begin} ... {end}")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{fn()}\n{end}{tail}"
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    old = README.read_text()
    new = render(old)
    if args.write:
        README.write_text(new)
    elif args.check and new != old:
        print("README.md is stale: run `make readme`", file=sys.stderr)
        return 1
    else:
        print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
