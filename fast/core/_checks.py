"""Shared input validation for the fast path: every public function calls these first.

Each check raises ValueError (TypeError for a non-tensor) naming the argument, so a
bad input never turns into a small finite bound.
"""

import math

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def tensor(name, x, ndim=None, dtypes=FLOATS):
    """x is a torch tensor with the given number of dims and one of the dtypes."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {x.dtype} not in {[str(d) for d in dtypes]}")
    return x


def finite(name, x):
    """No NaN or Inf anywhere in x."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: contains NaN or Inf")
    return x


def nonneg_finite(name, x):
    """Every entry of x is finite and >= 0 (NaN fails `x >= 0`)."""
    if not bool(((x >= 0) & (x < math.inf)).all()):
        raise ValueError(f"{name}: every entry must be finite and >= 0 (NaN, Inf or a negative entry found)")
    return x


def nonempty(name, x, dim):
    if x.shape[dim] == 0:
        raise ValueError(f"{name}: empty along dim {dim} (shape {tuple(x.shape)})")
    return x


def same(name_a, a, name_b, b):
    if a != b:
        raise ValueError(f"{name_a} = {a} does not match {name_b} = {b}")


def positive_scale(name, s):
    """A finite real scale > 0 (a Python number)."""
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got shape {tuple(s.shape)}")
        s = s.item()
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"{name}: expected a real number, got {type(s).__name__}")
    s = float(s)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"{name}: must be finite and > 0, got {s}")
    return s


def probability(name, d):
    """A budget strictly inside (0, 1)."""
    if isinstance(d, bool) or not isinstance(d, (int, float)):
        raise TypeError(f"{name}: expected a real number, got {type(d).__name__}")
    d = float(d)
    if not (0.0 < d < 1.0):
        raise ValueError(f"{name}: must lie in (0, 1), got {d}")
    return d


def positive_int(name, n):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {n!r}")
    return n


def version(t):
    """t's version counter (bumped by every in-place write), or None for an inference tensor, which keeps none (a
    write to it in inference mode is not counted): callers that skip work while the version is unchanged treat None
    as changed."""
    return None if t.is_inference() else t._version


def bands_tensor(bands, D):
    """bands: LongTensor [NB, D // NB] partitioning range(D) (as built by rope_bands). The partition check runs
    once per tensor and version (a cache's bands are checked on every witness call: a sort and a copy each)."""
    tensor("bands", bands, ndim=2, dtypes=(torch.int64, torch.int32))
    NB, W = bands.shape
    if NB * W != D:
        raise ValueError(f"bands: shape {tuple(bands.shape)} does not cover head dim D = {D}")
    seen, ver = _BANDS_SEEN.get(id(bands)), version(bands)
    if seen is None or seen[0] is not bands or ver is None or seen[1] != ver:
        flat = bands.reshape(-1).to(torch.int64).cpu()
        if not torch.equal(torch.sort(flat).values, torch.arange(D)):
            raise ValueError("bands: must be a partition of range(D) (every coordinate exactly once)")
        if len(_BANDS_SEEN) > 256:
            _BANDS_SEEN.clear()
        _BANDS_SEEN[id(bands)] = (bands, ver)  # the tensor is kept: its id cannot pass to another
    return bands.to(torch.int64)


_BANDS_SEEN = {}  # id(bands) -> (bands, version) of a bands tensor found to partition range(D), D = its numel


def gqa(H, Hkv):
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"GQA: query heads H = {H} must be a multiple of KV heads Hkv = {Hkv}")
    return H // Hkv


def weights_and_bounds(p_tilde, c):
    """p_tilde, c: [B, H, N] float, same shape, nonempty rows, finite and >= 0 (the TV forms' inputs)."""
    tensor("p_tilde", p_tilde, ndim=3)
    tensor("c", c, ndim=3)
    if p_tilde.shape != c.shape:
        raise ValueError(f"p_tilde shape {tuple(p_tilde.shape)} != c shape {tuple(c.shape)}")
    nonempty("p_tilde", p_tilde, 2)
    nonneg_finite("p_tilde", p_tilde)
    nonneg_finite("c", c)
