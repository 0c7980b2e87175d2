# Every config key (config.py) is a make variable in capitals: PRECISION=bf16 is --precision=bf16,
# N_LAYER=8 is --n_layer=8. Only variables given on the command line become flags.
# Three variables are not config keys: NPROC (processes for `make ddp`, at most one per GPU on
# CUDA, per core on CPU), PYTHON (an existing interpreter that has torch, e.g. on GPU machines:
# nothing is installed) and ARGS (any other flags, e.g. a tool's own: ARGS='--tp=4'; each word
# one flag). Any other capitalised variable is refused, and every value reaches the program as
# given: quoted for the shell, never expanded by make.

VENV := .venv
ifdef PYTHON
PY = $(call q,$(value PYTHON))
DEPS :=
else
PY := $(VENV)/bin/python
DEPS := $(VENV)/.installed
endif

KEYS := DATA OUT_DIR SEED DEVICE N_LAYER N_HEAD N_EMBD BLOCK_SIZE VOCAB_SIZE LOSS_CHUNKS DROPOUT BIAS ATTN \
        BATCH_SIZE ACCUM TOTAL_BATCH_TOKENS LOSS_NORM NO_SYNC FP32_GRAD_ACCUM SHARD MAX_ITERS OPTIMIZER LEARNING_RATE MIN_LR \
        WARMUP_ITERS LR_DECAY_ITERS WEIGHT_DECAY BETA1 BETA2 GRAD_CLIP PRECISION LOSS_SCALE \
        LOSS_SCALE_HYSTERESIS LOSS_SCALE_GROWTH LOSS_SCALE_BACKOFF LOSS_SCALE_INTERVAL FP8_BACKEND FP8_RECIPE FP8_AMAX_HISTORY FP8_MARGIN FP8_GRAD FP8_KEEP_WEIGHT CKPT CKPT_SEGMENT CKPT_IMPL COMPILE \
        LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS SNAPSHOT_INTERVAL RESUME SAMPLE_TOKENS PEAK_FLOPS LEDGER SAMPLE_ONLY \
        MEMORY_SNAPSHOT
VARIABLES := $(KEYS) NPROC PYTHON ARGS
# a value as one shell word, whatever it holds ('N_LAYER=2;touch x' must not run touch); values are
# taken with $(value), so make does not expand a $(...) inside them either
q = '$(subst ','\'',$(1))'
lower = $(shell echo $(call q,$(1)) | tr A-Z a-z)
given = $(filter command line,$(origin $(1)))
unexport $(VARIABLES)  # make would expand a command-line value to put it in the recipe's environment
FLAGS := $(strip $(foreach K,$(KEYS),$(if $(call given,$(K)),$(call q,--$(call lower,$(K))=$(value $(K))))) \
                 $(foreach A,$(value ARGS),$(call q,$(A))))

# a capitalised variable that is no key would be dropped without a word (N_LAYERS=8): refuse it
UNKNOWN := $(firstword $(foreach V,$(.VARIABLES),$(if $(call given,$(V)),$(if $(filter $(V),$(VARIABLES)),,$(if \
             $(filter $(V),$(call lower,$(V))),,$(V))))))
ifneq ($(UNKNOWN),)
NEAREST := $(shell python3 -c 'import difflib, sys; print(*difflib.get_close_matches(sys.argv[1], sys.argv[2:], 1))' \
             $(call q,$(UNKNOWN)) $(VARIABLES) 2>/dev/null)
$(error error: $(UNKNOWN) is not a config key$(if $(NEAREST), (the nearest is $(NEAREST)),) nor NPROC, PYTHON or \
        ARGS; a tool's own flags go in ARGS='--$(call lower,$(UNKNOWN))=...')
endif

ifdef PYTHON
ifneq ($(filter-out help clean,$(MAKECMDGOALS)),)
ifeq ($(shell command -v $(call q,$(value PYTHON))),)
$(error error: PYTHON=$(value PYTHON) is not an interpreter that runs here (not found or not executable))
endif
endif
endif

NPROC ?= 2
ifneq ($(filter ddp,$(MAKECMDGOALS)),)
ifeq ($(shell echo $(call q,$(value NPROC)) | grep -Ex '[1-9][0-9]*'),)
$(error error: NPROC=$(value NPROC) must be a positive integer (processes per node))
endif
# one rank per GPU on CUDA, per core on CPU: more would only queue, and every rank holds a whole model
GPUS := $(if $(filter cpu,$(value DEVICE)),0,$(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU'))
CORES := $(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
LIMIT := $(if $(filter-out 0,$(GPUS)),$(GPUS) GPUs,$(CORES) CPU cores)
ifeq ($(shell awk -v n=$(value NPROC) -v m=$(firstword $(LIMIT)) 'BEGIN { print (n + 0 <= m + 0) }'),0)
$(error error: NPROC=$(value NPROC) is more ranks than this machine's $(LIMIT) (make ddp starts one per GPU on CUDA, \
        one per core on CPU))
endif
endif

.PHONY: help train test house bench sample ddp ledger plan chapter dtypes underflow flops reading gpu-check clean

help: $(DEPS)  ## this list; CKPT's choices are read from checkpoint.POLICIES
	@echo "make train      train on the built-in data (PRECISION=fp32|bf16|fp16|fp8 CKPT=<a policy, below> ACCUM=K COMPILE=1)"
	@echo "make test       the test suite (CPU; CUDA tests skip without a GPU)"
	@echo "make house      the house's own rules (CI runs it after make test): file sizes, imports, what runs"
	@echo "make bench      tokens/s, ms/step, MFU and peak memory per precision and ckpt policy -> out/bench.jsonl"
	@echo "make sample     print a sample from out/snapshot.pt"
	@echo "make ddp        torchrun --nproc_per_node=NPROC train.py (gloo on CPU, NCCL on GPU: NPROC = GPUs to use, default 2;"
	@echo "                SHARD=zero1|zero2|fsdp splits the states over the ranks, zero.py and fsdp.py)"
	@echo "make ledger     the memory ledger: predicted vs measured bytes per component, the techniques table"
	@echo "make plan       will it fit? every precision x CKPT x SHARD x ATTN that fits NPROC GPUs (ARGS=--gpu=H100|24GiB),"
	@echo "                fastest first, with the command that runs the best -> out/plan.svg"
	@echo "make chapter    every claim of the chapter measured here -> out/chapter/report.md (ARGS=--quick: short)"
	@echo "make dtypes     the dtype table from torch.finfo"
	@echo "make underflow  the share of FP16 gradients lost without loss scaling"
	@echo "make flops      each recompute policy's step FLOPs, counted by FlopCounterMode"
	@echo "make reading    the lines each run executes, counted by running it (ARGS=--readme writes the README's tables)"
	@echo "make gpu-check  on a GPU: CUDA tests, ledger, the plan's check, benchmark (the fast config too), every step run -> out/gpu-check/summary.md"
	@echo "variables: any config key in capitals (python train.py --help lists them), NPROC, PYTHON, ARGS='--key=value ...'"
	@$(PY) -c 'import checkpoint; print("CKPT= recompute policies (one class each in checkpoint.py):"); \
		[print(f"  {name:10} {policy.help}") for name, policy in checkpoint.POLICIES.items()]; \
		print("CKPT_IMPL= hooks (the real recompute, on saved-tensor hooks) | naive (the textbook Function)")'

$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@

train: $(DEPS)
	$(PY) train.py $(FLAGS)

sample: $(DEPS)
	$(PY) train.py --sample_only $(FLAGS)

# two pytest workers (pytest-xdist) where the interpreter has it: CI's two cores, one thread
# each (tests/conftest.py); an interpreter given as PYTHON without it runs the suite in one
test: $(DEPS)
	$(PY) -m pytest -q $$($(PY) -c 'import xdist' 2>/dev/null && printf -- '-n 2 --dist loadfile') tests

bench: $(DEPS)
	$(PY) tools/bench.py $(FLAGS)

ddp: $(DEPS)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) train.py $(FLAGS)

ledger: $(DEPS)
	$(PY) tools/ledger.py $(FLAGS)

# NPROC is no config key: the plan's own --nproc (GPUs of the plan, not processes started here)
plan: $(DEPS)
	$(PY) tools/plan.py $(FLAGS) $(if $(call given,NPROC),$(call q,--nproc=$(value NPROC)))

chapter: $(DEPS)
	$(PY) tools/chapter.py $(FLAGS)

dtypes: $(DEPS)
	$(PY) tools/demos.py dtypes $(FLAGS)

underflow: $(DEPS)
	$(PY) tools/demos.py underflow $(FLAGS)

flops: $(DEPS)
	$(PY) tools/demos.py flops $(FLAGS)

reading: $(DEPS)
	$(PY) tools/reading.py --check $(FLAGS)

# the house's own rules, not the learner's: CI runs it after make test
house: $(DEPS)
	$(PY) tools/house.py

gpu-check: $(DEPS)
	@$(PY) tools/gpu_check.py $(FLAGS)

clean:
	rm -rf out .cache __pycache__ tests/__pycache__ tools/__pycache__ .pytest_cache
