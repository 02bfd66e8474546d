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
        table = data.get("readme_table")
        if not table:
            continue
        out.append(f"**{table['title']}** (`{path.relative_to(ROOT)}`, from `{data.get('command', '?')}`)")
        out.append("")
        out.append("| " + " | ".join(table["header"]) + " |")
        out.append("|" + "---|" * len(table["header"]))
        out += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
        out.append("")
    return "\n".join(out) if out else "(no results yet: run `make bench`)"


SECTIONS = {"verified": verified_table, "results": results_tables}


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
