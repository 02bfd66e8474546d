"""The gate: which KV heads the meter sends back to exact keys (none | certified:TAU | risk:K).

Shared by the integrations (transformers CertifiedCache, vLLM plugin)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Gate:
    """none | certified:TAU | risk:K (issue 4, Gating)."""
    kind: str = "none"
    tau: float = 1.0
    k: int = 0

    def __str__(self):
        return {"none": "none", "certified": f"certified:{self.tau:g}", "risk": f"risk:{self.k}"}[self.kind]


def parse_gate(spec):
    """'none', 'certified:0.2' or 'risk:4' -> Gate; anything else -> ValueError (one line)."""
    if isinstance(spec, Gate):
        return spec
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"gate {spec!r}: a string, 'none', 'certified:TAU' or 'risk:K' (e.g. gate='certified:{spec}')")
    spec = (spec or "none").strip()
    if spec == "none":
        return Gate()
    kind, sep, arg = spec.partition(":")
    if kind == "certified" and sep:
        try:
            if not arg.isascii():  # float() would take '٠.٢'
                raise ValueError
            tau = float(arg)
        except ValueError:
            raise ValueError(f"gate {spec!r}: TAU must be a number in [0, 1], got {arg!r}") from None
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"gate {spec!r}: TAU must be in [0, 1], got {tau}")
        return Gate("certified", tau=tau)
    if kind == "risk" and sep:
        if not (arg.isascii() and arg.isdigit()):  # isdigit alone takes '٣' (int: 3) and '³' (int: error)
            raise ValueError(f"gate {spec!r}: K must be a non-negative integer, got {arg!r}")
        return Gate("risk", k=int(arg))
    raise ValueError(f"unknown gate {spec!r}: use none, certified:TAU or risk:K")
