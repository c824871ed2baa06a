"""Running ahead (rollout.steps_ahead, ppo.py's departure 8) on the main job: synchronous, one step ahead with the
engine in the trainer's process, and one step ahead against a vLLM server on a core of its own; seconds per step,
tokens per second, greedy validation after 40 steps; and a timing model, from the measured phase times, of a GPU
node split into generation and training devices.

    flock /tmp/heavy.lock .venv/bin/python bench/async_bench.py                 # the three runs, then the table
    .venv/bin/python bench/async_bench.py --table                               # the table of what has run
    .venv/bin/python bench/async_bench.py --runs k1_server --steps 3 --out /tmp/async_smoke --set data.val_max_samples=8

Each run is `ppo.py --config configs.yaml` (the demo: SmolLM2-135M, PPO with a critic, LoRA) with trainer.max_kl=0 (the
KL guard off, so that all reach the last step) in <out>/<run>/, its console in <out>/<run>.log; a finished run is not
run again. On a machine of C cores, k0 and k1_colocated use all of them; k1_server pins the server to the last core
(rollout.server.cpus) and the trainer to the others (taskset, OMP_NUM_THREADS). Seconds per step are medians over the
steps after the first two (engine warm-up) without a validation; timings from a shared machine are contended.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORES = os.cpu_count()
RUNS = {  # name → (what it is, its overrides, the trainer's cores)
    "k0": ("synchronous (steps_ahead=0), vLLM engine in the trainer's process", [], None),
    "k1_colocated": ("one step ahead, the engine in the trainer's process (a thread)", ["rollout.steps_ahead=1"], None),
    "k1_server": (f"one step ahead, a vLLM server on core {CORES - 1}, the trainer on the rest",
                  ["rollout.steps_ahead=1", "rollout.name=server", f"rollout.server.cpus={CORES - 1}",
                   "rollout.server.lora_push=merged"],  # vLLM's CPU LoRA kernels: 9× the base model's time
                  f"0-{CORES - 2}" if CORES > 2 else "0"),
}
PHASES = ["time/gen_s", "time/gen_wait_s", "time/reward_s", "time/trunk_s", "time/old_logprob_s", "time/ref_s",
          "time/values_s", "time/update_actor_s", "time/update_critic_s", "time/sync_s"]


def run(name: str, args) -> int:
    _, overrides, cores = RUNS[name]
    out = os.path.join(args.out, name)
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", *overrides, f"trainer.output_dir={out}",
           f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.steps}", f"trainer.seed={args.seed}",
           "trainer.max_kl=0", "trainer.save_freq=0", "trainer.plot_curves=false", "trainer.sample_freq=0", *args.set]
    threads = CORES if cores is None else max(1, CORES - 1)
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.log"), "a") as log:
        print(f"{name}: {' '.join(cmd)}", flush=True)
        return subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def figures(name: str, out: str) -> dict:
    """The run's medians over its steady steps, and its validations."""
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if r["step"] > 2 and "val/score/mean" not in r]
    vals = {r["step"]: r["val/score/mean"] for r in rows if "val/score/mean" in r}

    def median(key):
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else 0.0
    return {"step_s": median("time/step_s"), "tokens_per_s": median("perf/tokens_per_s"), "val": vals,
            "staleness_max": max((r.get("rollout/staleness_max", 0) for r in rows), default=0),
            "phases": {key: median(key) for key in PHASES}, "steps": max(r["step"] for r in rows)}


def timing_model(phases: dict, devices: int = 8) -> list[str]:
    """The step time of a node of `devices` GPUs from the synchronous run's phases: G = generation, T = the rest
    of a step but the weight sync. Colocated and synchronous, every device does both in turn: G + T + sync. Split, g
    devices generate one step ahead while devices − g train: max(G·(N/g)^a, T·(N/(N − g))^b) + push, at the best g,
    where a phase on d of the N devices takes (N/d)^exponent times its time on all N (1 = linear scaling; below 1
    where fewer devices run it more efficiently, as decoding does with larger batches per device), and the push
    between devices costs what the colocated sync did (both move every weight once). Assumed, not measured: the
    exponents, and that the phases' ratio on GPUs is the CPU's."""
    gen, push_s = phases["time/gen_s"], phases["time/sync_s"]
    rest = sum(v for k, v in phases.items() if k not in ("time/gen_s", "time/gen_wait_s", "time/sync_s"))
    sync_step = gen + rest + phases["time/sync_s"]
    lines = [f"G = {gen:.2f} s, T = {rest:.2f} s, sync = {phases['time/sync_s']:.2f} s: colocated synchronous "
             f"{sync_step:.2f} s/step on any N (the reference, 1.00×)",
             "| generation scaling a | training scaling b | best split (gen + train of 8) | s/step | × synchronous |",
             "| --- | --- | --- | --- | --- |"]
    for a, b in ((1.0, 1.0), (0.8, 1.0), (0.6, 1.0), (0.6, 0.9)):
        best = min(range(1, devices), key=lambda g: max(gen * (devices / g) ** a, rest * (devices / (devices - g)) ** b))
        step = max(gen * (devices / best) ** a, rest * (devices / (devices - best)) ** b) + push_s
        lines.append(f"| {a} | {b} | {best} + {devices - best} | {step:.2f} | {step / sync_step:.2f} |")
    return lines


def table(out: str) -> str:
    done = [n for n in RUNS if os.path.exists(os.path.join(out, n, "metrics.jsonl"))]
    figs = {n: figures(n, out) for n in done}
    lines = ["| run | s/step (median) | × k0 | tokens/s | val step 0 → last | staleness max | gen / wait / update "
             "actor+critic (s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    base = figs.get("k0", {}).get("step_s")
    for n, f in figs.items():
        p, vals = f["phases"], f["val"]
        ratio = f"{f['step_s'] / base:.2f}" if base else "–"
        val = " → ".join(f"{vals[s]:.3f}" for s in sorted(vals)) + f" (step {max(vals) if vals else '–'})"
        lines.append(f"| {RUNS[n][0]} (`{n}`) | {f['step_s']:.2f} | {ratio} | {f['tokens_per_s']:.0f} | {val} | "
                     f"{f['staleness_max']:.0f} | {p['time/gen_s']:.2f} / {p['time/gen_wait_s']:.2f} / "
                     f"{p['time/update_actor_s'] + p['time/update_critic_s']:.2f} |")
    if "k0" in figs:
        lines += ["", "Timing model (bench/async_bench.timing_model), from k0's phases:", ""]
        lines += timing_model(figs["k0"]["phases"])
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "async_bench"))
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every run")
    parser.add_argument("--table", action="store_true", help="only print the table of what has run")
    args = parser.parse_args()
    if not args.table:
        for name in args.runs:
            if run(name, args) != 0:
                print(f"{name} failed: see {os.path.join(args.out, name + '.log')}", file=sys.stderr)
    text = table(args.out)
    print(text)
    with open(os.path.join(args.out, "async_bench.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
