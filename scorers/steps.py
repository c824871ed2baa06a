"""Step rewards: a reward function may return, beside its "score", "step_rewards": [r_1, …] with "step_ends":
[c_1, …], the character offsets in solution_str where each step ends; r_k then lands on the response token whose text
holds character c_k − 1, as a process reward model's would. rewards.FunctionScorer reads them from its function's
results through its STEP_REWARDS line; ppo.py's step 5 adds them to the score at the last token.

Each reward must be a finite number within ±reward.max_abs_score, and a sample has at most as many steps as the
text it rewards has tokens (checked before any token is decoded); a sample whose steps break a rule has none, and
rewards.count_failures' rule holds: every sample that returned steps failing → the run stops naming the first error;
some → a console line, counted in reward/step_errors.
"""
import math
import numbers
from typing import Optional

import torch

from rewards import count_failures


def step_rewards(tokenizer, ro, results: list, max_abs_score: float = math.inf) -> tuple[torch.Tensor, dict]:
    """(token rewards (B, Tr), metrics) from a reward function's raw results, one per response of the rollout `ro`:
    each result's steps (read_steps) at their tokens (step_token_rewards); a result whose steps do not read has none,
    and counts in reward/step_errors (count_failures: all of those that returned steps → RewardError)."""
    steps, bad, first = [], 0, None
    lengths = last_turn(ro.response_mask).sum(1).tolist()  # (B,) the tokens of the text each reward read
    for result, length in zip(results, lengths):
        try:
            steps.append(read_steps(result, max(1, int(length)), max_abs_score))
        except ValueError as e:
            steps.append(None)
            bad, first = bad + 1, first or str(e)
    tried = sum(isinstance(r, dict) and "step_rewards" in r for r in results)
    count_failures("the reward function's step rewards", bad, tried, first, lost="their scores alone",
                   kept="those samples have none")
    return step_token_rewards(tokenizer, ro, steps), {  # (B, Tr)
        "reward/step_errors": float(bad), "reward/step_samples": float(sum(s is not None for s in steps))}


def read_steps(result, max_steps: int, max_abs_score: float = math.inf) -> Optional[list]:
    """A reward function's step rewards as [(offset, reward), …], or None when it returned none; a ValueError when
    "step_rewards" and "step_ends" are not two lists of finite numbers of one length, hold more than max_steps (the
    tokens of the text rewarded), or a reward beyond ±max_abs_score (reward.max_abs_score)."""
    if not isinstance(result, dict) or "step_rewards" not in result:
        return None
    rewards, ends = result["step_rewards"], result.get("step_ends")
    if isinstance(rewards, list) and len(rewards) > max_steps:
        raise ValueError(f"{len(rewards)} step_rewards for a text of {max_steps} tokens: at most one a token")
    if not (isinstance(rewards, list) and isinstance(ends, list) and len(rewards) == len(ends)) or not all(
            isinstance(x, numbers.Real) and finite(x) for x in rewards + ends):
        raise ValueError(f"step_rewards and step_ends must be two lists of finite numbers of one length, got "
                         f"{str(rewards)[:200]} and {str(ends)[:200]}")
    beyond = next((r for r in rewards if abs(r) > max_abs_score), None)
    if beyond is not None:
        raise ValueError(f"a step reward is {beyond:g}, beyond reward.max_abs_score={max_abs_score:g}")
    return [(int(end), float(reward)) for end, reward in zip(ends, rewards)]


def finite(x: numbers.Real) -> bool:
    """Is x a finite float (10**400 is not: float() cannot hold it)?"""
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def step_token_rewards(tokenizer, ro, steps: list) -> torch.Tensor:
    """(B, Tr) from each sample's steps [(character offset where the step ends, reward), …] (None: no steps) in the
    text of its last turn: each reward at the first token of that turn whose text reaches the offset (the last token
    when the offset lies beyond the text); steps ending on one token add up."""
    rewards = torch.zeros(ro.responses.shape)  # (B, Tr)
    turn = last_turn(ro.response_mask)  # (B, Tr)
    for i, sample in enumerate(steps):
        if not sample:
            continue
        positions = turn[i].nonzero()[:, 0].tolist()
        ends = token_ends(tokenizer, ro.responses[i, positions].tolist())
        for offset, reward in sample:
            k = next((k for k, end in enumerate(ends) if end >= offset), len(ends) - 1)
            rewards[i, positions[k]] += reward
    return rewards


def last_turn(response_mask) -> torch.Tensor:
    """(B, Tr) bool: the tokens of the text a reward reads, the last run of response_mask ones (the whole response
    with one turn, the last assistant turn with several: decode_responses)."""
    mask = response_mask.bool()
    before = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    runs = (mask & ~before).long().cumsum(1)  # (B, Tr) how many runs started at or before t
    return mask & (runs == runs[:, -1:])


def token_ends(tokenizer, ids: list[int]) -> list[int]:
    """For each token, the length of the text decoded up to and including it: where its characters end in
    tokenizer.decode(ids). Decoded incrementally, so that it holds for the tokens sampled, whatever a fresh
    tokenisation of the text would give."""
    ends, longest = [], 0
    for k in range(1, len(ids) + 1):
        longest = max(longest, len(tokenizer.decode(ids[:k], skip_special_tokens=True)))
        ends.append(longest)
    return ends
