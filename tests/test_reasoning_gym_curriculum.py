"""reasoning-gym's curricula through data.curriculum (agents/reasoning_gym.py): a curriculum file as
reasoning-gym's training configs write it makes the rows its CurriculumExperiment makes, scored as reasoning-gym
scores them, with levels that move as its trainer moves them; a ppo.py run raises them, saves them and resumes them."""
import json
import subprocess
import sys
import types

import pytest

import rewards
from conftest import free_port, make_tiny_model, make_tokenizer, read_metrics, REPO
from data import DataError
from agents.reasoning_gym import Curriculum, read_spec

reasoning_gym = pytest.importorskip("reasoning_gym")
from reasoning_gym.coaching import (CurriculumAttributeConfig, CurriculumExperiment,  # noqa: E402 (after the skip)
                                    CurriculumExperimentConfig)
from reasoning_gym.utils import extract_answer, SYSTEM_PROMPTS  # noqa: E402

# reasoning-gym's training/configs/curriculum/spell_backward.yaml (0.1.25), its reasoning_gym: and curriculum: blocks
# as written there (the verl keys after them are not read), the size cut for a test and a second task added
SPELL_BACKWARD = """\
reasoning_gym:
  dataset_size: {size}
  developer_prompt: DeepSeekZero
  datasets:
curriculum:
    enabled: True
    schedule:
      automatic: {automatic}
      update_steps: 1
    last_k: {last_k}
    success_threshold: 0.70
    failure_threshold: 0.10
    curricula:
      spell_backward:
        attribute_levels:
          word_len: 0
      basic_arithmetic:
        attribute_levels:
          "*": 0
        weight: 0.5
data:
  max_prompt_length: 512
"""
DATA = types.SimpleNamespace(max_prompt_length=4000, truncation="error", val_max_samples=6, train_batch_size=4)


def write_spec(path, size=60, automatic=False, last_k=4) -> str:
    path.write_text(SPELL_BACKWARD.format(size=size, automatic=automatic, last_k=last_k))
    return str(path)


def theirs(size: int, seed: int) -> CurriculumExperiment:
    """reasoning-gym's own experiment for SPELL_BACKWARD, its tasks seeded as the curriculum seeds them."""
    config = CurriculumExperimentConfig(curricula={
        "spell_backward": CurriculumAttributeConfig(attribute_levels={"word_len": 0}),
        "basic_arithmetic": CurriculumAttributeConfig(attribute_levels={"*": 0}, weight=0.5)})
    experiment = CurriculumExperiment("theirs", config, size, seed=seed)
    for i, task in enumerate(["spell_backward", "basic_arithmetic"]):
        experiment.composite.update_dataset_config(task, {"seed": seed + i + 1})
    return experiment


def score(row, text) -> float:
    return rewards.default_compute_score(row["data_source"], text, row["ground_truth"])["score"]


def test_rows_are_reasoning_gyms_entries_at_each_level_and_score_as_it_scores_them(tmp_path):
    """Row i is the experiment's entry i (the developer prompt, the question), before and after a level move made
    both ways (ours: Curriculum.move; reasoning-gym's: update_difficulty); the rows of the moved task change and only
    they; every row scores its own answer 1 and a wrong one as reasoning-gym's score_answer_with_id does."""
    tokenizer = make_tokenizer()
    ours = Curriculum(write_spec(tmp_path / "c.yaml"), DATA, tokenizer, seed=3, print0=lambda *a: None)
    gym = theirs(60, seed=3)
    assert len(ours.rows) == 60 and len(ours.val_rows) == 6
    for step in range(3):
        entries = [gym.get_dataset_entry(i) for i in range(60)]
        assert [row["prompt"] for row in ours.rows] == [
            [{"role": "system", "content": SYSTEM_PROMPTS["DeepSeekZero"]}, {"role": "user", "content": e["question"]}]
            for e in entries]
        assert {row["data_source"] for row in ours.rows} == {"reasoning_gym/spell_backward",
                                                             "reasoning_gym/basic_arithmetic"}
        for row, entry in zip(ours.rows[:20], entries):
            for text in (f"<answer>{entry['answer']}</answer>", "<answer>0</answer>", "no tags"):
                assert score(row, text) == gym.score_answer_with_id(extract_answer(text),
                                                                    entry["metadata"]["entry_id"])
            assert score(row, f"<answer>{entry['answer']}</answer>") == 1.0
        before = [row["prompt"] for row in ours.rows]
        ours.move("spell_backward", "increment", "test")
        gym.update_difficulty("spell_backward", "increment")
        changed = {row["data_source"] for row, old in zip(ours.rows, before) if row["prompt"] != old}
        assert changed == {"reasoning_gym/spell_backward"}, step
    assert ours.levels() == {"spell_backward": 3, "basic_arithmetic": 0}
    lengths = [len(row["columns"]["prompt"][-1]["content"].rsplit(" ", 1)[-1]) for row in ours.rows
               if row["data_source"] == "reasoning_gym/spell_backward"]
    assert min(lengths) > 3  # level 3's words are longer than level 0's three letters


def feed(curriculum, task: str, right: int, wrong: int) -> None:
    """`right` correct and `wrong` wrong answers to rows of `task`, recorded as one process's samples."""
    rows = [row for row in curriculum.rows if row["data_source"] == f"reasoning_gym/{task}"][:right + wrong]
    answers = [json.loads(row["ground_truth"])["entry"]["answer"] for row in rows]
    texts = [f"<answer>{a}</answer>" if i < right else "<answer>wrong</answer>" for i, a in enumerate(answers)]
    curriculum.record(rows, texts, types.SimpleNamespace(num_processes=1))


def test_levels_move_as_reasoning_gyms_trainer_moves_them(tmp_path):
    """reasoning-gym's trainer rules (ray_grpo_trainer.py): a task whose window holds last_k samples moves up when
    its mean is above success_threshold and down when below failure_threshold, its window then emptied; a window
    not yet full, or a mean between, moves nothing; the metrics are each task's level and window mean; the
    automatic schedule raises every task that has samples every update_steps steps; the state round-trips."""
    c = Curriculum(write_spec(tmp_path / "c.yaml", last_k=4), DATA, make_tokenizer(), seed=0, print0=lambda *a: None)
    feed(c, "spell_backward", 3, 0)
    assert c.update(1)["curriculum/spell_backward/level"] == 0 and c.levels()["spell_backward"] == 0  # 3 < last_k
    feed(c, "spell_backward", 1, 0)
    metrics = c.update(2)
    assert metrics["curriculum/spell_backward/accuracy"] == 1.0 and c.levels()["spell_backward"] == 1
    assert c.windows["spell_backward"] == [] and "curriculum/basic_arithmetic/accuracy" not in metrics
    feed(c, "spell_backward", 2, 2)  # 0.5: between the thresholds
    c.update(3)
    assert c.levels()["spell_backward"] == 1 and len(c.windows["spell_backward"]) == 4
    feed(c, "spell_backward", 0, 4)  # the last 4 of the window: all wrong, 0 < 0.10
    c.update(4)
    assert c.levels() == {"spell_backward": 0, "basic_arithmetic": 0}
    feed(c, "basic_arithmetic", 0, 5)  # at level 0 a decrement moves nothing, and empties the window
    c.update(5)
    assert c.levels()["basic_arithmetic"] == 0 and c.windows["basic_arithmetic"] == []
    feed(c, "spell_backward", 1, 0)
    saved = json.loads(json.dumps(c.state_dict()))
    auto = Curriculum(write_spec(tmp_path / "a.yaml", automatic=True), DATA, make_tokenizer(), seed=0,
                      print0=lambda *a: None)
    auto.load_state_dict(saved)
    assert auto.windows["spell_backward"] == [1.0] and auto.levels() == c.levels()
    auto.update(6)  # automatic: the task with samples goes up, the other waits
    assert auto.levels() == {"spell_backward": 1, "basic_arithmetic": 0}
    restored = Curriculum(write_spec(tmp_path / "c.yaml"), DATA, make_tokenizer(), seed=0, print0=lambda *a: None)
    restored.load_state_dict(json.loads(json.dumps(auto.state_dict())))
    assert [r["prompt"] for r in restored.rows] == [r["prompt"] for r in auto.rows]  # the rows made again


@pytest.mark.parametrize("edit, said", [
    (lambda t: t.replace("spell_backward:", "spell_backwards:"), "no curriculum for 'spell_backwards'; did you mean"),
    (lambda t: t.replace("word_len: 0", "word_length: 0"), "spell_backward's attributes are word_len"),
    (lambda t: t.replace("word_len: 0", "word_len: 99"), "word_len must be a level from 0 to"),
    (lambda t: t.replace("enabled: True", "enabled: False"), "nothing to run; unset data.curriculum"),
    (lambda t: t.replace("failure_threshold: 0.10", "failure_threshold: 0.9"), "is above success_threshold"),
    (lambda t: t.replace("last_k: 4", "last_k: 0"), "last_k must be an integer ≥ 1"),
    (lambda t: t.replace("last_k: 4", "last_k: 4\n    lastk: 4"), "unknown key 'lastk'"),
    (lambda t: t.replace("DeepSeekZero", "Zero"), "developer_prompt 'Zero' is not one of"),
    (lambda t: t.replace("automatic: False", "automatic: sometimes"), "schedule takes automatic (true or false)"),
    (lambda t: "curriculum: [1, 2]", "holds no curriculum: mapping"),
])
def test_a_bad_curriculum_file_is_one_sentence_naming_it(tmp_path, edit, said):
    path = tmp_path / "c.yaml"
    path.write_text(edit(SPELL_BACKWARD.format(size=10, automatic=False, last_k=4)))
    with pytest.raises(DataError, match=f"^data.curriculum={path}: .*" + said.replace("(", r"\(").replace(")", r"\)")):
        read_spec(str(path))


def run(model, spec, out, *overrides, nproc=1):
    launcher = [sys.executable] + (["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp_cpu.yaml",
                                    "--num_processes", str(nproc), "--main_process_port", str(free_port())]
                                   if nproc > 1 else [])
    return subprocess.run(
        launcher + ["ppo.py", "--config", "configs.yaml", f"model.path={model}", f"data.curriculum={spec}",
                    "rollout.name=hf", "rollout.max_response_length=6", "data.max_prompt_length=300",
                    "data.truncation=left",
                    "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.save_freq=1",
                    "trainer.test_freq=0", "trainer.sample_freq=0", "trainer.plot_curves=false",
                    "trainer.val_before_train=false", "trainer.max_kl=0", f"trainer.output_dir={out}", "model.dtype=fp32",
                    "data.val_max_samples=2", *overrides], cwd=REPO, capture_output=True, text=True, timeout=900)


def test_a_run_raises_the_levels_saves_them_and_resumes_them(tmp_path):
    """ppo.py with a curriculum file whose schedule is automatic (every step): the levels logged go 0, 1, 2 (each
    step's rows made at the level it began with), the rewards arrive without an error, the checkpoint holds the
    levels, and a resumed run goes on from them; --check reads the file before any model loads (a truncation that
    would drop rows, a dataset smaller than a batch: one sentence each)."""
    model = make_tiny_model(tmp_path / "model")
    spec = write_spec(tmp_path / "c.yaml", size=40, automatic=True)
    check = subprocess.run([sys.executable, "ppo.py", "--check", "--config", "configs.yaml", f"model.path={model}",
                            f"data.curriculum={spec}", "data.truncation=filter", "data.max_prompt_length=500"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode != 0 and "data.truncation=filter would drop rows" in check.stderr + check.stdout
    small = write_spec(tmp_path / "small.yaml", size=2)
    check = subprocess.run([sys.executable, "ppo.py", "--check", "--config", "configs.yaml", f"model.path={model}",
                            f"data.curriculum={small}", "data.truncation=left", "data.max_prompt_length=300"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode != 0 and "data.curriculum's dataset_size is 2, fewer than data.train_batch_size=4" in (
        check.stderr + check.stdout)
    proc = run(model, spec, tmp_path / "out", "trainer.total_steps=3")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "curriculum: spell_backward level 1 → 2 (schedule.automatic at step 2)" in proc.stdout
    lines = read_metrics(tmp_path / "out")
    assert [line["curriculum/spell_backward/level"] for line in lines] == [0, 1, 2]
    assert all(line["reward/errors"] == 0 for line in lines)
    state = json.loads((tmp_path / "out" / "step_3" / "state.json").read_text())
    assert state["curriculum"]["levels"]["spell_backward"] == {"word_len": 3}
    proc = run(model, spec, tmp_path / "out", "trainer.total_steps=4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert read_metrics(tmp_path / "out")[-1]["curriculum/spell_backward/level"] == 3


def test_two_processes_fill_one_window(tmp_path):
    """DDP over 2 processes: each process's samples go into every process's windows, so the window after two steps
    holds the 16 samples of the whole batch (4 prompts × 2 samples × 2 steps), not one process's 8."""
    model = make_tiny_model(tmp_path / "model")
    spec = write_spec(tmp_path / "c.yaml", size=40, last_k=100)
    proc = run(model, spec, tmp_path / "out", "trainer.total_steps=2", nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    windows = json.loads((tmp_path / "out" / "step_2" / "state.json").read_text())["curriculum"]["windows"]
    assert sum(len(w) for w in windows.values()) == 16

