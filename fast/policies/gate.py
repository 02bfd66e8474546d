"""The gate: which KV heads the meter sends back to exact keys (none | certified:TAU | ladder:TAU | risk:K).

certified:TAU sends a (layer, KV head) whose certificate exceeds TAU straight to exact keys;
ladder:TAU moves it up one rung of a precision ladder at a time (each rung a residual codec
refining what the rungs below left, e.g. kivi2 + int4 + int4 + int8 residuals, then exact:
fast.integrations.hf_cache.LADDERS), each rung certified on its own, until the certificate is
<= TAU or the head is exact. Shared by the integrations (transformers CertifiedCache, vLLM plugin)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Gate:
    """none | certified:TAU | ladder:TAU | risk:K (issue 4, Gating; issue 20, the ladder)."""
    kind: str = "none"
    tau: float = 1.0
    k: int = 0

    def __str__(self):
        return {"none": "none", "certified": f"certified:{self.tau:g}", "ladder": f"ladder:{self.tau:g}",
                "risk": f"risk:{self.k}"}[self.kind]

    @property
    def thresholded(self):
        """True for the gates that compare each read's certificate with TAU (certified, ladder)."""
        return self.kind in ("certified", "ladder")


def parse_gate(spec):
    """'none', 'certified:0.2', 'ladder:0.2' or 'risk:4' -> Gate; anything else -> ValueError (one line)."""
    if isinstance(spec, Gate):
        return spec
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"gate {spec!r}: a string, 'none', 'certified:TAU', 'ladder:TAU' or 'risk:K' (e.g. gate='certified:{spec}')")
    spec = (spec or "none").strip()
    if spec == "none":
        return Gate()
    kind, sep, arg = spec.partition(":")
    if kind in ("certified", "ladder") and sep:
        try:
            if not arg.isascii():  # float() would take '٠.٢'
                raise ValueError
            tau = float(arg)
        except ValueError:
            raise ValueError(f"gate {spec!r}: TAU must be a number in [0, 1], got {arg!r}") from None
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"gate {spec!r}: TAU must be in [0, 1], got {tau}")
        return Gate(kind, tau=tau)
    if kind == "risk" and sep:
        if not (arg.isascii() and arg.isdigit()):  # isdigit alone takes '٣' (int: 3) and '³' (int: error)
            raise ValueError(f"gate {spec!r}: K must be a non-negative integer, got {arg!r}")
        return Gate("risk", k=int(arg))
    raise ValueError(f"unknown gate {spec!r}: use none, certified:TAU, ladder:TAU or risk:K")
