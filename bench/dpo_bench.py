"""DPO on the demo pairs, ours (dpo.py as shipped) against TRL 1.12.0's DPOTrainer: the same model, LoRA, batch,
steps and optimiser, fp32 on the CPU.

    make prepare preferences                                     # models/SmolLM2-135M-Instruct, data/preferences
    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && \
        .venv-trl/bin/pip install trl==1.12.0 transformers==5.19.0 peft   # once, as bench/trl_bench.py
    .venv/bin/python bench/dpo_bench.py                          # 20 steps each (make dpo's), 2 threads

Prints one line per trainer, then their ratio:
    ours steps=N seconds_per_step=X peak_rss_mb=Y val_accuracy=A val_margin=M
    TRL  steps=N seconds_per_step=X peak_rss_mb=Y val_accuracy=A val_margin=M
seconds_per_step: the mean over steps 2..N−1 (step 1 is warm-up; the last step holds the final evaluation in ours):
ours from metrics.jsonl's time/step_s, TRL's from the gaps between its `on_step_end` callbacks. peak_rss_mb: the
child process's own peak (os.wait4). val_accuracy / val_margin: rewards/accuracies and rewards/margins on the first
100 held-out pairs (data/preferences/val.parquet) after the last step, ours as val/rewards/*, TRL's from evaluate()
in one batch of 100 (TRL averages its batches' means: one batch makes it the mean over pairs, as ours).

The workload, on both sides: SmolLM2-135M-Instruct, LoRA r=16, α=32, dropout 0 on the 7 projections of the top 8 of
its 30 layers (the reference is the adapter switched off, on both sides), DPO's sigmoid loss, β=0.1, 16 pairs a step in
one micro-batch, AdamW lr 5e-4 (betas 0.9/0.999, no weight decay), warmup 5% then cosine to 10%, gradient clipping
at 1.0, the pairs as chat messages rendered by the model's template. Where they differ: ours runs each pair's prompt
once for both answers (dpo.share_prompt_prefix, departure 2 of dpo.py), TRL runs chosen and rejected as two rows;
TRL's warmup rounds 5% of the steps up, ours down (with 10 steps: 1 step against 0).
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import REPO, run_child  # noqa: E402

MODEL = "models/SmolLM2-135M-Instruct"
TRAIN, VAL = "data/preferences/train.parquet", "data/preferences/val.parquet"
VAL_PAIRS = 100
LAYERS, TOP = 30, 8
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trl_child(spec: dict) -> None:
    """TRL's DPOTrainer on the demo pairs; prints a json line {"seconds": [...], "eval": {...}}."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(1)

    def pairs(path, limit=None):  # our layout → TRL's conversational one (prompt messages, one assistant message)
        rows = pq.read_table(os.path.join(REPO, path)).to_pylist()[:limit]
        return Dataset.from_list([{"prompt": r["prompt"], "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                   "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])

    stamps = []

    class Timer(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    args = DPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], per_device_train_batch_size=16,
        gradient_accumulation_steps=1, per_device_eval_batch_size=VAL_PAIRS, learning_rate=5e-4, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0.05, max_grad_norm=1.0, beta=0.1,
        loss_type=["sigmoid"], max_length=96, use_cpu=True, bf16=False, seed=1, logging_steps=1, report_to="none",
        save_strategy="no", eval_strategy="no", dataloader_num_workers=0)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PROJECTIONS,
                      layers_to_transform=list(range(LAYERS - TOP, LAYERS)), task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(os.path.join(REPO, MODEL), dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=args, train_dataset=pairs(TRAIN), eval_dataset=pairs(VAL, VAL_PAIRS),
                         processing_class=AutoTokenizer.from_pretrained(os.path.join(REPO, MODEL)),
                         peft_config=lora, callbacks=[Timer()])
    trainer.train()
    result = trainer.evaluate()
    seconds = [b - a for a, b in zip(stamps, stamps[1:])]  # step k+1's time, k ≥ 1: step 1 is warm-up
    print(json.dumps({"seconds": seconds[:-1] if len(seconds) > 1 else seconds,
                      "eval": {"accuracy": result["eval_rewards/accuracies"],
                               "margin": result["eval_rewards/margins"]}}))


def ours(steps: int, workdir: str, threads: int) -> dict:
    """dpo.py as shipped on the same workload (validation by greedy answers off: only the held-out pairs)."""
    out = os.path.join(workdir, "ours")
    shutil.rmtree(out, ignore_errors=True)  # the bench's own folder
    rss = run_child([os.path.join(REPO, ".venv/bin/python"), "dpo.py", "--config", "configs.yaml",
                     f"dpo.total_steps={steps}", f"dpo.output_dir={out}", "dpo.val_prompts=null",
                     "dpo.val_before_train=false", "dpo.eval_freq=0", f"dpo.val_max_rows={VAL_PAIRS}",
                     "dpo.save_freq=0", "dpo.dtype=fp32", f"dpo.train_files={TRAIN}", f"dpo.val_files={VAL}"],
                    os.path.join(workdir, "ours.log"), threads)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    last = rows[-1]
    return {"seconds": [r["time/step_s"] for r in rows[1:-1]], "rss": rss,
            "accuracy": last["val/rewards/accuracies"], "margin": last["val/rewards/margins"]}


def trl(steps: int, workdir: str, threads: int) -> dict:
    python = os.path.join(REPO, ".venv-trl/bin/python")
    if not os.path.exists(python):
        sys.exit(f"{python} is missing: make it as this file's docstring says")
    spec = {"steps": steps, "output_dir": os.path.join(workdir, "trl")}
    log = os.path.join(workdir, "trl.log")
    rss = run_child([python, os.path.abspath(__file__), "--child", json.dumps(spec)], log, threads)
    with open(log) as f:
        result = json.loads([line for line in f if line.startswith('{"seconds"')][-1])
    return {"seconds": result["seconds"], "rss": rss, **result["eval"]}


def line(name: str, steps: int, r: dict) -> str:
    return (f"{name:<4} steps={steps} seconds_per_step={sum(r['seconds']) / len(r['seconds']):.3f} "
            f"peak_rss_mb={r['rss']:.0f} val_accuracy={r['accuracy']:.3f} val_margin={r['margin']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps on each side (≥ 3)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each child")
    parser.add_argument("--workdir", default="/tmp/dpo_bench")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return trl_child(json.loads(args.child))
    for path in (MODEL, TRAIN, VAL):
        if not os.path.exists(os.path.join(REPO, path)):
            sys.exit(f"{path} is missing: run `make prepare preferences` first")
    os.makedirs(args.workdir, exist_ok=True)
    a, b = ours(args.steps, args.workdir, args.threads), trl(args.steps, args.workdir, args.threads)
    print(line("ours", args.steps, a))
    print(line("TRL", args.steps, b))
    ratio = (sum(a["seconds"]) / len(a["seconds"])) / (sum(b["seconds"]) / len(b["seconds"]))
    print(f"ours/TRL time per step {ratio:.2f}, peak memory {a['rss'] / b['rss']:.2f}")


if __name__ == "__main__":
    main()
