"""Benchmark the shared trunk (issue 25) on the main job: seconds per step by phase and peak RSS, with and without it.

    .venv/bin/python bench/trunk_bench.py                          # the main job (configs.yaml), 20 steps each way
    .venv/bin/python bench/trunk_bench.py --steps 60 --repeat 2    # `make run`'s 60 steps, each way twice, alternating
    .venv/bin/python bench/trunk_bench.py --steps 3 --override rollout.name=hf   # a quick check that it works

Each run is `python ppo.py --config configs.yaml` as `make run` runs it (every core's OpenMP thread unless --threads),
with trainer.total_steps=--steps, a fresh output folder under --workdir, checkpoints only at the end, and
model.share_trunk=true or false; --override adds keys to both. On a CPU vLLM runs inside that process, so its peak RSS
(os.wait4's ru_maxrss) is the whole job's.

Prints for each setting the median over steps 2..N (step 1 is warm-up) of every time/* key ppo.py logs — gen, reward,
trunk (the shared layers' one pass), old_logprob, ref, values, update_actor, update_critic, sync, step — its peak RSS,
and the validation scores of its last step (ppo.py validates at the end); then, as its last line:

    TRUNK steps=N step_s_whole=X step_s_shared=Y ratio=Y/X peak_rss_mb_whole=A peak_rss_mb_shared=B machine="…"

Measure on an idle machine: other processes on the cores change both figures (a shared 2-core machine made steps
several times slower). --repeat alternates the two settings so that a drift in the machine's load hits both alike.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import sys

from workload import REPO, run_child

SETTINGS = {"whole": "model.share_trunk=false", "shared": "model.share_trunk=true"}


def machine() -> str:
    """The CPU (and GPU) this ran on, and the core count."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    try:
        import torch
        gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    except ImportError:
        gpu = ""
    return f"{cpu}, {os.cpu_count()} cores{gpu}"


def run_once(args, name: str, index: int) -> dict:
    """One ppo.py run of a setting; its per-step metrics (steps 2..N) and peak RSS."""
    out = os.path.join(args.workdir, f"{name}_{index}")
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume
    os.makedirs(out)
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", f"trainer.total_steps={args.steps}",
           f"trainer.output_dir={out}", "trainer.save_freq=0", "trainer.plot_curves=false", SETTINGS[name],
           *args.override]
    threads = args.threads or os.cpu_count()  # as `make run`: accelerate launch would otherwise set 1
    rss = run_child(cmd, os.path.join(out, "log.txt"), threads)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    return dict(steps=[m for m in metrics if m["step"] > 1], last=metrics[-1], rss=rss)


def summary(name: str, runs: list) -> dict:
    """Medians over the runs' steps of every time/* key, the largest peak RSS, the last validation scores."""
    steps = [m for r in runs for m in r["steps"]]
    phases = sorted({k for m in steps for k in m if k.startswith("time/")})
    medians = {k[5:-2]: statistics.median(m[k] for m in steps if k in m) for k in phases}
    val = {k: v for k, v in runs[-1]["last"].items() if k.startswith("val/") and k.endswith("/mean")}
    rss = max(r["rss"] for r in runs)
    print(f"{name:6s} " + "  ".join(f"{k} {v:.3f}" for k, v in medians.items()) + f"  peak_rss_mb {rss:.0f}  "
          + "  ".join(f"{k} {v:.4f}" for k, v in sorted(val.items())), flush=True)
    return dict(step=medians["step"], rss=rss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="PPO steps per run; step 1 is warm-up, not counted")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each setting, alternating whole and shared")
    parser.add_argument("--threads", type=int, default=0, help="OpenMP threads (0: one per core, as make run)")
    parser.add_argument("--workdir", default=os.path.join(REPO, "outputs", "trunk_bench"), help="the runs' folders")
    parser.add_argument("--override", action="append", default=[], help="extra ppo.py key=value for both runs")
    args = parser.parse_args()
    if args.steps < 2:
        sys.exit("trunk_bench.py: --steps must be at least 2 (step 1 is warm-up and not counted)")
    runs = {name: [] for name in SETTINGS}
    for index in range(args.repeat):
        for name in SETTINGS:
            runs[name].append(run_once(args, name, index))
    whole, shared = (summary(name, runs[name]) for name in SETTINGS)
    print(f"TRUNK steps={args.steps} repeat={args.repeat} step_s_whole={whole['step']:.3f} "
          f"step_s_shared={shared['step']:.3f} ratio={shared['step'] / whole['step']:.3f} "
          f"peak_rss_mb_whole={whole['rss']:.0f} peak_rss_mb_shared={shared['rss']:.0f} machine=\"{machine()}\"")


if __name__ == "__main__":
    main()
