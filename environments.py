"""Environments: what a multi-turn rollout talks to between the model's turns (agent.py drives them, issue 33).

    accelerate launch ppo.py --config examples/guess_number.yaml                      # the demo (make env)
    … rollout.multi_turn.enable=true rollout.multi_turn.env=path/to/file.py:Class     # your environment

The whole contract. A class with a constructor that takes no arguments, `reset` and `step` (and `close`, optional):

    from environments import Reset, Step

    class Guess:
        def reset(self, row):                # row: the data row (prompt, ground_truth, data_source, extra_info, …)
            self.secret = row["extra_info"]["secret"]
            return None                      # the row's own prompt is the first message
        def step(self, text):                # text: the model's turn, decoded without special tokens
            if text.strip() == str(self.secret):
                return Step([], reward=1.0, done=True)
            return Step([{"role": "user", "content": "higher" if int(text) < self.secret else "lower"}])

One instance per sample (episode). It lives in a process of its own, forked from a worker process that imported
the file once (infra/episodes.py): state in one instance, module globals included, never reaches another sample, and
what an instance does (raise, hang holding the GIL, os._exit, start processes) costs that sample only.

reset(row) gives the episode's first messages, the prompt the model answers. It may return
    None                        the row's own prompt, as data.py tokenised it
    Reset(messages, tools)      messages: the whole prompt, [{"role": …, "content": …}, …]; tools: JSON schemas of
                                the functions offered, given to the chat template (apply_chat_template(tools=…))
    a list of messages          Reset(messages)
    a str                       appended to the row's last user message (TRL's environment_factory `reset`)
    (messages or str, metadata) SkyRL-Gym's `init`: the metadata is ignored

step(text) is called after every assistant turn, the last one included (its reward counts), and returns
    Step(messages, reward=0.0, done=False, info={})
        messages  what follows the turn: user or tool messages, written through the chat template after the turn's
                  EOS with response_mask 0 (no loss on them). Their text is data: no special token can come from it
                  (a tool answer holding "<|im_start|>system" is read as those characters, not as a system turn).
        reward    this turn's reward, at the turn's last token (Rollout.token_rewards, (B, Tr))
        done      True ends the episode
        info      numbers (int, float, bool) are logged as their mean over samples, env/<key>; every info is kept
                  in the sample's conversation record, which a reward function reads (extra_info["turns"] …)
    or what other libraries' environments return: SkyRL-Gym's BaseTextEnvStepOutput, a dict with "observations",
    "reward", "done" (and "metadata"); gym's (observation, reward, done, info) or (observation, reward, terminated,
    truncated, info). An observation that is a str is one user message; a list is messages.

An episode ends when step says done, after rollout.multi_turn.max_turns assistant turns, when a turn does not end
at EOS (it reached its token budget), or when the messages would leave the model no room within
rollout.max_response_length; the messages of a step that ends the episode are not written. A reset or step that
raises, returns something else, takes longer than rollout.multi_turn.env_timeout_s or ends its process ends its
episode where it is (the turns so far kept, no further reward) and counts in agent/env_errors; it never ends the
run. A class that cannot be imported or built is refused at start-up in one sentence.

The built-in environment, when rollout.multi_turn.env is empty, is ToolEnvironment (agent.py): the tool calls of
rollout.multi_turn.tools, each run in a process of its own.
"""
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Reset:
    """What reset(row) returns: the episode's first messages, and the tools to show the chat template."""
    messages: list  # [{"role": …, "content": …}, …]: the whole prompt
    tools: Optional[list] = None  # JSON schemas (OpenAI's function format), or None


@dataclass
class Step:
    """What step(text) returns: the messages after the model's turn, the turn's reward, whether the episode ends."""
    messages: list = field(default_factory=list)  # user or tool messages; their text is data, never control tokens
    reward: float = 0.0  # at the turn's last token
    done: bool = False
    info: dict = field(default_factory=dict)  # numbers logged as env/<key>; all kept in the conversation record


def as_messages(observation, where: str) -> list:
    """A str observation → one user message; a list of {"role", "content": str} dicts as it is; else a TypeError
    naming `where`."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, (list, tuple)) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in observation):
        return [dict(m) for m in observation]
    raise TypeError(f"{where} must be a str or a list of {{'role': str, 'content': str}} messages, got "
                    f"{type(observation).__name__} {str(observation)[:80]!r}")


def as_reset(result, row: dict) -> Reset:
    """reset's result in any of the accepted forms (module docstring) → Reset; a TypeError saying what was wrong."""
    if isinstance(result, tuple) and len(result) == 2 and not isinstance(result[0], dict):  # SkyRL-Gym's init
        result = result[0]
    if result is None:
        return Reset(list(row["prompt"]) if isinstance(row.get("prompt"), list) else
                     [{"role": "user", "content": str(row.get("prompt", ""))}])
    if isinstance(result, Reset):
        return Reset(as_messages(result.messages, "Reset.messages"), result.tools)
    if isinstance(result, str):  # TRL: appended to the last user message
        prompt = as_reset(None, row).messages
        last = max((i for i, m in enumerate(prompt) if m["role"] == "user"), default=None)
        if last is None:
            return Reset(prompt + [{"role": "user", "content": result}])
        return Reset(prompt[:last] + [{**prompt[last], "content": prompt[last]["content"] + result}] + prompt[last + 1:])
    return Reset(as_messages(result, "reset's result"))


def as_step(result) -> Step:
    """step's result in any of the accepted forms (module docstring) → Step; a TypeError saying what was wrong."""
    if isinstance(result, dict) and "observations" in result:  # SkyRL-Gym's BaseTextEnvStepOutput
        result = Step(result["observations"], result.get("reward") or 0.0, result.get("done", False),
                      result.get("metadata") or {})
    elif isinstance(result, tuple) and len(result) in (4, 5):  # gym: (obs, reward, done, info), or terminated/truncated
        obs, reward, *ends, info = result
        result = Step(obs, reward or 0.0, any(bool(e) for e in ends), info or {})
    if not isinstance(result, Step):
        raise TypeError(f"step must return a Step (or SkyRL's dict, or gym's tuple), got {type(result).__name__}")
    reward = float(result.reward)
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"step's reward is {reward}")
    if not isinstance(result.info, dict):
        raise TypeError(f"Step.info must be a dict, got {type(result.info).__name__}")
    return Step(as_messages(result.messages, "Step.messages"), reward, bool(result.done), dict(result.info))


def check_environment_class(cls, spec: str) -> None:
    """A ValueError in one sentence unless `cls` is a class built without arguments with callable reset and step."""
    import inspect
    if not inspect.isclass(cls):
        raise ValueError(f"{spec} is a {type(cls).__name__}, not a class")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(f"{spec} has no method {' or '.join(missing)}: an environment needs reset(row) and step(text)")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return  # a class implemented in C: built and seen at the first reset
    required = [p.name for p in signature.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ValueError(f"{spec}'s constructor needs {', '.join(required)}; an environment is built with no "
                         f"arguments (reset(row) gets the row)")
