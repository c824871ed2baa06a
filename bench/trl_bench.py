"""The peer: TRL 1.12.0's experimental PPOTrainer on the workload of bench/ppo_bench.py.

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && \
        .venv-trl/bin/pip install trl==1.12.0 transformers==5.19.0        # once; transformers as ours
    .venv-trl/bin/python bench/trl_bench.py                      # default preset, as shipped
    .venv-trl/bin/python bench/trl_bench.py --preset large --gc-freeze

Prints, as its last two lines:
    phases (mean s/step): gen … ref … reward … values … update+rest …
    TRL steps=N seconds_per_step=X peak_rss_mb=Y tokens_per_s=Z gc=shipped
phases: the module's batch_generation (gen), no-grad forward (ref), get_reward on the reward model (reward) and
on the value model (values), each wrapped with a timer; update+rest is the step less those (PPO epoch, GAE,
logging, empty_cache/gc.collect).

The same workload as ours: the same random Llama (policy and reference), a sequence classifier of the same
shape as value model and reward model (TRL needs a reward *model*), the same prompts (bench/workload.py
builds them all under --workdir), S sequences per step (TRL samples one response per prompt, so S prompts where
ours takes S/4 prompts × 4), fixed-length responses (`stop_token=None`: no EOS truncation, generation runs
`response_length` tokens; checked on every batch), 2 mini-batches of one micro-batch each
(per_device_train_batch_size=S, gradient_accumulation_steps=1, num_mini_batches=2), 1 PPO epoch,
k1 KL in the reward with a fixed β, fp32 on CPU. TRL trains policy and value in one forward/backward
through its PolicyAndValueWrapper with one optimiser; ours runs two.

What is timed: the gap between successive `on_step_end` callbacks (one per PPO update: generate, score,
logprobs, values, GAE, the PPO epoch, logging, and TRL's per-step `empty_cache()` and `gc.collect()`), over
updates 2..N; the first update, from `on_train_begin`, is warm-up. Checkpoints and sample generations are
off (save_strategy="no", num_sample_generations=0).

--gc-freeze: `gc.collect(); gc.freeze(); gc.disable()` just before trainer.train(), and the trainer module's
explicit calls patched out, since gc.disable() does not stop an explicit gc.collect(): `ppo_trainer.gc`
becomes a stub whose collect() does nothing, and `ppo_trainer.empty_cache` a no-op (on CPU it calls
torch.cuda.empty_cache(), which does nothing without CUDA anyway).
"""
import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import REPO, build_workload, common_args, result_line, run_child, size_of, workdir_of  # noqa: E402


def child(spec: dict) -> None:
    import gc
    import types

    import torch
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer

    sys.path.insert(0, REPO)
    import data

    root, S, Tr = spec["root"], spec["sequences"], spec["response_length"]
    tokenizer = AutoTokenizer.from_pretrained(f"{root}/model", padding_side="left")
    rows, _ = data.load_rl_dataset(f"{root}/train.parquet", tokenizer, 128, "error")
    prompts = Dataset.from_dict({"input_ids": [r["prompt_ids"] for r in rows]})
    dtype = torch.float32  # the weights; bf16 below is autocast over them, as ours

    def load(cls, name):
        return cls.from_pretrained(f"{root}/{name}", dtype=dtype)

    policy, ref = load(AutoModelForCausalLM, "model"), load(AutoModelForCausalLM, "model")
    value, reward = load(AutoModelForSequenceClassification, "rm"), load(AutoModelForSequenceClassification, "rm")
    args = PPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=S, gradient_accumulation_steps=1,
        num_mini_batches=2, num_ppo_epochs=1, total_episodes=spec["steps"] * S, response_length=Tr,
        stop_token=None, temperature=1.0, kl_coef=0.001, kl_estimator="k1", learning_rate=5e-5,
        local_rollout_forward_batch_size=64, num_sample_generations=0, save_strategy="no", report_to="none",
        logging_steps=1, disable_tqdm=True, seed=spec["seed"], bf16=spec["dtype"] == "bf16", fp16=False,
        use_cpu=not torch.cuda.is_available())

    # Every update's tokens, a check that generation never stopped early, and seconds per phase: the module's
    # generate / no-grad forward / reward-or-value forward, wrapped; update = the rest of the step.
    tokens, phases, spent = [], [], defaultdict(float)

    def timed(fn, name_of):
        def wrapped(model, *a, **k):
            t0 = time.perf_counter()
            out = fn(model, *a, **k)
            spent[name_of(model)] += time.perf_counter() - t0
            return out
        return wrapped

    ppo_trainer.batch_generation = timed(ppo_trainer.batch_generation, lambda m: "gen")
    ppo_trainer.forward = timed(ppo_trainer.forward, lambda m: "ref" if not torch.is_grad_enabled() else "fwd_grad")
    ppo_trainer.get_reward = timed(ppo_trainer.get_reward, lambda m: "reward" if m is reward else "values")
    generate = ppo_trainer.batch_generation

    def counted(model, queries, *a, **k):
        query_responses, logits = generate(model, queries, *a, **k)
        assert query_responses.shape[1] == queries.shape[1] + Tr, "TRL stopped generating before response_length"
        tokens.append(int((queries != tokenizer.pad_token_id).sum()) + queries.shape[0] * Tr)
        return query_responses, logits

    ppo_trainer.batch_generation = counted
    stamps = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())
            phases.append(dict(spent))
            spent.clear()

    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=prompts, eval_dataset=prompts.select(range(8)),
                         callbacks=[Clock()])
    if spec["gc_freeze"]:
        ppo_trainer.gc = types.SimpleNamespace(collect=lambda *a: 0)
        ppo_trainer.empty_cache = lambda: None
        gc.collect()
        gc.freeze()
        gc.disable()
    trainer.train()
    seconds = [b - a for a, b in zip(stamps, stamps[1:])]
    with open(spec["result"], "w") as f:
        json.dump({"seconds": seconds, "tokens": tokens, "phases": phases}, f)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.steps < 2:
        sys.exit("trl_bench.py: --steps must be at least 2 (step 1 is warm-up and not timed)")
    size = size_of(args)
    root = build_workload(workdir_of(args, size), size)
    out = os.path.join(root, "runs", f"trl_Tr{size['response_length']}_S{size['sequences']}")
    os.makedirs(out, exist_ok=True)
    spec = dict(root=root, output_dir=out, result=os.path.join(out, "result.json"), steps=args.steps,
                sequences=size["sequences"], response_length=size["response_length"], dtype=args.dtype,
                gc_freeze=args.gc_freeze, seed=args.seed)
    rss = run_child([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                    os.path.join(out, "log.txt"), args.threads)
    with open(spec["result"]) as f:
        result = json.load(f)
    if len(result["seconds"]) != args.steps:
        sys.exit(f"trl_bench.py: expected {args.steps} updates, timed {len(result['seconds'])}; see {out}/log.txt")
    steps = list(zip(result["seconds"], result["phases"]))[1:]
    names = sorted({k for _, p in steps for k in p} - {"fwd_grad"})
    update = sum(s - sum(p.get(k, 0.0) for k in names) for s, p in steps) / len(steps)
    print("phases (mean s/step): " + "  ".join(f"{k} {sum(p.get(k, 0.0) for _, p in steps) / len(steps):.4f}"
                                               for k in names) + f"  update+rest {update:.4f}")
    print(result_line("TRL", args.steps, result["seconds"][1:], result["tokens"][1:], rss,
                      gc="frozen" if args.gc_freeze else "shipped", threads=args.threads or "default"), flush=True)


if __name__ == "__main__":
    main()
