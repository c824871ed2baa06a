#!/usr/bin/env bash
# PPO with a critic on GSM8K: Qwen2.5-0.5B-Instruct as actor and critic, with the settings of verl's
# published baseline. verl reports 56.7 on GSM8K test after PPO, from 36.4 for the checkpoint
# (verl docs/algo/baseline.md and docs/algo/ppo.md "Reference Example"; the run's command and full log:
# github.com/eric-haibin-lin/verl-data, gsm8k/Qwen2.5-0.5B-bsz256_2-prompt1024-resp512-0.567.log, whose
# final line reads test_score 0.5686). Qwen's own report gives 49.6 for the checkpoint, with its own prompt.
#
#   bash examples/gsm8k_qwen05b_ppo.sh                          # one GPU; data step included
#   NUM_PROCESSES=8 bash examples/gsm8k_qwen05b_ppo.sh          # DDP over 8 GPUs (same global batch)
#   bash examples/gsm8k_qwen05b_ppo.sh trainer.total_steps=50   # any override, appended: it wins
#
# The data step, then accelerate launch ppo.py --config examples/gsm8k_qwen05b_ppo.yaml. Not run here (no GPU, no
# model hub); tests/test_examples.py runs it for one step with a tiny model and tiny GSM8K files swapped in.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
DATA=${GSM8K_DATA:-data/gsm8k}
GSM8K_DATA=$DATA bash examples/prepare_gsm8k.sh

# examples/gsm8k_qwen05b_ppo.yaml holds the run's settings, each with its reason; the data folder may move
accelerate launch --num_processes "${NUM_PROCESSES:-1}" --num_machines 1 --mixed_precision no --dynamo_backend no \
    ppo.py --config examples/gsm8k_qwen05b_ppo.yaml data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" "$@"
