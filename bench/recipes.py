"""The recipe table: the demo job (make run's) trained by each recipe for 40 steps from the same seed, and what came of
it: greedy validation before training, at step 20 and at step 40, seconds per step, KL, minutes of training.

    .venv/bin/python bench/recipes.py                                  # every recipe, 40 steps each; then the table
    .venv/bin/python bench/recipes.py --recipes grpo dapo              # a subset
    .venv/bin/python bench/recipes.py --table                          # only print the table of what has run
    .venv/bin/python bench/recipes.py --recipes grpo --steps 2 --test-freq 1 --out outputs/recipes_smoke \
        --set rollout.name=hf data.val_max_samples=16                  # a 2-step smoke run

Each recipe runs `accelerate launch ppo.py --config <its file> <its overrides>` in its own output folder
(<out>/<recipe>/), with trainer.max_kl=0 (the KL guard off, so that every recipe reaches step 40; its KL is in the
table instead) and a checkpoint every 10 steps. It is resumable per recipe: a recipe whose run finished is not run
again (ppo.py itself sees final/ at total_steps), and one that was stopped resumes from its latest checkpoint. The
table is printed (Markdown) at the end and written to <out>/recipes.md; <out>/recipes.json holds the same figures.
Timing is only meaningful on an idle machine: say which one, and whether it was shared.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name → (what it is, with its paper; its config file; its command-line overrides). The config file is configs.yaml
# (the defaults) where the recipe is one key, else its own file in recipes/, which holds only its changes.
RECIPES = {
    "ppo": ("the main job: PPO with a critic, GAE (Schulman et al., 2017)", "configs.yaml", []),
    "grpo": ("GRPO (Shao et al., 2024)", "configs.yaml", ["algorithm.adv_estimator=grpo"]),
    "dapo": ("DAPO (Yu et al., 2025): clip-higher, dynamic sampling, overlong shaping", "recipes/dapo.yaml", []),
    "dr_grpo": ("Dr. GRPO (Liu et al., 2025): no std, constant normaliser", "recipes/dr_grpo.yaml", []),
    "gspo": ("GSPO (Zheng et al., 2025): one ratio per response", "recipes/gspo.yaml", []),
    "cispo": ("CISPO (MiniMax-M1, 2025): clipped stop-gradient weight", "recipes/cispo.yaml", []),
    "rloo": ("RLOO (Ahmadian et al., 2024)", "configs.yaml", ["algorithm.adv_estimator=rloo"]),
    "reinforce_plus_plus": ("REINFORCE++ (Hu et al., 2025), KL in the reward", "recipes/reinforce_plus_plus.yaml", []),
    "reinforce_plus_plus_baseline": ("REINFORCE++-baseline (Hu et al., 2025)", "configs.yaml",
                                     ["algorithm.adv_estimator=reinforce_plus_plus_baseline"]),
}


def command(recipe: str, out: str, args) -> list[str]:
    """The launch line of one recipe's run."""
    _, config_file, overrides = RECIPES[recipe]
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "ppo.py",
            "--config", config_file, *overrides, f"trainer.output_dir={out}", f"trainer.total_steps={args.steps}",
            f"trainer.test_freq={args.test_freq}", f"trainer.seed={args.seed}", "trainer.max_kl=0",
            "trainer.save_freq=10", "trainer.plot_curves=false", *args.set]


def run(recipe: str, args) -> int:
    """One recipe's run (or its resumption); its exit code. Its console output goes to <out>/<recipe>.log."""
    out = os.path.join(args.out, recipe)
    os.makedirs(args.out, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}  # as make run
    with open(os.path.join(args.out, f"{recipe}.log"), "a") as log:
        print(f"{recipe}: {' '.join(command(recipe, out, args)[3:])}", flush=True)
        proc = subprocess.run(command(recipe, out, args), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc.returncode


def summary(recipe: str, args) -> dict:
    """The figures of one recipe's metrics.jsonl (None for what it has not logged yet)."""
    path = os.path.join(args.out, recipe, "metrics.jsonl")
    lines = []
    if os.path.exists(path):
        with open(path) as f:
            lines = [json.loads(line) for line in f]
    val = {line["step"]: line["val/score/mean"] for line in lines if "val/score/mean" in line}
    steps = [line for line in lines if line["step"] > 0]
    step_s = [line["time/step_s"] for line in steps[1:]]  # step 1 warms up
    last_kl = [line.get("kl/mean", 0.0) for line in steps[-10:]]
    return {"recipe": recipe, "what": RECIPES[recipe][0], "steps": len(steps),
            "val_0": val.get(0), f"val_{args.test_freq}": val.get(args.test_freq),
            f"val_{2 * args.test_freq}": val.get(2 * args.test_freq),
            "s_per_step": statistics.median(step_s) if step_s else None,
            "kl_last_10": sum(last_kl) / len(last_kl) if last_kl else None,
            "train_min": sum(line["time/step_s"] for line in steps) / 60 if steps else None}


def table(rows: list[dict], args) -> str:
    t1, t2 = args.test_freq, 2 * args.test_freq

    def cell(x, fmt):
        return "–" if x is None else format(x, fmt)
    lines = [f"| recipe | val step 0 | val step {t1} | val step {t2} | s/step (median) | kl/mean (last 10 steps) | "
             f"training min |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['what']} (`{r['recipe']}`) | {cell(r['val_0'], '.3f')} | {cell(r[f'val_{t1}'], '.3f')} | "
                     f"{cell(r[f'val_{t2}'], '.3f')} | {cell(r['s_per_step'], '.2f')} | {cell(r['kl_last_10'], '.4f')} "
                     f"| {cell(r['train_min'], '.1f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES), metavar="NAME",
                        help=f"which to run (default: all): {', '.join(RECIPES)}")
    parser.add_argument("--steps", type=int, default=40, help="training steps per recipe")
    parser.add_argument("--test-freq", type=int, default=20, help="validate every N steps (the table's columns)")
    parser.add_argument("--seed", type=int, default=1, help="trainer.seed, the same for every recipe")
    parser.add_argument("--out", default="outputs/recipes", help="one folder per recipe under it, and the table")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides, for every recipe")
    parser.add_argument("--table", action="store_true", help="print the table of what has run, run nothing")
    args = parser.parse_args()
    failed = [] if args.table else [recipe for recipe in args.recipes if run(recipe, args) != 0]
    rows = [summary(recipe, args) for recipe in args.recipes]
    text = table(rows, args)
    print(text)
    if os.path.isdir(args.out):
        with open(os.path.join(args.out, "recipes.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "recipes.json"), "w") as f:
            json.dump(rows, f, indent=1)
    if failed:
        sys.exit(f"bench/recipes.py: {', '.join(failed)} failed; see {args.out}/<recipe>.log")
