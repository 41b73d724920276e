# ckptctl developer entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ORACLES_STAMP := $(VENV)/.oracles

.PHONY: install oracles demo test test-full fuzz bench bench-scale fixtures clean

# ckptctl and its dev extras (what the demo, benchmarks and fuzzer need); `oracles` adds the
# frameworks the tests check against (several minutes the first time), for `make test` only.
install: $(STAMP)
oracles: $(ORACLES_STAMP)

# Oracles of the tests, without their heavy dependencies, which the code the tests run never
# imports: torchtitan (not datasets, wandb, triton …) and megatron-core (0.16: the newest for
# Python 3.11; not Transformer Engine or apex), NeMo Automodel (its state-dict adapters need
# only torch and transformers), peft and accelerate (LoRA merges and adapter folders, FP8 folders
# loaded by transformers); Megatron-Bridge's mapping code (0.6.2, a
# pure-Python wheel that declares Python 3.12: its mapping modules run on 3.11). Tests skip
# without them.
ORACLES := torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 tyro==1.0.17 \
           docstring_parser==0.18.0 torchdata==0.11.0 einops==0.8.2 \
           megatron-core==0.16.1 psutil nemo-automodel==0.7.0 peft==0.21.2 accelerate==1.15.0
PY312_ORACLES := megatron-bridge==0.6.2
# megatron-core 0.15.3 beside 0.16.1 (not in the venv's site-packages): the last release that saves
# the DistributedOptimizer's fully_sharded_model_space (0.16 refuses its flattened_range); only
# fixtures.megatron_optim's torchrun workers put it first on their PYTHONPATH.
MCORE_015 := $(VENV)/megatron-core-0.15
# megatron-core 0.19.2 beside them too: the current release, whose torch_dist keeps the common state
# in a `common_state` item and whose default optimizer format is dp_reshardable (it declares
# Python 3.12; what the fixtures run of it runs on 3.11).
MCORE_019 := $(VENV)/megatron-core-0.19
# torchao 0.18.0 beside them (not in the venv's site-packages, where transformers would import it and
# print its warnings on every export): its float8 training under fully_shard saves the DCP items
# `fixtures.fp8_dcp` writes; only that fixture's gloo ranks put it first on their sys.path.
TORCHAO := $(VENV)/torchao-0.18

# torch first (the local CPU wheel), so resolving the package never pulls a CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(ORACLES_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps $(ORACLES)
	$(PY) -m pip install -q --no-deps --ignore-requires-python $(PY312_ORACLES)
	$(PY) -m pip install -q --no-deps --upgrade --target $(MCORE_015) megatron-core==0.15.3
	$(PY) -m pip install -q --no-deps --upgrade --ignore-requires-python --target $(MCORE_019) megatron-core==0.19.2
	$(PY) -m pip install -q --no-deps --upgrade --target $(TORCHAO) torchao==0.18.0
	touch $(ORACLES_STAMP)

demo: install
	rm -rf demo && $(PY) fixtures/demo.py make demo
	$(VENV)/bin/ckptctl inspect demo/ckpt
	$(VENV)/bin/ckptctl reshard demo/ckpt demo/ckpt-ws3 --world-size 3 --verify
	$(VENV)/bin/ckptctl diff demo/ckpt demo/ckpt-ws3
	$(VENV)/bin/ckptctl inspect demo/ckpt-ws3 --filter 'model.*'
	$(VENV)/bin/ckptctl export-hf demo/ckpt-ws3 demo/hf --hf-config demo/hf-config --arch raw --verify
	$(VENV)/bin/ckptctl diff demo/ckpt-ws3 demo/hf
	$(VENV)/bin/ckptctl import-hf demo/hf demo/ckpt-from-hf --world-size 2 --verify
	$(VENV)/bin/ckptctl diff demo/ckpt-from-hf demo/hf
	$(PY) fixtures/demo.py check demo

test: oracles
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test-full: oracles
	$(PY) -m pytest -q -n 2 --dist loadfile -m ""

# A long run of the structured fuzzer over mutated real fixtures (a short one is in `make test`).
fuzz: install
	$(PY) -m tests.fuzz_inputs 5000

bench: oracles
	$(PY) bench/bench.py

# Structure at scale: checkpoints of many tiny chunks (SIZES=2.5M for 1,024 ranks x 2,500 tensors).
SIZES ?= 256x300,1024x160
bench-scale: install
	$(PY) bench/scale.py --sizes $(SIZES)

fixtures: oracles
	$(PY) fixtures/make_fixtures.py

clean:
	rm -rf demo bench/.cache .pytest_cache
