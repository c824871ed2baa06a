"""verifiers' environments (`load_environment()`, the environments prime-rl trains on) as environments of this
library (agents/environments.py's contract: reset(row), step(text)), driven on this library's own generation.

    python tools/prepare_data.py --task verifiers:my_env.py --output data/my_env      # its dataset as the prompts
    python ppo.py --config configs.yaml data.train_files=data/my_env/train.parquet \\
        data.val_files=data/my_env/val.parquet rollout.multi_turn.enable=true rollout.multi_turn.max_turns=4 \\
        rollout.multi_turn.env=verifiers:my_env.py                                     # or an installed module

`verifiers:<target>` (short for `agents/verifiers.py:<target>`, the class `<target>` of this file, which
`__getattr__` below makes) names a verifiers environment: a file path/to/env.py, or an installed module
(as `vf-eval` takes it), whose `load_environment()` returns a SingleTurnEnv, a MultiTurnEnv or another of verifiers'
own environments. The environment is loaded once, in the worker that hosts the episodes (agents/episodes.py), and
each episode runs in a process forked from it.

An episode is verifiers' own rollout (`MultiTurnEnv.rollout`: setup_state, its stop conditions — is_completed,
max_turns, final_env_response —, env_response between turns), run in a thread, with a client whose model is this
library's sampler: each time verifiers asks its client for a response, the messages go out (reset gives the first,
step the env_response after each turn) and the model's next turn comes back as the response. The token ids, masks
and sampler log-probs are this library's rollout's, kept as every multi-turn rollout keeps them (agents/multi_turn.py).

The reward is verifiers' rubric (`Rubric.score_rollout`: Σ weight·func over its reward functions), paid turn by turn
as what each turn added to it: before the model's next turn the rubric scores the conversation so far, and the turn
is paid the difference from the last score; when verifiers ends the rollout, the last turn is paid the rest of the
final score, and the functions' values are that step's info (env/<name>). The rewards of an episode so sum to the
rubric's score of the conversation where it ended, whether verifiers ended it or this library did (at
rollout.multi_turn.max_turns, or at a turn cut by rollout.max_response_length), and as differences of one potential
they leave the best policy as it was (Ng et al., 1999, "Policy invariance under reward transformations"). A rubric
that is slow (a judge) is called once per turn.
Not here: group rubrics (score_group: this library's episodes are one sample each), and tool calls (ToolEnv reads
them from the OpenAI server's parsed tool_calls; here a turn is its text).

Pinned at verifiers 0.3.1 (requirements-verifiers.txt): 0.4.0 replaced SingleTurnEnv, MultiTurnEnv and Rubric with
its v1 stack (Taskset, Harness), configured and served quite differently; its tasksets: agents/verifiers_v1.py.
"""
import asyncio
import copy
import functools
import importlib
import importlib.util
import json
import os
import queue
import re
import threading


@functools.lru_cache(maxsize=None)
def load(target: str):
    """The verifiers environment of `target`: path/to/env.py's load_environment(), or vf.load_environment(module)."""
    import verifiers as vf
    if not target.endswith(".py"):
        return vf.load_environment(target)
    if not os.path.isfile(target):
        raise FileNotFoundError(f"verifiers environment file {target} does not exist")
    name = "verifiers_env_" + re.sub(r"\W", "_", os.path.splitext(os.path.abspath(target))[0])
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "load_environment", None)):
        raise AttributeError(f"{target} has no function load_environment()")
    return module.load_environment()


def as_dicts(messages) -> list[dict]:
    """verifiers' messages (pydantic models or dicts) as [{"role", "content": str}]."""
    out = []
    for m in messages:
        m = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        content = m.get("content") or ""
        if not isinstance(content, str):  # content parts: the text ones, in order
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        out.append({"role": m["role"], "content": content})
    return out


def dataset_rows(target: str, split: str) -> list[dict]:
    """The environment's dataset (split "train") or eval dataset ("eval"; verifiers falls back to the dataset) as
    RL rows: the prompt as verifiers formats it (system prompt and few-shot included), the whole verifiers row as
    JSON for the ground truth (reset starts verifiers' rollout from it: prompt, answer, info, task), data_source
    verifiers/<the file's or module's name>."""
    env = load(target)
    dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
    name = os.path.splitext(os.path.basename(target))[0]
    return [{"prompt": as_dicts(row["prompt"]), "ground_truth": json.dumps(dict(row), default=str),
             "data_source": f"verifiers/{name}", "extra_info": {"index": i}} for i, row in enumerate(dataset)]


@functools.lru_cache(maxsize=None)
def policy_client_class() -> type:
    """verifiers' model client (vf.Client), answered by this library's sampler: get_response hands the messages to
    the episode (asks) and waits for the model's turn (answers). Made on first use: importing verifiers takes
    seconds, which runs without it should not pay."""
    from verifiers.legacy.clients.client import Client
    from verifiers.legacy.types import Response, ResponseMessage

    class PolicyClient(Client):
        def __init__(self, env, asks: queue.Queue, answers: queue.Queue):
            super().__init__(None)
            self.env, self.asks, self.answers = env, asks, answers

        async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            state = kwargs["state"]  # verifiers' get_model_response passes it
            score = await score_so_far(self.env, state, prompt) if state["trajectory"] else 0.0
            self.asks.put(("ask", prompt, tools, score))
            text = await asyncio.to_thread(self.answers.get)
            return Response(id="policy", created=0, model=model, message=ResponseMessage(
                role="assistant", content=text, finish_reason="stop", is_truncated=False))

        # the parts of the client contract that get_response above replaces
        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            raise NotImplementedError

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            return response

        async def close(self):
            return None
    return PolicyClient


async def score_so_far(env, state, prompt) -> float:
    """The rubric's score of the rollout were it to end here, before the model's next turn: `prompt` (the whole
    conversation so far) less the first prompt is the completion, as verifiers renders it at the end."""
    if not env.score_rollouts:
        return 0.0
    snapshot = copy.copy(state)  # the rubric writes reward and metrics into the state it scores
    snapshot["completion"] = list(prompt)[len(state["prompt"]):]
    await env.rubric.score_rollout(snapshot)
    return float(snapshot["reward"] or 0.0)


class VerifiersEpisode:
    """One episode of `env` (a verifiers environment; a subclass per target sets it, see __getattr__ below). Its
    returns are agents/environments.py's plain forms: reset a list of messages (None: the row's own prompt), step gym's
    (messages, reward, done, info)."""
    env = None

    def reset(self, row: dict):
        self.asks, self.answers, self.paid = queue.Queue(), queue.Queue(), 0.0
        task = json.loads(row["ground_truth"])  # the verifiers row (dataset_rows)
        threading.Thread(target=asyncio.run, args=(self.run(task),), daemon=True).start()
        kind, prompt, tools, _ = self.asks.get()
        if kind != "ask":  # verifiers ended the episode before asking the model anything
            raise RuntimeError(f"the verifiers environment ended the episode before the first turn: {prompt}")
        if tools:
            raise ValueError("the verifiers environment offers tools; tool calls are not supported here")
        self.sent, messages = len(prompt), as_dicts(prompt)
        return None if messages == row.get("prompt") else messages  # None: tokenised as data.py did it

    def step(self, text: str):
        """The next messages, and as reward what the turn added to the rubric's score: the rewards of an episode
        sum to the rubric's score wherever it ends (verifiers' end, or this library's max_turns or token budget)."""
        self.answers.put(text)
        kind, value, _, score = self.asks.get()
        if kind == "error":
            raise value
        if kind == "done":  # verifiers scores a rollout that stopped on an error too (its has_error stop)
            metrics = {k: float(v) for k, v in (value["metrics"] or {}).items() if isinstance(v, (int, float))}
            metrics["verifiers_error"] = float(value["error"] is not None)
            return [], float(value["reward"] or 0.0) - self.paid, True, metrics
        reward, self.paid = score - self.paid, score
        messages = as_dicts(value)[self.sent + 1:]  # after the prompt so far and the model's turn: env_response
        self.sent = len(value)
        return messages, reward, False, {}

    async def run(self, task: dict) -> None:
        """verifiers' rollout, scored as verifiers scores one (Environment._run_rollout_state): its rubric's
        score_rollout, then the rubric's cleanup."""
        try:
            env = self.env
            state = await env.rollout(task, policy_client_class()(env, self.asks, self.answers), "policy", {})
            await (env.rubric.score_rollout if env.score_rollouts else env.rubric.dummy_score_rollout)(state)
            await env.rubric.cleanup(state)
            self.asks.put(("done", state, None, None))
        except Exception as e:
            self.asks.put(("error", e, None, None))


def __getattr__(target: str):
    """`agents/verifiers.py:<target>` (rollout.multi_turn.env): an episode class bound to target's
    environment, loaded here once (PEP 562: the name after the colon is looked up on this module)."""
    if target.startswith("__"):
        raise AttributeError(target)
    return episode_class(target)


@functools.lru_cache(maxsize=None)
def episode_class(target: str) -> type:
    """The episode class of target's environment; the client class made here too, so that the processes forked
    for the episodes inherit its imports instead of each importing them again (seconds)."""
    policy_client_class()
    return type(f"Verifiers_{os.path.basename(target)}", (VerifiersEpisode,), {"env": load(target)})
