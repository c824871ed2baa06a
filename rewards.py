"""Rule rewards with verl's signature: compute_score(data_source, solution_str, ground_truth, extra_info=None).

Built-ins, chosen by data_source in `default_compute_score`:
  openai/gsm8k, gsm8k        "#### <n>" compared numerically to the ground truth (verl's gsm8k.py)
  lighteval/MATH, …, math    the last \\boxed{…}, lightly normalised, compared as a string
  arithmetic                 the demo: the whole response must be "a + b = c" or the bare number c

A custom function is `reward.function=path/to/file.py:name`; verl reward files work unchanged.
A function may return a number, or a dict with "score" and other numbers to log.
"""
import importlib.util
import math
import numbers
import os
import re
import sys
import warnings

# ---- GSM8K (verl/utils/reward_score/gsm8k.py)

GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9.,]*[0-9])")
ANY_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def to_number(text: str):
    """float of "1,234" or "$5." or "-3.50"; None when it is not a number."""
    try:
        return float(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except ValueError:
        return None


def extract_gsm8k(solution_str: str, strict: bool = True):
    """The number after the last "####"; when not strict and there is none, the last number in the text."""
    found = GSM8K_ANSWER.findall(solution_str)
    if not found and not strict:
        found = ANY_NUMBER.findall(solution_str)
    return found[-1] if found else None


def gsm8k_score(solution_str: str, ground_truth: str, strict: bool = True,
                format_score: float = 0.0, score: float = 1.0) -> float:
    """score when the extracted answer equals ground_truth numerically, format_score when an answer was
    found but is wrong, 0.0 when none was found (verl's convention)."""
    answer = extract_gsm8k(solution_str, strict)
    if answer is None:
        return 0.0
    got, want = to_number(answer), to_number(str(ground_truth))
    return score if got is not None and want is not None and math.isclose(got, want, abs_tol=1e-6) else format_score


# ---- MATH (the last \boxed{…}, as in verl/utils/reward_score/math.py, with lighter normalisation)


def last_boxed(text: str):
    """Content of the last \\boxed{…} (braces balanced) or \\boxed x; None when there is none."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    rest = text[start + len("\\boxed"):]
    if rest.startswith(" "):
        words = rest.split("$")[0].split()
        return words[0] if words else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced: the response was cut off inside the box


def normalize_math(answer: str) -> str:
    """Light normalisation: no spaces, \\left/\\right, \\! or trailing '.', and dfrac/tfrac → frac."""
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("dfrac", "frac"), ("tfrac", "frac")):
        answer = answer.replace(old, new)
    return "".join(answer.split()).rstrip(".")


def math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer equals the ground truth (itself unboxed if boxed) after normalising."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) if "\\boxed" in truth else truth
    return float(truth is not None and normalize_math(answer) == normalize_math(truth))


# ---- arithmetic (the demo)

EQUATION_OR_INTEGER = re.compile(r"(?:[0-9+ ]+=\s*)?(-?[0-9]+)\.?")


def arithmetic_score(solution_str: str, ground_truth: str) -> float:
    """1.0 only when the whole stripped response is "a + b = c" (digits, '+' and spaces before a single
    '=') or the bare integer c, optionally with one trailing '.', and c equals the ground truth.
    Lenient parsing ("the number after =" anywhere) gets gamed: responses grow long and repetitive."""
    match = EQUATION_OR_INTEGER.fullmatch(solution_str.strip())
    return float(bool(match) and int(match.group(1)) == int(str(ground_truth).strip()))


# ---- dispatch and loading

BUILTIN_SCORES = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "math": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "arithmetic": arithmetic_score,
}


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The built-in rule for data_source; an unknown data_source is a ValueError naming the way out."""
    if data_source not in BUILTIN_SCORES:
        raise ValueError(f"no built-in reward for data_source {data_source!r}; known: {sorted(BUILTIN_SCORES)}. "
                         f"Write a function compute_score(data_source, solution_str, ground_truth, extra_info=None) "
                         f"and set reward.function=path/to/file.py:name")
    return BUILTIN_SCORES[data_source](solution_str, ground_truth)


def load_reward_function(spec):
    """None → default_compute_score; "path/to/file.py:name" (name defaults to compute_score, as in verl)
    → that function, imported from the file."""
    if not spec:
        return default_compute_score
    path, sep, name = spec.rpartition(":")
    if not sep:
        path, name = spec, "compute_score"
    if not os.path.isfile(path):
        raise ValueError(f"reward.function: file {path} does not exist (expected path/to/file.py:function_name)")
    module_name = "custom_reward_" + re.sub(r"\W", "_", os.path.splitext(os.path.abspath(path))[0])
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # so pickling the function (e.g. to worker processes) finds it
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"reward.function: importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"reward.function: {path} has no function `{name}`; callables found there: {found}")
    return fn


def as_score(result) -> tuple[float, dict]:
    """(score, extra numbers) from a function's return: a number, or a dict that carries "score"."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"a reward dict must carry 'score', got keys {sorted(result)}")
        extras = {k: float(v) for k, v in result.items()
                  if k != "score" and isinstance(v, numbers.Real)}
        return float(result["score"]), extras
    if isinstance(result, (str, bytes)) or result is None:
        raise TypeError(f"a reward function must return a number or a dict, got {result!r}")
    return float(result), {}


def score_responses(compute_score, rows: list[dict], responses: list[str]) -> tuple[list[float], dict, int]:
    """Score each (row, response) with compute_score(data_source=, solution_str=, ground_truth=, extra_info=),
    by keyword as verl calls it, so a custom function's argument order does not matter.

    Returns (scores, extras, errors): extras holds each extra numeric dict key's values, for logging
    as means. A call that raises or returns something unusable scores 0.0 and counts as an error,
    so one bad sample never ends a run; the first failure of each call is shown as a warning.
    """
    if len(rows) != len(responses):
        raise ValueError(f"score_responses got {len(rows)} rows but {len(responses)} responses")
    scores, extras, errors, first = [], {}, 0, None
    for row, response in zip(rows, responses):
        try:
            score, more = as_score(compute_score(data_source=row["data_source"], solution_str=response,
                                                 ground_truth=row["ground_truth"], extra_info=row["extra_info"]))
        except Exception as e:
            score, more, errors = 0.0, {}, errors + 1
            first = first or f"{type(e).__name__}: {e}"
        scores.append(score)
        for key, value in more.items():
            extras.setdefault(key, []).append(value)
    if errors:
        warnings.warn(f"reward function failed on {errors}/{len(rows)} samples (scored 0.0); first: {first}")
    return scores, extras, errors


class Scorer:
    """The task score of each response: a rule function, a reward model, or their weighted sum (reward.type)."""

    def __init__(self, cfg_reward, device, dtype):
        self.cfg, self.rule_fn, self.model = cfg_reward, None, None
        if cfg_reward.type in ("rule", "both"):
            self.rule_fn = load_reward_function(cfg_reward.function)
        if cfg_reward.type in ("model", "both"):
            from config import ConfigError
            from reward_model import RewardModelScorer
            if not cfg_reward.model_path:
                raise ConfigError(f"reward.type={cfg_reward.type} needs reward.model_path "
                                  "(the final/ folder written by reward_model.py)")
            self.model = RewardModelScorer(cfg_reward.model_path, cfg_reward.micro_batch_size, cfg_reward.normalize,
                                           cfg_reward.clip, device, dtype)

    def __call__(self, rows: list[dict], texts: list[str]):
        """rows (with prompt, ground_truth, data_source, extra_info) and decoded responses → scores (B,), metrics."""
        import torch
        both, metrics, scores = self.cfg.type == "both", {}, torch.zeros(len(texts))
        if self.rule_fn is not None:
            rule, extras, errors = score_responses(self.rule_fn, rows, texts)
            scores += (self.cfg.rule_weight if both else 1.0) * torch.tensor(rule, dtype=torch.float32)
            metrics["reward/errors"] = float(errors)
            metrics.update({f"reward/{k}": sum(v) / len(v) for k, v in extras.items() if v})
        if self.model is not None:
            model_scores = self.model.score([r["prompt"] for r in rows], texts).float().cpu()
            scores += (self.cfg.model_weight if both else 1.0) * model_scores
            metrics["reward/model_score_mean"] = model_scores.mean().item()
        return scores, metrics
