"""rewards.py: the library's own rules by hand cases, dispatch, custom functions (sync and async), score_responses
and its error rules, and the start-up data_source check. verl's rules are checked against verl itself in
test_verl_rewards.py."""
import asyncio
import os
import sys
import time
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rewards  # noqa: E402
from infra.config import ConfigError  # noqa: E402
from rewards import default_compute_score  # noqa: E402
from reward_rules.library import arithmetic_score, boxed_score, gsm8k_score, last_boxed  # noqa: E402


# ---- GSM8K


def test_gsm8k_strict_reads_the_last_marked_answer():
    """strict: only "#### n" counts (commas and $ stripped, compared as numbers); the last marker wins."""
    assert gsm8k_score("so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert gsm8k_score("#### $1,234", "1234") == 1.0
    assert gsm8k_score("#### 72.0", "72") == 1.0
    assert gsm8k_score("#### 5\n#### -3", "-3") == 1.0
    assert gsm8k_score("#### 8", "7") == 0.0
    assert gsm8k_score("the answer is 7", "7") == 0.0


def test_gsm8k_compares_exact_numbers():
    """No float tolerance: a relative one matched 1000000001 with 1000000000, an absolute one 0.0000001 with 0."""
    assert gsm8k_score("#### 1000000001", "1000000000") == 0.0
    assert gsm8k_score("#### 0.0000001", "0") == 0.0
    assert gsm8k_score("#### 1,000,000,000", "1000000000") == 1.0 and gsm8k_score("#### 0.50", "0.5") == 1.0
    assert gsm8k_score("#### 158.", "158") == 1.0 and gsm8k_score("####132", "132") == 1.0


def test_gsm8k_flexible_falls_back_to_the_last_number():
    """strict=False: without a marker the last number in the text is the answer."""
    assert gsm8k_score("3 + 4 gives 7.", "7", strict=False) == 1.0
    assert gsm8k_score("it is 1,000 apples", "1000", strict=False) == 1.0
    assert gsm8k_score("7 or maybe 8", "7", strict=False) == 0.0
    assert gsm8k_score("no numbers here", "7", strict=False) == 0.0


def test_gsm8k_format_score_is_given_to_a_wrong_but_marked_answer():
    """format_score rewards a found-but-wrong answer; no answer at all still scores 0."""
    assert gsm8k_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k_score("eight", "7", format_score=0.1) == 0.0


# ---- MATH


def test_last_boxed_balances_nested_braces():
    """The content of the last \\boxed{…} is read with balanced braces; a cut-off box gives None."""
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\sqrt{\frac{a}{b}}}") == r"\sqrt{\frac{a}{b}}"
    assert last_boxed(r"$\boxed 5$") == "5" and last_boxed(r"\boxed $") is None
    assert last_boxed(r"\boxed{\frac{1}{2") is None
    assert last_boxed("no box") is None


def test_math_score_normalises_lightly():
    """Spaces, \\left/\\right, \\!, a trailing '.', and dfrac are ignored; ground truth may itself be boxed."""
    assert boxed_score(r"so \boxed{\dfrac{1}{2}}.", r"\frac{1}{2}") == 1.0
    assert boxed_score(r"\boxed{\left( 1, 2 \right)}", "(1,2)") == 1.0
    assert boxed_score(r"\boxed{10\!000.}", r"\boxed{10000}") == 1.0
    assert boxed_score(r"\boxed{3}", "4") == 0.0
    assert boxed_score("3", "3") == 0.0  # no box, no score


# ---- arithmetic


@pytest.mark.parametrize("response, score", [
    ("8", 1.0), (" 8. ", 1.0), ("\n8\n", 1.0), ("3 + 5 = 8", 1.0), ("3+5=8.", 1.0), ("1 + 2 + 5 = 8", 1.0),
    ("8\n8", 0.0), ("The answer is 8", 0.0), ("80", 0.0), ("8..", 0.0), ("3 + 5 = 9", 0.0), ("8!", 0.0), ("", 0.0),
    ("3 + 5 = 8\n3 + 5 = 8", 0.0), ("3 + 5 = 8 = 8", 0.0), ("8 = 3 + 5", 0.0), ("So 3 + 5 = 8", 0.0), ("3 + 5 =", 0.0),
])
def test_arithmetic_is_strict(response, score):
    """Only "a + b = c" or the bare integer c (optionally with one '.'), c equal to the ground truth, scores 1."""
    assert arithmetic_score(response, "8") == score


def test_arithmetic_negative_numbers():
    """A negative answer is read with its sign."""
    assert arithmetic_score("-3", "-3") == 1.0 and arithmetic_score("3", "-3") == 0.0


# ---- dispatch and custom functions


def test_default_dispatches_by_data_source():
    """Each data_source reaches its rule: verl's names verl's rules (math is DAPO's ±1, aime* by prefix), the
    library's own names its lenient rules."""
    assert default_compute_score("openai/gsm8k", "#### 7", "7") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 7.0", "7") == 0.0  # verl compares text
    assert default_compute_score("gsm8k", "#### 7.0", "7") == 1.0 and default_compute_score("gsm8k", "7", "7") == 0.0
    assert default_compute_score("HuggingFaceH4/MATH-500", r"\boxed{\frac87}", r"\frac{8}{7}") == 1.0
    assert default_compute_score("boxed", r"\boxed{\frac87}", r"\frac{8}{7}") == 0.0
    assert default_compute_score("math", "Answer: 7", "7") == {"score": 1.0, "acc": True, "pred": "7"}
    assert default_compute_score("aime2025", "Answer: 8", "7")["score"] == -1.0
    assert default_compute_score("numina_olympiads", "The answer is 0.5", r"\frac{1}{2}") == 1.0
    assert default_compute_score("arithmetic", "7", "7", {"index": 0}) == 1.0


def test_unknown_data_source_names_it_and_the_fix():
    """An unknown data_source names itself, the known ones, and reward.function=path/to/file.py:name."""
    with pytest.raises(ValueError) as e:
        default_compute_score("my/data", "7", "7")
    msg = str(e.value)
    assert "'my/data'" in msg and "openai/gsm8k" in msg and "aime*" in msg and "arithmetic" in msg
    assert "reward.function=path/to/file.py:name" in msg


def test_a_null_ground_truth_is_an_error_not_a_silent_zero():
    """A built-in rule given ground_truth None raises, so score_responses counts it in reward/errors."""
    with pytest.raises(ValueError, match="no ground truth"):
        default_compute_score("openai/gsm8k", "#### 7", None)
    rows = [{"data_source": "arithmetic", "ground_truth": g, "extra_info": {}} for g in ("7", None)]
    with pytest.warns(UserWarning, match=r"failed on 1/2 samples .*no ground truth"):
        assert rewards.score_responses(default_compute_score, rows, ["7", "7"]) == ([1.0, 0.0], {}, 1)


# ---- start-up check of data_source values

def reward_config(**keys):
    """A reward section's keys for the start-up check: the sources default (sources, weights, type null)."""
    return SimpleNamespace(**{"sources": None, "weights": [], "type": None, "function": None, **keys})


RULE = reward_config(type="rule")


def test_check_data_sources_names_every_unsupported_source_and_the_fix():
    """Sources no built-in rule scores are all named (with why, for verl's code/search routes) in one sentence
    with the fix; supported ones, aime* included, pass."""
    rewards.check_data_sources({"openai/gsm8k", "math", "aime2024", "numina_cn_k12", "arithmetic"}, RULE)
    with pytest.raises(ConfigError) as e:
        rewards.check_data_sources(["openai/gsm8k", "apps", "searchR1_nq", "my/data", "apps"], RULE)
    msg = str(e.value)
    assert "'apps' (verl runs the code in a sandbox)" in msg and "'searchR1_nq' (verl's search-tool task)" in msg
    assert "'my/data'" in msg and "'openai/gsm8k'" not in msg.split(";")[0]
    assert "reward.function=path/to/file.py:compute_score" in msg and msg.count(". ") == 0


def test_check_data_sources_trusts_a_custom_function_or_a_reward_model():
    """A custom reward.function scores every source; reward.type=model uses no rule."""
    rewards.check_data_sources({"apps", "my/data"}, reward_config(type="rule", function="r.py:f"))
    rewards.check_data_sources({"apps"}, reward_config(type="model"))
    with pytest.raises(ConfigError):
        rewards.check_data_sources({"apps"}, reward_config(type="both"))


VERL_STYLE = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}

def other(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5
'''


def test_load_reward_function_from_a_file(tmp_path):
    """None gives the built-ins (in this process); path.py:name (or path.py, meaning compute_score) gives that
    function, run in a worker process and called by keyword as verl calls it."""
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_STYLE)
    assert rewards.load_reward_function(None, 5) is default_compute_score
    row = [{"data_source": "x", "ground_truth": "7", "extra_info": {}}]
    assert rewards.score_responses(rewards.load_reward_function(f"{path}:other", 5), row, ["y"]) == ([0.5], {}, 0)
    worker = rewards.load_reward_function(str(path), 5)
    assert worker.proc.pid != os.getpid()
    assert rewards.score_responses(worker, row, ["7 "]) == ([1.0], {"length": [2.0]}, 0)


def test_load_reward_function_errors_name_the_file_and_the_function(tmp_path):
    """A missing file or a missing function is named, with the functions the file does define."""
    with pytest.raises(ConfigError, match=r"file .*nope.py does not exist"):
        rewards.load_reward_function(f"{tmp_path}/nope.py:f", 5)
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_STYLE)
    with pytest.raises(ValueError, match=r"has no function `missing`; callables found there: \['compute_score', 'other'\]"):
        rewards.load_reward_function(f"{path}:missing", 5)
    bad = tmp_path / "broken.py"
    bad.write_text("import not_a_module_xyz\n")
    with pytest.raises(ValueError, match=r"importing .*broken.py failed: ModuleNotFoundError"):
        rewards.load_reward_function(f"{bad}:f", 5)


# ---- score_responses

ROWS = [{"data_source": "arithmetic", "ground_truth": str(g), "extra_info": {"index": i}} for i, g in enumerate([3, 4, 5])]


def test_score_responses_with_the_built_ins():
    """Float results are the scores; no extras, no errors."""
    assert rewards.score_responses(default_compute_score, ROWS, ["3", "four", "5."]) == ([1.0, 0.0, 1.0], {}, 0)


def test_score_responses_collects_numeric_dict_keys():
    """A dict result gives its "score"; its other numeric keys are gathered per key, non-numbers ignored but for
    "pred" (verl's answer as read, kept as text for maj@k)."""
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "acc": True, "length": len(solution_str), "pred": solution_str}
    scores, extras, errors = rewards.score_responses(fn, ROWS, ["a", "bb", "ccc"])
    assert scores == [1.0, 1.0, 1.0] and extras == {"acc": [1.0, 1.0, 1.0], "length": [1.0, 2.0, 3.0],
                                                    "pred": ["a", "bb", "ccc"]} and errors == 0


def test_score_responses_counts_a_raising_function_and_carries_on():
    """A call that raises (or returns a dict without "score") scores 0.0 and is counted; the rest still score."""
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("bad parse")
        return {"acc": 1.0} if solution_str == "nodict" else 1
    with pytest.warns(UserWarning, match=r"failed on 2/3 samples .*RuntimeError: bad parse"):
        scores, extras, errors = rewards.score_responses(fn, ROWS, ["boom", "ok", "nodict"])
    assert scores == [0.0, 1.0, 0.0] and errors == 2 and extras == {}


def test_score_responses_passes_verl_keyword_arguments():
    """compute_score is called by keyword as verl calls it, so any argument order works; extra_info carries the
    row's keys plus those verl's reward loop adds (num_turns=2, rollout_reward_scores={}), the row left unchanged."""
    seen = []

    def reordered(solution_str, ground_truth, extra_info=None, data_source=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 0.0
    rewards.score_responses(reordered, ROWS[:2], ["x", "y"])
    verl_keys = {"num_turns": 2, "rollout_reward_scores": {}}
    assert seen == [("arithmetic", "x", "3", {"index": 0, **verl_keys}),
                    ("arithmetic", "y", "4", {"index": 1, **verl_keys})]
    assert ROWS[0]["extra_info"] == {"index": 0}


def test_a_reward_file_reading_num_turns_works():
    """A verl reward file that reads extra_info["num_turns"] (verl always sets it) scores instead of raising."""
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return float(extra_info["num_turns"] == 2 and extra_info["rollout_reward_scores"] == {})
    assert rewards.score_responses(fn, ROWS, ["a", "b", "c"]) == ([1.0, 1.0, 1.0], {}, 0)


def test_async_compute_score_is_awaited_concurrently():
    """An `async def compute_score` is awaited for the whole batch at once: 3 calls that each sleep 0.3 s take
    about 0.3 s, not 0.9 s; one that raises is counted as an error like a sync one."""
    async def fn(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0.3)
        if solution_str == "boom":
            raise RuntimeError("async failure")
        return {"score": float(solution_str == ground_truth), "turns": extra_info["num_turns"]}
    start = time.perf_counter()
    assert rewards.score_responses(fn, ROWS, ["3", "4", "x"]) == ([1.0, 1.0, 0.0], {"turns": [2.0, 2.0, 2.0]}, 0)
    assert time.perf_counter() - start < 0.6
    with pytest.warns(UserWarning, match=r"failed on 1/3 samples .*RuntimeError: async failure"):
        assert rewards.score_responses(fn, ROWS, ["3", "boom", "5"])[::2] == ([1.0, 0.0, 1.0], 1)


def test_a_non_finite_score_is_an_error_scored_zero():
    """NaN or ±inf (bare or as a dict's "score") scores 0.0 and is counted, so one sample cannot poison a batch."""
    results = iter([float("nan"), {"score": float("inf")}, 1.0])
    with pytest.warns(UserWarning, match=r"failed on 2/3 samples .*ValueError: the reward is nan"):
        scores, _, errors = rewards.score_responses(lambda **kw: next(results), ROWS, ["a", "b", "c"])
    assert scores == [0.0, 0.0, 1.0] and errors == 2


@pytest.mark.parametrize("fn, first", [
    (lambda **kw: 1 / 0, "ZeroDivisionError: division by zero"),
    (lambda **kw: None, "TypeError: a reward function must return a number or a dict, got None"),
    (lambda **kw: "1.0", "TypeError: a reward function must return a number or a dict, got '1.0'"),
    (lambda **kw: {"acc": 1.0}, "ValueError: a reward dict must carry 'score'"),
    (lambda **kw: float("nan"), "ValueError: the reward is nan, not a finite number"),
    (lambda solution_str, ground_truth: 1.0, "TypeError: "),
])
def test_a_function_failing_on_every_sample_stops_the_run(fn, first):
    """When every sample errors (raises, None, a string, no "score", NaN, a wrong signature), RewardError (a
    ConfigError: ppo.py prints it as one sentence) carries the first error's text, instead of training on zeros."""
    with pytest.raises(rewards.RewardError, match=r"failed on all 3 samples of a batch") as e:
        rewards.score_responses(fn, ROWS, ["a", "b", "c"])
    assert isinstance(e.value, ConfigError) and f"the first error: {first}" in str(e.value)


def test_an_unknown_data_source_with_the_built_ins_stops_the_run():
    """Every sample of an unknown data_source errors, so the built-ins stop the run rather than score 0."""
    rows = [{"data_source": "my/data", "ground_truth": "1", "extra_info": {}}] * 2
    with pytest.raises(rewards.RewardError, match=r"first error: ValueError: no built-in reward for data_source"):
        rewards.score_responses(default_compute_score, rows, ["1", "2"])


@pytest.mark.parametrize("data_source", ["lighteval/MATH", "math_dapo", "numina_olympiads", "boxed", "gsm8k",
                                         "openai/gsm8k"])
def test_a_ground_truth_that_reads_nan_matches_nothing(data_source):
    """A NaN ground truth turned into the text "nan" once scored \\boxed{nan} as right under the MATH, DAPO, PRIME
    (numina) and boxed rules, a reward a policy could learn to game: now no answer matches it, while a real ground
    truth still matches its answer."""
    def score(response, truth):
        result = default_compute_score(data_source, response, truth)
        return result["score"] == 1.0 if isinstance(result, dict) else result == 1.0
    for truth in ("nan", "NaN", " -nan "):
        assert not any(score(r, truth) for r in ("\\boxed{nan}", "\\boxed{NaN}", "Answer: nan", "#### nan", "nan"))
    assert score("\\boxed{5}" if "gsm8k" not in data_source else "#### 5", "5")
