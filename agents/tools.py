"""Environments whose turns are tool calls: the built-in one (rollout.multi_turn.tools, plain functions) and TRL's
environment_factory classes (rollout.multi_turn.env=path.py:Class, whose public methods are the tools). Both follow
agents/environments.py's contract, batched as multi_turn.AgentRollout drives it; the calls are read from a turn's
text by the parser of rollout.multi_turn.format (PARSERS below: hermes, tag) and every call runs in a process
(agents/episodes.py), killed after its timeout.
"""
import json
import math
import numbers
import os
import re
from dataclasses import dataclass, replace
from typing import Optional, Union

from agents.environments import as_messages, HostedEnvironment, Reset, Step
from infra.config import ConfigError
from agents.episodes import ObjectHost
from infra.worker import CallFailed, WorkerStartError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Union[dict, str]  # hermes: the keyword arguments; tag: the text between the tags
    error: Optional[str] = None  # why the call cannot be run (malformed, unknown tool): the model is told so


HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str, names) -> list[ToolCall]:
    """Every <tool_call>{"name": …, "arguments": {…}}</tool_call> in text (Qwen2.5's format, verl's `hermes`
    parser). JSON that does not parse (nested too deep for Python's parser included), a name that is not a string,
    missing arguments, an unknown tool or an unclosed tag → a ToolCall with its error. A lone surrogate escape in the
    JSON ("\\ud800", which no UTF-8 text can hold, so a tokenizer would fail on it) becomes U+FFFD."""
    calls = []
    for body in HERMES.findall(text):
        try:
            call = clean_surrogates(json.loads(body))
            name, arguments = call["name"], call["arguments"]
            arguments = clean_surrogates(json.loads(arguments)) if isinstance(arguments, str) else arguments
            if not isinstance(name, str):
                raise TypeError(f"the name must be a string, not {type(name).__name__}")
            if not isinstance(arguments, dict):
                raise TypeError("arguments must be a JSON object")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            calls.append(ToolCall("?", body, f"the call is not {{\"name\": …, \"arguments\": {{…}}}} JSON "
                                             f"({type(e).__name__}: {str(e)[:200]})"))
            continue
        calls.append(ToolCall(name, arguments, None if name in names else
                              f"there is no tool named {name[:100]!r}; the tools are {', '.join(sorted(names))}"))
    if text.count("<tool_call>") > len(HERMES.findall(text)):
        calls.append(ToolCall("?", text[text.rfind("<tool_call>"):], "a <tool_call> is not closed by </tool_call>"))
    return calls


def clean_surrogates(value):
    """`value` (parsed JSON) with every lone surrogate in its strings, keys included, replaced by U+FFFD."""
    if isinstance(value, str):
        return SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [clean_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {clean_surrogates(k): clean_surrogates(v) for k, v in value.items()}
    return value


SURROGATE = re.compile("[\ud800-\udfff]")


def parse_tag(text: str, names) -> list[ToolCall]:
    """Every <name>text</name> for a tool `name` in text, the function to be called with the stripped text: a
    format a small model learns from one example. An opening tag that is never closed → a ToolCall with its error."""
    calls = []
    for name in sorted(names):
        for match in re.finditer(f"<{re.escape(name)}>(.*?)(</{re.escape(name)}>|$)", text, re.DOTALL):
            closed = bool(match.group(2))
            calls.append((match.start(), ToolCall(name, match.group(1).strip(),
                                                  None if closed else f"<{name}> is not closed by </{name}>")))
    return [call for _, call in sorted(calls, key=lambda c: c[0])]


PARSERS = {"hermes": parse_hermes, "tag": parse_tag}  # rollout.multi_turn.format → (text, tool names) → calls


def tool_targets(specs: list[str]) -> dict[str, tuple[str, str]]:
    """{function name: (file, function name)} for each `path/to/file.py:function` of rollout.multi_turn.tools; a
    ConfigError naming the key otherwise."""
    targets = {}
    for spec in specs:
        path, _, name = spec.rpartition(":")
        if not path or not name:
            raise ConfigError(f"rollout.multi_turn.tools: {spec!r} must be path/to/file.py:function")
        if not os.path.isfile(path):
            raise ConfigError(f"rollout.multi_turn.tools: file {path} does not exist (in {spec!r})")
        targets[name] = (path, name)
    return targets


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads
    ok: bool  # False: the call was malformed, raised, timed out or ended its process (the text says which)


def run_tools(calls: list, host: ObjectHost, max_chars: int, owners: list = None) -> list[ToolResult]:
    """Each call's answer: str(tool(**arguments)) (hermes) or str(tool(text)) (tag), cut to max_chars. All calls run
    at once, each in a process of its own (agents/episodes.py) killed after rollout.multi_turn.tool_timeout_s: a call
    that raises, hangs, or ends its process answers an error, and what it started is ended with the run. owners:
    for each call, the key of the object whose method it calls (TRL's environments), instead of a new process."""
    runnable = [i for i, call in enumerate(calls) if call.error is None]
    keys = [owners[i] for i in runnable] if owners else [key for i in runnable for key in host.open(calls[i].name, 1)]
    outcomes = host.call_all([(key, None if owners is None else calls[i].name,
                               () if isinstance(calls[i].arguments, dict) else (calls[i].arguments,),
                               calls[i].arguments if isinstance(calls[i].arguments, dict) else {})
                              for key, i in zip(keys, runnable)])
    if owners is None:
        host.end(keys)
    answers = [ToolResult(f"error: {call.error}", False) for call in calls]
    for i, outcome in zip(runnable, outcomes):
        timed_out = isinstance(outcome, CallFailed) and str(outcome).startswith("TimeoutError")
        answers[i] = (ToolResult(f"error: the tool took longer than {host.timeout_s:g} s", False) if timed_out else
                      ToolResult(f"error: {outcome}", False) if isinstance(outcome, CallFailed) else
                      ToolResult(str(outcome), True))
    return [a if len(a.text) <= max_chars else ToolResult(a.text[:max_chars] + "...(truncated)", a.ok)
            for a in answers]


class ToolEnvironment:
    """The built-in environment (the contract above, batched as HostedEnvironment): no state and no reward. A turn's
    tool calls are answered by tool messages, and a turn that writes none ends the episode; at most max_calls of a
    turn run, the rest are answered with an error, so that one turn's tool work is bounded. A final turn's calls are
    counted but not run."""
    hosted = False  # the library's own code: it runs here, its tools in their processes
    finished = []  # TRL's environments as the episodes left them (MethodEnvironment.end)
    counts_tools = True  # its infos hold the calls: agent/* metrics and the record's tool_calls, tool_results

    def __init__(self, specs: list[str], parse, timeout_s: float, max_chars: int, max_calls: int):
        self.targets, self.timeout_s = tool_targets(specs), timeout_s
        self.parse, self.names, self.max_chars, self.max_calls = parse, set(self.targets), max_chars, max_calls
        self.host = self.start()

    def start(self) -> ObjectHost:
        try:
            return ObjectHost(self.targets, self.timeout_s)
        except WorkerStartError as e:
            raise ConfigError(f"rollout.multi_turn.tools: {e}") from None

    def reset(self, rows: list[dict]) -> list:
        return [None] * len(rows)  # the rows' own prompts

    def step(self, episodes: list[int], texts: list[str], final: list[bool]) -> list[Step]:
        if not self.host.alive():  # the worker itself was lost (its calls answered errors): a new one
            self.host = self.start()
        parsed = [self.parse(text, self.names) for text in texts]
        over = f"not run: more than {self.max_calls} calls in one turn (rollout.multi_turn.max_calls_per_turn)"
        calls = [[c if k < self.max_calls else replace(c, error=over) for k, c in enumerate(turn)]
                 for turn, last in zip(parsed, final) if not last]
        owners = [i for i, last in zip(episodes, final) if not last]
        results = iter(self.run([c for turn in calls for c in turn],
                                [i for i, turn in zip(owners, calls) for _ in turn]))
        steps, ran = [], iter(calls)
        for turn, last in zip(parsed, final):
            well_formed = sum(c.error is None for c in turn)
            info = {"well_formed": well_formed, "malformed": len(turn) - well_formed}
            if last:
                steps.append(Step([], done=True, info=info))
                continue
            answers = [(call, next(results)) for call in next(ran)]
            failed = [f"{c.name}: {r.text}" for c, r in answers if not r.ok and c.error is None]
            steps.append(Step([{"role": "tool", "name": c.name, "content": r.text} for c, r in answers],
                              done=not answers, info={**info, "tool_calls": [
                                  {"name": c.name, "arguments": c.arguments, "error": c.error} for c, _ in answers],
                                  "tool_results": [r.text for _, r in answers], "tool_errors": len(failed),
                                  "calls_run": sum(c.error is None for c, _ in answers), "failed_calls": failed}))
        return steps

    def run(self, calls: list, episodes: list[int]) -> list[ToolResult]:
        """The calls' answers, each call in a new process."""
        return run_tools(calls, self.host, self.max_chars)

    def end(self) -> None:
        pass

    def close(self) -> None:
        self.host.close()


def as_reward(value) -> float:
    """get_reward()'s value as a finite float, or a TypeError / ValueError saying what it returned."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"get_reward() returned {type(value).__name__} {repr(value)[:80]}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"get_reward() returned {value}, not a finite number")
    return float(value)


class MethodEnvironment(ToolEnvironment):
    """TRL's environment_factory (a class, or any factory of one; a dict of them routed by a column: agents/peers.py):
    one instance per episode in its process (HostedEnvironment), reset as TRL calls it, reset(**columns) (None, or a
    str appended to the last user message); its public methods are the tools, called on the episode's own instance,
    and shown to the chat template as TRL shows them (their JSON schemas, where transformers can read their
    docstrings); a turn that calls none ends the episode, paid get_reward() if the class has it."""
    hosted = True

    def __init__(self, env: HostedEnvironment, parse, max_chars: int, max_calls: int):
        self.env, self.host, self.parse, self.max_chars, self.max_calls = env, env.host, parse, max_chars, max_calls
        self.names = set().union(*(names for names, _, _ in env.trl.values()))
        self.by_route = env.trl  # {route: (tool names, schemas or None, has get_reward)}
        self.schemas = [s for _, schemas, _ in env.trl.values() for s in schemas or []]  # every route's

    def start(self) -> ObjectHost:
        return self.host  # lost mid-batch: its calls fail, and the next reset starts a new one

    def reset(self, rows: list[dict]) -> list:
        resets = self.env.reset(rows)
        self.host = self.env.host
        schemas = [None if isinstance(route, Exception) else self.by_route[route][1] for route in self.env.routes_now]
        return [r if isinstance(r, Exception) or not tools else
                Reset((r or Reset(as_messages(row["prompt"], "the row's prompt"))).messages, tools)
                for r, row, tools in zip(resets, rows, schemas)]

    def run(self, calls: list, episodes: list[int]) -> list[ToolResult]:
        return run_tools(calls, self.host, self.max_chars, owners=[self.env.keys[i] for i in episodes])

    def step(self, episodes: list[int], texts: list[str], final: list[bool]) -> list[Step]:
        steps = super().step(episodes, texts, final)
        routes = self.env.routes_now
        done = [k for k, step in enumerate(steps) if step.done and self.by_route[routes[episodes[k]]][2]]
        if done:
            rewards = self.host.call_all([(self.env.keys[episodes[k]], "get_reward", ()) for k in done])
            for k, reward in zip(done, rewards):
                try:
                    steps[k] = reward if isinstance(reward, Exception) else replace(steps[k], reward=as_reward(reward))
                except (TypeError, ValueError) as e:
                    steps[k] = e
        return steps

    def end(self) -> None:
        """The episodes' instances leave; first each one's attributes (vars, as it ended) are kept in self.finished,
        by episode, for the reward to read (TRL hands them to reward functions as environments=): None for one whose
        state cannot be sent back."""
        keys = self.env.keys
        states = self.host.call_all([(key, "__getstate__", ()) for key in keys]) if keys and self.host.alive() else []
        self.finished = [state if isinstance(state, dict) else None for state in states]
        self.env.end()

    def close(self) -> None:
        self.env.close()
