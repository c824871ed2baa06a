"""Multi-turn rollouts: the model calls tools, reads their answers and goes on (verl's tool agent loop, in one file).

    accelerate launch ppo.py --config examples/agent_calculator.yaml        # the demo (make agent)
    … rollout.multi_turn.enable=true rollout.multi_turn.tools=[path/to/tools.py:search]   # Hermes-format calls

`AgentRollout` wraps any rollout backend (rollout.KINDS) and runs up to `max_turns` assistant turns per
sample. A turn ends at EOS; the tool calls written in it (PARSERS) run (run_tools), their answers are appended as tool
messages through the tokenizer's chat template (ToolTemplate), and the model goes on from there: the next turn's
prompt is the whole row so far, so vLLM's prefix cache holds the turns before it. Each response is one token row:

    responses       turn 1 (model) | tool answer, next header | turn 2 (model) | … | padding
    response_mask   1 … 1          | 0 … 0                    | 1 … 1          | … | 0     loss, KL, entropy
    attention_mask  1 … 1          | 1 … 1                    | 1 … 1          | … | 0     what the forwards see
    logprobs        the sampler's on the model's tokens, 0 elsewhere (None with HF)

so the trainer's forward over the row sees at every model token exactly what the sampler saw.
rollout.max_response_length bounds the whole row. Each sample's conversation (Episode.record: the turns, the tool
calls, their results, num_turns) is what the reward function finds in extra_info (rewards.py).

Departures from verl 0.9.1's ToolAgentLoop: a call that cannot be read is answered with an error message (verl drops
it); the tokens after the model's EOS come from the chat template rendered around the tool messages (verl renders
them alone and, for Qwen, inserts the newline between turns by a model-specific builder).
"""
import importlib.util
import json
import os
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from infra.config import ConfigError
from infra.distributed import max_over_processes
from rollout import right_pad, Rollout

# ---------------------------------------------------------------------------------------
# Tool calls, as the model writes them


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


# ---------------------------------------------------------------------------------------
# The tools: plain Python functions, each run in a thread with a timeout


def load_tools(specs: list[str]) -> dict[str, Callable]:
    """{function name: function} for each `path/to/file.py:function` of rollout.multi_turn.tools; a ConfigError
    naming the key otherwise."""
    tools = {}
    for spec in specs:
        path, _, name = spec.rpartition(":")
        if not path or not name:
            raise ConfigError(f"rollout.multi_turn.tools: {spec!r} must be path/to/file.py:function")
        if not os.path.isfile(path):
            raise ConfigError(f"rollout.multi_turn.tools: file {path} does not exist (in {spec!r})")
        module_name = "agent_tools_" + re.sub(r"\W", "_", os.path.splitext(os.path.abspath(path))[0])
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = sys.modules[module_name] = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise ConfigError(f"rollout.multi_turn.tools: importing {path} failed: {type(e).__name__}: {e}") from e
        if not callable(getattr(module, name, None)):
            raise ConfigError(f"rollout.multi_turn.tools: {path} has no function `{name}`")
        tools[name] = getattr(module, name)
    return tools


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads
    ok: bool  # False: the call was malformed, raised or timed out (the text says which)


def run_tools(calls: list[ToolCall], tools: dict, timeout: float, max_chars: int) -> list[ToolResult]:
    """Each call's answer: str(tool(**arguments)) (hermes) or str(tool(text)) (tag), cut to max_chars. All calls
    run at once, each in a daemon thread given `timeout` seconds; one that raises or runs longer answers an error.
    Python cannot stop a thread, so a tool that never returns is left running (it does not keep the run alive)."""
    answers = [None] * len(calls)

    def call_one(i, call):
        try:
            fn = tools[call.name]
            answers[i] = ToolResult(str(fn(**call.arguments) if isinstance(call.arguments, dict)
                                        else fn(call.arguments)), True)
        except Exception as e:
            answers[i] = ToolResult(f"error: {type(e).__name__}: {e}", False)

    threads = []
    for i, call in enumerate(calls):
        if call.error:
            answers[i] = ToolResult(f"error: {call.error}", False)
        else:
            threads.append(threading.Thread(target=call_one, args=(i, call), daemon=True))
            threads[-1].start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    answers = [a if a is not None else ToolResult(f"error: the tool took longer than {timeout} s", False)
               for a in answers]
    return [a if len(a.text) <= max_chars else ToolResult(a.text[:max_chars] + "...(truncated)", a.ok)
            for a in answers]


# ---------------------------------------------------------------------------------------
# Tool answers as tokens: what the chat template writes after the model's EOS


class ToolTemplate:
    """tokens(tool messages) → the ids that follow an assistant turn's EOS: the rest of the template's end of turn
    (chatml's newline), the tool messages, the next assistant header.

    Rendered around a stand-in conversation: the text after the EOS that closes its assistant turn, in
    template(stand-in + tool messages, add_generation_prompt=True). That is the conversation as the template writes
    it, provided the template only appends (checked here, once, at start-up: ConfigError otherwise)."""
    STAND_IN = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

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

    def text(self, messages: list[dict]) -> Optional[str]:
        after = self.tokenizer.apply_chat_template(self.STAND_IN + messages, tokenize=False, add_generation_prompt=True)
        return after[len(self.prefix):] if self.prefix and after.startswith(self.prefix) else None

    def tokens(self, messages: list[dict]) -> list[int]:
        return self.tokenizer(self.text(messages), add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------
# One sample's conversation, and the loop over turns


@dataclass
class Episode:
    """One sample's response row as it grows, and the record the reward reads."""
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # the response row: the model's and the tools' tokens
    mask: list[int] = field(default_factory=list)  # 1 = the model's token
    logprobs: list[float] = field(default_factory=list)  # the sampler's; 0.0 on tool tokens
    turns: list[dict] = field(default_factory=list)  # the messages after the prompt, assistant and tool
    tool_calls: list[dict] = field(default_factory=list)  # each call that ran: name, arguments, error
    tool_results: list[str] = field(default_factory=list)  # its answer, in the same order
    pending: list[ToolCall] = field(default_factory=list)  # calls of the last turn, when it ended at EOS
    well_formed: int = 0  # calls written that could be run (the last turn's included)
    malformed: int = 0  # calls written that could not
    tool_errors: int = 0  # calls that ran and raised or timed out
    tool_rounds: int = 0  # turns whose calls ran (each answered by one or more tool messages)

    def record(self) -> dict:
        """What rewards.py adds to extra_info."""
        assistant_turns = sum(m["role"] == "assistant" for m in self.turns)
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_results": self.tool_results,
                "num_turns": 1 + assistant_turns + self.tool_rounds}  # as verl counts: the prompt is one


@dataclass(frozen=True)
class TurnSettings:
    """What AgentRollout reads of rollout.multi_turn, with the loaded tools."""
    max_turns: int
    max_length: int  # rollout.max_response_length: the whole row
    parse: Callable  # PARSERS[format]
    tools: dict
    tool_timeout: float
    max_tool_chars: int


def turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    """The seed of turn ≥ 2's generate call, drawn from (seed, turn): a rerun samples the same conversations."""
    return None if seed is None else random.Random(f"{seed}/turn{turn}").randrange(2**31)


class AgentRollout:
    """A backend's generate, turn after turn; its Rollout carries the attention mask, the conversations and agent/*
    metrics beside the usual fields. `reduce_max` makes every process run the same number of generate calls of the
    same size (HF generate under FSDP2 is a collective): a process with fewer waiting samples pads with stand-ins."""

    def __init__(self, backend, tokenizer, settings: TurnSettings, reduce_max: Callable[[int], int] = lambda x: x):
        self.backend, self.tokenizer, self.s, self.reduce_max = backend, tokenizer, settings, reduce_max
        self.template = ToolTemplate(tokenizer)
        self.eos_ids = backend.eos_ids

    def sync_weights(self, model, version: int = 0) -> None:
        self.backend.sync_weights(model, version)

    def close(self) -> None:
        self.backend.close()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, temperature: float, seed: Optional[int] = None) -> Rollout:
        s = self.s
        episodes = [Episode(p) for p in prompts for _ in range(n)]  # row i·n + j: sample j of prompt i
        first = self.backend.generate(prompts, n, temperature, seed=seed)
        self.add_turns(episodes, first, last=s.max_turns == 1)
        for turn in range(2, s.max_turns + 1):
            waiting = self.answer_calls([e for e in episodes if e.pending])
            count = self.reduce_max(len(waiting))  # the same on every process
            if count == 0:
                break
            stand_ins = count - len(waiting)
            stand_in = prompts[0] if prompts else [self.tokenizer.pad_token_id]  # this process may have none
            contexts = [e.prompt + e.tokens for e in waiting] + [stand_in] * stand_ins
            budgets = [s.max_length - len(e.tokens) for e in waiting] + [1] * stand_ins
            out = self.backend.generate(contexts, 1, temperature, seed=turn_seed(seed, turn), max_tokens=budgets)
            self.add_turns(waiting, out, last=turn == s.max_turns)
        responses, attention_mask = right_pad([e.tokens for e in episodes], self.tokenizer.pad_token_id)  # (B·n, Tr)
        response_mask, _ = right_pad([e.mask for e in episodes], 0)  # (B·n, Tr)
        logprobs = None  # HF has none
        if first.logprobs is not None:
            logprobs, _ = right_pad([e.logprobs for e in episodes], 0.0, dtype=torch.float32)  # (B·n, Tr)
        return Rollout(responses, response_mask, logprobs, attention_mask=attention_mask,
                       conversations=[e.record() for e in episodes], metrics=agent_metrics(episodes))

    def add_turns(self, episodes: list[Episode], out: Rollout, last: bool) -> None:
        """Append each episode's new model turn (row k of `out`) and read the calls in it; they wait for the next
        turn (pending) unless this is the last one or the turn did not end at EOS."""
        for k, e in enumerate(episodes):
            tokens = out.responses[k, :int(out.response_mask[k].sum())].tolist()
            e.tokens += tokens
            e.mask += [1] * len(tokens)
            e.logprobs += out.logprobs[k, :len(tokens)].tolist() if out.logprobs is not None else []
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            e.turns.append({"role": "assistant", "content": text})
            calls = self.s.parse(text, self.s.tools.keys())
            e.well_formed += sum(c.error is None for c in calls)
            e.malformed += sum(c.error is not None for c in calls)
            ended = bool(tokens) and tokens[-1] in self.eos_ids
            e.pending = calls if ended and not last else []

    def answer_calls(self, episodes: list[Episode]) -> list[Episode]:
        """Run every pending call of these episodes at once and append the answers as tool tokens (mask 0); return
        the episodes that go on: those whose answers leave room for at least one more token of the model."""
        calls = [c for e in episodes for c in e.pending]
        results = iter(run_tools(calls, self.s.tools, self.s.tool_timeout, self.s.max_tool_chars))
        going_on = []
        for e in episodes:
            answers = [(call, next(results)) for call in e.pending]
            e.pending = []
            messages = [{"role": "tool", "name": call.name, "content": r.text} for call, r in answers]
            ids = self.template.tokens(messages)
            if len(e.tokens) + len(ids) >= self.s.max_length:
                continue  # no room left to read the answers and reply: the episode ends at its call
            e.tokens += ids
            e.mask += [0] * len(ids)
            e.logprobs += [0.0] * len(ids)  # unused with HF, which has no sampler logprobs
            e.turns += messages
            e.tool_calls += [{"name": c.name, "arguments": c.arguments, "error": c.error} for c, _ in answers]
            e.tool_results += [r.text for _, r in answers]
            e.tool_errors += sum(not r.ok and c.error is None for c, r in answers)
            e.tool_rounds += 1
            going_on.append(e)
        return going_on


def agent_metrics(episodes: list[Episode]) -> dict:
    """Means over this process's samples: assistant turns, calls run, tool tokens, and the shares of samples that
    wrote at least one call that could be run (well-formed) or could not (malformed), tool errors per sample."""
    def mean(values):
        values = list(values)
        return sum(values) / max(1, len(values))
    return {"agent/turns_mean": mean(sum(m["role"] == "assistant" for m in e.turns) for e in episodes),
            "agent/tool_calls_mean": mean(len(e.tool_calls) for e in episodes),
            "agent/tool_tokens_mean": mean(len(e.mask) - sum(e.mask) for e in episodes),
            "agent/well_formed_share": mean(e.well_formed > 0 for e in episodes),
            "agent/malformed_share": mean(e.malformed > 0 for e in episodes),
            "agent/tool_errors_mean": mean(e.tool_errors for e in episodes)}


# ---------------------------------------------------------------------------------------
# What ppo.py calls


def check_multi_turn(cfg_rollout, tokenizer) -> Optional[TurnSettings]:
    """Before any model loads: the tools import, the chat template can write tool messages; None when
    rollout.multi_turn is off."""
    m = cfg_rollout.multi_turn
    if not m.enable:
        return None
    if not m.tools:
        raise ConfigError("rollout.multi_turn.enable=true needs tools: rollout.multi_turn.tools=[path/to/file.py:fn]")
    if m.format not in PARSERS:
        raise ConfigError(f"rollout.multi_turn.format={m.format!r} is not one of {', '.join(PARSERS)}")
    ToolTemplate(tokenizer)
    return TurnSettings(m.max_turns, cfg_rollout.max_response_length, PARSERS[m.format], load_tools(m.tools),
                        m.tool_timeout_s, m.max_tool_response_length)


def with_tools(backend, cfg_rollout, tokenizer):
    """`backend` itself, or with rollout.multi_turn on, an AgentRollout around it whose turns are counted over
    every process; not with rollout.steps_ahead, whose turns run in a thread beside the loop's collectives (a backend
    that runs ahead has weights of its own and makes no collective call: rollout.check_rollout)."""
    settings = check_multi_turn(cfg_rollout, tokenizer)
    reduce_max = (lambda count: count) if cfg_rollout.steps_ahead else max_over_processes
    return backend if settings is None else AgentRollout(backend, tokenizer, settings, reduce_max)


def with_conversations(rows: list[dict], ro: Rollout) -> list[dict]:
    """rows with each sample's conversation under "conversation" (the reward's extra_info: rewards.py), when the
    rollout had turns."""
    if ro.conversations is None:
        return rows
    return [{**row, "conversation": c} for row, c in zip(rows, ro.conversations)]


def transcript(row: dict, text: str) -> str:
    """The sample table's response: every turn and tool answer, joined by ⟶, or the response itself."""
    if "conversation" not in row:
        return text
    return " ⟶ ".join(m["content"] for m in row["conversation"]["turns"])
