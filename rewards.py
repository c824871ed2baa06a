"""Step 3, score: each response's task score, Σ_s w_s · score_s over reward.sources with reward.weights (Scorer). Each
source is one line of SCORERS, built as SCORERS[name](cfg_reward, setup), called as scorer(rows, texts, ro) → Scores:
here rule (the built-in rules, routed by data_source as verl routes them: reward_rules/routing.py) and function (your
reward.function); a reward model, an LLM judge and a reward server live in scorers/, named only on their lines.

A custom function is `reward.function=path/to/file.py:name`; verl reward files work unchanged, `async def` ones
included, and so do TRL's batched reward functions `f(prompts, completions, **columns)` and OpenRLHF's
`reward_func(queries, prompts, labels)`, told by their parameters (function_style) or by reward.function_style
(scorers/function_styles.py). A function may return a number, or a dict with "score" and other numbers to log. It
runs in a worker pool of reward.max_concurrency worker processes (infra/worker.py), each call limited to
reward.timeout_s and each batch to reward.max_timeouts timed-out calls: a call that hangs, raises, calls sys.exit, or
ends or kills its worker is an error for its sample (reward/errors), never the end of the run; so is a score that is
not finite or beyond ±reward.max_abs_score. Besides "score" it may return step rewards, "step_rewards" with
"step_ends", which land on the tokens that end the steps (scorers/steps.py), as a process reward model's would.
"""
import functools
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from accelerate.utils import gather_object

from infra.batches import autocast_dtype
from infra.checks import reward_sources
from infra.config import ConfigError, load_target
from infra.reward_calls import as_score, call_reward, verl_calls
from infra.rollout_common import add_token_rewards, cut_off, Samples, with_conversations
from infra.runs import Interrupted
from infra.worker import CallFailed, FunctionWorker, parameters, Pool, WorkerStartError
from reward_rules.routing import default_compute_score, environment_score, KNOWN, rule_for, without_rule

# ---- what every scorer returns, and what it is built with

@dataclass
class Scores:
    """A scorer's answer for a batch of B responses (SCORERS' calling convention: scorer(rows, texts, ro)).
    score_samples puts extras and token_rewards into infra.rollout_common.Samples; ppo.py's step 5 adds token_rewards
    to the score at the last token (kl.kl_penalty_rewards)."""
    scores: torch.Tensor  # (B,) float32, one number per response
    token_rewards: Optional[torch.Tensor] = None  # (B, Tr) rewards at response tokens (0 elsewhere), or None
    extras: list = field(default_factory=list)  # (B,) a dict per sample: "pred" (the rule's answer), "judge_answer" …
    metrics: dict = field(default_factory=dict)  # reward/* numbers for the step's log

    def __post_init__(self):
        self.extras = self.extras or [{} for _ in range(len(self.scores))]


@dataclass(frozen=True)
class Setup:
    """What a scorer may need from the run, bound once."""
    device: torch.device  # where a reward model runs
    dtype: Optional[torch.dtype]  # its autocast dtype (None: fp32)
    tokenizer: object = None  # the policy's: it maps a function's step rewards to tokens; None: texts only
    trust_remote_code: bool = False  # model.trust_remote_code, for the reward model's folder
    stop: object = None  # runs.StopSignal, which a hung reward.function call holds up ≤ reward.timeout_s


# ---- Step 3: the weighted sum of the run's reward.sources


class Scorer:
    """The task score of each response: Σ_s w_s · score_s over the run's reward.sources s with their reward.weights
    (token rewards weighted alike), each source's mean logged as reward/<source>/mean."""

    def __init__(self, cfg_reward, device, dtype, *, tokenizer=None, trust_remote_code: bool = False, stop=None):
        """`tokenizer`: the policy's (step rewards land on its tokens; None: texts only); `trust_remote_code`:
        model.trust_remote_code, for the reward model's folder; `stop`: runs.StopSignal."""
        self.sources = reward_sources(cfg_reward)  # [(name, weight)]
        setup = Setup(torch.device(device), dtype, tokenizer, trust_remote_code, stop)
        self.scorers = {name: load_target(SCORERS[name])(cfg_reward, setup) for name, _ in self.sources}
        # the score is one rule's at weight 1: pass@k and maj@k read it; else validation also logs the task's rule on
        # the same answers (val/rule_score/mean: does what a reward model, judge or server likes score?), which is
        # reward.function where it is set (its worker shared), else the built-ins
        self.is_rule = one_rule(self.sources)
        self.custom_rule = bool(cfg_reward.function)  # the task's rule is reward.function, which scores every row
        self.task_rule = None if self.is_rule else (
            self.scorers["function"].worker if "function" in self.scorers else reward_function(cfg_reward, stop))
        self.max_abs_score = cfg_reward.max_abs_score

    @classmethod
    def from_config(cls, cfg, device, tokenizer, stop):
        """ppo.py's: cfg.reward's sources, a reward model under model.dtype's autocast."""
        return cls(cfg.reward, device, autocast_dtype(cfg.model.dtype), tokenizer=tokenizer,
                   trust_remote_code=cfg.model.trust_remote_code, stop=stop)

    def __call__(self, rows: list[dict], texts: list[str], ro=None) -> Scores:
        total, token_rewards, metrics = torch.zeros(len(texts)), None, {}  # (B,)
        extras = [{} for _ in texts]
        for name, weight in self.sources:
            got = self.scorers[name](rows, texts, ro)
            total += weight * got.scores.float().cpu()
            if got.token_rewards is not None:
                token_rewards = weight * got.token_rewards + (0 if token_rewards is None else token_rewards)  # (B, Tr)
            for mine, theirs in zip(extras, got.extras):
                mine.update(theirs)
            for key, value in got.metrics.items():  # two sources' errors add up
                metrics[key] = metrics.get(key, 0.0) + value if key.endswith("errors") else value
            metrics[f"reward/{name}/mean"] = got.scores.float().mean().item()
        return Scores(total, token_rewards, extras, metrics)


# ---- the rule and the function, and the table of scorers


class RuleScorer:
    """The built-in rules by data_source (default_compute_score), in this process."""

    def __init__(self, cfg_reward, setup: Setup):
        self.fn, self.max_abs_score = default_compute_score, cfg_reward.max_abs_score

    def __call__(self, rows: list[dict], texts: list[str], ro=None) -> Scores:
        return rule_scores(*score_responses(self.fn, rows, texts, self.max_abs_score))


def rule_scores(scores: list, extras: dict, errors: int) -> Scores:
    """read_scores' answer as Scores: reward/errors, reward/<key> for each number the rule returned beside its
    score, and per sample the answer it read ("pred", verl's DAPO rule; maj@k reads it) where every sample has one."""
    preds = extras.get("pred", [])
    metrics = {"reward/errors": float(errors), **{f"reward/{key}": sum(values) / len(values)
                                                  for key, values in extras.items() if values and key != "pred"}}
    per_sample = [{"pred": p} for p in preds] if len(preds) == len(scores) else None
    return Scores(torch.tensor(scores, dtype=torch.float32), extras=per_sample, metrics=metrics)


def reward_function(cfg_reward, stop=None):
    """reward.function in reward.max_concurrency worker processes, each call bounded by reward.timeout_s and a batch by
    reward.max_timeouts timed-out calls (load_reward_function); the built-in rules where it is unset."""
    pool = Pool(cfg_reward.max_concurrency, cfg_reward.max_timeouts)
    return load_reward_function(cfg_reward.function, cfg_reward.timeout_s, stop, pool, cfg_reward.function_style)


class FunctionScorer:
    """reward.function in its worker processes (load_reward_function): the scores of its raw results (read_scores), and
    the step rewards they carry ("step_rewards", "step_ends") as token rewards at the tokens that end the steps."""

    def __init__(self, cfg_reward, setup: Setup):
        self.worker = reward_function(cfg_reward, setup.stop)
        self.tokenizer, self.max_abs_score = setup.tokenizer, cfg_reward.max_abs_score

    def __call__(self, rows: list[dict], texts: list[str], ro=None) -> Scores:
        ids = None if ro is None else [r[m.bool()].tolist() for r, m in zip(ro.responses, ro.response_mask)]
        results = function_results(self.worker, rows, texts, ids)  # (B,) each a return value or an exception
        scores = rule_scores(*read_scores(results, self.max_abs_score))
        if scores.metrics.get("reward/no_reward") == 1.0:  # TRL's None for every sample: there is nothing to learn
            raise RewardError(f"the reward function returned None (no reward) for all {len(texts)} samples of a batch, "
                              f"so training would learn from zeros")
        if ro is not None and self.tokenizer is not None:  # step rewards, where the function returns them
            scores.token_rewards, metrics = load_target(STEP_REWARDS)(self.tokenizer, ro, results,  # (B, Tr)
                                                                      self.max_abs_score)
            scores.metrics.update(metrics)
        return scores


# reward.sources' names → scorer (a feature folder's as "module:name", imported only by a run that names it)
SCORERS = {"rule": RuleScorer, "function": FunctionScorer, "model": "scorers.model:RewardModelScorer.from_config",
           "judge": "scorers.judge:JudgeScorer", "remote": "scorers.remote:RemoteScorer"}
# reward.function's batched calling conventions (verl's per-sample compute_score: infra/reward_calls.verl_calls)
REWARD_STYLES = {"trl": "scorers.function_styles:trl_style", "openrlhf": "scorers.function_styles:openrlhf_style"}
STEP_REWARDS = "scorers.steps:step_rewards"  # a function's step rewards → (token rewards, metrics), imported on use
# a source's check before any model loads (cfg_reward, trust_remote_code), where it has one
CHECKS = {"model": "scorers.model:check_model_source", "judge": "scorers.judge:check_judge_source",
          "remote": "scorers.remote:check_remote_source"}


# ---- reward.sources, and the checks at start-up


def one_rule(sources: list) -> bool:
    """Is the score one rule's, at weight 1 (`sources`: reward_sources' pairs)? pass@k and maj@k read its answers;
    any other score has validation log the task's rule beside it (val/rule_score/mean)."""
    return len(sources) == 1 and sources[0] in (("rule", 1.0), ("function", 1.0))


def check_reward_inputs(cfg_reward, trust_remote_code: bool = False) -> Optional[FunctionWorker]:
    """Before any model loads: reward.sources and reward.weights agree and name scorers, reward.function imports,
    and each source's inputs are there (CHECKS). Returns reward.function's worker, one process that has imported it,
    for check_sample_call to call and stop once the data is read (None without a reward.function)."""
    for name, _ in reward_sources(cfg_reward):
        if name not in SCORERS:
            raise ConfigError(f"reward.sources: {name!r} is not one of {', '.join(SCORERS)}")
    worker = None
    if cfg_reward.function:  # it imports, in a worker process (never in this one: infra/worker.py)
        worker = load_reward_function(cfg_reward.function, cfg_reward.timeout_s, style=cfg_reward.function_style)
    for name, _ in reward_sources(cfg_reward):
        if name in CHECKS:
            load_target(CHECKS[name])(cfg_reward, trust_remote_code)
    return worker


def check_data_sources(sources, reward_cfg) -> None:
    """At start-up: a ConfigError naming every data_source no rule scores, when the source rule (the built-ins) is
    one of reward.sources (reward_rules/routing.py routes them)."""
    missing = without_rule(sources) if "rule" in dict(reward_sources(reward_cfg)) else []
    if missing:
        raise ConfigError(f"the data has data_source values with no built-in reward: {', '.join(missing)}; score them "
                          f"with your own compute_score(data_source, solution_str, ground_truth, extra_info=None) by "
                          f"setting reward.function=path/to/file.py:compute_score (built in: {KNOWN})")


def rule_needing_truth(data_source, cfg_reward):
    """For data.py's check at start-up: the name of the built-in rule that will compare data_source's responses with
    their ground truth, or None (no source rule: a reward model, a judge or your function may need none)."""
    if "rule" not in dict(reward_sources(cfg_reward)):
        return None
    rule = rule_for(data_source)
    if rule is None or rule is environment_score:  # the environment scores its rows: no truth is compared
        return None
    return f"{rule.__module__.split('.')[-1]}.{rule.__name__}"


# ---- a reward function, called as verl (or TRL, or OpenRLHF) calls it (each call: infra/reward_calls.py)


def load_reward_function(spec, timeout_s: float, stop=None, pool: Pool = Pool(), style: str = "auto"):
    """None → default_compute_score, called in this process; "path/to/file.py:name" (name defaults to
    compute_score, as in verl) → a FunctionWorker running that function in pool.max_concurrency processes, each call
    limited to timeout_s and a batch to pool.max_timeouts timed-out calls (`stop`: runs.StopSignal, so that a
    preempted run does not wait for a hung call longer than that), its calling convention as `.style`
    (function_style; `style`: reward.function_style)."""
    if not spec:
        return default_compute_score
    path, sep, name = spec.rpartition(":")
    if not sep:
        path, name = spec, "compute_score"
    if not os.path.isfile(path):
        raise ConfigError(f"reward.function: file {path} does not exist (expected path/to/file.py:function_name)")
    try:
        worker = FunctionWorker(path, name, timeout_s, stop, pool)
    except WorkerStartError as e:
        raise ConfigError(f"reward.function: {e}") from None
    worker.style = function_style(worker.params, style)
    return worker


def function_style(params: list[str], style: str = "auto") -> str:
    """A reward function's calling convention, by its parameter names (`params`: worker.parameters') where `style`
    (reward.function_style) is "auto": "trl" with `completions` or `environments` (TRL's reward_funcs), "openrlhf"
    with `queries` (OpenRLHF's reward_func), else "verl" (compute_score, per sample)."""
    if style != "auto":
        return style
    return ("trl" if {"completions", "environments"} & set(params) else "openrlhf" if "queries" in params
            else "verl")


def function_results(compute_score, rows: list[dict], responses: list[str], completion_ids=None) -> list:
    """One result per (row, response) from a reward function in its style (its `.style`, else read from its
    parameters): verl's per sample (verl_calls), or a batched style's one call for the batch (REWARD_STYLES; only the
    keywords it takes where it has no **kwargs; OpenRLHF's three by position, as OpenRLHF passes them, where its
    parameters have other names) read back per sample; the call's exception is each sample's."""
    style = getattr(compute_score, "style", None) or function_style(parameters(compute_score))
    if style == "verl":
        return call_reward(compute_score, verl_calls(rows, responses))
    params = compute_score.params if isinstance(compute_score, FunctionWorker) else parameters(compute_score)

    def call(kwargs: dict):  # the one call for the batch: its return value, or the exception it raised
        if style == "openrlhf" and not set(kwargs) <= set(params):  # OpenRLHF passes them by position
            kwargs = dict(zip([p for p in params if p != "**"], kwargs.values()))
        taken = kwargs if "**" in params else {k: v for k, v in kwargs.items() if k in params}
        return call_reward(compute_score, [taken])[0]
    return load_target(REWARD_STYLES[style])(call, rows, responses, completion_ids)


def check_sample_call(cfg_reward, worker: Optional[FunctionWorker], row: dict) -> None:
    """Before the policy loads: a batched reward.function (TRL's, OpenRLHF's) called once on `row`, the data's first,
    with its ground truth as the response, in `worker` (check_reward_inputs', which stops here; None: no
    reward.function); a call that fails, or returns other than one reward for it, is a ConfigError naming the file,
    the function and the error. (verl's per-sample functions, and TRL's that read the `environments` only an episode
    makes, are not called here: one failing on every sample stops step 1 with its first error.)"""
    if worker is None:
        return
    try:
        if worker.style != "verl" and "environments" not in worker.params:
            for result in function_results(worker, [row], [str(row.get("ground_truth") or "")]):
                if not (isinstance(result, dict) and result.get("no_reward")):
                    as_score(result)
    except Exception as e:
        raise ConfigError(f"reward.function={cfg_reward.function}: the {worker.style}-style reward function failed "
                          f"its sample call on the data's first row: {e}") from None
    finally:
        worker.close()


def read_scores(results: list, max_abs_score: float = math.inf) -> tuple[list[float], dict, int]:
    """(scores, extras: each extra numeric dict key's values, errors) from a reward function's results: a call that
    raised, timed out, ended its worker, was not run (its batch reached reward.max_timeouts) or returned what as_score
    refuses (None, a string, a dict without "score", NaN, inf, beyond ±max_abs_score) scores 0.0 (count_failures)."""
    scores, extras, errors, first = [], {}, 0, None
    for result in results:
        try:
            score, more = as_score(result, max_abs_score)
        except Exception as e:
            score, more, errors = 0.0, {}, errors + 1
            first = first or (str(e) if isinstance(e, CallFailed) else f"{type(e).__name__}: {e}")
        scores.append(score)
        for key, value in more.items():
            extras.setdefault(key, []).append(value)
    count_failures("the reward function", errors, len(results), first)
    return scores, extras, errors


def score_responses(compute_score, rows: list[dict], responses: list[str],
                    max_abs_score: float = math.inf) -> tuple[list[float], dict, int]:
    """Score each (row, response) with compute_score (a function here, or a FunctionWorker's in its processes) by
    its style's keywords (verl's, TRL's, OpenRLHF's): (scores, extras, errors), read_scores' reading of
    function_results(compute_score, …)."""
    return read_scores(function_results(compute_score, rows, responses), max_abs_score)


# ---- failures: a sample's error scores 0, every sample's stops the run


class RewardError(ConfigError):
    """A scorer failed on every sample of a batch: training on would learn from zeros."""


def count_failures(what: str, errors: int, total: int, first: Optional[str], unit: str = "samples",
                   lost: str = "zeros", kept: str = "scored 0.0") -> None:
    """A source's failed samples (or calls: `unit`), each `kept` so: a warning naming the first error, or, when every
    one of the batch failed, RewardError (training on would learn from `lost`). Every source follows it: reward
    functions and servers, a judge, step rewards (scorers/steps.py), environments and tools (agents/multi_turn.py)."""
    if errors and errors == total:
        raise RewardError(f"{what} failed on all {errors} {unit} of a batch, so training would learn from {lost}; "
                          f"the first error: {first}")
    if errors:
        warnings.warn(f"{what} failed on {errors}/{total} {unit} ({kept}); first: {first}")


# ---- length shaping, the texts scored, and the score on every process


def overlong_reward(lengths, max_length: int, buffer_len: int, factor: float):
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13; verl's DAPO reward manager), (B,) from lengths (B,):

        R(y) = min(−(|y| − (L_max − L_cache)) / L_cache · factor, 0)
    0 up to L_max − L_cache tokens, then falling linearly to −factor at L_max = rollout.max_response_length;
    L_cache = reward.overlong_buffer_len; |y| counts the EOS, as verl's valid response length does.
    """
    exceed = lengths.float() - (max_length - buffer_len)
    return (-exceed / buffer_len * factor).clamp(max=0.0)


def decode_responses(tokenizer, ro) -> list[str]:
    """The text each response of a rollout.Rollout is scored on: its tokens, or with multi-turn its last assistant
    turn (agents/multi_turn.py)."""
    if ro.conversations is not None:
        return [c["turns"][-1]["content"] for c in ro.conversations]
    return tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(ro.responses, ro.response_mask)],
                                  skip_special_tokens=True)


def score_on_every_process(score: Callable, accelerator):
    """score() → Scores, on all processes together: when the reward fails on every sample of any process's batch
    (RewardError), every process raises it, with the failing process's message; when a stop signal could not wait
    for a reward call on any process (runs.Interrupted), every process raises that. Raised on that process alone,
    either would leave the others waiting for it at their next collective."""
    error, interrupted, scores = None, None, None
    try:
        scores = score()
    except RewardError as e:
        error = str(e)
    except Interrupted as e:
        interrupted = e
    flags = torch.tensor([float(error is not None), float(interrupted.signum if interrupted else 0)])
    failed, signum = accelerator.reduce(flags.to(accelerator.device), "max").tolist()
    if signum:
        raise interrupted or Interrupted(int(signum), "while a reward call of another process was still running; "
                                                      "this step is not saved, the last checkpoint is kept")
    if failed:
        raise RewardError(next(message for message in gather_object([error]) if message))
    return scores


# ---------------------------------------------------------------------------------------
# Step 3 of ppo.py for one generated batch


def score_samples(rows: list[dict], ro, scorer, tokenizer, eos_ids, cfg, accelerator) -> tuple[Samples, dict]:
    """The prompts' rows (each n times: row i·n + j holds sample j of prompt i) and their responses, decoded and
    scored on every process together (`scorer`: reward.sources, weighted), the rollout's token rewards (an
    environment's turns) added to the scorers', and the score shaped for length: reward.overlong_penalty for a
    response cut off at rollout.max_response_length, DAPO's soft punishment (overlong_reward) over the last
    reward.overlong_buffer_len tokens. Returns the Samples and the scorers' and rollout's metrics."""
    r, max_length = cfg.reward, cfg.rollout.max_response_length
    rows = with_conversations(rows, ro)  # multi-turn: the reward reads each conversation
    texts = decode_responses(tokenizer, ro)
    scored = score_on_every_process(functools.partial(scorer, rows, texts, ro), accelerator)
    scores, token_rewards = scored.scores, add_token_rewards(scored.token_rewards, ro.token_rewards)  # (B,), (B, Tr)
    lengths = (ro.response_mask if ro.attention_mask is None else ro.attention_mask).sum(1)  # (B,) tool answers too
    truncated = cut_off(ro.responses, lengths, max_length, eos_ids)  # (B,)
    scores = scores + r.overlong_penalty * truncated.float()
    if r.overlong_buffer_len:
        scores = scores + overlong_reward(lengths, max_length, r.overlong_buffer_len, r.overlong_penalty_factor)
    return (Samples(rows, ro.responses, ro.response_mask, ro.logprobs, texts, scores, truncated, ro.attention_mask,
                    token_rewards, scored.extras), {**scored.metrics, **ro.metrics})
