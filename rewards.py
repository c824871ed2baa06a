"""Rule rewards with verl's signature: compute_score(data_source, solution_str, ground_truth, extra_info=None).

`default_compute_score` routes each row's data_source as verl 0.9.1 does (BUILTIN_SCORES; README.md "Rewards" has
the table): verl's names to verl's own rules, ported with their quirks in reward_rules/ (verl_rules.py, verl_prime_math.py) so
that a response scores exactly as in verl, and this library's own, more lenient rules (gsm8k, boxed, arithmetic)
under their own names.
verl's code, search-tool and image routes are not built in: check_data_sources stops such a run at start-up.

A custom function is `reward.function=path/to/file.py:name`; verl reward files work unchanged, `async def` ones
included. A function may return a number, or a dict with "score" and other numbers to log. It runs in a worker
process of its own (infra/worker.py), each call limited to reward.timeout_s: a call that hangs, raises, calls
sys.exit, or ends or kills the worker is an error for its sample (reward/errors), never the end of the run.
"""
import asyncio
import functools
import inspect
import math
import numbers
import os
import warnings
from collections import Counter

import torch
from accelerate.utils import gather_object

import environments_verifiers
from agent import with_conversations
from infra.config import ConfigError
from infra.metrics import reduce_metrics, sum_over_processes
from infra.models import check_model_path
from infra.runs import Interrupted
from infra.worker import CallFailed, FunctionWorker, WorkerStartError
from judge import check_judge, Judge
from reward_rules import reasoning_gym_rules, verl_prime_math, verl_rules
from reward_rules.library import arithmetic_score, boxed_score, gsm8k_score
from reward_model import RewardModelScorer

# ---- dispatch by data_source, as verl's default_compute_score
NUMINA = ["numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
          "numina_olympiads"]
BUILTIN_SCORES = {
    "openai/gsm8k": verl_rules.gsm8k,
    **dict.fromkeys(["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"],
                    verl_rules.hendrycks_math),
    **dict.fromkeys(["math_dapo", "math", "math_dapo_reasoning"], verl_rules.dapo),  # and every aime*
    **dict.fromkeys(NUMINA, verl_prime_math.prime_math),
    "gsm8k": gsm8k_score, "boxed": boxed_score, "arithmetic": arithmetic_score,  # this library's own
}
KNOWN = ", ".join([s for s in BUILTIN_SCORES if s not in NUMINA]
                  + ["aime*", "numina_*", "reasoning_gym/*", "verifiers/*"])  # for error messages
NOT_BUILT_IN = {  # why a source has no rule here: verl needs more than a rule for these
    **dict.fromkeys(["codecontests", "apps", "codeforces", "taco"], "verl runs the code in a sandbox"),
    "hiyouga/geometry3k": "an image task verl scores with mathruler",
    "unknown": "rows with no data_source, as data.py names them",
    **{f"searchR1_{name}": "verl's search-tool task" for name in
       ["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"]},
}


def rule_for(data_source):
    """The built-in rule for data_source (aime* by prefix, as verl; reasoning_gym/<task> by prefix: the task's own
    score_answer; verifiers/<env>: 0, the environment pays its rubric); None when there is none."""
    if data_source in BUILTIN_SCORES:
        return BUILTIN_SCORES[data_source]
    if isinstance(data_source, str) and data_source.startswith("reasoning_gym/"):
        return reasoning_gym_rules.reasoning_gym_score
    if isinstance(data_source, str) and data_source.startswith("verifiers/"):  # the rubric: the environment's reward
        return environments_verifiers.rubric_paid_by_environment
    return verl_rules.dapo if isinstance(data_source, str) and data_source.startswith("aime") else None


def rule_needing_truth(data_source, cfg_reward):
    """For data.py's check at start-up: the name of the built-in rule that will compare data_source's responses with
    their ground truth, or None (reward.type=model: no rule; a custom reward.function: it may need none)."""
    if cfg_reward.type == "model" or cfg_reward.function:
        return None
    rule = rule_for(data_source)
    return None if rule is None else f"{rule.__module__.split('.')[-1]}.{rule.__name__}"


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, sandbox_fusion_url=None,
                          concurrent_semaphore=None, memory_limit_mb=None, **kwargs):
    """verl's default_compute_score: the rule for data_source gives what verl's gives (a float, or DAPO's
    {"score", "acc", "pred"} dict). An unknown data_source, or a null ground truth, is a ValueError (an error)."""
    rule = rule_for(data_source)
    if rule is None:
        raise ValueError(f"no built-in reward for data_source {data_source!r}; known: {KNOWN}. "
                         f"Write a function compute_score(data_source, solution_str, ground_truth, extra_info=None) "
                         f"and set reward.function=path/to/file.py:name")
    if ground_truth is None:
        raise ValueError(f"the row (data_source {data_source!r}) has no ground truth to compare with")
    return rule(solution_str, ground_truth)


def check_data_sources(sources, reward_cfg) -> None:
    """At start-up: a ConfigError naming every data_source no rule scores. A custom reward.function handles every
    source, reward.type=model or judge needs none, the built-ins handle those in BUILTIN_SCORES and aime*."""
    if reward_cfg.type in ("model", "judge") or reward_cfg.function:
        return
    missing = sorted({s for s in sources if rule_for(s) is None}, key=str)
    if missing:
        named = ", ".join(repr(s) + (f" ({NOT_BUILT_IN[s]})" if s in NOT_BUILT_IN else "") for s in missing)
        raise ConfigError(f"the data has data_source values with no built-in reward: {named}; score them with your "
                          f"own compute_score(data_source, solution_str, ground_truth, extra_info=None) by setting "
                          f"reward.function=path/to/file.py:compute_score (built in: {KNOWN})")


def check_reward_inputs(cfg_reward, trust_remote_code: bool = False) -> None:
    """Before any model loads: the reward model folder, the reward function the run will use (imported once in a
    worker, which then stops) and the judge."""
    if cfg_reward.type in ("model", "both"):
        if not cfg_reward.model_path:
            raise ConfigError(f"reward.type={cfg_reward.type} needs reward.model_path (the final/ folder "
                              f"written by reward_model.py)")
        check_model_path(cfg_reward.model_path, "reward.model_path", trust_remote_code=trust_remote_code)
    if cfg_reward.type in ("rule", "both", "rule+judge"):
        fn = load_reward_function(cfg_reward.function, cfg_reward.timeout_s)
        if isinstance(fn, FunctionWorker):
            fn.close()
    if cfg_reward.type in ("judge", "rule+judge"):
        check_judge(cfg_reward.judge)


def load_reward_function(spec, timeout_s: float, stop=None):
    """None → default_compute_score, called in this process; "path/to/file.py:name" (name defaults to
    compute_score, as in verl) → a FunctionWorker running that function, each call limited to timeout_s (`stop`:
    runs.StopSignal, so that a preempted run does not wait for a hung call longer than that)."""
    if not spec:
        return default_compute_score
    path, sep, name = spec.rpartition(":")
    if not sep:
        path, name = spec, "compute_score"
    if not os.path.isfile(path):
        raise ConfigError(f"reward.function: file {path} does not exist (expected path/to/file.py:function_name)")
    try:
        return FunctionWorker(path, name, timeout_s, stop)
    except WorkerStartError as e:
        raise ConfigError(f"reward.function: {e}") from None


class RewardError(ConfigError):
    """The reward function failed on every sample of a batch: training on would learn from zeros."""


def as_score(result) -> tuple[float, dict]:
    """(score, extras) from a function's return: a finite number, or a dict whose "score" is one; extras are its other
    numbers, and its "pred" as text where it has one (verl's DAPO rule: the answer it read, for maj@k)."""
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
    return score, extras


def call_all(compute_score, calls: list[dict]) -> list:
    """compute_score(**kwargs) for each call: its result, or the exception it raised. An `async def` function is
    awaited for the whole batch at once (asyncio.gather), as verl's reward loop runs it."""
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


def score_responses(compute_score, rows: list[dict], responses: list[str]) -> tuple[list[float], dict, int]:
    """Score each (row, response) with compute_score(data_source=, solution_str=, ground_truth=, extra_info=),
    by keyword as verl calls it (a function here, or a FunctionWorker's in its process); returns (scores, extras:
    each extra numeric dict key's values, errors). A call that raises, times out, ends its worker or returns something
    unusable (None, a string, a dict without "score", NaN, inf) scores 0.0 and counts as an error, warned once; when
    every call fails, RewardError stops the run rather than train on zeros.
    """
    if len(rows) != len(responses):
        raise ValueError(f"score_responses got {len(rows)} rows but {len(responses)} responses")
    # extra_info gets what verl's reward loop adds (reward_loop/reward_manager/naive.py): num_turns, counted as its
    # agent loops count (the prompt, each assistant turn, each round of tool answers: 2 for a prompt and one
    # response), and rollout_reward_scores = {} (no rollout-time scores here); from a multi-turn rollout (agent.py)
    # also the turns (the messages after the prompt), the tool_calls and their tool_results
    calls = [dict(data_source=row["data_source"], solution_str=response, ground_truth=row["ground_truth"],
                  extra_info={**(row.get("extra_info") or {}), **(row.get("conversation") or {"num_turns": 2}),
                              "rollout_reward_scores": {}})
             for row, response in zip(rows, responses)]
    scores, extras, errors, first = [], {}, 0, None
    results = compute_score.call_all(calls) if isinstance(compute_score, FunctionWorker) else call_all(compute_score,
                                                                                                        calls)
    for result in results:
        try:
            score, more = as_score(result)
        except Exception as e:
            score, more, errors = 0.0, {}, errors + 1
            first = first or (str(e) if isinstance(e, CallFailed) else f"{type(e).__name__}: {e}")
        scores.append(score)
        for key, value in more.items():
            extras.setdefault(key, []).append(value)
    if errors and errors == len(rows):
        raise RewardError(f"the reward function failed on all {errors} samples of a batch, so training would "
                          f"learn from zeros; the first error: {first}")
    if errors:
        warnings.warn(f"reward function failed on {errors}/{len(rows)} samples (scored 0.0); first: {first}")
    return scores, extras, errors


def score_on_every_process(scorer, rows: list[dict], texts: list[str], accelerator):
    """scorer(rows, texts) → (scores, metrics), on all processes together: when the reward fails on every sample of
    any process's batch (RewardError), every process raises it, with the failing process's message; when a stop
    signal could not wait for a reward call on any process (runs.Interrupted), every process raises that. Raised
    on that process alone, either would leave the others waiting for it at their next collective."""
    error, interrupted = None, None
    try:
        scores, metrics = scorer(rows, texts)
    except RewardError as e:
        scores, metrics, error = None, {}, str(e)
    except Interrupted as e:
        scores, metrics, interrupted = None, {}, e
    flags = torch.tensor([float(error is not None), float(interrupted.signum if interrupted else 0)])
    failed, signum = accelerator.reduce(flags.to(accelerator.device), "max").tolist()
    if signum:
        raise interrupted or Interrupted(int(signum), "while a reward call of another process was still running; "
                                                      "this step is not saved, the last checkpoint is kept")
    if failed:
        raise RewardError(next(message for message in gather_object([error]) if message))
    return scores, metrics


class Scorer:
    """The task score of each response: a rule function, a reward model, an LLM judge (judge.py), or a weighted sum
    of the rule and one of the others (reward.type)."""

    def __init__(self, cfg_reward, device, dtype, *, trust_remote_code: bool = False, stop=None):
        """`trust_remote_code`: model.trust_remote_code, for the reward model's folder; `stop`: runs.StopSignal, which
        a hung custom reward call then holds up for at most reward.timeout_s."""
        self.cfg, self.rule_fn, self.model, self.judge, self.task_rule = cfg_reward, None, None, None, None
        self.judge_answers = []  # the judge's raw answer to each response of the last call, for the sample table
        if cfg_reward.type in ("rule", "both", "rule+judge"):
            self.rule_fn = load_reward_function(cfg_reward.function, cfg_reward.timeout_s, stop)
        if cfg_reward.type in ("model", "both"):
            self.model = RewardModelScorer(cfg_reward.model_path, cfg_reward.micro_batch_size, cfg_reward.normalize,
                                           cfg_reward.clip, device, dtype, trust_remote_code=trust_remote_code)
        if cfg_reward.type in ("judge", "rule+judge"):
            self.judge = Judge(cfg_reward.judge)
        if cfg_reward.type != "rule":
            # the task's rule on the same answers (val/rule_score/mean): does what the reward model or judge like score?
            self.task_rule = self.rule_fn or load_reward_function(cfg_reward.function, cfg_reward.timeout_s, stop)

    def __call__(self, rows: list[dict], texts: list[str], with_answers: bool = False):
        """rows (with prompt, ground_truth, data_source, extra_info) and decoded responses → scores (B,), metrics; with
        with_answers, metrics["answers"] too: each response's answer as the rule read it ("pred"), else None."""
        weighted, metrics, scores = self.cfg.type in ("both", "rule+judge"), {}, torch.zeros(len(texts))
        if self.rule_fn is not None:
            rule, extras, errors = score_responses(self.rule_fn, rows, texts)
            scores += (self.cfg.rule_weight if weighted else 1.0) * torch.tensor(rule, dtype=torch.float32)
            metrics["reward/errors"] = float(errors)
            metrics.update({f"reward/{k}": sum(v) / len(v) for k, v in extras.items() if v and k != "pred"})
            if with_answers:
                answers = extras.get("pred", [])
                metrics["answers"] = answers if len(answers) == len(rows) else [None] * len(rows)
        if self.model is not None:
            model_scores = self.model.score([r["prompt"] for r in rows], texts).float().cpu()
            scores += (self.cfg.model_weight if weighted else 1.0) * model_scores
            metrics["reward/model_score_mean"] = model_scores.mean().item()
        if self.judge is not None:
            judged = self.judge(rows, texts)
            if judged.errors == len(texts):
                raise RewardError(f"the judge failed on all {judged.errors} samples of a batch, so training would "
                                  f"learn from zeros; the first error: {judged.first_error}")
            if judged.errors:
                warnings.warn(f"the judge failed on {judged.errors}/{len(texts)} samples (scored 0.0); first: "
                              f"{judged.first_error}")
            scores += (self.cfg.judge.weight if weighted else 1.0) * torch.tensor(judged.scores, dtype=torch.float32)
            self.judge_answers = judged.answers
            metrics.update({"reward/judge_errors": float(judged.errors),
                            "reward/judge_score_mean": sum(judged.scores) / len(texts)})
        return scores, metrics

    def validation_metrics(self, rows: list[dict], texts: list[str], sources: list, accelerator, k: int = 1) -> dict:
        """Over the rows of every process (`sources`: every data_source of the validation set), rows i·k … i·k + k − 1
        being one prompt's k samples: val/score/mean and val/<data_source>/score, the mean score (mean@k); with k > 1
        and a rule reward, pass@j and maj@k (pass_and_majority); with a reward model or a judge, val/rule_score/mean:
        the task's rule on the same answers, over the rows with a ground truth and a rule."""
        scores, scored = score_on_every_process(functools.partial(self, with_answers=True), rows, texts, accelerator)
        sums = torch.zeros(len(sources), 2)  # (sum of scores, count) per data_source
        for row, score in zip(rows, scores.tolist()):
            sums[sources.index(row["data_source"])] += torch.tensor([score, 1.0])
        sums = sum_over_processes(accelerator, sums)
        metrics = {"val/score/mean": (sums[:, 0].sum() / sums[:, 1].sum()).item()}
        metrics.update({f"val/{src}/score": (s / max(c, 1)).item() for src, (s, c) in zip(sources, sums)})
        if k > 1 and self.cfg.type == "rule":
            metrics.update(pass_and_majority(rows, scores.tolist(), scored["answers"], sources, k, accelerator))
        if self.task_rule is not None:
            ruled = [(row, text) for row, text in zip(rows, texts)
                     if row["ground_truth"] is not None and (self.cfg.function or rule_for(row["data_source"]))]
            rule_scores, _, _ = score_responses(self.task_rule, [row for row, _ in ruled], [text for _, text in ruled])
            total, count = sum_over_processes(accelerator, torch.tensor([sum(rule_scores), len(rule_scores)],
                                                                        dtype=torch.float64)).tolist()
            if count:
                metrics["val/rule_score/mean"] = total / count
        return metrics


# ---- validation: k samples per prompt


def decode_responses(tokenizer, ro) -> list[str]:
    """The text each response of a rollout.Rollout is scored on: its tokens, or with multi-turn its last assistant
    turn (agent.py)."""
    if ro.conversations is not None:
        return [c["turns"][-1]["content"] for c in ro.conversations]
    return tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(ro.responses, ro.response_mask)],
                                  skip_special_tokens=True)


@torch.no_grad()
def validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator) -> dict:
    """rollout.val_n responses per validation prompt at rollout.val_temperature (one, greedy, by default), scored:
    Scorer.validation_metrics. Every validation samples with the run's seed, so that they differ by the policy."""
    k, mine = cfg.rollout.val_n, val_rows[accelerator.process_index::accelerator.num_processes]
    ro = rollout.generate([r["prompt_ids"] for r in mine], n=k, temperature=cfg.rollout.val_temperature,
                          seed=cfg.trainer.seed)
    texts = decode_responses(tokenizer, ro)
    sources = sorted({r["data_source"] for r in val_rows})
    rows = with_conversations([r for r in mine for _ in range(k)], ro)  # multi-turn: the reward reads them
    metrics = scorer.validation_metrics(rows, texts, sources, accelerator, k)
    turn_metrics = reduce_metrics(accelerator, ro.metrics) if ro.metrics else {}  # agent/*: multi-turn only
    return {**metrics, **{f"val/{key}": value for key, value in turn_metrics.items()}}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are right (Chen et al., 2021, eq. 1):
    1 − C(n − c, k) / C(n, k), the chance that k of the n drawn without replacement hold a right one."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_and_majority(rows: list[dict], scores: list, answers: list, sources: list, k: int, accelerator) -> dict:
    """Per data_source (val/<src>/…) and over all prompts (val/…/mean), from k samples per prompt, a sample being
    right when its rule score is > 0 (rules score 1 right, 0 or −1 wrong):
        pass@j for j = 1, 2, 4, … and k    unbiased (pass_at_k); pass@1 is the share of right samples
        maj@k                               is the most frequent answer right? Over the prompts whose k samples all
                                            have one (Scorer.answers; ties: the answer seen first)
    """
    js = sorted({2 ** i for i in range(k.bit_length()) if 2 ** i <= k} | {k})
    table = torch.zeros(len(sources), len(js) + 3, dtype=torch.float64)  # prompts, Σ pass@j …, Σ maj@k, its prompts
    for start in range(0, len(rows), k):
        src, right = sources.index(rows[start]["data_source"]), [s > 0 for s in scores[start:start + k]]
        table[src, 0] += 1
        table[src, 1:len(js) + 1] += torch.tensor([pass_at_k(k, sum(right), j) for j in js], dtype=torch.float64)
        group = answers[start:start + k]
        if None not in group:
            majority = Counter(group).most_common(1)[0][0]
            table[src, -2:] += torch.tensor([float(right[group.index(majority)]), 1.0], dtype=torch.float64)
    table = sum_over_processes(accelerator, table)
    metrics = {}
    for prefix, suffix, counts in [(f"val/{src}/", "", row) for src, row in zip(sources, table)] + [
            ("val/", "/mean", table.sum(0))]:
        metrics.update({f"{prefix}pass@{j}{suffix}": (counts[1 + i] / counts[0].clamp(min=1)).item()
                        for i, j in enumerate(js)})
        if counts[-1] > 0:
            metrics[f"{prefix}maj@{k}{suffix}"] = (counts[-2] / counts[-1]).item()
    return metrics


# ---- length shaping


def overlong_reward(lengths, max_length: int, buffer_len: int, factor: float):
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13; verl's DAPO reward manager), (B,) from lengths (B,):

        R(y) = min(−(|y| − (L_max − L_cache)) / L_cache · factor, 0)
    0 up to L_max − L_cache tokens, then falling linearly to −factor at L_max = rollout.max_response_length;
    L_cache = reward.overlong_buffer_len; |y| counts the EOS, as verl's valid response length does.
    """
    exceed = lengths.float() - (max_length - buffer_len)
    return (-exceed / buffer_len * factor).clamp(max=0.0)
