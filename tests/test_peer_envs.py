"""Other libraries' environments drop in as their users write them (agents/peers.py), each through one real step
of ppo.py on the tiny model, its rows as that library stores them (no data_source, no ground truth that nothing
reads): TRL's environment_factory class; TRL's factories that are a function, a lambda and a functools.partial, in
a dict routed by a column; SkyRL-Gym's BaseTextEnv and verifiers 0.4's tasksets (the real packages, installed here
with conftest.pip_install). In each, every episode ran without an environment error and the reward is the
environment's, a value the environment computed from the row's own columns (or its task's data), so a column that
did not arrive fails the test."""
import subprocess
import sys

import pytest

from conftest import make_tiny_model, make_tokenizer, pip_install, read_metrics, REPO
from data import write_parquet

# TRL's environment_factory, written as TRL's documentation writes it: reset(**kwargs) with the dataset's columns,
# a public method with a docstring and type hints as the tool, get_reward() the episode's reward. `max_tokens` is a
# column of the user's: it never meets the library's own key of that name.
TRL_ENV = '''
import functools


class CounterEnv:
    def __init__(self, scale: float = 1.0):
        self.scale = scale
        self.counter = 0

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = kwargs["target"]
        self.budget = kwargs["max_tokens"]
        return None

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return -self.scale * abs(self.target - self.counter) - self.budget


def make_env():
    return CounterEnv(scale=2.0)


make_lambda = lambda: CounterEnv(scale=3.0)  # noqa: E731
make_partial = functools.partial(CounterEnv, scale=4.0)
ENVS = {"function": make_env, "lambda": make_lambda, "partial": make_partial, "class": CounterEnv}
'''

# SkyRL-Gym's environment, written as SkyRL's "new environment" guide writes its multiply example: BaseTextEnv,
# built as (env_config, extras) with the row's reward_spec among the extras, step() -> BaseTextEnvStepOutput.
SKYRL_ENV = '''
import re
from typing import Any, Dict

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class MultiplyEnv(BaseTextEnv):
    def __init__(self, env_config: Any, extras: Dict[str, Any] = {}):
        super().__init__()
        assert "reward_spec" in extras, "reward_spec field is required"
        assert "ground_truth" in extras["reward_spec"], "ground_truth is required in reward_spec field"
        self.ground_truth = extras["reward_spec"]["ground_truth"]
        self.max_turns = extras["max_turns"] if "max_turns" in extras else 5

    def _parse_action(self, action: str) -> str:
        match = re.search(r"\\\\boxed\\{([^}]+)\\}", action)
        return match.group(1) if match else None

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        answer = self._parse_action(action)
        is_correct = answer is not None and answer.strip() == str(self.ground_truth).strip()
        done = is_correct or self.turns >= self.max_turns
        reward = 1.0 if is_correct else -0.1 * len(str(self.ground_truth))  # wrong: a penalty, longer for longer
        if done:
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={"turns": self.turns})
        feedback = "Please provide your answer in the format \\\\boxed{your_answer}."
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": feedback}], reward=0.0, done=False,
                                     metadata={"turns": self.turns})
'''
SKYRL = "skyrl-gym==0.4.0"


def run_ppo(model, rows, spec, out, turns, extra=(), pythonpath=None):
    """ppo.py, one step on `rows` (written as a parquet file), the environment `spec`."""
    write_parquet(rows, str(out / "train.parquet"))
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", f"model.path={model}",
           f"data.train_files={out}/train.parquet", "data.val_files=null", "rollout.name=hf",
           "rollout.max_response_length=12", "data.max_prompt_length=96", f"data.train_batch_size={len(rows)}",
           "rollout.n=2", f"actor.ppo_mini_batch_size={len(rows)}", "trainer.total_steps=1", "trainer.save_freq=0",
           "trainer.test_freq=0", "trainer.sample_freq=0", "trainer.plot_curves=false",
           "trainer.val_before_train=false", "trainer.max_kl=0", f"trainer.output_dir={out}/run", "model.dtype=fp32",
           "model.lora_rank=8", "model.target_modules=q_proj,v_proj", "algorithm.adv_estimator=grpo",
           "rollout.multi_turn.enable=true", f"rollout.multi_turn.max_turns={turns}", f"rollout.multi_turn.env={spec}",
           *extra]
    env = None
    if pythonpath:
        import os
        env = {**os.environ, "PYTHONPATH": pythonpath + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def one_step(proc, out) -> dict:
    """The metrics of step 1, after checking the run ended well and no episode's environment failed."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in read_metrics(out / "run") if line.get("step") == 1 and "reward/mean" in line]
    assert lines, read_metrics(out / "run")
    assert lines[0]["agent/env_errors_share"] == 0.0, lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("peer_model") / "model")


def test_a_trl_environment_factory_class_runs_with_the_rows_own_columns(model, tmp_path):
    """TRL's class (environment_factory=CounterEnv) on TRL's dataset layout (prompt plus the columns reset reads,
    nothing else): reset(**row) gets every column, `max_tokens` the user's own; the tiny model calls no tool, so each
    episode ends at its first turn paid get_reward() = −|target − 0| − max_tokens, which is the step's reward (the
    environment's rows need no data_source and no ground truth). The tiny template ignores tools: said at start-up."""
    (tmp_path / "trl_env.py").write_text(TRL_ENV)
    rows = [{"prompt": [{"role": "user", "content": "Count to the target."}], "target": t, "max_tokens": b}
            for t, b in ((3, 1), (5, 2))]
    proc = run_ppo(model, rows, f"{tmp_path}/trl_env.py:CounterEnv", tmp_path, turns=2)
    step = one_step(proc, tmp_path)
    assert step["reward/mean"] == pytest.approx(-(3 + 1 + 5 + 2) / 2) == step["agent/env_return_mean"]
    assert "chat template ignores tool schemas" in proc.stdout and "increment" in proc.stdout


def test_a_trl_reward_function_reads_the_environments_as_they_ended(model, tmp_path):
    """TRL's reward function beside its environment_factory, as TRL's docs pair them: reward(environments, **kwargs)
    reads each sample's environment as its episode ended. It pays 10·target, read from the environment (reset set
    it from the row's column); get_reward() adds −target − max_tokens at the last turn: the step's reward is their
    sum, so it holds only if each sample's own environment reached the function."""
    (tmp_path / "trl_env.py").write_text(TRL_ENV)
    (tmp_path / "trl_reward.py").write_text(
        "def target_reward(environments, **kwargs):\n"
        "    return [10.0 * env.target for env in environments]\n")
    rows = [{"prompt": [{"role": "user", "content": "Count to the target."}], "target": t, "max_tokens": b}
            for t, b in ((3, 1), (5, 2))]
    proc = run_ppo(model, rows, f"{tmp_path}/trl_env.py:CounterEnv", tmp_path, turns=2,
                   extra=[f"reward.function={tmp_path}/trl_reward.py:target_reward"])
    step = one_step(proc, tmp_path)
    assert step["reward/mean"] == pytest.approx((30 - 3 - 1 + 50 - 5 - 2) / 2)


def test_trl_factories_a_function_a_lambda_a_partial_in_a_dict_routed_by_a_column(model, tmp_path):
    """A dict of TRL factories {name: function | lambda | functools.partial | class}, each row built by the one its
    env_class column names: each episode's reward is −scale·target − max_tokens with its factory's scale (2, 3, 4, 1),
    so the step's mean reward holds only if every row reached its own factory with its columns."""
    (tmp_path / "trl_env.py").write_text(TRL_ENV)
    rows = [{"prompt": "Count to the target.", "env_class": name, "target": 1, "max_tokens": 0}
            for name in ("function", "lambda", "partial", "class")]
    proc = run_ppo(model, rows, f"{tmp_path}/trl_env.py:ENVS", tmp_path, turns=2)
    step = one_step(proc, tmp_path)
    assert step["reward/mean"] == pytest.approx(-(2 + 3 + 4 + 1) / 4) == step["agent/env_return_mean"]


def test_a_row_that_the_dict_does_not_name_fails_its_episode_in_one_sentence(tmp_path):
    """A row whose env_class names no environment of the dict: its reset fails, saying which value and which names."""
    from agents.environments import HostedEnvironment
    (tmp_path / "trl_env.py").write_text(TRL_ENV)
    env = HostedEnvironment(f"{tmp_path}/trl_env.py:ENVS", 5.0)
    try:
        results = env.reset([{"prompt": "p", "columns": {"prompt": "p", "env_class": "wordle", "target": 1,
                                                         "max_tokens": 0}},
                             {"prompt": "p", "columns": {"prompt": "p", "env_class": "lambda", "target": 1,
                                                         "max_tokens": 0}}])
    finally:
        env.close()
    assert isinstance(results[0], ValueError) and "env_class is 'wordle'" in str(results[0])
    assert "'function', 'lambda', 'partial', 'class'" in str(results[0]) and results[1] is None


def test_rows_that_the_dict_does_not_name_stop_the_run_before_any_model_loads(model, tmp_path):
    """ppo.py with a dict of environments and a row whose env_class names none of them: one sentence naming the row,
    its value and the dict's names, before any model loads (else every such episode would fail at its reset)."""
    (tmp_path / "trl_env.py").write_text(TRL_ENV)
    rows = [{"prompt": "Count.", "env_class": name, "target": 1, "max_tokens": 0} for name in ("lambda", "wordle")]
    proc = run_ppo(model, rows, f"{tmp_path}/trl_env.py:ENVS", tmp_path, turns=2)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert ("data row 1 (train files, then val): the row's env_class is 'wordle', which rollout.multi_turn.env="
            in proc.stdout + proc.stderr), proc.stdout[-1000:] + proc.stderr[-1000:]


def test_trl_environments_as_they_ended_are_on_each_samples_record(tmp_path):
    """The tools are CounterEnv's methods, called on the episode's own instance; after the episode, the instance's
    attributes as it ended are on the sample's conversation record (what TRL hands reward functions as
    environments=), beside get_reward()'s reward at the last turn."""
    from agents.multi_turn import AgentRollout, check_multi_turn
    from infra.cli import load_config
    from infra.distributed import max_over_processes
    from test_agent import chat, question, ScriptedBackend
    (tmp_path / "trl_env.py").write_text(TRL_ENV)
    tokenizer = make_tokenizer()
    cfg = load_config(None, ["rollout.multi_turn.enable=true", f"rollout.multi_turn.env={tmp_path}/trl_env.py:CounterEnv",
                             "rollout.multi_turn.max_turns=3", "rollout.max_response_length=400"])
    calls = ['<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>', "done"]
    reply = lambda context, j: calls[context.count("<|im_start|>tool")]  # noqa: E731
    rollout = AgentRollout(ScriptedBackend(tokenizer, reply), tokenizer, check_multi_turn(cfg, tokenizer),
                           max_over_processes)
    rows = [{"prompt_ids": chat(tokenizer, question(1, 2)), "prompt": question(1, 2),
             "columns": {"prompt": question(1, 2), "target": t, "max_tokens": 0}} for t in (2, 5)]
    try:
        ro = rollout.generate(rows, 1, 1.0)
    finally:
        rollout.close()
    assert [c["environment"] for c in ro.conversations] == [
        {"scale": 1.0, "counter": 2, "target": 2, "budget": 0}, {"scale": 1.0, "counter": 2, "target": 5, "budget": 0}]
    assert [c["rewards"][-1] for c in ro.conversations] == [0.0, -3.0]


def test_skyrl_gym_environments_run_on_skyrls_rows(model, tmp_path):
    """SkyRL-Gym's BaseTextEnv (the real skyrl-gym) on SkyRL's rows (prompt, env_class, reward_spec.ground_truth,
    extra_info; no data_source): built as MultiplyEnv(env_config, extras) with the row as the extras, init(prompt)
    the base class's, step's BaseTextEnvStepOutput read; the tiny model never boxes the product, so each episode
    ends at the row's max_turns=1 (an extra SkyRL's rows carry) with the penalty −0.1·len(ground truth) of its row,
    which is the step's reward."""
    root = pip_install(SKYRL)  # base_text_env needs none of its dependencies
    (tmp_path / "multiply_env.py").write_text(SKYRL_ENV)
    rows = [{"prompt": [{"role": "user", "content": f"{a} * {b} = ? Answer in \\boxed{{}}."}], "env_class": "multiply",
             "reward_spec": {"method": "rule", "ground_truth": str(a * b)}, "max_turns": 1,
             "extra_info": {"a": a, "b": b}} for a, b in ((3, 4), (25, 41))]  # 12, 1025
    proc = run_ppo(model, rows, f"{tmp_path}/multiply_env.py:MultiplyEnv", tmp_path, turns=2, pythonpath=root)
    step = one_step(proc, tmp_path)
    assert step["reward/mean"] == pytest.approx(-(0.2 + 0.4) / 2) == step["agent/env_return_mean"]
    assert step["env/turns"] == 1.0


# verifiers 0.4's taskset, written as verifiers.v1's Taskset docstring writes one: TaskData fields, a Task whose
# @reward methods declare what they read (task, trace), a Taskset whose load() yields the tasks; exported in __all__.
V1_TASKSET = '''
import verifiers.v1 as vf

__all__ = ["AddOneTaskset"]


class AddOneData(vf.TaskData):
    answer: str


class AddOneTask(vf.Task[AddOneData]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.25)
    async def replied(self, trace) -> float:
        return float(trace.num_turns == 1 and len(trace.messages) == 3)  # system, user, the model's reply


class AddOneTaskset(vf.Taskset[AddOneTask]):
    def load(self):
        for i in range(6):
            data = AddOneData(prompt=f"What is {i} + 1?", system_prompt="Answer with the number.", answer=str(i + 1001))
            yield AddOneTask(data, self.config.task)
'''
VERIFIERS_V1 = [line for line in open(f"{REPO}/requirements-verifiers-v1.txt").read().splitlines()
                if line and not line.startswith("#")]


def test_verifiers_0_4_tasksets_run_with_their_rewards(model, tmp_path):
    """verifiers 0.4.0 (the real package, installed --no-deps beside this library's openai and mcp pins, as
    requirements-verifiers-v1.txt says): prepare_data writes the taskset's tasks as rows, ppo.py runs one step with
    rollout.multi_turn.env=verifiers.v1:<taskset id>, each episode scored by the task's own @reward functions on the
    trace of its reply: replied·0.25 (the trace holds the system prompt, the prompt and the reply), exact 0 (the
    answers are past 1000), so the step's reward is 0.25, the environment's."""
    root = pip_install(*VERIFIERS_V1)
    (tmp_path / "add_one_v1.py").write_text(V1_TASKSET)
    pythonpath = f"{root}:{tmp_path}"
    import os
    env = {**os.environ, "PYTHONPATH": pythonpath + os.pathsep + os.environ.get("PYTHONPATH", "")}
    prep = subprocess.run([sys.executable, "tools/prepare_data.py", "--task", "verifiers.v1:add_one_v1", "--val-size",
                           "2", "--output", str(tmp_path / "data")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert prep.returncode == 0, prep.stdout[-2000:] + prep.stderr[-3000:]
    from data import read_parquet
    rows = read_parquet(str(tmp_path / "data" / "train.parquet"), ["prompt"]).to_pylist()
    assert len(rows) == 4 and rows[1]["prompt"] == [{"role": "system", "content": "Answer with the number."},
                                                    {"role": "user", "content": "What is 1 + 1?"}]
    proc = run_ppo(model, rows[:2], "verifiers.v1:add_one_v1", tmp_path, turns=1, pythonpath=pythonpath)
    step = one_step(proc, tmp_path)
    assert step["reward/mean"] == pytest.approx(0.25) == step["agent/env_return_mean"]
    assert step["env/replied"] == 1.0 and step["env/exact"] == 0.0


def test_a_template_that_renders_tools_shows_them_without_a_warning(capsys, tmp_path):
    """The start-up check speaks only where the template drops the schemas: one that renders `tools` is silent."""
    from agents.multi_turn import warn_unshown_tools
    schemas = [{"type": "function", "function": {"name": "increment", "parameters": {}}}]
    tokenizer = make_tokenizer()
    warn_unshown_tools(tokenizer, schemas)
    assert "ignores tool schemas" in capsys.readouterr().out
    tokenizer.chat_template = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}" + tokenizer.chat_template
    warn_unshown_tools(tokenizer, schemas)
    assert capsys.readouterr().out == ""
