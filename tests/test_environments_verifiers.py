"""verifiers' environments drop in (agents/verifiers.py): their dataset as the prompts, verifiers' own rollout
driving the turns (env_response, stop conditions, state), their rubric with its weights as the reward; end to end
through ppo.py for 2 steps, on examples/verifiers_add_one.py (a SingleTurnEnv) and a MultiTurnEnv built here."""
import json
import subprocess
import sys

import pytest

import data
import rewards
from conftest import make_tiny_model, read_metrics, REPO
from tools import prepare_data

pytest.importorskip("verifiers")
from agents import verifiers as environments_verifiers  # noqa: E402 (after the skip)

SINGLE = open(f"{REPO}/examples/verifiers_add_one.py").read()  # the README's example

MULTI = '''
import verifiers as vf
from datasets import Dataset

class Guess(vf.MultiTurnEnv):
    """Guess a number: "higher" or "lower" after each wrong guess, the game over at the right one."""
    async def setup_state(self, state):
        state["guesses"] = []
        return state

    async def env_response(self, messages, state, **kwargs):
        guess = messages[-1].content.strip()
        state["guesses"].append(guess)
        if guess == state["answer"]:
            state["final_env_response"] = [vf.UserMessage(content="correct")]
            return state["final_env_response"]
        low = guess.isdigit() and int(guess) < int(state["answer"])
        return [vf.UserMessage(content=f"higher than {guess}" if low else f"lower than {guess}")]

def load_environment():
    rows = [{"question": "Guess my number from 1 to 9.", "answer": str(3 + i % 5)} for i in range(8)]
    def won(state, **kwargs):
        return float(state["guesses"][-1:] == [state["answer"]])
    def guesses(state, **kwargs):
        return float(len(state["guesses"]))
    return Guess(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[won, guesses], weights=[1.0, -0.1]),
                 max_turns=4)
'''


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    """The two environment files, and their rows as prepare_data writes them."""
    folder = tmp_path_factory.mktemp("verifiers_envs")
    out = {}
    for name, text in (("single", SINGLE), ("multi", MULTI)):
        (folder / f"{name}.py").write_text(text)
        prepare_data.main(["--task", f"verifiers:{folder / name}.py", "--output", str(folder / name)])
        out[name] = (str(folder / f"{name}.py"), folder / name)
    return out


def rows_of(path):
    return data.read_parquet(str(path), ["prompt"]).to_pylist()


def play(target, row, texts):
    """One episode: reset on the row, then step on each text until it is done; the steps' returns."""
    episode = getattr(environments_verifiers, target)()
    first = episode.reset(row)
    steps = []
    for text in texts:
        steps.append(episode.step(text))
        if steps[-1][2]:
            break
    return first, steps


def test_the_dataset_becomes_the_prompts(envs):
    """train.parquet holds the dataset and val.parquet the eval dataset, each prompt as verifiers formats it (the
    system prompt, then the question), data_source verifiers/<file>, the verifiers row as the ground truth."""
    path, folder = envs["single"]
    train, val = rows_of(folder / "train.parquet"), rows_of(folder / "val.parquet")
    assert len(train) == 8 and len(val) == 4
    assert train[2]["prompt"] == [{"role": "system", "content": "Answer with the number."},
                                  {"role": "user", "content": "What is 2 + 1?"}]
    assert train[2]["data_source"] == "verifiers/single" and json.loads(train[2]["ground_truth"])["answer"] == "3"
    assert rewards.rule_for("verifiers/single")("anything", train[2]["ground_truth"]) == 0.0  # the env pays


def test_an_installed_module_is_loaded_as_verifiers_loads_it(envs, tmp_path, monkeypatch):
    """A target without .py is a module name, loaded by vf.load_environment (its load_environment() called)."""
    (tmp_path / "my_vf_single.py").write_text(SINGLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    episode = getattr(environments_verifiers, "my_vf_single")()
    row = rows_of(envs["single"][1] / "train.parquet")[0]
    assert episode.reset(row) is None and episode.step("1")[1] == 1.75


def test_single_turn_reward_is_the_rubric_with_its_weights(envs):
    """One turn, then done, with reward exact·1.0 + short·0.5 + answered·0.25 (hand-computed), the functions'
    values as info; the first messages are the row's own prompt (None)."""
    path, folder = envs["single"]
    row = rows_of(folder / "train.parquet")[2]
    for text, want in [("3", 1.75), (" 3 ", 1.25), ("4", 0.75), ("the answer is 3", 0.25)]:
        first, steps = play(path, row, [text, "never read"])
        assert first is None and len(steps) == 1
        messages, reward, done, info = steps[0]
        assert (messages, reward, done) == ([], want, True)
        assert info["exact"] == float(text.strip() == "3") and info["short"] == float(len(text) <= 2)


def test_multi_turn_state_carries_across_turns(envs):
    """env_response's messages come back after each turn, built from the state the turns so far left (the guesses);
    each turn is paid what it added to the rubric's score won·1.0 − 0.1·guesses, so the rewards sum to the score
    where the episode ends: at the right guess (final_env_response), or at the env's max_turns (verifiers counts the
    model's turns and answers none after the last)."""
    path, folder = envs["multi"]
    row = rows_of(folder / "train.parquet")[1]  # the answer is 4
    first, steps = play(path, row, ["2", "7", "4"])
    assert first is None
    assert steps[0][:3] == ([{"role": "user", "content": "higher than 2"}], pytest.approx(-0.1), False)
    assert steps[1][:3] == ([{"role": "user", "content": "lower than 7"}], pytest.approx(-0.1), False)
    assert steps[2][:3] == ([], pytest.approx(0.7 - -0.2), True) and steps[2][3]["won"] == 1.0
    _, lost = play(path, row, ["1", "2", "3", "5", "4"])  # max_turns=4: over at the fourth turn, never answered
    assert [step[1] for step in lost] == pytest.approx([-0.1, -0.1, -0.1, 0.0]) and lost[-1][2]
    assert lost[-1][3] == {"won": 0.0, "guesses": 3.0, "num_turns": 4.0, "verifiers_error": 0.0}


def test_a_failing_environment_fails_its_episode_and_a_bad_file_fails_in_one_sentence(envs, tmp_path):
    """An env_response that raises makes step raise it (the host ends that episode and counts an env error); a file
    without load_environment stops prepare_data with one sentence."""
    path, folder = envs["multi"]
    broken = tmp_path / "broken.py"
    broken.write_text(open(path).read().replace('guess = messages[-1].content.strip()', 'raise KeyError("boom")'))
    row = rows_of(folder / "train.parquet")[0]
    episode = getattr(environments_verifiers, str(broken))()
    episode.reset(row)
    with pytest.raises(KeyError, match="boom"):
        episode.step("1")
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match="loading the environment failed: AttributeError: .* has no function "
                                         "load_environment"):
        prepare_data.main(["--task", f"verifiers:{tmp_path}/empty.py", "--output", str(tmp_path / "out")])


def run_ppo(model, folder, spec, out, turns):
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", f"model.path={model}",
           f"data.train_files={folder}/train.parquet", f"data.val_files={folder}/val.parquet", "rollout.name=hf",
           "rollout.max_response_length=8", "data.max_prompt_length=96", "data.train_batch_size=2", "rollout.n=2",
           "actor.ppo_mini_batch_size=2", "trainer.total_steps=2", "trainer.save_freq=0", "trainer.test_freq=2",
           "trainer.sample_freq=0", "trainer.plot_curves=false", "trainer.val_before_train=false",
           "trainer.max_kl=0", f"trainer.output_dir={out}", "model.dtype=fp32", "model.lora_rank=8",
           "model.target_modules=q_proj,v_proj", "algorithm.adv_estimator=grpo", "rollout.multi_turn.enable=true",
           f"rollout.multi_turn.max_turns={turns}", f"rollout.multi_turn.env={spec}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name,turns,spelling", [("single", 1, "verifiers:"),
                                                  ("multi", 4, "agents/verifiers.py:")])
def test_verifiers_environments_train_two_steps_through_ppo(envs, tmp_path, name, turns, spelling):
    """ppo.py trains 2 steps on each environment's prompts with its rubric as the reward: every step ran every
    episode without an environment error, the reward is the environment's return (the rule of verifiers/* adds 0)
    and not 0 (each episode the tiny model plays gets answered·0.25, or loses 0.1 a guess), and validation (step 2)
    ran on the eval dataset. Each spelling of rollout.multi_turn.env names the environment: verifiers:<target> and
    the file's own, agents/verifiers.py:<target>."""
    path, folder = envs[name]
    proc = run_ppo(make_tiny_model(tmp_path / "model"), folder, spelling + path, tmp_path / "out", turns)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = read_metrics(tmp_path / "out")
    steps = [line for line in lines if "agent/env_errors_share" in line and line["step"] in (1, 2)]
    assert len(steps) >= 2 and all(line["agent/env_errors_share"] == 0.0 for line in steps), lines
    for line in steps:
        assert line["score/mean"] == 0.0  # the rule's; the rubric is paid at the turns' tokens (no KL in the reward)
        assert line["reward/mean"] == pytest.approx(line["agent/env_return_mean"]) != 0.0
    assert any("val/agent/env_return_mean" in line for line in lines), lines[-1]
