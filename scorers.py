"""Step 3's scorers: each turns a batch of responses into a rewards.Scores and is one line of SCORERS; reward.sources
names those a run adds up, with reward.weights (Scorer).

    scorer = Scorer(cfg.reward, device, dtype, tokenizer=tokenizer, stop=stop_signal)   # bound once (ppo.main)
    scores = scorer(rows, texts, ro)                                                    # every step: rewards.Scores

One calling convention for every scorer: built once as SCORERS[name](cfg_reward, setup) (setup: a `Setup`), then
called as scorer(rows, texts, ro) → rewards.Scores, rows being the data rows (prompt, ground_truth, data_source,
extra_info; with multi-turn the conversation), texts the decoded responses and ro the rollout.Rollout they came from
(None where only texts are scored: validation, tests). A check before any model loads, where a scorer needs one, is a
line of CHECKS. Adding a scorer: one class (or function) and one line in SCORERS; README.md ("Configuring, data,
rewards") has a worked example.

The reward model's network (RewardModel) is here as well: reward_model.py trains it, this file scores with it,
so that nothing ppo.py imports is the training script.
"""
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

import data
import judge
import rewards
from infra.batches import autocast, autocast_dtype
from infra.config import ConfigError
from infra.models import check_model_path, load_reward_classifier, load_tokenizer
from infra.worker import Pool
from rewards import load_reward_function, one_rule, reward_sources, Scores, score_responses
from rollout import right_pad


@dataclass(frozen=True)
class Setup:
    """What a scorer may need from the run, bound once."""
    device: torch.device  # where a reward model runs
    dtype: Optional[torch.dtype]  # its autocast dtype (None: fp32)
    tokenizer: object = None  # the policy's: it maps a function's step rewards to tokens; None: texts only
    trust_remote_code: bool = False  # model.trust_remote_code, for the reward model's folder
    stop: object = None  # runs.StopSignal, which a hung reward.function call holds up ≤ reward.timeout_s


# ---------------------------------------------------------------------------------------
# Rules and functions


def rule_scores(scores: list, extras: dict, errors: int) -> Scores:
    """score_responses' answer as Scores: reward/errors, reward/<key> for each number the rule returned beside its
    score, and per sample the answer it read ("pred", verl's DAPO rule; maj@k reads it) where every sample has one."""
    preds = extras.get("pred", [])
    metrics = {"reward/errors": float(errors), **{f"reward/{key}": sum(values) / len(values)
                                                  for key, values in extras.items() if values and key != "pred"}}
    per_sample = [{"pred": p} for p in preds] if len(preds) == len(scores) else None
    return Scores(torch.tensor(scores, dtype=torch.float32), extras=per_sample, metrics=metrics)


def reward_function(cfg_reward, stop=None):
    """reward.function in reward.max_concurrency worker processes, each call bounded by reward.timeout_s and a batch by
    reward.max_timeouts timed-out calls (rewards.load_reward_function); the built-in rules where it is unset."""
    pool = Pool(cfg_reward.max_concurrency, cfg_reward.max_timeouts)
    return load_reward_function(cfg_reward.function, cfg_reward.timeout_s, stop, pool)


class RuleScorer:
    """The built-in rules by data_source (rewards.default_compute_score), in this process."""

    def __init__(self, cfg_reward, setup: Setup):
        self.fn, self.max_abs_score = rewards.default_compute_score, cfg_reward.max_abs_score

    def __call__(self, rows: list[dict], texts: list[str], ro=None) -> Scores:
        return rule_scores(*score_responses(self.fn, rows, texts, self.max_abs_score))


class FunctionScorer:
    """reward.function in its worker process (rewards.load_reward_function), and the step rewards it returns
    ("step_rewards", "step_ends": rewards.read_steps) as token rewards at the tokens that end the steps."""

    def __init__(self, cfg_reward, setup: Setup):
        self.worker = reward_function(cfg_reward, setup.stop)
        self.tokenizer, self.results, self.max_abs_score = setup.tokenizer, [], cfg_reward.max_abs_score
        call_all = self.worker.call_all

        def keeping(calls):  # score_responses reads each result's score and numbers; the step rewards are read here
            self.results = call_all(calls)
            return self.results
        self.worker.call_all = keeping

    def __call__(self, rows: list[dict], texts: list[str], ro=None) -> Scores:
        scores = rule_scores(*score_responses(self.worker, rows, texts, self.max_abs_score))
        if ro is None or self.tokenizer is None:
            return scores
        steps, bad = [], 0
        for result in self.results:
            try:
                steps.append(rewards.read_steps(result))
            except ValueError:
                steps.append(None)
                bad += 1
        scores.token_rewards = rewards.step_token_rewards(self.tokenizer, ro, steps)  # (B, Tr)
        scores.metrics.update({"reward/step_errors": float(bad),
                               "reward/step_samples": float(sum(s is not None for s in steps))})
        return scores


# ---------------------------------------------------------------------------------------
# The reward model (reward_model.py trains it)


def last_token_index(attention_mask):
    """i* = max{t : mask_t = 1}, the last real position of each row, for right or left padding. (B, T) → (B,)"""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask).argmax(-1)


def shared_prefix_length(input_ids, attention_mask) -> int:
    """k = how many leading columns hold the same real token in every row, capped so that each row keeps at
    least its last real token after them (right padding). (B, T) → int."""
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)  # (T,)
    return min(int(same.long().cumprod(0).sum()), int(attention_mask.sum(1).min()) - 1)


class RewardModel(torch.nn.Module):
    """r(x) = w·h_{i*}: a sequence classifier (or a PEFT model of one) read at last_token_index.

    Conversations that open alike (the demo's system prompt and worked example: 33 of its 50 tokens) share
    that prefix: it runs once, its KV cache is copied to every row (keeping the autograd graph), and only the
    rest runs per row. Equal to one plain forward within fp32 rounding (tests/test_reward_model.py).
    """

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, attention_mask):
        from transformers import DynamicCache

        model = self.hf.get_base_model() if hasattr(self.hf, "get_base_model") else self.hf
        backbone = getattr(model, model.base_model_prefix)
        B, T, k = *input_ids.shape, shared_prefix_length(input_ids, attention_mask)
        cache = DynamicCache() if k > 0 else None
        if cache is not None:
            backbone(input_ids=input_ids[:1, :k], past_key_values=cache, use_cache=True)
            cache.reorder_cache(torch.zeros(B, dtype=torch.long, device=input_ids.device))  # (1, …) → (B, …)
        positions = torch.arange(k, T, device=input_ids.device).expand(B, -1)
        hidden = backbone(input_ids=input_ids[:, k:], attention_mask=attention_mask, position_ids=positions,
                          past_key_values=cache, use_cache=cache is not None).last_hidden_state  # (B, T − k, H)
        last = hidden[torch.arange(B, device=hidden.device), last_token_index(attention_mask) - k]  # (B, H)
        return model.score(last).squeeze(-1).float()  # (B,)


class RewardModelScorer:
    """Scores raw (prompt, response) pairs with a folder written by reward_model.py, rendered with its own
    tokenizer exactly as in training; micro-batched, no grad, eval mode.

    normalize: (s − mean) / std with final/reward_stats.json; clip: clamp to ±clip after normalising.
    """

    def __init__(self, path: str, micro_batch_size: int = 32, normalize: bool = False, clip=None,
                 device="cpu", autocast_dtype=None, *, trust_remote_code: bool = False):
        from transformers import AutoConfig

        if not os.path.isdir(path):
            raise ConfigError(f"reward model folder {path} does not exist; train one with reward_model.py")
        arch = (AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).architectures or ["?"])[0]
        if not arch.endswith("ForSequenceClassification"):
            raise ConfigError(f"{path} holds a {arch}, not a reward model (…ForSequenceClassification); "
                              f"point reward.model_path at the final/ folder written by reward_model.py")
        self.tokenizer = load_tokenizer(path, "reward.model_path", trust_remote_code=trust_remote_code)
        self.device = torch.device(device)
        model = RewardModel(load_reward_classifier(path, self.tokenizer.pad_token_id,
                                                   trust_remote_code=trust_remote_code))
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.micro_batch_size, self.clip, self.dtype, self.stats = micro_batch_size, clip, autocast_dtype, None
        if normalize:
            stats_path = os.path.join(path, "reward_stats.json")
            if not os.path.isfile(stats_path):
                raise ConfigError(f"reward.normalize needs {stats_path} (written by reward_model.py at the end "
                                  f"of training); retrain, or set reward.normalize=false")
            with open(stats_path) as f:
                self.stats = json.load(f)

    @classmethod
    def from_config(cls, cfg_reward, setup: Setup):
        return cls(cfg_reward.model_path, cfg_reward.micro_batch_size, cfg_reward.normalize, cfg_reward.clip,
                   setup.device, setup.dtype, trust_remote_code=setup.trust_remote_code)

    @torch.no_grad()
    def score(self, prompts: list, responses: list[str]) -> torch.Tensor:
        """prompts (text or chat messages, as stored) and decoded responses → scores (B,) on `device`."""
        texts = [data.render(p, r, self.tokenizer) for p, r in zip(prompts, responses, strict=True)]
        if not texts:
            return torch.zeros(0, device=self.device)
        ids = data.tokenize_prompts(texts, self.tokenizer)
        scores = []
        for i in range(0, len(ids), self.micro_batch_size):
            input_ids, attention_mask = right_pad(ids[i:i + self.micro_batch_size], self.tokenizer.pad_token_id)
            with autocast(self.device, self.dtype):
                scores.append(self.model(input_ids.to(self.device), attention_mask.to(self.device)))  # (b,)
        scores = torch.cat(scores)  # (B,)
        if self.stats is not None:
            scores = (scores - self.stats["mean"]) / max(self.stats["std"], 1e-8)
        if self.clip is not None:
            scores = scores.clamp(-self.clip, self.clip)
        return scores

    def __call__(self, rows: list[dict], texts: list[str], ro=None) -> Scores:
        scores = self.score([row["prompt"] for row in rows], texts).float().cpu()  # (B,)
        return Scores(scores, metrics={"reward/model_score_mean": scores.mean().item()})


# ---------------------------------------------------------------------------------------
# The table, the checks at start-up, and the weighted sum of a run's sources

# reward.sources' names → scorer, built as SCORERS[name](cfg_reward, setup), called as scorer(rows, texts, ro)
SCORERS = {"rule": RuleScorer, "function": FunctionScorer, "model": RewardModelScorer.from_config,
           "judge": judge.JudgeScorer, "remote": judge.RemoteScorer}


def check_model_source(cfg_reward, trust_remote_code: bool) -> None:
    if not cfg_reward.model_path:
        spelled = f"reward.type={cfg_reward.type}" if cfg_reward.type else "reward.sources with model"
        raise ConfigError(f"{spelled} needs reward.model_path (the final/ folder written by reward_model.py)")
    check_model_path(cfg_reward.model_path, "reward.model_path", trust_remote_code=trust_remote_code)


def check_function_source(cfg_reward, trust_remote_code: bool) -> None:
    """The function imports (once, in a worker, which then stops)."""
    load_reward_function(cfg_reward.function, cfg_reward.timeout_s).close()


# a source's check before any model loads (cfg_reward, trust_remote_code), where it has one
CHECKS = {"model": check_model_source,
          "judge": lambda cfg_reward, trust: judge.check_judge(cfg_reward.judge),
          "remote": lambda cfg_reward, trust: judge.check_remote(cfg_reward.remote)}


def check_reward_inputs(cfg_reward, trust_remote_code: bool = False) -> None:
    """Before any model loads: reward.sources and reward.weights agree and name scorers, reward.function imports,
    and each source's inputs are there (CHECKS)."""
    for name, _ in reward_sources(cfg_reward):
        if name not in SCORERS:
            raise ConfigError(f"reward.sources: {name!r} is not one of {', '.join(SCORERS)}")
    if cfg_reward.function:
        check_function_source(cfg_reward, trust_remote_code)
    for name, _ in reward_sources(cfg_reward):
        if name in CHECKS:
            CHECKS[name](cfg_reward, trust_remote_code)


class Scorer:
    """The task score of each response: Σ_s w_s · score_s over the run's reward.sources s with their reward.weights
    (token rewards weighted alike), each source's mean logged as reward/<source>/mean."""

    def __init__(self, cfg_reward, device, dtype, *, tokenizer=None, trust_remote_code: bool = False, stop=None):
        """`tokenizer`: the policy's (step rewards land on its tokens; None: texts only); `trust_remote_code`:
        model.trust_remote_code, for the reward model's folder; `stop`: runs.StopSignal."""
        self.sources = reward_sources(cfg_reward)  # [(name, weight)]
        setup = Setup(torch.device(device), dtype, tokenizer, trust_remote_code, stop)
        self.scorers = {name: SCORERS[name](cfg_reward, setup) for name, _ in self.sources}
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
