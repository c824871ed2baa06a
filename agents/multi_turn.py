"""Multi-turn rollouts: the model's turns, an environment's answers between them (verl's tool agent loop, in one file).

    accelerate launch ppo.py --config examples/agent_calculator.yaml        # tools (make agent)
    accelerate launch ppo.py --config examples/guess_number.yaml            # an environment (make env)

`AgentRollout` wraps a rollout backend (rollout.py) and runs up to `max_turns` assistant turns per sample. A turn
ends at EOS; the environment (agents/environments.py: the user's class, or the built-in ToolEnvironment running the tool
calls written in the turn, tools.PARSERS) answers it with messages, a reward and whether the episode is done; the
messages are appended through the tokenizer's chat template (ToolTemplate, their text never read as control tokens),
and the model goes on from there: the next turn's prompt is the whole row so far, so vLLM's prefix cache holds the
turns before it. Each response is one token row:

    responses       turn 1 (model) | answer, next header | turn 2 (model) | … | padding
    response_mask   1 … 1          | 0 … 0               | 1 … 1          | … | 0     loss, KL, entropy
    attention_mask  1 … 1          | 1 … 1               | 1 … 1          | … | 0     what the forwards see
    logprobs        the sampler's on the model's tokens, 0 elsewhere (None with HF)
    token_rewards   each turn's reward at its last token (None when no turn had one)

so the trainer's forward over the row sees at every model token exactly what the sampler saw.
rollout.max_response_length bounds the whole row. Each sample's conversation (Episode.record) is what the reward
function finds in extra_info (rewards.py).

Departures from verl 0.9.1's ToolAgentLoop: a call that cannot be read is answered with an error message (verl drops
it); the tokens after the model's EOS come from the chat template rendered around the messages (verl renders
them alone and, for Qwen, inserts the newline between turns by a model-specific builder).
"""
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from agents.environments import HostedEnvironment, ToolTemplate
from agents.limits import bounded, check_messages, RESET_ROLES, STEP_ROLES
from agents.peers import route_of
from agents.tools import MethodEnvironment, PARSERS, ToolEnvironment
from infra.cli import warn0
from infra.config import ConfigError
from infra.worker import CallFailed
from infra.rollout_common import right_pad, Rollout
from rewards import count_failures, RewardError

# ---------------------------------------------------------------------------------------
# One sample's conversation, and the loop over turns


@dataclass
class Episode:
    """One sample's response row as it grows, and the record the reward reads."""
    prompt: list[int]
    index: int  # its environment's (the row i·n + j of the rollout)
    tokens: list[int] = field(default_factory=list)  # the response row: the model's and the messages' tokens
    mask: list[int] = field(default_factory=list)  # 1 = the model's token
    logprobs: list[float] = field(default_factory=list)  # the sampler's; 0.0 on the messages' tokens
    turns: list[dict] = field(default_factory=list)  # the messages after the prompt, assistant, tool and user
    tool_calls: list[dict] = field(default_factory=list)  # each call that ran: name, arguments, error
    tool_results: list[str] = field(default_factory=list)  # its answer, in the same order
    rewards: list[tuple[int, float]] = field(default_factory=list)  # (position of the turn's last token, reward)
    infos: list[dict] = field(default_factory=list)  # each step's info
    fresh: bool = False  # its last turn waits for the environment's answer
    going_on: bool = False  # its last turn was answered with messages: it waits for the model's next turn
    ended_at_eos: bool = False  # its last turn did
    error: Optional[str] = None  # why its environment failed: the episode ended there
    well_formed: int = 0  # calls written that could be run (the last turn's included)
    malformed: int = 0  # calls written that could not
    tool_errors: int = 0  # calls that ran and raised or timed out
    tool_rounds: int = 0  # turns answered by messages (one or more)
    calls_run: int = 0  # tool calls that ran (well-formed, within max_calls_per_turn, not the final turn's)
    failed_calls: list[str] = field(default_factory=list)  # the answers of those that failed

    def record(self, hosted: bool) -> dict:
        """What rewards.py adds to extra_info; with an environment of the user's (hosted), its rewards, infos and
        error too."""
        assistant_turns = sum(m["role"] == "assistant" for m in self.turns)
        record = {"turns": self.turns, "tool_calls": self.tool_calls, "tool_results": self.tool_results,
                  "num_turns": 1 + assistant_turns + self.tool_rounds}  # as verl counts: the prompt is one
        if hosted:
            record.update(rewards=[r for _, r in self.rewards], infos=self.infos, env_error=self.error)
        return record


@dataclass(frozen=True)
class TurnSettings:
    """What AgentRollout reads of rollout.multi_turn, with the environment."""
    max_turns: int
    max_length: int  # rollout.max_response_length: the whole row
    max_prompt_length: int  # data.max_prompt_length: an environment's first messages
    environment: object  # environments.HostedEnvironment, or tools.py's ToolEnvironment, MethodEnvironment
    max_abs_score: float = math.inf  # reward.max_abs_score: the bound of every step's reward
    source: str = "rollout.multi_turn"  # what a failure names: the environment's or the tools' key and value

    def metric_names(self) -> list[str]:
        """The agent/* names a rollout logs (validation logs them as val/agent/*)."""
        return list(agent_metrics([], self.environment.hosted))


def turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    """The seed of turn ≥ 2's generate call, drawn from (seed, turn): a rerun samples the same conversations."""
    return None if seed is None else random.Random(f"{seed}/turn{turn}").randrange(2**31)


class AgentRollout:
    """A backend's generate, turn after turn, an environment answering each turn; its Rollout carries the attention
    mask, the conversations, the environment's rewards at each turn's last token and agent/* metrics beside the usual
    fields. `reduce_max` makes every process run the same number of generate calls of the same size (HF generate
    under FSDP2 is a collective): a process with fewer waiting samples pads with stand-ins."""

    def __init__(self, backend, tokenizer, settings: TurnSettings, reduce_max: Callable[[int], int] = lambda x: x):
        self.backend, self.tokenizer, self.s, self.reduce_max = backend, tokenizer, settings, reduce_max
        self.template = ToolTemplate(tokenizer)
        self.eos_ids = backend.eos_ids

    def sync_weights(self, *args) -> None:
        self.backend.sync_weights(*args)

    def close(self) -> None:
        self.s.environment.close()
        self.backend.close()

    @torch.no_grad()
    def generate(self, rows: list[dict], n: int, temperature: float, seed: Optional[int] = None) -> Rollout:
        """rows: the prompts' data rows, which the environment's reset reads."""
        s, env, prompts = self.s, self.s.environment, [row["prompt_ids"] for row in rows]
        episodes = [Episode(p, i * n + j) for i, p in enumerate(prompts) for j in range(n)]  # sample j of prompt i
        self.reset(episodes, [row for row in rows for _ in range(n)])
        try:
            if all(e.prompt is prompts[e.index // n] for e in episodes):
                first = self.backend.generate(rows, n, temperature, seed=seed)
            else:  # the environment wrote its own first messages
                first = self.backend.generate([{**rows[e.index // n], "prompt_ids": e.prompt} for e in episodes], 1,
                                              temperature, seed=seed)
            self.add_turns(episodes, first)
            for turn in range(2, s.max_turns + 2):
                self.answer([e for e in episodes if e.fresh and e.error is None], last=turn > s.max_turns)
                waiting = [e for e in episodes if e.going_on]
                count = self.reduce_max(len(waiting)) if turn <= s.max_turns else 0  # the same on every process
                if count == 0:
                    break
                stand_ins = count - len(waiting)
                stand_in = prompts[0] if prompts else [self.tokenizer.pad_token_id]  # this process may have none
                contexts = [{"prompt_ids": e.prompt + e.tokens, "max_tokens": s.max_length - len(e.tokens)}
                            for e in waiting] + [{"prompt_ids": stand_in, "max_tokens": 1}] * stand_ins
                out = self.backend.generate(contexts, 1, temperature, seed=turn_seed(seed, turn))
                self.add_turns(waiting, out)
        finally:
            env.end()
        self.stop_when_all_failed(episodes)
        return self.rollout(episodes, first.logprobs is not None, prompts, n)

    def stop_when_all_failed(self, episodes: list[Episode]) -> None:
        """rewards.count_failures' rule for the environment (episodes whose reset or step failed) and the tools
        (calls that ran and failed): all of a batch failed, on any process → RewardError on every process (training on
        would learn from first turns alone); some → a console line, counted in agent/env_errors_share and
        agent/tool_errors_mean."""
        env, checks = self.s.environment, []
        if env.hosted:
            errors = [e.error for e in episodes if e.error]
            checks.append((self.s.source, len(errors), len(episodes), errors[:1], "samples"))
        if env.counts_tools:
            failed = [answer for e in episodes for answer in e.failed_calls]
            checks.append((f"the tools of {self.s.source}", len(failed), sum(e.calls_run for e in episodes),
                           failed[:1], "tool calls"))
        all_failed = any(errors and errors == total for _, errors, total, _, _ in checks)
        elsewhere = self.reduce_max(int(all_failed) - 1) == 0  # 0: some process's batch all failed; −1: none did
        for what, errors, total, first, unit in checks:
            count_failures(what, errors, total, first[0] if first else None, unit, "first turns alone",
                           "its episode ended there" if unit == "samples" else "the model read the error")
        if elsewhere:
            raise RewardError(f"{self.s.source}: every episode or tool call of another process's batch failed, so "
                              f"training would learn from first turns alone (that process names the first error)")

    def reset(self, episodes: list[Episode], rows: list[dict]) -> None:
        """Each episode's first messages, from its environment's reset: its prompt ids unless it keeps the row's.
        A reset that fails, or whose prompt is longer than data.max_prompt_length, ends the episode after its first
        turn (sampled from the row's prompt)."""
        for e, result in zip(episodes, self.s.environment.reset(rows)):
            try:
                if isinstance(result, Exception):
                    raise result
                if result is not None:
                    check_messages(result.messages, RESET_ROLES, self.s.max_prompt_length, "data.max_prompt_length",
                                   result.tools)
                    e.prompt = self.template.prompt(result.messages, result.tools)
                    if len(e.prompt) > self.s.max_prompt_length:
                        raise ValueError(f"reset's prompt is {len(e.prompt)} tokens, more than data.max_prompt_length="
                                         f"{self.s.max_prompt_length}")
            except Exception as exc:
                e.prompt, e.error = rows[e.index].get("prompt_ids", e.prompt), f"reset: {reason(exc)}"

    def add_turns(self, episodes: list[Episode], out: Rollout) -> None:
        """Append each episode's new model turn (row k of `out`)."""
        for k, e in enumerate(episodes):
            tokens = out.responses[k, :int(out.response_mask[k].sum())].tolist()
            e.tokens += tokens
            e.mask += [1] * len(tokens)
            e.logprobs += out.logprobs[k, :len(tokens)].tolist() if out.logprobs is not None else []
            e.turns.append({"role": "assistant", "content": self.tokenizer.decode(tokens, skip_special_tokens=True)})
            e.ended_at_eos, e.fresh, e.going_on = bool(tokens) and tokens[-1] in self.eos_ids, True, False

    def answer(self, episodes: list[Episode], last: bool) -> None:
        """The environment's step on each episode's new turn: its reward at the turn's last token, and its messages
        appended (mask 0) when the episode goes on: the turn ended at EOS, it was not the last, the step is not done
        and leaves room for at least one more token of the model."""
        final = [last or not e.ended_at_eos for e in episodes]
        steps = self.s.environment.step([e.index for e in episodes], [e.turns[-1]["content"] for e in episodes], final)
        for e, step, end in zip(episodes, steps, final):
            e.fresh = False
            try:
                if isinstance(step, Exception):
                    raise step
                e.rewards.append((max(len(e.tokens) - 1, 0), bounded(step.reward, self.s.max_abs_score)))
                e.infos.append(step.info)
                if self.s.environment.counts_tools:  # a tool environment's counts (agent/* metrics)
                    e.well_formed += step.info["well_formed"]
                    e.malformed += step.info["malformed"]
                    e.calls_run += step.info.get("calls_run", 0)
                    e.failed_calls += step.info.get("failed_calls", [])
                if end or step.done or not step.messages:
                    continue
                check_messages(step.messages, STEP_ROLES, self.s.max_length - len(e.tokens),
                               "rollout.max_response_length")
                ids = self.template.tokens(step.messages)
            except Exception as exc:
                e.error = f"step: {reason(exc)}"
                continue
            if len(e.tokens) + len(ids) >= self.s.max_length:
                continue  # no room left to read the messages and reply: the episode ends at its turn
            e.tokens += ids
            e.mask += [0] * len(ids)
            e.logprobs += [0.0] * len(ids)  # unused with HF, which has no sampler logprobs
            e.turns += step.messages
            e.tool_rounds += 1
            if self.s.environment.counts_tools:
                e.tool_calls += step.info["tool_calls"]
                e.tool_results += step.info["tool_results"]
                e.tool_errors += step.info["tool_errors"]
            e.going_on = True

    def rollout(self, episodes: list[Episode], with_logprobs: bool, prompts: list, n: int) -> Rollout:
        """The episodes as one Rollout: right-padded rows, the rewards at their tokens (None when no step gave
        one), the prompts where an environment wrote its own."""
        hosted = self.s.environment.hosted
        responses, attention_mask = right_pad([e.tokens for e in episodes], self.tokenizer.pad_token_id)  # (B·n, Tr)
        response_mask, _ = right_pad([e.mask for e in episodes], 0)  # (B·n, Tr)
        logprobs = right_pad([e.logprobs for e in episodes], 0.0, dtype=torch.float32)[0] if with_logprobs else None
        token_rewards = torch.zeros(responses.shape, dtype=torch.float32)  # (B·n, Tr)
        for i, e in enumerate(episodes):
            for position, reward in e.rewards:
                token_rewards[i, position] += reward
        own_prompts = any(e.prompt is not prompts[e.index // n] for e in episodes)
        records = [e.record(hosted) for e in episodes]
        for e, record in zip(episodes, records) if self.s.environment.finished else ():
            record["environment"] = self.s.environment.finished[e.index]  # TRL's: its attributes as it ended
        if own_prompts:
            for e, record in zip(episodes, records):
                record["prompt_text"] = self.tokenizer.decode(e.prompt)
        return Rollout(responses, response_mask, logprobs, attention_mask=attention_mask, conversations=records,
                       metrics=agent_metrics(episodes, hosted),
                       token_rewards=token_rewards if any(r for e in episodes for _, r in e.rewards) else None,
                       prompts=[e.prompt for e in episodes] if own_prompts else None)


def reason(exc: Exception) -> str:
    """Why an environment's call failed: a CallFailed's own "<Type>: <message>", or the exception's."""
    return str(exc) if isinstance(exc, CallFailed) else f"{type(exc).__name__}: {exc}"


def agent_metrics(episodes: list[Episode], hosted: bool) -> dict:
    """Means over this process's samples: assistant turns, calls run, tool tokens, and the shares of samples that
    wrote at least one call that could be run (well-formed) or could not (malformed), tool errors per sample; with
    an environment of the user's, its return (the sum of a sample's rewards), the share of samples whose environment
    failed, and env/<key>, the mean over samples of each number in its steps' infos, as the last step that gave it
    held it (where the episode ended: "won", a final score)."""
    def mean(values):
        values = list(values)
        return sum(values) / max(1, len(values))
    metrics = {"agent/turns_mean": mean(sum(m["role"] == "assistant" for m in e.turns) for e in episodes),
               "agent/tool_calls_mean": mean(len(e.tool_calls) for e in episodes),
               "agent/tool_tokens_mean": mean(len(e.mask) - sum(e.mask) for e in episodes),
               "agent/well_formed_share": mean(e.well_formed > 0 for e in episodes),
               "agent/malformed_share": mean(e.malformed > 0 for e in episodes),
               "agent/tool_errors_mean": mean(e.tool_errors for e in episodes)}
    if hosted:
        metrics.update({"agent/env_return_mean": mean(sum(r for _, r in e.rewards) for e in episodes),
                        "agent/env_errors_share": mean(e.error is not None for e in episodes)})
        numbers = defaultdict(list)
        for e in episodes:
            last = {}  # each key's value at the episode's last step that gave it: where the episode ended
            for info in e.infos:
                last.update({key: float(v) for key, v in info.items()  # bool too; ±inf (a huge int) left out
                             if isinstance(v, (int, float)) and math.isfinite(v)})
            for key, value in last.items():
                numbers[f"env/{key}"].append(value)
        metrics.update({key: mean(values) for key, values in numbers.items()})
    return metrics


# ---------------------------------------------------------------------------------------
# What rollout.py calls


def check_multi_turn(cfg, tokenizer, rows=()) -> TurnSettings:
    """Before any model loads, with rollout.multi_turn on: the environment's class (or the tools) imported in its
    worker process and checked, the chat template able to write messages, each data row named by a dict of
    environments. The settings hold the started environment (closed by AgentRollout.close)."""
    m = cfg.rollout.multi_turn
    if bool(m.tools) == bool(m.env):
        raise ConfigError("rollout.multi_turn.enable=true needs tools (rollout.multi_turn.tools=[path/to/file.py:fn]) "
                          "or an environment (rollout.multi_turn.env=path/to/file.py:Class), not both")
    if m.format not in PARSERS:
        raise ConfigError(f"rollout.multi_turn.format={m.format!r} is not one of {', '.join(PARSERS)}")
    if m.max_calls_per_turn < 1:
        raise ConfigError(f"rollout.multi_turn.max_calls_per_turn must be at least 1, got {m.max_calls_per_turn}")
    ToolTemplate(tokenizer)
    if m.tools:
        environment = ToolEnvironment(m.tools, PARSERS[m.format], m.tool_timeout_s, m.max_tool_response_length,
                                      m.max_calls_per_turn)
    else:
        environment = HostedEnvironment(m.env, m.env_timeout_s, m.env_column)
        for i, row in enumerate(rows):  # a dict of environments: every row's column names one
            try:
                route_of(row, environment.routes, m.env_column, m.env)
            except ValueError as e:
                environment.close()
                raise ConfigError(f"data row {i} (train files, then val): {e}") from None
        if environment.trl:  # TRL's environment_factory: its methods are the tools
            environment = MethodEnvironment(environment, PARSERS[m.format], m.max_tool_response_length,
                                            m.max_calls_per_turn)
            warn_unshown_tools(tokenizer, environment.schemas)
    source = f"rollout.multi_turn.tools={m.tools}" if m.tools else f"the environment rollout.multi_turn.env={m.env}"
    return TurnSettings(m.max_turns, cfg.rollout.max_response_length, cfg.data.max_prompt_length, environment,
                        cfg.reward.max_abs_score, source)


def warn_unshown_tools(tokenizer, schemas) -> None:
    """At start-up: a warning when the chat template writes the same prompt with the tools' schemas as without them
    (it ignores `tools`), so the model would not be shown them: the prompts must then describe the tools."""
    if not schemas:
        return
    messages = [{"role": "user", "content": "u"}]
    if (tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)):
        warn0(f"rollout.multi_turn.env: the tokenizer's chat template ignores tool schemas, so the prompts will not "
              f"show the model the tools {', '.join(s['function']['name'] for s in schemas)}; describe them in the "
              f"prompts or use a template that renders `tools` (model.tokenizer_path)")
