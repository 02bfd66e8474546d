"""attention_rows on the Triton path (one decode kernel per row) against the torch twin, under the
interpreter (TRITON_INTERPRET=1 must be set before triton is imported: a child process)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.triton

CHILD = r'''
import torch, fast
from fast.core.attention import attention_rows
g = torch.Generator().manual_seed(0)
B, T, H, Hkv, N, D = 2, 3, 4, 2, 20, 32
q = torch.randn(B, T, H, D, generator=g)
k, v = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
kc, vc = fast.quantize(k, "int8", group_size=16), fast.quantize(v, "int8", group_size=16)
bands = fast.rope_bands(D, 4)
qp = torch.tensor([[5, 12, 19], [17, 18, 19]])
valid = torch.ones(B, N, dtype=torch.bool)
valid[1, :4] = False
exact = torch.zeros(B, Hkv, N, dtype=torch.bool)
exact[..., -2:] = True
ve = torch.rand(B, Hkv, N, generator=g) * 0.01
a = attention_rows(q, kc, vc, None, 0.2, bands=bands, q_pos=qp, valid=valid, exact=exact, v_err=ve, backend="torch")
b = attention_rows(q, kc, vc, None, 0.2, bands=bands, q_pos=qp, valid=valid, exact=exact, v_err=ve, backend="triton")
torch.testing.assert_close(b[0], a[0], rtol=1e-4, atol=1e-5)
assert sorted(a[1]) == sorted(b[1])
for key in a[1]:  # the kernel's online sums vs the twin's: same margins, a few fp32 ulps apart
    torch.testing.assert_close(b[1][key], a[1][key], rtol=1e-4, atol=1e-6)
print("rows triton ok")
'''


def test_rows_triton_matches_torch():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0 and "rows triton ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
