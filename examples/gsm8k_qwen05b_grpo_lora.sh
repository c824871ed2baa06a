#!/usr/bin/env bash
# GRPO with LoRA on GSM8K, Qwen2.5-0.5B-Instruct, with the settings of verl's published GRPO-LoRA run:
# 54.3 on GSM8K test (verl docs/algo/baseline.md; the run's script and log:
# github.com/eric-haibin-lin/verl-data, gsm8k/Qwen2.5-0.5B-bsz64_2-prompt512-resp1024-lorarank32-score0.543.log).
#
#   bash examples/gsm8k_qwen05b_grpo_lora.sh                    # one GPU; data step included
#   bash examples/gsm8k_qwen05b_grpo_lora.sh trainer.total_steps=20
#
#   NUM_PROCESSES=8 bash examples/gsm8k_qwen05b_grpo_lora.sh          # DDP over 8 GPUs (the same global batch)
#
# The data step, then accelerate launch ppo.py --config examples/gsm8k_qwen05b_grpo_lora.yaml. Not run here (no GPU, no
# model hub); tests/test_examples.py runs it for one step with a tiny model and tiny GSM8K files swapped in.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
DATA=${GSM8K_DATA:-data/gsm8k}
GSM8K_DATA=$DATA bash examples/prepare_gsm8k.sh

# examples/gsm8k_qwen05b_grpo_lora.yaml holds the run's settings, each with its reason; the data folder may move
accelerate launch --num_processes "${NUM_PROCESSES:-1}" --num_machines 1 --mixed_precision no --dynamo_backend no \
    ppo.py --config examples/gsm8k_qwen05b_grpo_lora.yaml data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" "$@"
