"""Ours (bench/ppo_bench.py, .venv) against TRL 1.12's PPOTrainer (bench/trl_bench.py, .venv-trl): one table.

    .venv/bin/python bench/compare.py                          # both presets, as shipped and GC-frozen, 20 steps
    .venv/bin/python bench/compare.py --wait-quiet 40          # first wait (≤ 40 min) for load average < 0.5
    .venv/bin/python bench/compare.py --steps 3 --presets default    # a smoke run
    .venv/bin/python bench/compare.py --packing                # also ours, --vary-lengths, layouts padded/packed/shared

Goal: ours ≤ half of TRL's seconds per step with the garbage collector frozen for both, at both presets.
Runs are interleaved (ours, TRL, ours, TRL, …) so that a change in the machine's load hits both alike;
--repeats R runs each R times and keeps the median. The load average is printed before and after, since
on a shared machine it decides the figures more than anything here.
"""
import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = [os.path.join(REPO, ".venv/bin/python"), os.path.join(REPO, "bench/ppo_bench.py")]
TRL = [os.path.join(REPO, ".venv-trl/bin/python"), os.path.join(REPO, "bench/trl_bench.py")]


def wait_quiet(minutes: float, threshold: float = 0.5) -> None:
    """Poll the 1-minute load average every minute until it is below threshold, or give up after `minutes`."""
    deadline = time.time() + 60 * minutes
    while os.getloadavg()[0] >= threshold and time.time() < deadline:
        print(f"waiting for a quiet machine: load average {os.getloadavg()[0]:.2f}", flush=True)
        time.sleep(60)


def run(cmd: list[str]) -> dict:
    """Run one bench script; its last line `NAME key=value …` as a dict (one per layout)."""
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"compare.py: {' '.join(cmd[1:])} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PPO ", "TRL "))]
    phases = [line for line in proc.stdout.splitlines() if line.startswith("phases")]
    results = [dict(kv.split("=", 1) for kv in line.split()[1:]) for line in lines]
    for r, p in zip(results, phases or [None] * len(results)):
        r["phases"] = p
    return results


def median_of(runs: list[list[dict]]) -> list[dict]:
    """Per line position, the run whose seconds_per_step is the median."""
    out = []
    for same in zip(*runs):
        ordered = sorted(same, key=lambda r: float(r["seconds_per_step"]))
        out.append(ordered[(len(ordered) - 1) // 2])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--presets", nargs="+", default=["default", "large"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--wait-quiet", type=float, default=0, help="minutes to wait for load average < 0.5")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    parser.add_argument("--layout", default="shared", choices=["shared", "padded", "packed"],
                        help="ours' training-forward layout in the TRL comparison (bench/ppo_bench.py --layout)")
    parser.add_argument("--packing", action="store_true",
                        help="also ours with --vary-lengths, layouts padded, packed and shared")
    args = parser.parse_args()
    if args.wait_quiet:
        wait_quiet(args.wait_quiet)
    load_before = os.getloadavg()
    rows, extra = [], []
    for preset in args.presets:
        for gc in ([], ["--gc-freeze"]):
            common = ["--preset", preset, "--steps", str(args.steps), "--threads", str(args.threads), *gc]
            ours, trl = [], []
            for _ in range(args.repeats):
                ours.append(run(OURS + common + ["--layout", args.layout]))
                trl.append(run(TRL + common))
            rows.append((preset, "frozen" if gc else "shipped", median_of(ours)[0], median_of(trl)[0]))
            print(f"done: {preset} gc={rows[-1][1]}: ours {[r[0]['seconds_per_step'] for r in ours]} s/step, "
                  f"TRL {[r[0]['seconds_per_step'] for r in trl]} s/step", flush=True)
        if args.packing:
            extra += [(preset, r) for r in run(OURS + ["--preset", preset, "--steps", str(args.steps),
                                                       "--threads", str(args.threads),
                                                       "--gc-freeze", "--vary-lengths", "--layout", "padded", "packed",
                                                       "shared"])]
    load_after = os.getloadavg()

    print(f"\nload average before {load_before[0]:.2f}/{load_before[1]:.2f}, "
          f"after {load_after[0]:.2f}/{load_after[1]:.2f} (1/5 min); {os.cpu_count()} cores, threads per run "
          f"{args.threads or 'default'}; steps={args.steps}, "
          f"step 1 not timed; median of {args.repeats}\n")
    head = f"{'preset':8} {'gc':8} {'ours s/step':>11} {'TRL s/step':>10} {'ours/TRL':>8} " \
           f"{'ours tok/s':>10} {'TRL tok/s':>9} {'ours RSS MB':>11} {'TRL RSS MB':>10}"
    print(head + "\n" + "-" * len(head))
    for preset, gc, o, t in rows:
        ratio = float(o["seconds_per_step"]) / float(t["seconds_per_step"])
        print(f"{preset:8} {gc:8} {float(o['seconds_per_step']):11.3f} {float(t['seconds_per_step']):10.3f} "
              f"{ratio:8.2f} {float(o['tokens_per_s']):10.0f} {float(t['tokens_per_s']):9.0f} "
              f"{o['peak_rss_mb']:>11} {t['peak_rss_mb']:>10}")
    for preset, r in extra:
        print(f"{preset:8} ours vary_lengths layout={r['layout']:6}: {float(r['seconds_per_step']):.3f} s/step, "
              f"{float(r['tokens_per_s']):.0f} tok/s, training phases {float(r['train_tokens_per_s']):.0f} tok/s, "
              f"{r['peak_rss_mb']} MB")
    for preset in dict.fromkeys(p for p, _ in extra):  # in the order run
        by = {r["layout"]: float(r["train_tokens_per_s"]) for p, r in extra if p == preset}
        gain = by["packed"] / by["padded"] - 1
        print(f"goal packed ≥ 1.2 × padded training tokens/s, {preset}: {'MET' if gain >= 0.2 else 'NOT MET'} "
              f"({gain:+.0%}; shared {by['shared'] / by['padded'] - 1:+.0%})")
    print("\nmean seconds per step by phase:")
    for preset, gc, o, t in rows:
        for name, r in (("ours", o), ("TRL", t)):
            print(f"  {preset:8} {gc:8} {name:4} {(r['phases'] or ':?').split(':', 1)[1].strip()}")
    print()
    for preset, gc, o, t in rows:
        if gc == "frozen":
            ratio = float(o["seconds_per_step"]) / float(t["seconds_per_step"])
            print(f"goal ours ≤ ½ TRL, GC frozen, {preset}: {'MET' if ratio <= 0.5 else 'NOT MET'} ({ratio:.2f})")


if __name__ == "__main__":
    main()
