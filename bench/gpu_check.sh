#!/bin/bash
# GPU checks in one go, at most ~8 minutes on one H200:
#   1. ppo.py under FSDP2 on 1 GPU (accelerate_configs/fsdp2.yaml), HF rollout: GAE with a critic and a
#      reference (full fine-tune, KL in the reward), a sharded checkpoint and an exact resume from it;
#   2. GRPO + LoRA + a vLLM engine that sleeps between rollouts (rollout.free_cache_engine: weights woken and
#      synced before the KV cache), under FSDP2, with the sampler/trainer logprob gap;
#   3. the packing parity test on CUDA (tests/test_packing.py);
#   4. bench/ppo_bench.py at a Qwen2-0.5B-like size built from config (random weights), bf16, vLLM rollouts,
#      then padded vs packed with HF rollouts.
# Figures and pass/fail per stage go to $OUT/gpu_check.txt when $OUT is set, else bench/gpu_check.txt.
#
#   make install && bash bench/gpu_check.sh          # on a GPU machine, from the repository root
#   PY=python3 bash bench/gpu_check.sh                # with a python that already has the requirements
#
# It downloads nothing and installs nothing: run it after `make install` on that machine (the Makefile picks
# vllm==0.32.0 with its CUDA torch there), or point PY at a python with torch (CUDA), transformers,
# accelerate, peft, pyarrow, pyyaml, tqdm and pytest. Every model and dataset is built from config here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
REPORT=${OUT:+$OUT/gpu_check.txt}
REPORT=${REPORT:-bench/gpu_check.txt}
WORK=${WORK:-/tmp/gpu_check}
BUDGET_S=${BUDGET_S:-470}              # whole script; each stage gets what is left, up to its own cap
DEADLINE=$((SECONDS + BUDGET_S))
FAILED=0
rm -rf "$WORK" && mkdir -p "$WORK" "$(dirname "$REPORT")"
: >"$REPORT"

say() { echo "$*" | tee -a "$REPORT"; }

# stage NAME CAP_S LOG COMMAND...: run under `timeout` (CAP_S or the time left), log to LOG, record the outcome.
stage() {
  local name=$1 cap=$2 log=$3; shift 3
  local left=$((DEADLINE - SECONDS))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -le 10 ]; then say "SKIP $name (out of time)"; FAILED=1; return 1; fi
  local t0=$SECONDS
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then say "PASS $name ($((SECONDS - t0)) s)"; else
    say "FAIL $name (exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit} s"); $((SECONDS - t0)) s)"
    tail -n 25 "$log" | sed 's/^/    /' | tee -a "$REPORT" >/dev/null
    FAILED=1
  fi
  return $rc
}

say "gpu_check $(date -u +%FT%TZ)  commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo none)"
if ! "$PY" -c "import torch, transformers, accelerate, peft, pyarrow, yaml, tqdm; assert torch.cuda.is_available()"; then
  say "FAIL setup: $PY lacks torch with CUDA or a requirement; run \`make install\` on this machine first"
  exit 1
fi
say "python: $("$PY" -c 'import sys, torch, transformers, accelerate; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)')"
say "vllm: $("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || echo absent)"

# ---- 1. FSDP2 on one GPU, on the tiny model of bench/ppo_bench.py's default preset
TINY=$WORK/tiny
"$PY" -c "import sys; sys.path.insert(0, 'bench'); import workload as b
b.build_workload('$TINY', dict(hidden=128, layers=2, heads=2, kv_heads=2, vocab=1024, intermediate=256))" \
  >"$WORK/build_tiny.log" 2>&1 || { say "FAIL building the tiny model"; tail "$WORK/build_tiny.log"; exit 1; }
LAUNCH=("$PY" -m accelerate.commands.launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1
        ppo.py --config configs.yaml)
TINY_ARGS=(model.path=$TINY/model data.train_files=$TINY/train.parquet data.val_files=$TINY/train.parquet
           data.val_max_samples=16 reward.function=$TINY/reward.py:compute_score rollout.name=hf
           rollout.max_response_length=16 data.max_prompt_length=128 data.train_batch_size=4 rollout.n=4
           actor.ppo_mini_batch_size=2 trainer.max_kl=0 trainer.test_freq=2 trainer.plot_curves=false
           trainer.sample_freq=0 model.dtype=bf16)
GAE=(algorithm.adv_estimator=gae algorithm.use_kl_in_reward=true algorithm.use_kl_loss=false model.lora_rank=0
     trainer.save_freq=2 trainer.keep_checkpoints=5)
stage "fsdp2 gae full fine-tune, 3 steps, checkpoint at 2" 150 "$WORK/fsdp_gae.log" \
  "${LAUNCH[@]}" "${TINY_ARGS[@]}" "${GAE[@]}" trainer.total_steps=3 trainer.output_dir=$WORK/gae
# Resume: a fresh folder holding only step_2 continues to step 3 and must log what the straight run logged.
mkdir -p "$WORK/resumed" && cp -r "$WORK/gae/step_2" "$WORK/resumed/" 2>/dev/null
stage "fsdp2 resume from the sharded step_2 checkpoint" 120 "$WORK/fsdp_resume.log" \
  "${LAUNCH[@]}" "${TINY_ARGS[@]}" "${GAE[@]}" trainer.total_steps=3 trainer.output_dir=$WORK/resumed
stage "fsdp2 resumed step 3 equals the straight run's" 20 "$WORK/fsdp_compare.log" "$PY" -c "
import json
def step3(p):
    return [json.loads(l) for l in open(p) if json.loads(l)['step'] == 3][0]
a, b = step3('$WORK/gae/metrics.jsonl'), step3('$WORK/resumed/metrics.jsonl')
keys = ['score/mean', 'loss/value', 'loss/policy', 'kl/mean', 'policy/entropy', 'value/mean']
print({k: (a[k], b[k]) for k in keys})
assert all(abs(a[k] - b[k]) <= 1e-3 * max(1.0, abs(a[k])) for k in keys), 'resumed run differs'"

# ---- 2. GRPO + LoRA + vLLM with sleep/wake, under FSDP2
stage "fsdp2 grpo LoRA with a sleeping vLLM engine, 3 steps" 200 "$WORK/fsdp_lora.log" \
  "${LAUNCH[@]}" "${TINY_ARGS[@]}" algorithm.adv_estimator=grpo model.lora_rank=8 trainer.total_steps=3 \
  trainer.save_freq=0 trainer.output_dir=$WORK/lora rollout.name=vllm rollout.free_cache_engine=true \
  rollout.gpu_memory_utilization=0.3 rollout.dtype=bf16
[ -f "$WORK/lora/metrics.jsonl" ] && say "  vllm gap: $("$PY" -c "
import json
lines = [json.loads(l) for l in open('$WORK/lora/metrics.jsonl') if json.loads(l)['step'] > 0]
print(' '.join(f\"step {m['step']}: logprob_diff_mean {m.get('rollout/logprob_diff_mean', float('nan')):.2e} max {m.get('rollout/logprob_diff_max', float('nan')):.2e} sync {m.get('time/sync_s', 0):.2f} s\" for m in lines))")"
for run in gae lora; do
  [ -f "$WORK/$run/metrics.jsonl" ] && say "  fsdp2 $run: $("$PY" -c "
import json
lines = [json.loads(l) for l in open('$WORK/$run/metrics.jsonl') if json.loads(l)['step'] > 0]
print(' '.join(f\"step {m['step']}: {m['time/step_s']:.3f} s, score {m['score/mean']:.3f}\" for m in lines))")"
done

# ---- 3. packing parity on CUDA
if [ -f tests/test_packing.py ]; then
  stage "pytest tests/test_packing.py (CUDA)" 120 "$WORK/pytest_packing.log" "$PY" -m pytest -q tests/test_packing.py
  say "  $(tail -n 1 "$WORK/pytest_packing.log")"
else
  say "SKIP tests/test_packing.py (not in this checkout)"
fi

# ---- 4. the benchmark at a Qwen2-0.5B-like size (hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 32000)
BENCH=("$PY" bench/ppo_bench.py --hidden 896 --layers 24 --heads 14 --kv-heads 2 --vocab 32000
       --intermediate 4864 --dtype bf16 --sequences 32 --response-length 128 --steps 6 --workdir "$WORK/bench")
stage "ppo_bench 0.5B-like, vLLM rollouts, fixed length 128, 32 seqs/step" 200 "$WORK/bench_vllm.log" \
  "${BENCH[@]}" --rollout vllm
grep -E "^(phases|PPO )" "$WORK/bench_vllm.log" | sed 's/^/  /' | tee -a "$REPORT"
stage "ppo_bench 0.5B-like, lengths U[8,128], padded vs packed" 200 "$WORK/bench_packing.log" \
  "${BENCH[@]}" --vary-lengths --layout padded packed
grep -E "^(phases|PPO )" "$WORK/bench_packing.log" | sed 's/^/  /' | tee -a "$REPORT"

say "total $SECONDS s; $([ $FAILED -eq 0 ] && echo 'all stages passed' || echo 'SOME STAGES FAILED')"
exit $FAILED
