"""reasoning-gym's tasks as data and reward: tools/prepare_data.py --task reasoning_gym:<name> writes rows that the
built-in rule reasoning_gym/* scores exactly as reasoning-gym itself scores the same entries and answers."""
import functools
import json
import os

import pytest

import data
import rewards
from conftest import make_tokenizer
from infra.config_rl import RewardConfig
from reward_rules import reasoning_gym_rules
from test_verl_rewards import outcome
from tools import prepare_data

reasoning_gym = pytest.importorskip("reasoning_gym")
from reasoning_gym.factory import DATASETS  # noqa: E402 (after the skip)
from reasoning_gym.utils import extract_answer  # noqa: E402

SEED, N = 5, 1
REFUSED = {"arc_agi", "rearc"}  # their metadata holds tuples, which JSON turns into lists: the score changes
TASKS = sorted(set(DATASETS) - REFUSED - {"composite"})  # composite: one row per task it mixes, as each task is here


def responses(answer: str) -> list[str]:
    """What a model might write: the right answer in tags, with reasoning around, twice (the last counts), off by
    one character, empty tags, no tags (malformed), and a tag left open."""
    return [f"<answer>{answer}</answer>", f"Let me think.\n<answer> {answer} </answer>\nDone.",
            f"<answer>wrong</answer> then <answer>{answer}</answer>", f"<answer>{answer}</answer><answer>x</answer>",
            f"<answer>{answer[:-1]}</answer>", f"<answer>{answer}0</answer>", "<answer></answer>", answer,
            f"<answer>{answer}"]


def test_scores_equal_reasoning_gyms_own_on_every_task():
    """For every task reasoning-gym registers (less the two refused), the rows prepare_data writes score each
    response exactly as the task's own score_answer scores reasoning_gym.utils.extract_answer(response) against
    the entry reasoning-gym made (the same value, or the same exception)."""
    wrong = []
    for task in TASKS:
        theirs = reasoning_gym.create_dataset(task, seed=SEED, size=N)
        for row, entry in zip(prepare_data.make_reasoning_gym(task, N, SEED, {}), list(theirs)):
            assert row["data_source"] == f"reasoning_gym/{task}"
            assert row["prompt"][-1]["content"] == entry["question"]
            for response in responses(str(entry["answer"])):
                want = outcome(lambda: float(theirs.score_answer(extract_answer(response), entry)))
                got = outcome(lambda: rewards.default_compute_score(row["data_source"], response,
                                                                   row["ground_truth"])["score"])
                if want != got:
                    wrong.append((task, entry["question"][:40], response[:60], want, got))
    assert not wrong, wrong[:10]


def test_hand_computed_leg_counting_scores():
    """leg_counting's entry 0 with seed 0 has answer 500 (checked here); its score_answer gives 1 for "500" in
    tags, len("500")/len(answer) when the answer merely holds it, 0 for another number or no tags, and the rule reads
    the last <answer> of the response."""
    row = prepare_data.make_reasoning_gym("leg_counting", 1, 0, {})[0]
    assert json.loads(row["ground_truth"])["entry"]["answer"] == "500"

    def score(text):
        return rewards.default_compute_score("reasoning_gym/leg_counting", text, row["ground_truth"])

    assert score("<answer>500</answer>") == {"score": 1.0, "pred": "500"}
    assert score("<answer>5000</answer>")["score"] == 0.75
    assert score("<answer>499</answer>")["score"] == 0.0
    assert score("The answer is 500.") == {"score": 0.0, "pred": ""}
    assert score("<answer>500</answer> no, <answer>4</answer>")["score"] == 0.0


def test_the_rule_scores_with_the_config_the_rows_were_made_with():
    """decimal_arithmetic's score_answer accepts an answer within 10^-max_num_decimal_places: with the rows made at 1
    decimal place, an answer off by 0.05 is right (as reasoning-gym scores it with that config), where the default
    config's tolerance would call it wrong."""
    config = {"max_num_decimal_places": 1, "min_num_decimal_places": 1}
    row = prepare_data.make_reasoning_gym("decimal_arithmetic", 1, 3, config)[0]
    entry = json.loads(row["ground_truth"])["entry"]
    near = f"<answer>{float(entry['answer']) + 0.05:.2f}</answer>"
    theirs = reasoning_gym.create_dataset("decimal_arithmetic", seed=3, size=1, **config)
    default = reasoning_gym.create_dataset("decimal_arithmetic", seed=3, size=1)
    assert theirs.score_answer(extract_answer(near), entry) == 1.0 > default.score_answer(extract_answer(near), entry)
    assert rewards.default_compute_score(row["data_source"], near, row["ground_truth"])["score"] == 1.0


def test_routing_and_bad_ground_truths():
    """reasoning_gym/<anything> routes to the rule by prefix; a ground truth that is not the {task, config, entry}
    JSON prepare_data writes is a ValueError saying what it should be (an error for its sample, not a 0)."""
    assert rewards.rule_for("reasoning_gym/leg_counting") is reasoning_gym_rules.reasoning_gym_score
    assert rewards.rule_for("reasoning_gymnastics") is None
    for bad in ["500", '{"task": "leg_counting"}', "not json"]:
        with pytest.raises(ValueError, match="JSON text of {task, config, entry}"):
            rewards.default_compute_score("reasoning_gym/leg_counting", "<answer>1</answer>", bad)


def test_prepare_data_splits_by_question_and_refuses_what_it_cannot_score(tmp_path, capsys):
    """--size rows in all, split by question: val gets every row of the questions drawn for it (at least --val-size
    rows) and train the rest, so no val question is in train even where the config repeats questions (leg_counting
    with one animal of one kind, at most 2: a few dozen questions); an unknown task, a config the task refuses, and a
    task whose entries JSON changes each stop with one sentence naming the fix."""
    out = tmp_path / "lc"
    prepare_data.main(["--task", "reasoning_gym:leg_counting", "--size", "40", "--val-size", "10", "--seed", "1",
                       "--task-config", '{"min_animals": 1, "max_animals": 1, "max_instances": 2}',
                       "--output", str(out)])
    train, val = (data.read_parquet(str(out / f"{name}.parquet"), ["prompt"]).to_pylist() for name in ("train", "val"))
    questions = [{r["prompt"][-1]["content"] for r in rows} for rows in (train, val)]
    assert len(train) + len(val) == 40 and len(val) >= 10 and not questions[0] & questions[1]
    assert len(questions[0]) + len(questions[1]) < 40 and "held out for val" in capsys.readouterr().out
    assert {r["data_source"] for r in train + val} == {"reasoning_gym/leg_counting"}
    for args, sentence in [(["reasoning_gym:leg_countin"], "has no task 'leg_countin'; did you mean leg_counting"),
                           (["reasoning_gym:leg_counting", "--task-config", '{"legs": 3}'], "refused the config"),
                           (["reasoning_gym:leg_counting", "--task-config", "[1]"], "must be a JSON object"),
                           (["reasoning_gym:arc_agi", "--size", "3", "--val-size", "1"], "this task is not supported")]:
        with pytest.raises(SystemExit, match=sentence):
            prepare_data.main(["--task", *args, "--output", str(tmp_path / "x")])
    assert not os.path.exists(tmp_path / "x")


def test_prepared_rows_pass_ppos_start_up_checks_and_score_without_errors(tmp_path):
    """The rows prepare_data writes load as ppo.py loads them (load_rl_dataset with the rule's ground-truth check,
    check_data_sources with no reward.function) and the default reward scores every one without an error."""
    prepare_data.main(["--task", "reasoning_gym:leg_counting", "--size", "8", "--val-size", "0", "--seed", "0",
                       "--output", str(tmp_path)])
    tokenizer = make_tokenizer()
    rule_of = functools.partial(rewards.rule_needing_truth, cfg_reward=RewardConfig())
    rows, stats = data.load_rl_dataset(str(tmp_path / "train.parquet"), tokenizer, 4096, "error", rule_of)
    rewards.check_data_sources({r["data_source"] for r in rows}, RewardConfig())
    answers = [f"<answer>{json.loads(r['ground_truth'])['entry']['answer']}</answer>" for r in rows]
    scores, extras, errors = rewards.score_responses(rewards.default_compute_score, rows, answers)
    assert stats["kept"] == 8 and errors == 0 and scores == [1.0] * 8 and extras["pred"] == [a[8:-9] for a in answers]


# reasoning-gym's CompositeConfig YAML, as its docs write one (size and seed are --size and --seed here)
COMPOSITE_YAML = """size: 100
seed: 42
datasets:
  - name: leg_counting
    weight: 2
    config:
      max_animals: 3
  - name: basic_arithmetic
    weight: 1
    config:
      min_terms: 2
      max_terms: 3
  - name: decimal_arithmetic
    weight: 1
    config:
      max_num_decimal_places: 1
      min_num_decimal_places: 1
"""


def test_composite_rows_score_as_reasoning_gyms_composite_scores_them(tmp_path):
    """--task reasoning_gym:composite with reasoning-gym's own composite YAML: the rows are the entries of
    create_dataset("composite", datasets=[DatasetSpec(…)]) in order, each task drawn by its weight, and every row
    scores each response exactly as the composite's score_answer scores it (it forwards to the task's dataset, made
    with the config the composite gave it: decimal_arithmetic's tolerance reads it)."""
    import yaml
    from reasoning_gym.composite import DatasetSpec
    (tmp_path / "mix.yaml").write_text(COMPOSITE_YAML)
    n, seed = 24, 7
    prepare_data.main(["--task", "reasoning_gym:composite", "--task-config", str(tmp_path / "mix.yaml"), "--size",
                       str(n), "--val-size", "4", "--seed", str(seed), "--output", str(tmp_path / "out")])
    rows = [r for name in ("train", "val") for r in data.read_parquet(str(tmp_path / "out" / f"{name}.parquet"),
                                                                      ["prompt"]).to_pylist()]
    specs = [DatasetSpec(**d) for d in yaml.safe_load(COMPOSITE_YAML)["datasets"]]
    theirs = reasoning_gym.create_dataset("composite", seed=seed, size=n, datasets=specs)
    entries = {e["question"]: e for e in theirs}
    assert len(rows) == n and {r["prompt"][-1]["content"] for r in rows} == set(entries)
    assert {r["data_source"] for r in rows} == {f"reasoning_gym/{s.name}" for s in specs}  # all three drawn
    wrong = []
    for row in rows:
        entry = entries[row["prompt"][-1]["content"]]
        for response in responses(str(entry["answer"])):
            want = outcome(lambda: float(theirs.score_answer(extract_answer(response), entry)))
            got = outcome(lambda: rewards.default_compute_score(row["data_source"], response,
                                                               row["ground_truth"])["score"])
            if want != got:
                wrong.append((row["data_source"], response[:60], want, got))
    assert not wrong, wrong[:10]
    for config, sentence in [('{"datasets": [{"name": "leg_countin", "weight": 1}]}', "refused the composite"),
                             ('{"datasets": [{"task": "leg_counting"}]}', "datasets: a list of {name, weight, config}"),
                             ('{"datasets": [{"name": "leg_counting", "weight": -1}]}', "refused the composite")]:
        with pytest.raises(SystemExit, match=sentence):
            prepare_data.main(["--task", "reasoning_gym:composite", "--task-config", config, "--size", "4",
                               "--val-size", "1", "--output", str(tmp_path / "x")])
    assert not os.path.exists(tmp_path / "x")


def test_composite_rows_train_one_step_with_reasoning_gyms_scores(tmp_path):
    """The composite's rows through ppo.py: the start-up checks pass (each task's rule is built in), one step runs on
    the tiny model and the reward arrives from reasoning-gym's scoring without an error."""
    import subprocess
    import sys
    from conftest import make_tiny_model, read_metrics, REPO
    (tmp_path / "mix.yaml").write_text(COMPOSITE_YAML)
    prepare_data.main(["--task", "reasoning_gym:composite", "--task-config", str(tmp_path / "mix.yaml"), "--size",
                       "12", "--val-size", "2", "--system-prompt", "direct", "--output", str(tmp_path / "d")])
    model = make_tiny_model(tmp_path / "model")
    proc = subprocess.run(
        [sys.executable, "ppo.py", "--config", "configs.yaml", f"model.path={model}",
         f"data.train_files={tmp_path}/d/train.parquet", "data.val_files=null", "rollout.name=hf",
         "rollout.max_response_length=8", "data.max_prompt_length=400", "data.truncation=left",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.total_steps=1",
         "trainer.save_freq=0", "trainer.test_freq=0", "trainer.sample_freq=0", "trainer.plot_curves=false",
         "trainer.val_before_train=false", "trainer.max_kl=0", f"trainer.output_dir={tmp_path}/out",
         "model.dtype=fp32"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    step = [line for line in read_metrics(tmp_path / "out") if line["step"] == 1][0]
    assert step["reward/errors"] == 0 and "reward/rule/mean" in step
