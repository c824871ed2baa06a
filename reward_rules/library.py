"""This library's own rules (verl's are verl_rules.py and verl_prime_math.py): a lenient GSM8K rule, a lenient
\\boxed{} rule, and the demo's strict arithmetic rule. Each is compute_score's (solution_str, ground_truth) part.
"""
import re
from fractions import Fraction

from reward_rules.verl_rules import closing_brace, is_nan_text

# ---- gsm8k: this library's lenient GSM8K rule (verl's own is verl_rules.gsm8k, for openai/gsm8k)

GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9.,]*[0-9])")
ANY_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def to_number(text: str):
    """The exact value (a Fraction) of "1,234" or "$5." or "-3.50"; None when it is not a number. Exact, so
    1000000001 ≠ 1000000000 and 0.0000001 ≠ 0 (a float tolerance once matched both)."""
    try:
        return Fraction(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k_score(solution_str: str, ground_truth: str, strict: bool = True,
                format_score: float = 0.0, score: float = 1.0) -> float:
    """score when the number after the last "####" (not strict: else the last number in the text) equals
    ground_truth as an exact number ("#### 72.0" = "72"), format_score when it is wrong, 0.0 when there is none."""
    found = GSM8K_ANSWER.findall(solution_str)
    if not found and not strict:
        found = ANY_NUMBER.findall(solution_str)
    if not found:
        return 0.0
    got, want = to_number(found[-1]), to_number(str(ground_truth))
    return score if got is not None and got == want else format_score


# ---- boxed: this library's lenient \boxed{} rule (verl's MATH rule is verl_rules.hendrycks_math)
def last_boxed(text: str):
    """Content of the last \\boxed{…} (braces balanced) or \\boxed x; None when there is none."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    rest = text[start + len("\\boxed"):]
    if rest.startswith(" "):
        words = rest.split("$")[0].split()
        return words[0] if words else None
    end = closing_brace(rest, 0) if rest.startswith("{") else None
    return None if end is None else rest[1:end]  # None too when the response was cut off inside the box


def normalize_math(answer: str) -> str:
    """Light normalisation: no spaces, \\left/\\right, \\! or trailing '.', and dfrac/tfrac → frac."""
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("dfrac", "frac"), ("tfrac", "frac")):
        answer = answer.replace(old, new)
    return "".join(answer.split()).rstrip(".")


def boxed_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer equals the ground truth (itself unboxed if boxed) after normalising; never for
    a ground truth that reads "nan" (verl_rules.is_nan_text)."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) if "\\boxed" in truth else truth
    if is_nan_text(truth):
        return 0.0
    return float(truth is not None and normalize_math(answer) == normalize_math(truth))


# ---- arithmetic (the demo)
EQUATION_OR_INTEGER = re.compile(r"(?:[0-9+ ]+=\s*)?(-?[0-9]+)\.?")


def arithmetic_score(solution_str: str, ground_truth: str) -> float:
    """1.0 only when the whole stripped response is "a + b = c" (digits, '+' and spaces before a single
    '=') or the bare integer c, optionally with one trailing '.', and c equals the ground truth.
    Lenient parsing ("the number after =" anywhere) gets gamed: responses grow long and repetitive."""
    match = EQUATION_OR_INTEGER.fullmatch(solution_str.strip())
    return float(bool(match) and int(match.group(1)) == int(str(ground_truth).strip()))
