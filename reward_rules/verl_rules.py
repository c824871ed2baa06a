"""verl 0.9.1's rule rewards (verl/utils/reward_score), ported so that a response scores here exactly as in verl.

tests/test_verl_rewards.py compares every route with verl's, case by case. verl's quirks are kept, each noted below
(Q:), but one: a ground truth that reads "nan" (a missing value written out) matches nothing (is_nan_text), where
verl's MATH, DAPO and PRIME rules score \boxed{nan} as right. The numina_* route, verl's prime_math grader, is
verl_prime_math.py. Sources: gsm8k.py; math_reward.py
(Hendrycks' MATH, MIT); math_dapo.py (Minerva). verl is Apache-2.0.
"""
import re


def is_nan_text(ground_truth) -> bool:
    """Does the ground truth read as NaN ("nan", "-NaN")? It is str(float("nan")), a value that went missing on the
    way to the parquet file; a rule that let \boxed{nan} match it would reward a policy for learning to say "nan".
    data.py refuses such rows at start-up; the rules refuse to match them too."""
    return isinstance(ground_truth, str) and ground_truth.strip().lstrip("+-").lower() == "nan"


# ---- openai/gsm8k (gsm8k.py, method="strict")
def gsm8k(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last "#### <n>" equals ground_truth as a string, else 0.0.
    Q: only the last 300 characters are searched.   Q: exactly one space after "####" ("####7" finds nothing).
    Q: <n> is [-0-9.,]+ with commas removed, compared as text: "72.0" ≠ "72", "158." ≠ "158", "$5" finds nothing."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str[-300:])
    return float(bool(found) and found[-1].replace(",", "") == ground_truth)


# ---- boxes, as the MATH, DAPO and PRIME rules find them
def last_box(string: str) -> int:
    """Where the last "\\boxed" starts, else the last "\\fbox"; -1 when there is neither."""
    idx = string.rfind("\\boxed")
    return idx if idx >= 0 else string.rfind("\\fbox")


def closing_brace(string: str, start: int):
    """Index of the "}" that brings the brace depth, counted from `start`, back to 0; None when none does."""
    depth = 0
    for i in range(start, len(string)):
        depth += {"{": 1, "}": -1}.get(string[i], 0)
        if string[i] == "}" and depth == 0:
            return i
    return None


# ---- lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500 (math_reward.py)
def math_last_boxed(string: str):
    """"\\boxed{…}" (or "\\fbox{…}") with balanced braces, from the last one; None when there is none.
    Q: any "\\boxed " (with a space) wins over later \\boxed{…}: its text up to the next "$" is the answer."""
    if "\\boxed " in string:
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    idx = last_box(string)
    end = closing_brace(string, idx) if idx >= 0 else None
    return None if end is None else string[idx:end + 1]


def fix_fracs(string: str) -> str:
    """\\frac12 → \\frac{1}{2}, \\frac1b → \\frac{1}{b}, \\frac1{72} → \\frac{1}{72}."""
    substrs = string.split("\\frac")
    new_str = substrs[0]
    for substr in substrs[1:]:
        if substr[0] == "{":  # Q: IndexError on a trailing "\\frac": the raw strings are compared then
            new_str += "\\frac" + substr
        elif len(substr) < 2:
            return string
        elif substr[1] == "{":
            new_str += "\\frac{" + substr[0] + "}" + substr[1:]
        else:
            new_str += "\\frac{" + substr[0] + "}{" + substr[1] + "}" + substr[2:]
    return new_str


def fix_a_slash_b(string: str) -> str:
    """"a/b" of two integers written plainly (no "+", spaces or leading zeros) → \\frac{a}{b}."""
    if re.fullmatch(r"(0|-?[1-9][0-9]*)/(0|-?[1-9][0-9]*)", string):
        return "\\frac{" + string.replace("/", "}{") + "}"
    return string


def fix_sqrt(string: str) -> str:
    """\\sqrt3 → \\sqrt{3} (Q: IndexError on a trailing "\\sqrt")."""
    if "\\sqrt" not in string:
        return string
    splits = string.split("\\sqrt")
    return splits[0] + "".join("\\sqrt" + s if s[0] == "{" else "\\sqrt{" + s[0] + "}" + s[1:] for s in splits[1:])


def strip_string(string: str) -> str:
    """Hendrycks' MATH normalisation: no newlines, \\!, \\left/\\right, degrees, \\$, units after "\\text{ ", \\%,
    spaces; dfrac/tfrac → frac; ".5" → "0.5"; "k = 5" → "5" (left side ≤ 2 characters); \\sqrt3, \\frac12, a/b fixed.
    Q: only "0.5" becomes \\frac{1}{2}.   Q: a second "\\text{ " is an AssertionError (raw strings compared)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        string = string.replace(old, new)
    if "\\text{ " in string:
        assert string.count("\\text{ ") == 1
        string = string.split("\\text{ ")[0]
    string = string.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if string.startswith("."):
        string = "0" + string
    if len(string.split("=")) == 2 and len(string.split("=")[0]) <= 2:
        string = string.split("=")[1]
    string = fix_fracs(fix_sqrt(string).replace(" ", ""))
    if string == "0.5":
        string = "\\frac{1}{2}"
    return fix_a_slash_b(string)


def hendrycks_math(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer equals ground_truth after strip_string (raw strings compared when that raises).
    Q: ground_truth itself is not unboxed.   Q: a last \\fbox{…} scores 0 (verl's remove_boxed asserts "\\boxed")."""
    if is_nan_text(ground_truth):
        return 0.0
    try:
        boxed = math_last_boxed(solution_str)
    except Exception:  # verl prints the error and scores 0
        return 0.0
    if boxed is None or not boxed.startswith(("\\boxed ", "\\boxed{")):
        return 0.0
    answer = boxed[len("\\boxed "):] if boxed.startswith("\\boxed ") else boxed[len("\\boxed{"):-1]
    try:
        return float(strip_string(answer) == strip_string(ground_truth))
    except Exception:
        return float(answer == ground_truth)


# ---- math_dapo, math, math_dapo_reasoning, aime* (math_dapo.py)

DAPO_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                      (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
DAPO_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
                r",\!", "{,}", '"', "\\dots"]


def dapo_normalize(final_answer: str) -> str:
    """Minerva's normalisation: the text after the last "=", words and units removed, \\text{…}, \\boxed{…} etc.
    unwrapped, \\fracab and \\sqrta braced, "1,000" → "1000".   Q: "a "/"an " are deleted inside words too."""
    final_answer = final_answer.split("=")[-1]
    for before, after in DAPO_SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in DAPO_REMOVED:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    for command in ("text", "textbf", "overline"):
        final_answer = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer).replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def dapo_last_boxed(string: str):
    """The inside of the last "\\boxed{…}" (braces balanced), or None."""
    idx = string.rfind("\\boxed{")
    end = closing_brace(string, idx) if idx >= 0 else None
    return None if end is None else string[idx + len("\\boxed{"):end]


def dapo(solution_str: str, ground_truth: str) -> dict:
    """{"score": +1.0 right / -1.0 wrong, "acc": bool, "pred": str}.   Q: only the last 300 characters count.
    The last "Answer: …" line (any case), normalised, is compared with the normalised ground_truth; without one, the
    last \\boxed{…} in the last 100 characters is compared with ground_truth exactly (Q: no normalisation)."""
    solution_str = solution_str[-300:]
    found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", solution_str)
    pred = dapo_normalize(found[-1] if found else "[INVALID]")
    correct = pred == dapo_normalize(ground_truth)
    if pred == "[INVALID]":
        boxed = dapo_last_boxed(solution_str[-100:])
        if boxed is not None:
            correct, pred = boxed == ground_truth, boxed
    correct = correct and not is_nan_text(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
