"""Write datasets as parquet files: the demos' rows (data.py makes them), or a jsonl file converted.

    python tools/prepare_data.py --task arithmetic --output data/arithmetic                 # the PPO demo
    python tools/prepare_data.py --task arithmetic-preferences --output data/preferences    # the reward-model demo
    python tools/prepare_data.py --task arithmetic-tool --output data/arithmetic_tool       # the agent demo (agents/multi_turn.py)
    python tools/prepare_data.py --task guess-number --output data/guess_number             # the environment demo
    python tools/prepare_data.py --input gsm8k_train.jsonl --output data/gsm8k --val-fraction 0.05 --seed 0
    python tools/prepare_data.py --task reasoning_gym:leg_counting --size 2200 --seed 0 --output data/leg_counting

`--task reasoning_gym:<name>` makes --size entries of one of reasoning-gym's tasks (`--task-config '{"max_animals":
3}'`: its keyword arguments), about --val-size of them in val.parquet, split by question (no val question is in
train.parquet); the rule reasoning_gym/* scores them with the task's own score_answer (reward_rules/).
`--task reasoning_gym:composite --task-config spec.yaml` mixes tasks by weight as reasoning-gym's composite dataset
does, the spec as reasoning-gym's CompositeConfig YAML (or the same as JSON) writes it: `datasets:` a list of
`{name: leg_counting, weight: 2, config: {…}}`; each row is its task's own (agents/reasoning_gym.py).
`--task verifiers:<path/to/env.py or module>` writes a verifiers environment's dataset (train) and eval dataset (val),
for rollout.multi_turn.env=verifiers:<the same> (agents/verifiers.py); `--task verifiers.v1:<taskset id>` a verifiers
0.4 taskset's tasks (the last --val-size in val), for rollout.multi_turn.env=verifiers.v1:<the same> (agents/verifiers_v1.py).

`--output` is always a folder: train.parquet and val.parquet are written inside it.
`--input` converts a jsonl file; the kind of row is detected from the first line's keys:
  ours        prompt (string or chat messages) [+ ground_truth, data_source, extra_info] → RL parquet
  GSM8K       question, answer ending in "#### <n>" → RL parquet, prompted as verl does
  preference  prompt, chosen, rejected [+ margin] → preference parquet
  HH-RLHF     chosen, rejected (full "\\n\\nHuman: … \\n\\nAssistant: …" texts) → preference parquet: the
              shared text through the last "\\n\\nAssistant:" is `prompt`, so prompt + chosen is the original
"""
import argparse
import json
import os
import random
import sys
from collections import Counter

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for data.py

from agents.reasoning_gym import make_reasoning_gym
from data import (check_prompt, DataError, ground_truth_of, make_arithmetic, make_arithmetic_preferences,
                  make_arithmetic_tool, make_guess_number, split_rows, write_parquet)

TASKS = {"arithmetic": make_arithmetic,  # with extra_info.answer: val/perplexity's text
         "arithmetic-preferences": make_arithmetic_preferences,
         "arithmetic-tool": make_arithmetic_tool, "guess-number": make_guess_number}  # and reasoning_gym:<name>
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's wording
HH_ASSISTANT = "\n\nAssistant:"


# ---- converting jsonl

def split_hh(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen reply, rejected reply): the shared text up to its last "\\n\\nAssistant:" is the prompt."""
    shared = os.path.commonprefix([chosen, rejected])
    cut = shared.rfind(HH_ASSISTANT)
    if cut < 0:
        raise ValueError('the two texts share no "\\n\\nAssistant:" turn')
    cut += len(HH_ASSISTANT)
    if "\n\nHuman:" in chosen[cut:] or "\n\nHuman:" in rejected[cut:]:
        raise ValueError("chosen and rejected differ before their final assistant reply")
    return chosen[:cut], chosen[cut:], rejected[cut:]


def row_kind(keys) -> str:
    """rl | gsm8k | preference | hh, from the keys of a jsonl row."""
    keys = set(keys)
    if {"prompt", "chosen", "rejected"} <= keys:
        return "preference"
    if {"chosen", "rejected"} <= keys:
        return "hh"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if "prompt" in keys:
        return "rl"
    raise ValueError(f"cannot tell the kind of row from its keys {sorted(keys)}; expected prompt[, ground_truth, "
                     f"data_source] | question, answer (GSM8K) | prompt, chosen, rejected | chosen, rejected (HH-RLHF)")


def convert_row(row: dict, kind: str, index: int) -> dict:
    """One jsonl row as a parquet row of its kind; raises ValueError saying what is wrong."""
    if row_kind(row.keys()) != kind:
        raise ValueError(f"this row is {row_kind(row.keys())} but the file's first row is {kind}")
    if kind == "gsm8k":
        answer = str(row["answer"])
        if "####" not in answer:
            raise ValueError('the GSM8K `answer` has no "#### <number>" line')
        gt = answer.split("####")[-1].strip().replace(",", "").replace("$", "")
        return {"prompt": f"{row['question']} {GSM8K_INSTRUCTION}", "ground_truth": gt, "data_source": "openai/gsm8k",
                "extra_info": {"index": index, "question": row["question"], "answer": answer}}
    if kind == "hh":
        prompt, chosen, rejected = split_hh(str(row["chosen"]), str(row["rejected"]))
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if kind == "preference":
        check_prompt(row["prompt"], "")
        if not (isinstance(row["chosen"], str) and isinstance(row["rejected"], str)):
            raise ValueError("`chosen` and `rejected` must be strings")
        out = {k: row[k] for k in ("prompt", "chosen", "rejected")}
        return {**out, "margin": float(row["margin"])} if row.get("margin") is not None else out
    check_prompt(row["prompt"], "")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise ValueError("`extra_info` must be an object")
    return {"prompt": row["prompt"], "ground_truth": ground_truth_of(row),
            "data_source": row.get("data_source") or "unknown", "extra_info": {"index": index, **extra_info}}


def convert_jsonl(path: str) -> list[dict]:
    """Every line of a jsonl file converted by the kind of its first row; a bad line raises naming it."""
    rows, kind = [], None
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("a line must hold one JSON object")
                kind = kind or row_kind(row.keys())
                rows.append(convert_row(row, kind, len(rows)))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise DataError(f"{path} line {n}: {e}") from None
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def write_split(train: list[dict], val: list[dict], folder: str) -> None:
    """Write folder/train.parquet and folder/val.parquet (skipped when val is empty) and say so."""
    for name, rows in (("train", train), ("val", val)):
        if rows:
            path = os.path.join(folder, f"{name}.parquet")
            write_parquet(rows, path)
            print(f"wrote {path} ({len(rows)} rows)")


def reasoning_gym_split(task: str, args) -> tuple[list[dict], list[dict]]:
    """--size rows of reasoning-gym's task, split by question: questions drawn at random (--seed) go to val with every
    row that asks them until val has --val-size rows, so that no val question is in train (an easy config repeats
    questions) and val's rows are distributed as train's."""
    try:  # JSON, or a YAML file (reasoning-gym's CompositeConfig files)
        config = read_yaml(args.task_config) if os.path.isfile(args.task_config) else json.loads(args.task_config)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise DataError(f"--task-config must be a JSON object of the task's keyword arguments, or a YAML file of "
                        f"them: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(config, dict):
        raise DataError(f"--task-config must be a JSON object of the task's keyword arguments, got {config!r}")
    if task == "composite":  # the composite's own size and seed are --size and --seed
        config = {k: v for k, v in config.items() if k not in ("size", "seed")}
    size = args.size or args.train_size + args.val_size
    if not 0 <= args.val_size < size:
        raise DataError(f"--val-size {args.val_size} must be below --size {size}")
    rows = make_reasoning_gym(task, size, args.seed, config, args.system_prompt, args.shots)
    asked = Counter(row["prompt"][-1]["content"] for row in rows)
    questions = list(asked)
    random.Random(args.seed).shuffle(questions)
    held, count = set(), 0
    for question in questions:
        if count >= args.val_size:
            break
        held.add(question)
        count += asked[question]
    if count >= size:
        raise DataError(f"reasoning_gym:{task} asks only {len(asked)} distinct questions in {size} rows: too few to "
                        f"hold out {args.val_size} rows; lower --val-size or widen --task-config")
    print(f"{len(asked)} distinct questions; {len(held)} of them held out for val ({count} rows)")
    return ([row for row in rows if row["prompt"][-1]["content"] not in held],
            [row for row in rows if row["prompt"][-1]["content"] in held])


def read_yaml(path: str):
    with open(path) as f:
        return yaml.safe_load(f)


def verifiers_split(target: str) -> tuple[list[dict], list[dict]]:
    """A verifiers environment's dataset and eval dataset as rows; a DataError when it cannot be loaded."""
    from agents import verifiers as environments_verifiers
    try:
        return environments_verifiers.dataset_rows(target, "train"), environments_verifiers.dataset_rows(target, "eval")
    except Exception as e:  # whatever the user's load_environment raises
        raise DataError(f"--task verifiers:{target}: loading the environment failed: {type(e).__name__}: {e}") from None


def verifiers_v1_split(target: str, val_size: int) -> tuple[list[dict], list[dict]]:
    """A verifiers 0.4 taskset's tasks as rows, the last val_size held out for val; a DataError when it cannot be
    loaded."""
    from agents import verifiers_v1
    try:
        rows = verifiers_v1.dataset_rows(target)
    except Exception as e:  # whatever the user's taskset raises
        raise DataError(f"--task verifiers.v1:{target}: loading the taskset failed: {type(e).__name__}: {e}") from None
    if len(rows) <= val_size:
        raise DataError(f"--task verifiers.v1:{target}: {len(rows)} tasks, and --val-size {val_size} would leave "
                        f"none for training; lower --val-size")
    return rows[:len(rows) - val_size], rows[len(rows) - val_size:]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="jsonl file to convert (kind detected from its rows)")
    parser.add_argument("--task", help=f"generate rows: {', '.join(TASKS)}, reasoning_gym:<name> or "
                                       f"verifiers:<path/to/env.py or module>, verifiers.v1:<taskset id>")
    parser.add_argument("--output", required=True, help="folder for train.parquet and val.parquet")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of --input rows held out as val")
    parser.add_argument("--train-size", type=int, default=2000, help="--task rows in train.parquet")
    parser.add_argument("--val-size", type=int, default=200, help="--task rows in val.parquet")
    parser.add_argument("--seed", type=int, default=0, help="seed for the demo rows or the train/val split")
    parser.add_argument("--size", type=int, help="reasoning_gym: entries in all (default --train-size + --val-size)")
    parser.add_argument("--task-config", default="{}", help="reasoning_gym: the task's keyword arguments, as JSON")
    parser.add_argument("--system-prompt", default="default",
                        help="reasoning_gym: which of reasoning_gym.utils.SYSTEM_PROMPTS the prompts start with")
    parser.add_argument("--shots", type=int, default=0, help="reasoning_gym: worked examples before each question")
    args = parser.parse_args(argv)
    if (args.input is None) == (args.task is None):
        parser.error("give exactly one of --input or --task")
    if args.output.endswith(".parquet"):
        parser.error(f"--output is a folder (train.parquet and val.parquet go inside), got {args.output}")
    try:
        if args.task and args.task.startswith("verifiers.v1:"):
            write_split(*verifiers_v1_split(args.task.removeprefix("verifiers.v1:"), args.val_size), args.output)
        elif args.task and args.task.startswith("verifiers:"):
            write_split(*verifiers_split(args.task.removeprefix("verifiers:")), args.output)
        elif args.task and args.task.startswith("reasoning_gym:"):
            write_split(*reasoning_gym_split(args.task.removeprefix("reasoning_gym:"), args), args.output)
        elif args.task:
            if args.task not in TASKS:
                parser.error(f"--task {args.task}: choose {', '.join(TASKS)}, reasoning_gym:<name> or "
                             f"verifiers:<path/to/env.py or module>")
            rows = TASKS[args.task](args.train_size + args.val_size, args.seed)
            write_split(rows[:args.train_size], rows[args.train_size:], args.output)
        elif not os.path.isfile(args.input):
            raise DataError(f"input file {args.input} does not exist")
        else:
            write_split(*split_rows(convert_jsonl(args.input), args.val_fraction, args.seed), args.output)
    except DataError as e:
        raise SystemExit(f"tools/prepare_data.py: {e}")


if __name__ == "__main__":
    main()
