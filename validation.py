"""Validation: rollout.val_n responses per validation prompt, scored as training scores them (rewards.Scorer), and
what k samples of a prompt tell: mean@k, unbiased pass@k and maj@k per data_source, and beside a reward model, judge
or reward server the task's rule on the same answers (val/rule_score/mean), so that reward hacking shows; and the
policy's perplexity of held-out reference text (val/perplexity, data.val_reference).

    metrics = validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator, perplexity)   # every trainer.test_freq

check_best_metric, before any model loads, holds trainer.best_metric to the names validation logs (logged_names).
"""
import dataclasses
import difflib
import functools
import math
import os
from collections import Counter
from dataclasses import dataclass

import torch

from data import load_preferences, render_prompt, tokenize_prompts
from infra.batches import autocast_dtype, micro_batch, set_train_mode
from infra.config import ConfigError, RewardConfig, RolloutConfig
from infra.metrics import reduce_metrics, sum_over_processes
from infra.rollout_common import left_pad, right_pad, with_conversations
from rewards import (decode_responses, one_rule, reward_sources, rule_for, score_on_every_process, score_responses,
                     Scorer)
from rollout import HFRollout


@torch.no_grad()
def validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator, perplexity=None) -> dict:
    """rollout.val_n responses per validation prompt at rollout.val_temperature (one, greedy, by default), scored:
    validation_metrics; and perplexity() (held_out_perplexity, bound to the policy) where given. Every validation
    samples with the run's seed, so that they differ by the policy."""
    k, mine = cfg.rollout.val_n, val_rows[accelerator.process_index::accelerator.num_processes]
    ro = rollout.generate(mine, k, cfg.rollout.val_temperature, seed=cfg.trainer.seed)
    texts = decode_responses(tokenizer, ro)
    sources = sorted({r["data_source"] for r in val_rows})
    rows = with_conversations([r for r in mine for _ in range(k)], ro)  # multi-turn: the reward reads them
    metrics = validation_metrics(scorer, rows, texts, sources, accelerator, k, ro=ro)
    turn_metrics = reduce_metrics(accelerator, ro.metrics) if ro.metrics else {}  # agent/*: multi-turn only
    metrics.update({f"val/{key}": value for key, value in turn_metrics.items()})
    return {**metrics, **(perplexity() if perplexity else {})}


# ---- val/perplexity: the policy on held-out reference text


@dataclass(frozen=True)
class References:
    """val/perplexity's text, tokenised at start-up (reference_text): each a prompt and its reference response."""
    rows: list  # {"prompt_ids": [...], "reference_ids": [..., EOS]}; empty: no val/perplexity
    pad_id: int
    size: int  # rows a forward: actor.log_prob_micro_batch_size_per_device
    source: str  # what the text is, or why there is none: the start-up line


def field_of(row: dict, spec: str):
    """The value at a dotted field of a data row ("extra_info.answer", "ground_truth"), or None."""
    for key in spec.split("."):
        row = row.get(key) if isinstance(row, dict) else None
    return row


def reference_text(cfg, val_rows: list, tokenizer) -> References:
    """data.val_reference read and tokenised before any model loads: a field of the validation rows (the rows that
    have it, none: no val/perplexity), or a parquet of preference pairs (their chosen responses, data.val_max_samples
    of them); none without validation. Each response ends with the EOS that ends a sampled one."""
    cfg_data, eos = cfg.data, [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    spec, none = cfg_data.val_reference, functools.partial(References, [], tokenizer.pad_token_id, 0)
    if not spec or not val_rows:
        return none(f"none (data.val_reference={spec}, data.val_files={cfg_data.val_files})")
    if spec.endswith(".parquet"):
        if not os.path.isfile(spec):
            raise ConfigError(f"data.val_reference: {spec} does not exist; give a parquet of preference pairs "
                              f"(prompt, chosen), a field of the validation rows (extra_info.answer), or null")
        pairs = load_preferences(spec)[0][:cfg_data.val_max_samples or None]
        prompts = tokenize_prompts([render_prompt(pair["prompt"], tokenizer) for pair in pairs], tokenizer)
        texts, source = [pair["chosen"] for pair in pairs], f"the chosen responses of {spec}, {len(pairs)} of them"
    else:
        found = [(row["prompt_ids"], str(text)) for row in val_rows if (text := field_of(row, spec)) not in (None, "")]
        prompts, texts = [ids for ids, _ in found], [text for _, text in found]
        source = f"{spec} of {len(texts)} of the {len(val_rows)} validation rows"
        if not texts:
            return none(f"none ({source}; set data.val_reference to a field they have, or a parquet)")
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    rows = [{"prompt_ids": list(p), "reference_ids": r + eos} for p, r in zip(prompts, ids)]
    return References(rows, tokenizer.pad_token_id, cfg.actor.log_prob_micro_batch_size_per_device, "on " + source)


@torch.no_grad()
def held_out_perplexity(policy, fwd, references: References, accelerator) -> dict:
    """{"val/perplexity": exp(−Σ log π(y_t | prompt, y_<t) / Σ 1)} over every token of every reference response,
    whichever process holds it, at temperature 1 from the embeddings up (no trunk states); {} without references.
    references.size rows a forward; every process runs as many forwards (FSDP2's collectives), a short share padded with
    rows of weight 0."""
    if not references.rows:
        return {}
    rows, world = references.rows, accelerator.num_processes
    share = -(-len(rows) // world)
    mine = rows[accelerator.process_index::world]
    weights = torch.tensor([1.0] * len(mine) + [0.0] * (share - len(mine)), dtype=torch.float64)  # (B,)
    mine = mine + rows[:share - len(mine)]
    queries, query_mask = left_pad([r["prompt_ids"] for r in mine], references.pad_id)  # (B, Tq)
    responses, response_mask = right_pad([r["reference_ids"] for r in mine], references.pad_id)  # (B, Tr)
    batch = dict(queries=queries, query_mask=query_mask, responses=responses, response_mask=response_mask)
    whole = dataclasses.replace(fwd, temperature=1.0, trunk=None)
    set_train_mode([policy], False)
    total = torch.zeros(2, dtype=torch.float64)  # Σ log-prob, token count
    for inds in torch.arange(share).split(references.size):
        mb = micro_batch(batch, inds, accelerator.device)
        mask = mb["response_mask"].cpu().double() * weights[inds, None]  # (b, tr)
        logprobs = whole.logprobs(policy, mb)[0].cpu().double()  # (b, tr)
        total += torch.stack([(logprobs * mask).sum(), mask.sum()])
    total = sum_over_processes(accelerator, total)
    return {"val/perplexity": math.exp(-(total[0] / total[1]).item())}


@torch.no_grad()
def greedy_validation(model, tokenizer, val_rows, accelerator, section, sharded: bool) -> dict:
    """sft.py's and dpo.py's validation, on ppo.py's yardstick: one greedy answer (at most section.max_response_length
    tokens) per prompt from the model being trained (rollout.HFRollout; sharded under FSDP2, every process runs as
    many forwards as the one with most), scored by the task's rule (reward.sources' default, [rule]):
    val/score/mean and val/<data_source>/score, as validate logs them."""
    rollout = HFRollout(accelerator.unwrap_model(model), tokenizer,
                        RolloutConfig(max_response_length=section.max_response_length),
                        autocast_dtype(section.dtype), synced_gpus=sharded, device=accelerator.device)
    mine = val_rows[accelerator.process_index::accelerator.num_processes]
    ro = rollout.generate(mine, 1, 0.0, seed=section.seed)
    scorer = Scorer(RewardConfig(), accelerator.device, None)
    return validation_metrics(scorer, mine, decode_responses(tokenizer, ro),
                              sorted({r["data_source"] for r in val_rows}), accelerator, 1, ro=ro)


def validation_metrics(scorer, rows: list[dict], texts: list[str], sources: list, accelerator, k: int = 1,
                       ro=None) -> dict:
    """Over the rows of every process (`sources`: every data_source of the validation set), rows i·k … i·k + k − 1
    being one prompt's k samples: val/score/mean and val/<data_source>/score, the mean score (mean@k); with k > 1
    and a score that is one rule's (Scorer.is_rule), pass@j and maj@k (pass_and_majority); with any other score,
    val/rule_score/mean: the task's rule on the same answers, over the rows with a ground truth and a rule. ro: the
    rollout.Rollout of the texts, which a scorer may read (a reward server's query: the tokens), or None; its
    token_rewards (an environment's turns) count in the score, as in training."""
    got = score_on_every_process(functools.partial(scorer, rows, texts, ro), accelerator)
    scores = got.scores if getattr(ro, "token_rewards", None) is None else got.scores + ro.token_rewards.sum(1)
    sums = torch.zeros(len(sources), 2)  # (sum of scores, count) per data_source; an environment's turns added
    for row, score in zip(rows, scores.tolist()):
        sums[sources.index(row["data_source"])] += torch.tensor([score, 1.0])
    sums = sum_over_processes(accelerator, sums)
    metrics = {"val/score/mean": (sums[:, 0].sum() / sums[:, 1].sum()).item()}
    metrics.update({f"val/{src}/score": (s / max(c, 1)).item() for src, (s, c) in zip(sources, sums)})
    if k > 1 and scorer.is_rule:
        answers = [extra.get("pred") for extra in got.extras]
        metrics.update(pass_and_majority(rows, got.scores.tolist(), answers, sources, k, accelerator))
    if scorer.task_rule is not None:
        ruled = [(row, text) for row, text in zip(rows, texts)
                 if row["ground_truth"] is not None and rule_of(scorer, row)]
        rule_scores, _, _ = score_responses(scorer.task_rule, [row for row, _ in ruled], [text for _, text in ruled],
                                            scorer.max_abs_score)
        total, count = sum_over_processes(accelerator, torch.tensor([sum(rule_scores), len(rule_scores)],
                                                                    dtype=torch.float64)).tolist()
        if count:
            metrics["val/rule_score/mean"] = total / count
    return metrics


def rule_of(scorer, row: dict) -> bool:
    """Whether the task rule scores this row: a custom reward.function scores every row, the built-ins those whose
    data_source has a rule."""
    return scorer.custom_rule or rule_for(row["data_source"]) is not None


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are right (Chen et al., 2021, eq. 1):
    1 − C(n − c, k) / C(n, k), the chance that k of the n drawn without replacement hold a right one."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_and_majority(rows: list[dict], scores: list, answers: list, sources: list, k: int, accelerator) -> dict:
    """Per data_source (val/<src>/…) and over all prompts (val/…/mean), from k samples per prompt, a sample being
    right when its rule score is > 0 (rules score 1 right, 0 or −1 wrong):
        pass@j for j = 1, 2, 4, … and k    unbiased (pass_at_k); pass@1 is the share of right samples
        maj@k                               is the most frequent answer right? Over the prompts whose k samples all
                                            have one (the rule's "pred"; ties: the answer seen first)
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


# ---- the names validation logs, checked at start-up

ENV_INFO = "val/env/"  # + <key>: a number an environment's step infos give, named only once it runs


def logged_names(cfg, sources: set, turn_metrics=(), perplexity: bool = False) -> set[str]:
    """Every name that ppo.py's validation can log (validation.py): val/score/mean and val/<data_source>/score for
    the validation data's sources; with rollout.val_n = k > 1 and a score that is one rule's (rewards.one_rule),
    val/pass@j/mean and val/<data_source>/pass@j for j = 1, 2, 4, … and k, and maj@k (logged where the rule gives
    its answers); with any other score, val/rule_score/mean; with rollout.multi_turn, val/<key> for each
    key of `turn_metrics` (agents/multi_turn.py's TurnSettings.metric_names). With an environment, also val/env/<key> (ENV_INFO) for the
    numbers in its infos, which no name here can list. With held-out reference text (`perplexity`), val/perplexity."""
    k, rule_alone = cfg.rollout.val_n, one_rule(reward_sources(cfg.reward))
    names = {"val/score/mean"} | {f"val/{src}/score" for src in sources}
    if k > 1 and rule_alone:
        kinds = [f"pass@{j}" for j in sorted({2 ** i for i in range(k.bit_length()) if 2 ** i <= k} | {k})]
        for kind in kinds + [f"maj@{k}"]:
            names |= {f"val/{kind}/mean"} | {f"val/{src}/{kind}" for src in sources}
    if not rule_alone:
        names.add("val/rule_score/mean")
    if cfg.rollout.multi_turn.enable:
        names |= {f"val/{key}" for key in turn_metrics}
    if perplexity:
        names.add("val/perplexity")
    return names


def check_best_metric(cfg, sources: set, turn_metrics=(), references=None) -> None:
    """trainer.best_metric is a name this run's validation logs (logged_names), checked once the validation
    data is read and before any model loads; a misspelt one used to fail at the first validation, with
    trainer.test_freq=0 only after the last step, losing the run. val/perplexity needs `references` with rows."""
    best = cfg.trainer.best_metric
    if not best:
        return
    if best == "val/perplexity" and not (references and references.rows):
        raise ConfigError(f"trainer.best_metric=val/perplexity needs held-out reference text, and there is "
                          f"{references.source if references else 'none'}: set data.val_reference to a field the "
                          f"validation rows have or to a parquet of preference pairs")
    names = logged_names(cfg, sources, turn_metrics, perplexity=bool(references and references.rows))
    if cfg.rollout.multi_turn.env and best.startswith(ENV_INFO) and len(best) > len(ENV_INFO):
        return  # an environment's info: said at each validation that lacks it (train_state.best_metric_missing)
    if best not in names:
        near = difflib.get_close_matches(best, names, n=1, cutoff=0.6)
        shown = sorted(names)[:20] + (["…"] if len(names) > 20 else [])
        raise ConfigError(f"trainer.best_metric={best} is not a metric this run's validation logs (it logs "
                          f"{', '.join(shown)})" + (f": did you mean {near[0]}?" if near else ""))
