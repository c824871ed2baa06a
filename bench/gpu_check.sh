#!/bin/bash
# The GPU check: at most 8 minutes on one GPU by construction. Every stage has a time cap, the caps and the reserve for
# what runs between stages add up to at most BUDGET_S = 480 s, and each stage also stops at the deadline; a stage past
# its time is killed with every process it started (torchrun's workers run in sessions of their own, so they are found
# by a tag in their environment). Each stage ends PASS, FAIL or SKIP with its reason; one figures file is written.
#
#   bash bench/gpu_check.sh                   # on the GPU machine, from the repository root
#   GPU_CHECK_DRY=1 bash bench/gpu_check.sh   # anywhere: the stages, their caps and the total; runs nothing
#   GPU_CHECK_CPU=1 bash bench/gpu_check.sh   # anywhere: the same code on the CPU, tiny models, up to the device
#                                             # boundary (gloo for nccl, the vLLM stage SKIP before its engine)
#   GPU_CHECK_STAGES="setup build half-lora" bash bench/gpu_check.sh   # these stages only; the others SKIP
#   PY=/path/to/python3 bash bench/gpu_check.sh
#
# It installs and downloads nothing (HF_HUB_OFFLINE=1): it runs on the machine's python3 with torch (CUDA),
# transformers, accelerate, peft, pyarrow, tqdm and pytest; vLLM is optional, and its stage is SKIP without it (the HF
# backend never stands in for it). Every model and dataset is built here: the 0.5B-size one from Qwen2.5-0.5B's shape
# with random weights, unless QWEN_PATH names a local folder with the real ones.
# Figures: $OUT/gpu_check.json when $OUT is set, else bench/gpu_check.json. Logs: $WORK/logs (default /tmp/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
SELF=bench/gpu_check.sh
BUDGET_S=480
CPU_SLOWER=4  # GPU_CHECK_CPU=1: every cap and the budget × 4
RESERVE_S=30  # between stages: the GPU memory probe, reaping, the next stage's start; and the report at the end
STAGES=(setup:25 build:40 fsdp2:50 resume:45 packing:40 half-full:85 half-lora:60 offload:45 vllm:60)
declare -A ABOUT=(
  [setup]="torch sees the GPU; versions; the library imports on this stack; whether vLLM imports"
  [build]="tiny Qwen2 with grouped-query attention (4 query / 2 KV heads), a Qwen2.5-0.5B-shaped model, prompts"
  [fsdp2]="ppo.py under FSDP2 on 1 GPU: GAE with a critic and a reference, full fine-tune, fp32, sampled, 3 steps, checkpoint at 2"
  [resume]="a folder holding only step_2 resumes to step 3, which equals the straight run's (1e-4 relative)"
  [packing]="tests/test_packing.py on CUDA: packed = padded (MHA and GQA); the GQA packed pass without the math kernel"
  [half-full]="0.5B-shaped, bf16, HF rollouts (32 x 128 tokens), packed: GAE full fine-tune with a critic and a bf16 reference; step time, peak memory per phase, packed attention with SDPA's math kernel ruled out"
  [half-lora]="the same model, GRPO with LoRA (reference: the adapter disabled), packed, kernel checked; peak memory per phase"
  [offload]="ppo.py under FSDP2 with CPU offload and gradient checkpointing, bf16, 2 steps (HF rollout on the GPU)"
  [vllm]="bf16 vLLM engine under torchrun, sleeping: sync changes its greedy output, logprob gap within bf16's, sleep frees memory; SKIP without vLLM"
)
declare -A NEEDS=([build]="setup" [fsdp2]="build" [resume]="fsdp2" [packing]="setup" [half-full]="build"
                  [half-lora]="build" [offload]="build" [vllm]="build")

export GPU_CHECK_CPU=${GPU_CHECK_CPU:-}
[ -n "$GPU_CHECK_CPU" ] && export CUDA_VISIBLE_DEVICES=""  # the CPU, even on a GPU machine
BACKEND=$([ -n "$GPU_CHECK_CPU" ] && echo gloo || echo nccl)
export PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
export WORK=${WORK:-/tmp/gpu_check}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS, for the exact resume
TINY=$WORK/models/tiny HALF=$WORK/models/half DATA=$WORK/data RUNS=$WORK/runs
LAUNCH=("$PY" -m accelerate.commands.launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1)
COMMON=(data.train_files=$DATA/train.parquet data.val_files=null reward.function=$DATA/reward.py:compute_score
        rollout.name=hf trainer.max_kl=0 trainer.test_freq=0 trainer.val_before_train=false trainer.sample_freq=0
        trainer.plot_curves=false)
TINY_ARGS=("${COMMON[@]}" model.path=$TINY rollout.max_response_length=16 data.train_batch_size=4 rollout.n=4
           actor.ppo_mini_batch_size=2 rollout.temperature=1.0)
GAE_FULL=(algorithm.adv_estimator=gae model.lora_rank=0 critic.lora_rank=0 algorithm.use_kl_in_reward=true
          algorithm.use_kl_loss=false)
HALF_ARGS=("${COMMON[@]}" model.path=$HALF model.dtype=bf16 model.use_remove_padding=true rollout.max_response_length=128
           rollout.ignore_eos=true rollout.temperature=1.0 rollout.micro_batch_size=32 data.train_batch_size=8 rollout.n=4
           actor.ppo_mini_batch_size=4 trainer.save_freq=0)
# on the CPU: the path, not the size (still two mini-batches, so that every pass of step 4 runs)
[ -n "$GPU_CHECK_CPU" ] && HALF_ARGS+=(rollout.max_response_length=8 data.train_batch_size=4 rollout.n=2
                                       actor.ppo_mini_batch_size=2)

port() { echo $((20000 + RANDOM % 20000)); }

# ---- the stages (run as `bash bench/gpu_check.sh --stage NAME`, in a session of their own)

stage_setup() { "$PY" bench/gpu_check.py setup; }

stage_build() { "$PY" bench/gpu_check.py build; }

# What each ppo stage runs (bench/gpu_check.py's arguments) and the line its log must hold (grep -E): ppo_stage NAME
# sets ARGS and SAYS. `bash bench/gpu_check.sh --args NAME` prints them (tests/test_gpu_paths.py reads them).
ppo_stage() {
  local fsdp_tiny=("${TINY_ARGS[@]}" "${GAE_FULL[@]}" model.dtype=fp32 trainer.total_steps=3 trainer.save_freq=2
                   trainer.keep_checkpoints=5)
  case $1 in
    fsdp2) ARGS=(ppo fsdp2 "${fsdp_tiny[@]}" trainer.output_dir=$RUNS/fsdp2)
           SAYS="parallel: fsdp2 over 1 processes \([^)]*$BACKEND[^)]*\); sharded: policy, critic, reference" ;;
    resume) ARGS=(ppo resumed "${fsdp_tiny[@]}" trainer.output_dir=$RUNS/resumed)
            SAYS="resumed from $RUNS/resumed/step_2 at step 2" ;;
    half-full) ARGS=(ppo half-full --strict-packed --no-save "${HALF_ARGS[@]}" "${GAE_FULL[@]}" trainer.total_steps=3
                     trainer.output_dir=$RUNS/half-full)
               SAYS="" ;;
    half-lora) ARGS=(ppo half-lora --strict-packed --no-save "${HALF_ARGS[@]}" algorithm.adv_estimator=grpo
                     model.lora_rank=32 algorithm.use_kl_loss=true algorithm.use_kl_in_reward=false trainer.total_steps=2
                     trainer.output_dir=$RUNS/half-lora)
               SAYS="" ;;
    offload) ARGS=(ppo offload "${TINY_ARGS[@]}" "${GAE_FULL[@]}" model.dtype=bf16 model.gradient_checkpointing=true
                   trainer.total_steps=2 trainer.save_freq=0 trainer.output_dir=$RUNS/offload)
             SAYS="offload_params=True, param_dtype=torch.bfloat16" ;;
  esac
  [ -n "$GPU_CHECK_CPU" ] && [[ $1 = half-* ]] && ARGS+=(trainer.total_steps=1)
  return 0
}

# says WHAT: the stage's log holds the line SAYS, or FAIL saying WHAT did not happen
says() { grep -qE "$SAYS" "$STAGE_LOG" || { echo "FAIL: $1"; return 1; }; }

stage_fsdp2() {
  ppo_stage fsdp2
  "${LAUNCH[@]}" --main_process_port "$(port)" bench/gpu_check.py "${ARGS[@]}" || return 1
  says "ppo.py did not say it sharded policy, critic and reference over $BACKEND"
}

stage_resume() {
  [ -d "$RUNS/fsdp2/step_2" ] || { echo "SKIP: the fsdp2 stage left no step_2 checkpoint"; return 3; }
  mkdir -p "$RUNS/resumed" && cp -r "$RUNS/fsdp2/step_2" "$RUNS/resumed/"
  ppo_stage resume
  "${LAUNCH[@]}" --main_process_port "$(port)" bench/gpu_check.py "${ARGS[@]}" || return 1
  says "the run did not resume" || return 1
  "$PY" bench/gpu_check.py same-step "$RUNS/fsdp2" "$RUNS/resumed" 3
}

stage_packing() {
  "$PY" -m pytest -q -p no:cacheprovider tests/test_packing.py || return 1
  if [ -z "$GPU_CHECK_CPU" ] && grep -q "skipped" "$STAGE_LOG"; then
    echo "FAIL: CUDA tests were skipped on a GPU machine"; return 1
  fi
}

stage_half_full() { ppo_stage half-full; "$PY" bench/gpu_check.py "${ARGS[@]}"; }

stage_half_lora() { ppo_stage half-lora; "$PY" bench/gpu_check.py "${ARGS[@]}"; }

stage_offload() {
  ppo_stage offload
  "${LAUNCH[@]}" --fsdp_offload_params true --main_process_port "$(port)" bench/gpu_check.py "${ARGS[@]}" || return 1
  says "ppo.py did not say it offloads parameters"
}

stage_vllm() {
  # without vLLM, or on the CPU: SKIP with the reason
  "$PY" -c "import vllm" 2>/dev/null && [ -z "$GPU_CHECK_CPU" ] || { "$PY" bench/gpu_check.py vllm; return $?; }
  "$PY" -m torch.distributed.run --nproc-per-node 1 --master-port "$(port)" bench/gpu_check.py vllm
}

if [ "${1:-}" = --stage ]; then
  "stage_${2//-/_}"
  exit $?
fi
if [ "${1:-}" = --args ]; then  # a ppo stage's arguments, one a line, then the line its log must hold
  ppo_stage "$2"
  printf '%s\n' "${ARGS[@]}" "SAYS=$SAYS"
  exit 0
fi

# ---- the runner

DRY=${GPU_CHECK_DRY:-}
total=$RESERVE_S
for s in "${STAGES[@]}"; do total=$((total + ${s#*:})); done
if [ -n "$DRY" ]; then
  echo "gpu_check dry run: the stages, each one's cap, and the total (nothing runs)"
  for s in "${STAGES[@]}"; do printf '  %-9s cap %3d s  %s\n' "${s%%:*}" "${s#*:}" "${ABOUT[${s%%:*}]}"; done
  printf '  %-9s     %3d s  %s\n' reserve "$RESERVE_S" "between stages, and the report"
  echo "total $total s = $((total / 60)) min $((total % 60)) s; budget $BUDGET_S s"
  [ "$total" -le "$BUDGET_S" ] || { echo "FAIL: the caps add up to more than the budget"; exit 1; }
  exit 0
fi
if [ "$total" -gt "$BUDGET_S" ]; then echo "FAIL: the caps add up to $total s, more than $BUDGET_S s"; exit 1; fi

[ -n "$GPU_CHECK_CPU" ] && BUDGET_S=$((BUDGET_S * CPU_SLOWER))  # the caps are a GPU's; a shared CPU is slower
FIGURES=${OUT:+$OUT/gpu_check.json}
FIGURES=${FIGURES:-bench/gpu_check.json}
export BUDGET_S GPU_CHECK_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo '?')
DEADLINE=$((SECONDS + BUDGET_S - 10))  # the report's seconds at the end
rm -rf "$WORK" && mkdir -p "$WORK/logs" "$(dirname "$FIGURES")"
: >"$WORK/status.tsv"
declare -A OUTCOME=()

gpu_used_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1; }

# reap TAG SIGNAL: signal every process whose environment carries GPU_CHECK_TAG=TAG
reap() {
  local p
  for p in /proc/[0-9]*; do
    grep -qzx "GPU_CHECK_TAG=$1" "$p/environ" 2>/dev/null && kill -"$2" "${p#/proc/}" 2>/dev/null
  done
}

# record NAME OUTCOME SECONDS CAP GPU_PEAK REASON
record() {
  OUTCOME[$1]=$2
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$(printf '%s' "$6" | tr '\t\n' '  ')" >>"$WORK/status.tsv"
  echo "$2 $1 ($3 s of $4; GPU peak ${5:-?} MiB)${6:+: $6}"
}

run_stage() {  # NAME CAP
  local name=$1 cap=$2 need reason="" limit
  [ -n "$GPU_CHECK_CPU" ] && cap=$((cap * CPU_SLOWER))
  if [ -n "${GPU_CHECK_STAGES:-}" ] && [[ " $GPU_CHECK_STAGES " != *" $name "* ]]; then
    record "$name" SKIP 0 "$cap" "" "not in GPU_CHECK_STAGES"; return
  fi
  for need in ${NEEDS[$name]:-}; do
    [ "${OUTCOME[$need]:-}" = PASS ] || reason="needs the $need stage, which did not pass"
  done
  limit=$((DEADLINE - SECONDS < cap ? DEADLINE - SECONDS : cap))
  [ -z "$reason" ] && [ "$limit" -lt 5 ] && reason="out of time ($limit s left of the budget)"
  if [ -n "$reason" ]; then record "$name" SKIP 0 "$cap" "" "$reason"; return; fi
  local log=$WORK/logs/$name.log tag="gpu_check_$$_$name" t0=$SECONDS timed_out=0 sampler=""
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$WORK/logs/$name.smi" 2>/dev/null &
    sampler=$!
  fi
  GPU_CHECK_TAG=$tag STAGE_LOG=$log setsid bash "$SELF" --stage "$name" >"$log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ $((SECONDS - t0)) -ge $((limit - 4)) ]; then  # its cap includes the 4 s its kill may take
      timed_out=1
      kill -TERM -- "-$pid" 2>/dev/null; reap "$tag" TERM; sleep 3
      kill -KILL -- "-$pid" 2>/dev/null; reap "$tag" KILL
      break
    fi
    sleep 0.5
  done
  wait "$pid"
  local rc=$?
  reap "$tag" KILL  # nothing the stage started outlives it
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null && wait "$sampler" 2>/dev/null
  local peak
  peak=$(sort -n "$WORK/logs/$name.smi" 2>/dev/null | tail -n 1)
  local said
  said=$(grep -E "^(PASS|FAIL|SKIP): " "$log" | tail -n 1 | cut -d' ' -f2-)
  if [ $timed_out = 1 ]; then
    record "$name" FAIL $((SECONDS - t0)) "$cap" "$peak" "timed out after $limit s; killed with its children"
  elif [ $rc = 0 ]; then
    record "$name" PASS $((SECONDS - t0)) "$cap" "$peak" "$said"
  elif [ $rc = 3 ]; then
    record "$name" SKIP $((SECONDS - t0)) "$cap" "$peak" "${said:-no reason given}"
  else
    record "$name" FAIL $((SECONDS - t0)) "$cap" "$peak" "exit $rc${said:+; $said}"
  fi
  if [ "${OUTCOME[$name]}" = FAIL ]; then tail -n 30 "$log" | sed 's/^/    /'; fi
}

echo "gpu_check $(date -u +%FT%TZ) commit $GPU_CHECK_COMMIT python $PY; budget $BUDGET_S s (caps $((total - RESERVE_S)) s)"
echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>/dev/null \
  || echo 'nvidia-smi: none')"
for s in "${STAGES[@]}"; do run_stage "${s%%:*}" "${s#*:}"; done
"$PY" bench/gpu_check.py report "$FIGURES" || echo "FAIL: the report could not be written"
failed=$(grep -c $'\tFAIL\t' "$WORK/status.tsv")
echo "total $SECONDS s; $(grep -c $'\tPASS\t' "$WORK/status.tsv") passed, $failed failed, \
$(grep -c $'\tSKIP\t' "$WORK/status.tsv") skipped"
[ "$failed" -eq 0 ]
