"""A reward function's calls, whoever scores with it (rewards.py: the rule, your reward.function, validation's task
rule): the keywords verl gives each sample (verl_calls), the calls run here or in a worker pool (call_reward), and a
return read as a score (as_score).
"""
import asyncio
import inspect
import math
import numbers

from infra.worker import FunctionWorker


def verl_calls(rows: list[dict], responses: list[str]) -> list[dict]:
    """For each (row, response), compute_score's keywords as verl gives them: data_source, solution_str, ground_truth,
    extra_info."""
    if len(rows) != len(responses):
        raise ValueError(f"score_responses got {len(rows)} rows but {len(responses)} responses")
    # extra_info gets what verl's reward loop adds (reward_loop/reward_manager/naive.py): num_turns, counted as its
    # agent loops count (the prompt, each assistant turn, each round of tool answers: 2 for a prompt and one
    # response), and rollout_reward_scores = {} (no rollout-time scores here); from a multi-turn rollout
    # (agents/multi_turn.py) also the turns (the messages after the prompt), the tool_calls and their tool_results
    return [dict(data_source=row["data_source"], solution_str=response, ground_truth=row["ground_truth"],
                 extra_info={**(row.get("extra_info") or {}), **(row.get("conversation") or {"num_turns": 2}),
                             "rollout_reward_scores": {}})
            for row, response in zip(rows, responses)]


def call_reward(compute_score, calls: list[dict]) -> list:
    """compute_score(**kwargs) for each call: its result, or the exception it raised. A FunctionWorker runs them in
    its processes (CallFailed where a call failed there); an `async def` function is awaited for the whole batch at
    once (asyncio.gather), as verl's reward loop runs it."""
    if isinstance(compute_score, FunctionWorker):
        return compute_score.call_all(calls)
    if not inspect.iscoroutinefunction(compute_score):
        results = []
        for kwargs in calls:
            try:
                results.append(compute_score(**kwargs))
            except Exception as e:
                results.append(e)
        return results

    async def one(kwargs):
        return await compute_score(**kwargs)

    async def batch():
        return await asyncio.gather(*(one(kwargs) for kwargs in calls), return_exceptions=True)
    return asyncio.run(batch())


def as_score(result, max_abs_score: float = math.inf) -> tuple[float, dict]:
    """(score, extras) from a function's return: a finite number within ±max_abs_score (reward.max_abs_score), or a
    dict whose "score" is one; extras are its other numbers, and its "pred" as text where it has one (verl's DAPO
    rule: the answer it read, for maj@k). Beyond the bound is an error: 1e308 is inf in float32."""
    if isinstance(result, BaseException):  # raised inside an async function, returned by asyncio.gather
        raise result
    extras = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"a reward dict must carry 'score', got keys {sorted(result)}")
        extras = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, numbers.Real)}
        extras.update({"pred": str(result["pred"])} if "pred" in result else {})
        result = result["score"]
    if isinstance(result, (str, bytes)) or result is None:
        raise TypeError(f"a reward function must return a number or a dict, got {result!r}")
    score = float(result)
    if not math.isfinite(score):
        raise ValueError(f"the reward is {score}, not a finite number")
    if abs(score) > max_abs_score:
        raise ValueError(f"the reward is {score:g}, beyond reward.max_abs_score={max_abs_score:g}")
    return score, extras
