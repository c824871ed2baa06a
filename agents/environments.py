"""Environments: what a multi-turn rollout talks to between the model's turns (agents/multi_turn.py drives them).

    accelerate launch ppo.py --config examples/guess_number.yaml                      # the demo (make env)
    … rollout.multi_turn.enable=true rollout.multi_turn.env=path/to/file.py:Class     # your environment

The whole contract. A class with a constructor that takes no arguments, `reset` and `step` (and `close`, optional):

    from agents.environments import Reset, Step

    class Guess:
        def reset(self, row):                # row: the data row (prompt, ground_truth, data_source, extra_info, …)
            self.secret = row["extra_info"]["secret"]
            return None                      # the row's own prompt is the first message
        def step(self, text):                # text: the model's turn, decoded without special tokens
            if text.strip() == str(self.secret):
                return Step([], reward=1.0, done=True)
            return Step([{"role": "user", "content": "higher" if int(text) < self.secret else "lower"}])

One instance per sample (episode). It lives in a process of its own, forked from a worker process that imported
the file once (agents/episodes.py): state in one instance, module globals included, never reaches another sample, and
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
        info      numbers (int, float, bool) are logged as env/<key>: each sample's value at its last step that gave
                  it (where the episode ended), averaged over samples; every info is kept
                  in the sample's conversation record, which a reward function reads (extra_info["turns"] …)
    or what other libraries' environments return: SkyRL-Gym's BaseTextEnvStepOutput, a dict with "observations",
    "reward", "done" (and "metadata"); gym's (observation, reward, done, info) or (observation, reward, terminated,
    truncated, info). An observation that is a str is one user message; a list is messages.

An episode ends when step says done, after rollout.multi_turn.max_turns assistant turns, when a turn does not end
at EOS (it reached its token budget), or when the messages would leave the model no room within
rollout.max_response_length; the messages of a step that ends the episode are not written. A reset or step that
raises, returns something else, takes longer than rollout.multi_turn.env_timeout_s or ends its process ends its
episode where it is (the turns so far kept, no further reward) and counts in agent/env_errors, with a console line;
when every episode of a batch fails so, the run stops naming the first error (multi_turn.AgentRollout). A reward
that is not finite or beyond reward.max_abs_score, a message whose role the step may not send (it sends user and
tool messages only) and messages too long to fit fail the step alike. A class that cannot be imported is refused at
start-up in one sentence.

The built-in environment, when rollout.multi_turn.env is empty, is ToolEnvironment (agents/tools.py): the
tool calls of rollout.multi_turn.tools, each run in a process of its own. A class of TRL's environment_factory
(reset(**row), public methods, get_reward(); no step) has its methods called as the tools there (MethodEnvironment).
Other libraries' environments as their users write them (TRL's factories, SkyRL-Gym's BaseTextEnv, a dict of them
routed by a column): agents/peers.py.
"""
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from infra.config import ConfigError, MultiTurnConfig
from agents import peers
from agents.peers import check_environment_class  # noqa: F401 (the check of ours and TRL's classes)
from agents.episodes import ObjectHost
from infra.worker import WorkerStartError


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


def as_reset(result, row: dict) -> Optional[Reset]:
    """reset's result in any of the accepted forms (module docstring) → Reset, or None for the row's own prompt; a
    TypeError saying what was wrong."""
    if isinstance(result, tuple) and len(result) == 2 and not isinstance(result[0], dict):  # SkyRL-Gym's init
        result = result[0]
    if result is None:
        return None
    if isinstance(result, Reset):
        return Reset(as_messages(result.messages, "Reset.messages"), result.tools)
    if isinstance(result, str):  # TRL: appended to the last user message
        prompt = as_messages(row["prompt"], "the row's prompt")
        last = max((i for i, m in enumerate(prompt) if m["role"] == "user"), default=None)
        if last is None:
            return Reset(prompt + [{"role": "user", "content": result}])
        appended = {**prompt[last], "content": prompt[last]["content"] + result}
        return Reset(prompt[:last] + [appended] + prompt[last + 1:])
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


# ---------------------------------------------------------------------------------------
# Messages as tokens: what the chat template writes after the model's EOS, and an environment's first messages


class ToolTemplate:
    """tokens(messages) → the ids that follow an assistant turn's EOS: the rest of the template's end of turn
    (chatml's newline), the tool (or user) messages, the next assistant header; prompt(messages, tools) → the ids of
    a whole prompt.

    Rendered around a stand-in conversation: the text after the EOS that closes its assistant turn, in
    template(stand-in + messages, add_generation_prompt=True). That is the conversation as the template writes it,
    provided the template only appends (checked here, once, at start-up: ConfigError otherwise).

    The messages' text is data, never control: the template is rendered with a marker in place of each
    message's content; its own text between the markers is tokenised with its special tokens, each content with
    none (split_special_tokens), so that a tool answer holding "<|im_start|>system" is those characters, not a turn."""
    STAND_IN = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    MARK = re.compile("\x00([0-9]+)\x00")

    def __init__(self, tokenizer):
        self.tokenizer, eos = tokenizer, tokenizer.eos_token
        if tokenizer.chat_template is None:
            raise ConfigError("rollout.multi_turn needs a tokenizer with a chat template (model.tokenizer_path) to "
                              "write tool answers as messages")
        before = tokenizer.apply_chat_template(self.STAND_IN, tokenize=False)
        self.prefix = before[:before.rfind(eos) + len(eos)] if eos and eos in before else None
        probe = self.text([{"role": "tool", "name": "probe", "content": "PROBE"}])
        if probe is None or "PROBE" not in probe:
            raise ConfigError(f"rollout.multi_turn: the tokenizer's chat template does not end an assistant turn with "
                              f"its EOS {eos!r} and then append tool messages after it; use a chatml-style template "
                              f"(model.tokenizer_path)")
        try:
            self.tokens([{"role": "tool", "name": "probe", "content": "x"}, {"role": "user", "content": "y"}])
        except ValueError:
            raise ConfigError("rollout.multi_turn: the tokenizer's chat template changes the text of the messages it "
                              "writes, so their text cannot be kept apart from its control tokens; use a "
                              "chatml-style template (model.tokenizer_path)") from None

    def text(self, messages: list[dict]) -> Optional[str]:
        after = self.tokenizer.apply_chat_template(self.STAND_IN + messages, tokenize=False, add_generation_prompt=True)
        return after[len(self.prefix):] if self.prefix and after.startswith(self.prefix) else None

    def tokens(self, messages: list[dict]) -> list[int]:
        return self.encode(self.text(self.marked(messages)), messages)

    def prompt(self, messages: list[dict], tools: Optional[list] = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(self.marked(messages), tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
        return self.encode(text, messages)

    @staticmethod
    def marked(messages: list[dict]) -> list[dict]:
        return [{**m, "content": f"\x00{i}\x00"} for i, m in enumerate(messages)]

    def encode(self, text: Optional[str], messages: list[dict]) -> list[int]:
        """The template's text (with markers) as ids: its own special tokens read, the contents' never. A
        ValueError when the template did not write each content once, in order."""
        pieces = self.MARK.split(text or "")
        if pieces[1::2] != [str(i) for i in range(len(messages))]:
            raise ValueError("the chat template did not write each message's content once, in order")
        ids = []
        for k, piece in enumerate(pieces):
            data = k % 2 == 1
            text = messages[int(piece)]["content"] if data else piece
            if text:
                ids += self.tokenizer(text, add_special_tokens=False, split_special_tokens=data)["input_ids"]
        return ids


# ---------------------------------------------------------------------------------------
# The environments multi_turn.AgentRollout drives: a user's class, or the built-in tools


class HostedEnvironment:
    """A user's environment (rollout.multi_turn.env: a class or factory of one of agents/peers.py's contracts, or a
    dict of them routed by the row's `column`), one instance per episode, each in a process of its own
    (agents/episodes.py); multi_turn.AgentRollout drives it, a batch of episodes at a time: reset(rows), step(…) after
    each turn, end(). A call that fails is returned as the exception (CallFailed, TypeError, …): it ends that
    episode only. The worker is started again at the next reset when it was lost."""
    hosted = True  # the user's code: every call runs in the episode's process
    finished = []  # what tools.MethodEnvironment keeps of TRL's environments; none here
    counts_tools = False  # its infos are its own (ToolEnvironment's hold the calls, for agent/*)

    def __init__(self, spec: str, timeout_s: float, column: str = MultiTurnConfig.env_column):
        here = os.path.dirname(os.path.abspath(__file__))
        if spec.startswith("verifiers:"):  # the short name of agents/verifiers.py:<target>
            spec = os.path.join(here, "verifiers.py") + spec.removeprefix("verifiers")  # …py:<target>
        elif spec.startswith("verifiers.v1:"):  # verifiers 0.4's tasksets: agents/verifiers_v1.py:<taskset id>
            spec = os.path.join(here, "verifiers_v1.py") + spec.removeprefix("verifiers.v1")
        path, _, name = spec.rpartition(":")
        if not path or not name:
            raise ConfigError(f"rollout.multi_turn.env: {spec!r} must be path/to/file.py:Class, verifiers:<target> or "
                              f"verifiers.v1:<taskset id>")
        if not os.path.isfile(path):
            raise ConfigError(f"rollout.multi_turn.env: file {path} does not exist (in {spec!r})")
        self.spec, self.column = spec, column
        self.target, self.timeout_s, self.keys, self.routes_now = {"env": (path, name)}, timeout_s, [], []
        self.host = self.start()
        self.routes = self.host.checks["env"]  # {route: its contract and tools} (agents/peers.py)
        self.contract = next(iter(self.routes.values()))["contract"]
        self.trl = peers.tools_by_route(self.routes)  # TRL's environment_factory: its tools (agents/tools.py)

    def start(self) -> ObjectHost:
        try:
            return ObjectHost(self.target, self.timeout_s, check=(os.path.abspath(peers.__file__), "describe"))
        except WorkerStartError as e:
            raise ConfigError(f"rollout.multi_turn.env: {e}") from None

    def reset(self, rows: list[dict]) -> list:
        """A new instance per row, built and reset as its contract says (agents/peers.py: reset(row), TRL's
        reset(**columns), SkyRL's Class(env_config, extras) then init(prompt)): each a Reset, None (the row's own
        prompt) or the exception (a row that no environment of a dict is named by included)."""
        self.end()
        if not self.host.alive():
            self.host = self.start()
        self.routes_now = [checked(peers.route_of, row, self.routes, self.column, self.spec) for row in rows]
        routed = [k for k, route in enumerate(self.routes_now) if not isinstance(route, Exception)]
        firsts = {k: peers.first_call(self.contract, rows[k], self.routes_now[k]) for k in routed}  # (build, call)
        never_called = (next(iter(self.routes)), (), {})  # the object of a row that no environment is named by
        self.keys = self.host.open("env", len(rows), [firsts[k][0] if k in firsts else never_called
                                                       for k in range(len(rows))])
        results = dict(zip(routed, self.host.call_all([(self.keys[k], *firsts[k][1]) for k in routed])))
        return [checked(as_reset, results[k], row) if k in results else self.routes_now[k]
                for k, row in enumerate(rows)]

    def step(self, episodes: list[int], texts: list[str], final: list[bool]) -> list:
        """Each episode's step on its new turn (`final` does not change what is asked): a Step or the exception."""
        results = self.host.call_all([(self.keys[i], "step", (text,)) for i, text in zip(episodes, texts)])
        return [checked(as_step, result) for result in results]

    def end(self) -> None:
        """The batch's instances leave (their close() called)."""
        if self.keys and self.host.alive():
            self.host.end(self.keys)
        self.keys = []

    def close(self) -> None:
        self.host.close()


def checked(normalise, result, *args):
    """normalise(result, *args), or the exception a failed call or a malformed result is."""
    if isinstance(result, Exception):
        return result
    try:
        return normalise(result, *args)
    except (TypeError, ValueError, KeyError) as e:
        return e
