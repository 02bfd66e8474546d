"""The project's table of contents: spec/theorems.toml, loaded and checked for shape."""

import tomllib
from pathlib import Path

SPEC_PATH = Path(__file__).with_name("theorems.toml")
ROW_KEYS = {"id", "statement", "proof", "coq", "reference", "fast", "tests"}


def load(path=SPEC_PATH):
    """Return (theorems, assumptions): two lists of dicts, in file order."""
    data = tomllib.loads(Path(path).read_text())
    theorems = data.get("theorem", [])
    assumptions = data.get("assumption", [])
    known = {a["id"] for a in assumptions}
    for row in theorems:
        missing = ROW_KEYS - row.keys()
        if missing:
            raise ValueError(f"spec row {row.get('id', '?')}: missing keys {sorted(missing)}")
        for a in row.get("assumptions", []):
            if a not in known:
                raise ValueError(f"spec row {row['id']}: unknown assumption {a}")
    ids = [r["id"] for r in theorems]
    if len(ids) != len(set(ids)):
        raise ValueError("spec: duplicate theorem ids")
    return theorems, assumptions


def coq_qualified(row, name):
    """Fully qualified Coq name of one theorem of a row: KVCert.<File>.<name>."""
    return f"KVCert.{Path(row['proof']).stem}.{name}"
