# Every variable is a config key of train.py in capitals: PRECISION=bf16 is --precision=bf16.
# Anything else goes through ARGS='--max_iters=50 --n_layer=2'.
# PYTHON=python3 uses an existing interpreter that has torch (GPU machines) and installs nothing.

VENV := .venv
ifdef PYTHON
PY := $(PYTHON)
DEPS :=
else
PY := $(VENV)/bin/python
DEPS := $(VENV)/.installed
endif

PRECISION ?=
CKPT ?=
CKPT_SEGMENT ?=
ACCUM ?=
LOSS_SCALE ?=
FP8_BACKEND ?=
NPROC ?= 2
ARGS ?=
# only the variables that were given become flags, so train.py's defaults stay the defaults
FLAGS := $(if $(PRECISION),--precision=$(PRECISION)) $(if $(CKPT),--ckpt=$(CKPT)) \
         $(if $(CKPT_SEGMENT),--ckpt_segment=$(CKPT_SEGMENT)) $(if $(ACCUM),--accum=$(ACCUM)) \
         $(if $(LOSS_SCALE),--loss_scale=$(LOSS_SCALE)) $(if $(FP8_BACKEND),--fp8_backend=$(FP8_BACKEND)) $(ARGS)

.PHONY: help train test bench sample ddp ledger gpu-check clean

help:  ## this list
	@echo "make train      train on the built-in data (PRECISION=fp32|bf16|fp16|fp8 CKPT=none|full|sqrt|selective ACCUM=K)"
	@echo "make test       the test suite (CPU; CUDA tests skip without a GPU)"
	@echo "make bench      tokens/s, ms/step, MFU and peak memory per precision and ckpt policy -> out/bench.jsonl"
	@echo "make sample     print a sample from out/snapshot.pt"
	@echo "make ddp        torchrun --nproc_per_node=NPROC train.py (gloo on CPU, NCCL on GPU)"
	@echo "make ledger     the memory ledger: predicted vs measured bytes per component"
	@echo "make gpu-check  CUDA tests and the benchmark on a GPU (a message without one)"
	@echo "variables: PRECISION CKPT CKPT_SEGMENT ACCUM LOSS_SCALE FP8_BACKEND NPROC PYTHON ARGS='--key=value ...'"

$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@

train: $(DEPS)
	$(PY) train.py $(FLAGS)

sample: $(DEPS)
	$(PY) train.py --sample_only $(FLAGS)

test: $(DEPS)
	$(PY) -m pytest -q tests

bench: $(DEPS)
	$(PY) bench.py $(FLAGS)

ddp: $(DEPS)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) train.py $(FLAGS)

ledger: $(DEPS)
	$(PY) memory_ledger.py $(FLAGS)

gpu-check: $(DEPS)
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PY) -m pytest -q -m cuda tests && $(PY) memory_ledger.py --device=cuda $(FLAGS) \
		&& $(PY) bench.py --device=cuda --sections=precision,ckpt,memory,fp8wide $(FLAGS); \
	else echo "gpu-check: no CUDA device here; nothing to check (the CPU suite is 'make test')"; fi

clean:
	rm -rf out __pycache__ tests/__pycache__ .pytest_cache
