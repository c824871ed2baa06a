#!/usr/bin/env bash
# GSM8K as OpenAI distributes it (github.com/openai/grade-school-math: train.jsonl 7473 rows, test.jsonl
# 1319) → $GSM8K_DATA/train.parquet and test.parquet through tools/prepare_data.py, prompted as verl's
# examples/data_preprocess/gsm8k.py does ("<question> Let's think step by step and output the final answer
# after "####".", data_source openai/gsm8k, the number after "####" as ground truth).
#
#   bash examples/prepare_gsm8k.sh          # downloads the two jsonl files unless $GSM8K_RAW already has them
#
# Without network, copy train.jsonl and test.jsonl into $GSM8K_RAW first. Nothing is redone once the
# parquet files exist.
set -euo pipefail
cd "$(dirname "$0")/.."
RAW=${GSM8K_RAW:-data/gsm8k_raw}
DATA=${GSM8K_DATA:-data/gsm8k}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
URL=https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data

if [ -f "$DATA/train.parquet" ] && [ -f "$DATA/test.parquet" ]; then
    exit 0
fi
mkdir -p "$RAW"
for split in train test; do
    [ -f "$RAW/$split.jsonl" ] || curl -fsSL "$URL/$split.jsonl" -o "$RAW/$split.jsonl"
done
# --val-fraction 0: each file becomes one split whole; GSM8K's own test set is the validation set
"$PY" tools/prepare_data.py --input "$RAW/train.jsonl" --output "$DATA" --val-fraction 0
"$PY" tools/prepare_data.py --input "$RAW/test.jsonl" --output "$DATA/test_split" --val-fraction 0
mv "$DATA/test_split/train.parquet" "$DATA/test.parquet"
rmdir "$DATA/test_split"
