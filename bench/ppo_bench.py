"""Benchmark ppo.py: seconds per PPO step on a random Llama of a given size, fixed-length responses.

    .venv/bin/python bench/ppo_bench.py                          # default: hidden 128, 2 layers, Tr 32, 16 seqs/step
    .venv/bin/python bench/ppo_bench.py --preset large           # hidden 256, 4 layers, Tr 64, 32 seqs/step
    .venv/bin/python bench/ppo_bench.py --gc-freeze              # gc.freeze(); gc.disable() before ppo.main
    .venv/bin/python bench/ppo_bench.py --vary-lengths --layout padded packed shared  # lengths ~ U[8, Tr]
    .venv/bin/python bench/ppo_bench.py --hidden 896 --layers 24 --heads 14 --kv-heads 2 --vocab 32000 \
        --intermediate 4864 --dtype bf16                          # a Qwen2-0.5B-like shape (GPU)
    .venv/bin/python bench/compare.py                            # ours vs TRL, both presets, a table

Prints, as its last line (one line per layout):
    PPO steps=N seconds_per_step=X peak_rss_mb=Y tokens_per_s=Z train_tokens_per_s=W layout=shared vary_lengths=0 …

--layout is how training forwards lay out a micro-batch: shared (the library's default,
model.share_prompt_prefix: each distinct prompt run once, its KV cache gathered to its responses), packed
(model.use_remove_padding: real tokens only, each distinct prompt once, attention by batches.varlen_sdpa) or
padded (both off: every row padded to the longest).

The workload: GAE with a critic, β·KL in the reward (k1, fixed β), no KL loss, full fine-tune, fp32 by
default, HF generate with `rollout.ignore_eos=true` so every response is exactly Tr tokens; 2 mini-batches
of one micro-batch each, 1 PPO epoch; 4 samples per prompt. Scores come from a random reward model
(reward.type=model, as TRL must), or from a rule function with --reward rule. bench/workload.py builds the
model, tokenizer, reward model and prompts once under --workdir from the size alone (random weights,
nothing downloaded). On a busy machine pass --threads 1 (the same to trl_bench.py): two OpenMP threads
spinning against other processes made steps 20× slower here.

What is timed: ppo.py writes `time/step_s` (sample prompts → sync weights, before validation and
checkpoints) for every step to metrics.jsonl; seconds_per_step is their mean over steps 2..N (step 1 is
warm-up); tokens_per_s = prompt + response tokens of those steps / their seconds. Model loading, the
final checkpoint and the saved model are outside it. train_tokens_per_s counts the same tokens over the
training phases only (old/ref logprobs, values, actor and critic updates: step time less generation, scoring
and weight sync), the part the layout changes. peak_rss_mb is the peak resident memory of the
child process that runs ppo.main (os.wait4's ru_maxrss), which includes loading.

ppo.py runs in a child process, `ppo.main(cfg)` called in-process there, so that this script can freeze the
garbage collector (--gc-freeze) or cut each generated response to a random length (--vary-lengths: a
wrapper around the rollout's `generate` that pads the tail and clears its mask) without changing ppo.py.
"""
import argparse
import json
import os
import shutil
import sys

from workload import REPO, build_workload, common_args, result_line, run_child, size_of, workdir_of

SAMPLES_PER_PROMPT = 4
MIN_VARIED_LENGTH = 8


# ---------------------------------------------------------------------------------------
# The child: ppo.main in this process, with the wrappers asked for


def cut_to_random_lengths(generate, low: int, seed: int):
    """Wrap Rollout.generate: each response keeps a uniform random length in [low, Tr], the rest is padding."""
    import torch
    rng = torch.Generator().manual_seed(seed)

    def wrapped(self, prompts, n, temperature, seed=None):
        ro = generate(self, prompts, n, temperature, seed=seed)
        B, Tr = ro.responses.shape
        lengths = torch.randint(min(low, Tr), Tr + 1, (B,), generator=rng)  # (B,)
        keep = torch.arange(Tr)[None, :] < lengths[:, None]  # (B, Tr)
        ro.responses = ro.responses.masked_fill(~keep, self.pad_id)
        ro.response_mask = ro.response_mask * keep
        if ro.logprobs is not None:
            ro.logprobs = ro.logprobs * keep
        return ro

    return wrapped


def child(spec: dict) -> None:
    sys.path.insert(0, REPO)
    import gc

    from infra import cli
    import ppo
    import rollout

    cfg = cli.load_config(os.path.join(REPO, "configs.yaml"), spec["overrides"])
    if spec["vary_lengths"]:
        for cls in (rollout.HFRollout, rollout.VLLMRollout):
            cls.generate = cut_to_random_lengths(cls.generate, MIN_VARIED_LENGTH, cfg.trainer.seed)
    if spec["gc_freeze"]:
        gc.collect()
        gc.freeze()
        gc.disable()
    if not spec["profile"]:
        return ppo.main(cfg)
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.runcall(ppo.main, cfg)
    profiler.dump_stats(spec["profile"].replace(".txt", ".prof"))  # for pstats / snakeviz
    with open(spec["profile"], "w") as f:  # model loading included: read the loop's functions
        pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)


# ---------------------------------------------------------------------------------------
# The parent: build, run, read metrics.jsonl, print


def reward_overrides(choice: str, root: str) -> list[str]:
    """reward.type=model (as TRL, a sequence classifier's score) where reward_model.py can serve it, else a rule."""
    have_rm = os.path.exists(os.path.join(REPO, "reward_model.py")) and \
        "class RewardModelScorer" in open(os.path.join(REPO, "reward_model.py")).read()
    if choice == "model" or (choice == "auto" and have_rm):
        return ["reward.type=model", f"reward.model_path={root}/rm"]
    return ["reward.type=rule", f"reward.function={root}/reward.py:compute_score"]


LAYOUTS = {"padded": ["model.use_remove_padding=false", "model.share_prompt_prefix=false"],
           "shared": ["model.use_remove_padding=false", "model.share_prompt_prefix=true"],
           "packed": ["model.use_remove_padding=true"]}


def run_ours(args, size: dict, root: str, layout: str) -> str:
    prompts = size["sequences"] // SAMPLES_PER_PROMPT
    tag = f"ours_Tr{size['response_length']}_S{size['sequences']}_{layout}_v{int(args.vary_lengths)}"
    out = os.path.join(root, "runs", tag)
    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        f"model.path={root}/model", f"model.dtype={args.dtype}", "model.lora_rank=0",
        f"data.train_files={root}/train.parquet", "data.val_files=null", f"data.train_batch_size={prompts}",
        f"rollout.name={args.rollout}", f"rollout.n={SAMPLES_PER_PROMPT}", "rollout.ignore_eos=true",
        f"rollout.max_response_length={size['response_length']}", "rollout.temperature=1.0",
        f"rollout.dtype={args.dtype}",
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.use_kl_loss=false",
        "algorithm.kl_penalty=k1", "algorithm.kl_ctrl.type=fixed",
        f"actor.ppo_mini_batch_size={prompts // 2}", "actor.ppo_epochs=1",
        f"trainer.total_steps={args.steps}", f"trainer.output_dir={out}", "trainer.resume=off",
        "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.sample_freq=0",
        "trainer.max_kl=0", "trainer.plot_curves=false", f"trainer.seed={args.seed}",
        *LAYOUTS[layout], *reward_overrides(args.reward, root), *args.override]
    spec = dict(overrides=overrides, gc_freeze=args.gc_freeze, vary_lengths=args.vary_lengths,
                profile=args.profile and os.path.join(out, "profile.txt"))
    os.makedirs(out, exist_ok=True)
    rss = run_child([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                    os.path.join(out, "log.txt"), args.threads)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if m["step"] > 1]  # step 1 is warm-up
    if not steps:
        sys.exit("ppo_bench.py: --steps must be at least 2 (step 1 is warm-up and not timed)")
    seconds = [m["time/step_s"] for m in steps]
    tokens = [m["perf/tokens_per_s"] * m["time/step_s"] for m in steps]
    train_seconds = sum(m["time/step_s"] - m.get("time/gen_s", 0) - m.get("time/reward_s", 0) - m.get("time/sync_s", 0)
                        for m in steps)
    phases = sorted({k for m in steps for k in m if k.startswith("time/") and k != "time/step_s"})
    print("phases (mean s/step): " + "  ".join(
        f"{k[5:-2]} {sum(m.get(k, 0.0) for m in steps) / len(steps):.4f}" for k in phases), flush=True)
    if args.profile:
        print(f"profile (top 40 by own time, loading included): {spec['profile']}")
    return result_line("PPO", args.steps, seconds, tokens, rss, train_tokens_per_s=f"{sum(tokens) / train_seconds:.1f}",
                       layout=layout,
                       vary_lengths=int(args.vary_lengths), gc="frozen" if args.gc_freeze else "shipped",
                       threads=args.threads or "default")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    parser.add_argument("--vary-lengths", action="store_true",
                        help=f"cut each response to a uniform random length in [{MIN_VARIED_LENGTH}, Tr]")
    parser.add_argument("--layout", nargs="+", choices=sorted(LAYOUTS), default=["shared"],
                        help="training-forward layout(s), one run each: shared (default), packed, padded")
    parser.add_argument("--reward", choices=["auto", "model", "rule"], default="auto",
                        help="auto: the random reward model where reward_model.py serves one, else a rule")
    parser.add_argument("--rollout", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="cProfile the run into <run>/profile.txt")
    parser.add_argument("--override", action="append", default=[], help="extra ppo.py key=value (repeatable)")
    args = parser.parse_args()
    size = size_of(args)
    if size["sequences"] % (2 * SAMPLES_PER_PROMPT):
        sys.exit(f"ppo_bench.py: --sequences must be a multiple of {2 * SAMPLES_PER_PROMPT} (2 mini-batches of "
                 f"{SAMPLES_PER_PROMPT} samples per prompt)")
    root = build_workload(workdir_of(args, size), size)
    for layout in args.layout:
        print(run_ours(args, size, root, layout), flush=True)


if __name__ == "__main__":
    main()
