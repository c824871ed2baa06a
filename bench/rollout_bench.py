"""Rollout throughput, HF generate against vLLM, on the same model and prompts. A benchmark, not a test.

    .venv/bin/python bench/rollout_bench.py                           # tiny and demo model, 64×1 and 8×8
    .venv/bin/python bench/rollout_bench.py --models tiny --shapes 8x8 --repeats 5

Each (model, backend) runs in its own process, so vLLM's thread pinning cannot slow the HF run. Both sample
at T=1 in --dtype (auto picks as rollout.dtype does; in bf16 HF autocasts over fp32 weights, as the trainer
does, and vLLM holds bf16 weights) with rollout.ignore_eos, so every response is --new-tokens long and both
backends do the same work. Engine start-up and one warm-up call are left out of the timing and printed beside
it; tokens/s is the median over --repeats calls. On a shared machine the load average (printed) moves these
figures more than anything.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DEMO = os.path.join(REPO, "models/SmolLM2-135M-Instruct")


class OneProcess:
    """What make_rollout reads from accelerate's Accelerator, for a single process."""
    is_main_process = True
    distributed_type = type("DistributedType", (), {"name": "NO"})

    @staticmethod
    def unwrap_model(model):
        return model


def run_one(model_dir: str, backend: str, n_prompts: int, n: int, new_tokens: int, repeats: int, dtype: str) -> dict:
    """Start one backend, warm it up, time `repeats` rollouts; return the figures."""
    import torch
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM

    from infra.cli import load_config
    from rollout import make_rollout
    from infra.models import load_tokenizer

    cfg = load_config(None, [f"model.path={model_dir}", f"rollout.name={backend}", f"rollout.dtype={dtype}",
                             f"rollout.max_response_length={new_tokens}", "rollout.ignore_eos=true",
                             "data.max_prompt_length=64", "rollout.micro_batch_size=64"])
    tokenizer = load_tokenizer(model_dir)  # pad = eos where the tokenizer has none, as ppo.py loads it
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i} + {i % 7}?"}],
                                                       add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"] for i in range(n_prompts)]
    t0 = time.perf_counter()
    autocast = torch.bfloat16 if dtype == "bf16" else None
    rollout = make_rollout(cfg, model, tokenizer, OneProcess(), autocast_dtype=autocast)
    startup = time.perf_counter() - t0
    syncs = []
    for _ in range(3 if backend == "vllm" else 0):
        t0 = time.perf_counter()
        rollout.sync_weights(model)
        syncs.append(time.perf_counter() - t0)
    rows = [{"prompt_ids": p} for p in prompts]  # the rows rollout.generate takes
    rollout.generate(rows[:2], 1, 1.0, seed=0)  # warm-up
    times, tokens = [], 0
    for r in range(repeats):
        t0 = time.perf_counter()
        out = rollout.generate(rows, n, 1.0, seed=r)
        times.append(time.perf_counter() - t0)
        tokens = int(out.response_mask.sum())
    return dict(startup_s=startup, sync_s=statistics.median(syncs) if syncs else None, tokens=tokens,
                seconds=statistics.median(times), tokens_per_s=tokens / statistics.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "demo"], help="tiny (built here) and/or demo")
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--shapes", nargs="+", default=["64x1", "8x8"], help="PROMPTSxSAMPLES")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                        help="auto: bf16 where it is fast (CUDA, AVX512-BF16, AMX), else fp32, as rollout.dtype")
    parser.add_argument("--one", nargs=4, metavar=("DIR", "BACKEND", "PROMPTS", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtype == "auto":
        from infra.batches import fast_bf16
        args.dtype = "bf16" if fast_bf16() else "fp32"
    if args.one:  # the child process
        model_dir, backend, n_prompts, n = args.one
        print("RESULT " + json.dumps(run_one(model_dir, backend, int(n_prompts), int(n), args.new_tokens,
                                             args.repeats, args.dtype)), flush=True)
        return

    dirs = {"demo": DEMO}
    if "tiny" in args.models:
        sys.path.insert(0, os.path.join(REPO, "tests"))
        from conftest import make_tiny_model
        dirs["tiny"] = make_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
    print(f"load average {os.getloadavg()[0]:.2f}, {args.new_tokens} new tokens, T=1, {args.dtype}, "
          f"median of {args.repeats}", flush=True)
    for name in args.models:
        for shape in args.shapes:
            n_prompts, n = shape.split("x")
            for backend in args.backends:
                cmd = [sys.executable, __file__, "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                       "--dtype", args.dtype, "--one", dirs[name], backend, n_prompts, n]
                env = dict(os.environ, OMP_NUM_THREADS="2")
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
                if not lines:
                    print(f"{name:5s} {shape:5s} {backend:4s} failed (exit {out.returncode}):\n{out.stderr[-2000:]}",
                          flush=True)
                    continue
                r = json.loads(lines[0][len("RESULT "):])
                sync = f"  sync {r['sync_s']:.2f} s" if r["sync_s"] is not None else ""
                print(f"{name:5s} {shape:5s} {backend:4s} {r['tokens_per_s']:8.1f} tokens/s  ({r['tokens']} tokens "
                      f"in {r['seconds']:.2f} s)  start-up {r['startup_s']:.1f} s{sync}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
