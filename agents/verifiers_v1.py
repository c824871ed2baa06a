"""verifiers 0.4's tasksets (`verifiers.v1`: a Taskset yields Tasks whose @reward methods score a trace) as
environments of this library (agents/environments.py's contract: reset(row), step(text)), single-turn.

    python tools/prepare_data.py --task verifiers.v1:my_taskset --output data/my_taskset   # its tasks as the prompts
    … rollout.multi_turn.enable=true rollout.multi_turn.max_turns=1 rollout.multi_turn.env=verifiers.v1:my_taskset

`verifiers.v1:<taskset id>` (short for `agents/verifiers_v1.py:<taskset id>`; __getattr__ below makes the class)
names a taskset as verifiers 0.4 finds one: an installed module exporting its Taskset subclass in `__all__`, loaded
through `vf.load_environment(config)` (its Env: SingleAgentEnv, or the one the module exports), once, in the worker
that hosts the episodes (agents/episodes.py).

An episode is one task: its prompt (system prompt, then the prompt) is the row's; the model's reply is written into a
trace (the prompt's messages, then the reply as the sampled assistant message) and the task scores it as verifiers
does offline (`Task.score(trace)`, no runtime: its @reward functions, weighted, and its @metric ones); the trace's
reward is the step's, each reward and metric a number in its info (env/<name>).
Not here: verifiers 0.4's harnesses (an agent program that calls the model through an intercepted OpenAI-style
endpoint, in a runtime: subprocess, docker, sandbox) and their tools, multi-agent envs, and rewards that need a
runtime (they are skipped, as verifiers skips them offline).

Installing 0.4 (it replaces 0.3.1, the same package): `pip install --no-deps -r requirements-verifiers-v1.txt`. Its
metadata asks for openai<3 and mcp==2.0.0, which would undo vLLM's openai 3.x and mcp 2.3: the taskset, task and
scoring path runs with those (tests/test_peer_envs.py installs it so, beside this library's pins).
"""
import asyncio
import functools
import json
import os


@functools.lru_cache(maxsize=None)
def load(target: str):
    """The Env of taskset `target`, as verifiers 0.4 loads one (vf.load_environment of the config naming it)."""
    import verifiers.v1 as vf
    env_class = vf.environment_class(target)
    config = vf.env_config_type(env_class)(taskset=vf.TasksetConfig(id=target))
    return vf.load_environment(config)


def prompt_of(data) -> list[dict]:
    """A task's first messages: its system prompt, then its prompt (a str, or messages)."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    return messages + [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
                       for m in data.prompt or []]


def dataset_rows(target: str) -> list[dict]:
    """The taskset's tasks as RL rows: the prompt, the task's data as JSON for the ground truth (reset rebuilds the
    task from it), data_source verifiers/<the taskset's id> (the environment pays its rewards)."""
    taskset = load(target).taskset
    name = os.path.basename(target)
    return [{"prompt": prompt_of(task.data), "ground_truth": task.data.model_dump_json(),
             "data_source": f"verifiers/{name}", "extra_info": {"index": i}} for i, task in enumerate(taskset)]


class TaskEpisode:
    """One task of `env`'s taskset (a subclass per target sets env, see __getattr__ below): reset rebuilds it from
    the row, step scores the reply and ends the episode with gym's (messages, reward, done, info)."""
    env = None

    def reset(self, row: dict):
        task_type = self.env.taskset.task_type()
        data = task_type.data_type().model_validate(json.loads(row["ground_truth"]))
        self.task = task_type(data, self.env.taskset.config.task)
        return None  # the row's prompt, as data.py tokenised it

    def step(self, text: str):
        import verifiers.v1 as vf
        messages = [{"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}[m["role"]](
            content=m["content"]) for m in prompt_of(self.task.data)]
        nodes = [vf.MessageNode(parent=i - 1 if i else None, message=m) for i, m in enumerate(messages)]
        nodes.append(vf.MessageNode(parent=len(nodes) - 1, message=vf.AssistantMessage(content=text), sampled=True))
        trace = vf.Trace(task=vf.TraceTask(type=type(self.task).__name__, data=self.task.data),
                         agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes)
        asyncio.run(self.task.score(trace))
        info = {**{k: float(v) for k, v in trace.metrics.items() if v is not None},
                **{k: float(r.score) for k, r in trace.rewards.items() if r is not None}}
        return [], float(trace.reward), True, info


def __getattr__(target: str):
    """`agents/verifiers_v1.py:<taskset id>` (rollout.multi_turn.env): an episode class bound to the taskset's env,
    loaded here once (PEP 562)."""
    if target.startswith("__"):
        raise AttributeError(target)
    return episode_class(target)


@functools.lru_cache(maxsize=None)
def episode_class(target: str) -> type:
    return type(f"VerifiersTask_{os.path.basename(target)}", (TaskEpisode,), {"env": load(target)})
