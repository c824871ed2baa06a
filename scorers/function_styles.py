"""reward.function in TRL's and OpenRLHF's calling conventions: one call for the whole batch, where verl's
compute_score (infra.reward_calls.verl_calls) is called once per sample. rewards.py names each style's function here
on its REWARD_STYLES line and recognises a function's style by its parameters (rewards.function_style); each is
called as style(call, rows, responses, completion_ids) → one result per sample (a number, a dict with "score", or an
exception), where call(kwargs) makes the one call for the batch and returns what it returned (or the exception it
raised).

    # TRL (GRPOTrainer's reward_funcs): prompts and completions, every other column of the data as a keyword
    def reward_len(prompts, completions, **kwargs) -> list[float | None]:   # None: no reward for that sample
        return [-abs(20 - len(c)) for c in completions]

    # OpenRLHF (--remote_rm_url reward_func.py): queries = prompt + response texts, labels = the ground truths
    def reward_func(queries, prompts, labels):
        return {"rewards": torch.tensor(...), "scores": ..., "extra_logs": {"name": tensor}}   # or the tensor alone
"""
import math
import numbers
from types import SimpleNamespace
from typing import Callable, Optional


def trl_style(call: Callable, rows: list[dict], responses: list[str], completion_ids: Optional[list] = None) -> list:
    """TRL's reward function, called once for the batch with trl_call's keywords, its return read by trl_results."""
    return trl_results(call(trl_call(rows, responses, completion_ids)), len(rows))


def openrlhf_style(call: Callable, rows: list[dict], responses: list[str], completion_ids: Optional[list] = None):
    """OpenRLHF's reward_func, called once for the batch with openrlhf_call's keywords, read by openrlhf_results."""
    return openrlhf_results(call(openrlhf_call(rows, responses)), len(rows))


def trl_call(rows: list[dict], responses: list[str], completion_ids: Optional[list] = None) -> dict:
    """TRL's keywords (GRPOTrainer._calculate_rewards): `prompts` as stored and `completions` — strings for standard
    data; for conversational data (the prompt stored as messages) message lists, [{"role": "assistant", "content":
    text}] or a multi-turn rollout's turns — `completion_ids` where the tokens are known, and every other column of
    the data (rows' "columns", as stored), each a list over the batch; `environments` where a TRL environment ran,
    each sample's as it ended (its attributes, read as env.name; not its methods). Not passed: trainer_state (no
    Trainer here)."""
    conversational = isinstance(rows[0]["prompt"], list)
    completions = [((row.get("conversation") or {}).get("turns") or [{"role": "assistant", "content": text}])
                   if conversational else text for row, text in zip(rows, responses)]
    mine = ("prompt", "completion", "completion_ids")
    columns = {key: [(row.get("columns") or {}).get(key) for row in rows]
               for key in (rows[0].get("columns") or {}) if key not in mine}
    ids = {} if completion_ids is None else {"completion_ids": completion_ids}
    ended = [(row.get("conversation") or {}).get("environment") for row in rows]  # agents/multi_turn.py's record
    envs = {"environments": [None if e is None else SimpleNamespace(**e) for e in ended]} if any(ended) else {}
    return {**columns, "prompts": [row["prompt"] for row in rows], "completions": completions, **ids, **envs}


def trl_results(returned, size: int) -> list:
    """TRL's list of float | None, one per sample: a number's result is {"score", "no_reward": 0.0}, None's (no reward
    for this sample, as TRL reads it) {"score": 0.0, "no_reward": 1.0}, so reward/no_reward is the share of None."""
    values = one_per_sample(returned, size, "a list of rewards (float or None), one per completion")
    if isinstance(values, Exception):
        return [values] * size
    return [{"score": 0.0, "no_reward": 1.0} if v is None else {"score": v, "no_reward": 0.0} for v in values]


def openrlhf_call(rows: list[dict], responses: list[str]) -> dict:
    """OpenRLHF's reward_func keywords: queries (each prompt's text, chat template applied, followed by its response),
    prompts (those texts) and labels (the ground truths, OpenRLHF's --label_key column)."""
    prompts = [row["prompt_text"] for row in rows]
    return {"queries": [p + r for p, r in zip(prompts, responses)], "prompts": prompts,
            "labels": [row["ground_truth"] for row in rows]}


def openrlhf_results(returned, size: int) -> list:
    """OpenRLHF's return: a tensor (or list) of rewards, or a dict with "rewards" (the score here; "scores", which
    OpenRLHF filters on, is logged as reward/scores) and "extra_logs" (each logged as reward/<name>, its mean)."""
    logs = {}
    if isinstance(returned, dict):
        if "rewards" not in returned:
            return [ValueError(f"reward_func's dict must carry 'rewards', got keys {sorted(returned)}")] * size
        logs = {name: mean(value) for name, value in {"scores": returned.get("scores"),
                                                       **(returned.get("extra_logs") or {})}.items()}
        logs, returned = {k: v for k, v in logs.items() if v is not None}, returned["rewards"]
    values = one_per_sample(returned, size, "a tensor or list of rewards, one per query")
    if isinstance(values, Exception):
        return [values] * size
    return [values[i] if values[i] is None else {"score": values[i], **logs} for i in range(size)]


def one_per_sample(returned, size: int, expected: str):
    """The returned values as a list of `size` (a tensor's .tolist()), or the exception that says what came back
    instead (raised in the function: itself)."""
    if isinstance(returned, BaseException):
        return returned
    values = returned.tolist() if hasattr(returned, "tolist") else returned
    if not isinstance(values, (list, tuple)) or len(values) != size:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(returned)[:80]
        return ValueError(f"a batched reward function must return {expected} ({size}), got {got}")
    return list(values)


def mean(value) -> Optional[float]:
    """The mean of a number, a tensor or a list of numbers; None where it is none of those."""
    values = value.tolist() if hasattr(value, "tolist") else value
    values = values if isinstance(values, (list, tuple)) else [values]
    if not values or not all(isinstance(v, numbers.Real) for v in values):
        return None
    result = sum(values) / len(values)
    return result if math.isfinite(result) else None

