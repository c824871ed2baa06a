"""verl 0.9.1's default_compute_score: each row's data_source routed to its rule (the table BUILTIN_SCORES, and
rule_for's prefixes). verl's names go to verl's own rules, ported with their quirks (verl_rules.py, verl_prime_math.py)
so that a response scores exactly as in verl; this library's own, more lenient rules (library.py: gsm8k, boxed,
arithmetic) under their own names; reasoning_gym/<task> to that task's score_answer (reasoning_gym_rules.py).
verl's code, search-tool and image routes are not built in (NOT_BUILT_IN): rewards.check_data_sources stops such a
run at start-up.
"""
from reward_rules import reasoning_gym_rules, verl_prime_math, verl_rules
from reward_rules.library import arithmetic_score, boxed_score, gsm8k_score


def environment_score(solution_str: str, ground_truth: str) -> float:
    """data_source "environment": rows an environment scores alone with its turns' rewards (rollout.multi_turn.env,
    agents/environments.py), which rewards.score_samples adds at their tokens; verifiers/<env> (its rubric, paid by the environment
    at the last turn: agents/verifiers.py) too; the rule adds 0."""
    return 0.0


NUMINA = ["numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
          "numina_olympiads"]
BUILTIN_SCORES = {
    "openai/gsm8k": verl_rules.gsm8k,
    **dict.fromkeys(["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"],
                    verl_rules.hendrycks_math),
    **dict.fromkeys(["math_dapo", "math", "math_dapo_reasoning"], verl_rules.dapo),  # and every aime*
    **dict.fromkeys(NUMINA, verl_prime_math.prime_math),
    "gsm8k": gsm8k_score, "boxed": boxed_score, "arithmetic": arithmetic_score,  # this library's own
    "environment": environment_score,
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
        return environment_score
    return verl_rules.dapo if isinstance(data_source, str) and data_source.startswith("aime") else None


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, sandbox_fusion_url=None,
                          concurrent_semaphore=None, memory_limit_mb=None, **kwargs):
    """verl's default_compute_score: the rule for data_source gives what verl's gives (a float, or DAPO's
    {"score", "acc", "pred"} dict). An unknown data_source, or a null ground truth, is a ValueError (an error)."""
    rule = rule_for(data_source)
    if rule is None:
        raise ValueError(f"no built-in reward for data_source {data_source!r}; known: {KNOWN}. "
                         f"Write a function compute_score(data_source, solution_str, ground_truth, extra_info=None) "
                         f"and set reward.function=path/to/file.py:name")
    if ground_truth is None and rule is not environment_score:  # an environment's rows need none
        raise ValueError(f"the row (data_source {data_source!r}) has no ground truth to compare with")
    return rule(solution_str, ground_truth)


def without_rule(sources) -> list[str]:
    """The data_sources no built-in rule scores, sorted, each with the reason verl's needs more where NOT_BUILT_IN
    has one: "'apps' (verl runs the code in a sandbox)"."""
    missing = sorted({s for s in sources if rule_for(s) is None}, key=str)
    return [repr(s) + (f" ({NOT_BUILT_IN[s]})" if s in NOT_BUILT_IN else "") for s in missing]
