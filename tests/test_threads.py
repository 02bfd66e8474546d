"""Torch threads for the CPU read (fast.core.threads): the cores this process may use (affinity,
cgroup quota), set by the CLI unless OMP_NUM_THREADS / MKL_NUM_THREADS is set; the fused read never
starts more OpenMP threads than there are cores."""

import torch

from fast.core import cpu_fused, threads
from fast.tools.cli import main


def test_available_cores_reads_affinity_and_quota(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("150000 100000\n")                       # 1.5 CPUs of quota: 2 cores
    assert threads.available_cores(range(8), f) == 2
    f.write_text("max 100000\n")                          # no quota: the affinity mask
    assert threads.available_cores(range(8), f) == 8
    f.write_text("50000 100000\n")
    assert threads.available_cores(range(8), f) == 1
    assert threads.available_cores(range(3), tmp_path / "none") == 3   # no cgroup v2 file
    f.write_text("garbage")
    assert threads.available_cores(range(3), f) == 3


def test_configure_sets_threads_unless_the_user_chose(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert threads.configure(environ={}, cores=1) == 1 == torch.get_num_threads()
        torch.set_num_threads(2)
        assert threads.configure(environ={"OMP_NUM_THREADS": "2"}, cores=1) == 2
        assert threads.configure(environ={"MKL_NUM_THREADS": "2"}, cores=1) == 2
    finally:
        torch.set_num_threads(before)


def test_cli_sets_threads_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import fast.tools.cli as cli
    seen = []

    def load(*a, **k):
        seen.append(torch.get_num_threads())
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "load", load)
    monkeypatch.setattr(threads, "_cores", lambda: 1)
    for k in threads.ENV:
        monkeypatch.delenv(k, raising=False)
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["run", "--prompt-file", str(prompt), "--out", str(tmp_path / "o")]) == 130
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        assert main(["run", "--prompt-file", str(prompt), "--out", str(tmp_path / "o")]) == 130
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]


def test_fused_read_caps_its_threads_at_the_cores(monkeypatch):
    """The fused read asks read_threads for its OpenMP count; read_threads never exceeds the cores
    and its output is the same bits as with torch's count."""
    import fast
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 30, 64, generator=g), torch.randn(1, 2, 30, 64, generator=g)
    q = torch.randn(1, 2, 4, 64, generator=g)
    kq, vq = fast.quantize(k, "int8"), fast.quantize(v, "int8")
    args = dict(bands=fast.rope_bands(64, 8), q_pos=torch.tensor([[28, 29]]))
    rho = None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ref, _ = cpu_fused.attention_rows(q, kq, vq, rho, 0.125, **args)
        calls = []
        monkeypatch.setattr(threads, "_cores", lambda: 1)
        real = cpu_fused.read_threads
        monkeypatch.setattr(cpu_fused, "read_threads", lambda: calls.append(real()) or calls[-1])
        out, _ = cpu_fused.attention_rows(q, kq, vq, rho, 0.125, **args)
    finally:
        torch.set_num_threads(before)
    assert calls and set(calls) == {1}
    assert torch.equal(out, ref)
