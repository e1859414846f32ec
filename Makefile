# Two commands set everything up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-slow test-extra test-learning dry-run plan bench-gpu test-gpu gpu-check clean gpu-aot

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	bash scripts/ensure_egl.sh
	touch $(STAMP)

## Train configs/llama_tiny.py on a CPU-emulated 8-device mesh (dp=2, tp=4, ZeRO-1).
run: $(STAMP)
	$(BIN)/python -m jaxpar.train --config llama_tiny.py --workdir runs/llama_tiny

## XLA's GPU compiler for `--dry_run --gpu NAME` on a machine without a GPU (jaxpar/compiler/gpu_aot.py), in .gpu-aot/ outside
## the venv: installed in it, the CUDA plugin makes every CPU-only JAX process print CUDA driver warnings.
GPU_AOT := .gpu-aot
GPU_AOT_STAMP := $(GPU_AOT)/.installed
$(GPU_AOT_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install -q --upgrade --target $(GPU_AOT) $$($(BIN)/python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu-aot"]))')
	touch $(GPU_AOT_STAMP)
gpu-aot: $(GPU_AOT_STAMP)

## The test suite, in 2 worker processes (pytest-xdist; TEST_JOBS=1 for one); tests marked `slow` are excluded: `make test-slow` runs them.
TEST_JOBS ?= 2
test: $(STAMP) $(GPU_AOT_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadscope

## Compile llama7b for 8 emulated devices and report memory and collectives.
dry-run: $(STAMP)
	$(BIN)/python -m jaxpar.train --config llama7b.py --dry_run --workdir runs/llama7b_dry

## Tests marked slow (more layouts, the big dry runs, whole demos; CI runs them after `make test`), in 2 workers that
## steal work from each other (a module's slow tests do not queue on one worker), then the proof-of-learning runs alone.
test-slow: $(STAMP) $(GPU_AOT_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist worksteal -m "slow and not extra" --ignore=tests/test_learning.py
	$(MAKE) test-learning

## Slow tests CI leaves out, as its 2 cores cannot run them with the rest in its 90 minutes (marked `extra`; each
## repeats a check CI makes on another case or layout, its marker's comment says which; README "Two commands"): run them
## before changing what they cover (the planner's bounds, FP8 delayed scaling's layouts, the 2000-step soak).
test-extra: $(STAMP) $(GPU_AOT_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist worksteal -m extra

## The proof-of-learning runs (llama_tiny and vla_tiny as shipped; slow tests, about 13 minutes): CI runs them last, in `make test-slow`.
test-learning: $(STAMP)
	$(BIN)/python -m pytest -q -s -m slow tests/test_learning.py

## Analytic memory / step-time plan and layout recommendation (no compile).
plan: $(STAMP)
	$(BIN)/python -m jaxpar.plan --config llama7b.py
	$(BIN)/python -m jaxpar.plan --config vla70b.py --recommend --gpus 64 --gpus_per_node 8 --gpu a100-80gb

## ~1B Llama (bf16, seq 2048) on the GPU(s): tokens/s, MFU, step time, peak memory per attention kernel
## (cuDNN / XLA) and remat policy, plus tp / ZeRO-1 / ZeRO-3 with several GPUs (one process per variant,
## under 5 minutes on one H200; runs/bench_gpu/bench_gpu.{json,md}). `--smoke` runs it on CPU with a tiny model.
bench-gpu: $(STAMP)
	$(BIN)/python scripts/bench_gpu.py --out_dir runs/bench_gpu

## On a GPU machine without network whose Python already has jaxpar's dependencies (a lent GPU): SYSTEM_PYTHON=python3
## runs the GPU targets below with it, from this checkout, instead of creating .venv.
## Otherwise .venv gets jax's CUDA 12 plugin (pyproject's cuda12 extra) where an NVIDIA device is present.
ifdef SYSTEM_PYTHON
GPU_PY := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(SYSTEM_PYTHON)
GPU_DEPS :=
else
GPU_PY := $(BIN)/python
GPU_DEPS := $(VENV)/.cuda-installed
endif
$(VENV)/.cuda-installed: pyproject.toml $(STAMP)
	if ls /dev/nvidia[0-9]* >/dev/null 2>&1; then $(BIN)/python -m pip install -q -e '.[test,cuda12]'; fi
	touch $@

## The GPU lane: the tests marked `gpu` (tests/test_on_gpu_*.py) on this machine's NVIDIA GPU, under the XLA flag
## bundle (one GPU, under 8 minutes). Without a GPU it lists them and fails with one line.
test-gpu: $(GPU_DEPS)
	$(GPU_PY) scripts/gpu_check.py --lane

## One command for a lent GPU: the lane (one process per test file), then bench-gpu, within 10 minutes on one H200;
## writes runs/gpu_check/report.md and report.json (GPU_CHECK_ARGS: e.g. --out_dir DIR --commit SHA).
gpu-check: $(GPU_DEPS)
	$(GPU_PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf runs .pytest_cache
