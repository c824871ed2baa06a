"""verl 0.9.1's rule rewards (verl/utils/reward_score), ported so that a response scores here exactly as in verl.

tests/test_verl_rewards.py installs verl and checks every route case by case. Each rule keeps verl's quirks, one
line each below (Q:). The only departures, by design: model text is never run through `eval` (verl's prime-math
grader evals a prediction containing \\pi, or a "[…]" against a pmatrix, with its module's globals, and parses
"Matrix(…)" with sympy's eval-based parse_expr); here only number/tuple/list arithmetic is evaluated, and a
"Matrix(…)" only when it holds plain numbers. A model writing `abs(-2)*\\pi` or `Matrix([[x]])` scores
differently, by design.

Sources: gsm8k.py; math_reward.py (Hendrycks' MATH normalisation, MIT); math_dapo.py (Minerva); prime_math/
(PRM800K, ToRA; Apache-2.0 and MIT). verl is Apache-2.0.
"""
import ast
import contextlib
import logging
import math
import operator
import re
import signal
import threading

# ---- openai/gsm8k (gsm8k.py, method="strict")


def gsm8k(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last "#### <n>" equals ground_truth as a string, else 0.0.
    Q: only the last 300 characters are searched.   Q: exactly one space after "####" ("####7" finds nothing).
    Q: <n> is [-0-9.,]+ with commas removed, compared as text: "72.0" ≠ "72", "158." ≠ "158", "$5" finds nothing."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str[-300:])
    return float(bool(found) and found[-1].replace(",", "") == ground_truth)


# ---- lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500 (math_reward.py)


def math_last_boxed(string: str):
    """"\\boxed{…}" (or "\\fbox{…}") with balanced braces, from the last one; None when there is none.
    Q: any "\\boxed " (with a space) wins over later \\boxed{…}: its text up to the next "$" is the answer."""
    if "\\boxed " in string:
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    depth = 0
    for i in range(idx, len(string)):
        depth += {"{": 1, "}": -1}.get(string[i], 0)
        if string[i] == "}" and depth == 0:
            return string[idx:i + 1]
    return None


def math_remove_boxed(s: str) -> str:
    """The inside of "\\boxed{…}" or the rest after "\\boxed "; AssertionError otherwise (Q: so \\fbox scores 0)."""
    if "\\boxed " in s:
        assert s.startswith("\\boxed ")
        return s[len("\\boxed "):]
    assert s.startswith("\\boxed{") and s.endswith("}")
    return s[len("\\boxed{"):-1]


def fix_fracs(string: str) -> str:
    """\\frac12 → \\frac{1}{2}, \\frac1b → \\frac{1}{b}, \\frac1{72} → \\frac{1}{72}."""
    substrs = string.split("\\frac")
    new_str = substrs[0]
    for substr in substrs[1:]:
        new_str += "\\frac"
        if substr[0] == "{":  # Q: IndexError on a trailing "\\frac": is_equiv then compares the raw strings
            new_str += substr
            continue
        if len(substr) < 2:
            return string
        a, b, post = substr[0], substr[1], substr[2:]
        new_str += "{" + a + "}{" + b + "}" + post if b != "{" else "{" + a + "}" + b + post
    return new_str


def fix_a_slash_b(string: str) -> str:
    """"a/b" of two plain integers → \\frac{a}{b}."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
        assert string == f"{a}/{b}"
        return "\\frac{" + str(a) + "}{" + str(b) + "}"
    except Exception:
        return string


def fix_sqrt(string: str) -> str:
    """\\sqrt3 → \\sqrt{3} (Q: IndexError on a trailing "\\sqrt")."""
    if "\\sqrt" not in string:
        return string
    splits = string.split("\\sqrt")
    return splits[0] + "".join("\\sqrt" + s if s[0] == "{" else "\\sqrt{" + s[0] + "}" + s[1:] for s in splits[1:])


def strip_string(string: str) -> str:
    """Hendrycks' MATH normalisation: no newlines, \\!, \\left/\\right, degrees, \\$, units after "\\text{ ", \\%,
    spaces; dfrac/tfrac → frac; ".5" → "0.5"; "k = 5" → "5" (left side ≤ 2 characters); \\sqrt3, \\frac12, a/b
    fixed; "0.5" → \\frac{1}{2}.
    Q: no other decimal equals its fraction.   Q: a second "\\text{ " is an AssertionError (raw strings compared)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        string = string.replace(old, new)
    if "\\text{ " in string:
        splits = string.split("\\text{ ")
        assert len(splits) == 2
        string = splits[0]
    string = string.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if len(string) == 0:
        return string
    if string[0] == ".":
        string = "0" + string
    if len(string.split("=")) == 2 and len(string.split("=")[0]) <= 2:
        string = string.split("=")[1]
    string = fix_fracs(fix_sqrt(string).replace(" ", ""))
    if string == "0.5":
        string = "\\frac{1}{2}"
    return fix_a_slash_b(string)


def math_is_equiv(str1: str, str2: str) -> bool:
    """strip_string(str1) == strip_string(str2); the raw strings compared when normalising raises."""
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:
        return str1 == str2


def hendrycks_math(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer is equivalent to ground_truth (Q: ground_truth itself is not unboxed)."""
    try:
        boxed = math_last_boxed(solution_str)
        return float(boxed is not None and math_is_equiv(math_remove_boxed(boxed), ground_truth))
    except Exception:  # verl prints the error and scores 0
        return 0.0


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
    if idx < 0:
        return None
    depth = 0
    for i in range(idx, len(string)):
        depth += {"{": 1, "}": -1}.get(string[i], 0)
        if string[i] == "}" and depth == 0:
            return string[idx + len("\\boxed{"):i]
    return None


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
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ---- numina_* (prime_math/: PRM800K's grade_answer, then ToRA's math_equal)

SYMPY_BAD_SUBSTRINGS = ["^{", "^("]
SYMPY_BAD_REGEXES = [r"\^[0-9]+\^", r"\^[0-9][0-9]+"]
PRM_UNITS = ["degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
             "year", "foot", "feet", "inch", "yard", "liter"]


@contextlib.contextmanager
def time_limit(seconds: float):
    """TimeoutError inside the block after `seconds` (SIGALRM, main thread only; elsewhere no limit).
    verl runs this comparison in a child process with a 10 s limit; a timeout there also scores 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_timeout(signum, frame):
        raise TimeoutError(f"sympy took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def prm_normalize(expr: str) -> str:
    """PRM800K's normalisation before sympy: \\text{…}, $, %, units and "million" etc. handled, LaTeX → text via
    pylatexenc, lower case, "7 3/4" → "7+3/4", integral floats → ints.   Q: units are cut inside words too."""
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for unit in PRM_UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if is_float(expr) and is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        with contextlib.suppress(Exception):
            expr = latex_to_text(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr).lower()
    if str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def latex_to_text(expr: str) -> str:
    """LaTeX → plain text sympy can parse (pylatexenc), with √ π ∞ ∪ · × spelled out."""
    from pylatexenc import latex2text
    logging.getLogger("pylatexenc").setLevel(logging.ERROR)  # its warnings on malformed LaTeX would flood the log
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for old, new in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(old, new)
    return expr.strip()


def is_float(num: str) -> bool:
    try:
        float(num)
        return True
    except ValueError:
        return False


def is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except Exception:
        return False


def strip_thousands_commas(expr: str) -> str:
    """"1,234,567" → "1234567", leaving tuple commas ("1,2") alone."""
    while True:
        next_expr = re.sub(r"(\d)(,)(\d\d\d)($|\D)", r"\1\3\4", expr)
        if next_expr == expr:
            return next_expr
        expr = next_expr


def str_is_int(x: str) -> bool:
    try:
        return is_int(float(strip_thousands_commas(x)))
    except Exception:
        return False


def is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def equal_under_sympy(ground_truth: str, given: str) -> bool:
    """sympy.simplify((ground_truth) − (given)) == 0, unless the text has > 2 distinct letters or large powers."""
    import sympy
    from sympy.parsing import sympy_parser
    expr = f"({ground_truth})-({given})"
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or any(s in expr for s in SYMPY_BAD_SUBSTRINGS) or any(
            re.search(r, expr) for r in SYMPY_BAD_REGEXES):
        return False
    try:
        with time_limit(10):
            parsed = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=(
                sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)))
            return sympy.simplify(parsed) == 0
    except TimeoutError:
        raise
    except Exception:
        return False


def split_tuple(expr: str) -> list:
    """"(1,2)" → ["1", "2"]; anything else → [expr]."""
    expr = strip_thousands_commas(expr)
    if len(expr) == 0:
        return []
    if len(expr) > 2 and expr[0] in "()[]" and expr[-1] in "()[]" and all(ch not in expr[1:-1] for ch in "()[]"):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given_answer: str, ground_truth: str) -> bool:
    """PRM800K: equal after Hendrycks' normalisation, or after prm_normalize, or element by element under sympy.
    Q: unreduced fractions must match as written; an integer answer must match an integer exactly."""
    if given_answer is None:
        return False
    if normalize_answer(ground_truth) == normalize_answer(given_answer):
        return True
    truth, given = prm_normalize(ground_truth), prm_normalize(given_answer)
    if truth == given:
        return True
    if len(given) == 0:
        return False
    truth_elems, given_elems = split_tuple(truth), split_tuple(given)
    if (len(truth_elems) > 1 and (truth[0] != given[0] or truth[-1] != given[-1])
            or len(truth_elems) != len(given_elems)):
        return False
    for t, g in zip(truth_elems, given_elems):
        if is_frac(t) and is_frac(g):
            correct = t == g
        elif str_is_int(t) != str_is_int(g):
            correct = False
        else:
            try:
                correct = equal_under_sympy(t, g)
            except Exception:  # a timeout, as verl's
                correct = False
        if not correct:
            return False
    return True


def normalize_answer(answer: str) -> str:
    """PRM800K's copy of Hendrycks' normalisation: stripped, \\text{…} unwrapped, then strip_string."""
    answer = answer.strip()
    try:
        m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
        if m is not None:
            answer = m.group("text").strip()
        return strip_string(answer)
    except Exception:
        return answer


def prime_boxed(string: str):
    """The stripped inside of the first {…} after the last \\boxed (or \\fbox); None without one."""
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    left, depth = None, 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
            left = i if left is None else left
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[left + 1:i].strip() if left is not None else None
    return None


def match_answer(response: str) -> str:
    """The answer in a response: after the last "answer:"/"answer is", before "is the answer", the last box, then
    after the last "is ", "=", ": " … (Q: a trailing newline cuts two characters, as verl's)."""
    def after(marker_list, keep_before=False):
        nonlocal response
        for marker in marker_list:
            idx = response.lower().rfind(marker)
            if idx != -1:
                response = (response[:idx] if keep_before else response[idx + len(marker):]).strip()
                if response.endswith("\n"):
                    response = response[:-2]
    after(["answer:", "answer is", "answers are"])
    after(["is answer", "is the answer", "are answers", "are the answers"], keep_before=True)
    boxed = prime_boxed(response)
    if boxed:
        response = boxed
    if ". " in response:
        response = response[:response.lower().rfind(". ")].strip()
    after(["be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"])
    return response


# ---- ToRA's math_equal (prime_math/grader.py)

SAFE_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
            ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
            ast.USub: operator.neg, ast.UAdd: operator.pos}


def safe_eval(text: str):
    """Python's eval restricted to numbers, tuples, lists and + − × ÷ // % ** (no huge powers): what verl evals
    on model text, without running code. ValueError for anything else."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex)):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List)):
            return (tuple if isinstance(node, ast.Tuple) else list)(ev(e) for e in node.elts)
        if isinstance(node, ast.UnaryOp) and type(node.op) in SAFE_OPS:
            return SAFE_OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in SAFE_OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 10_000 or abs(left) > 2 ** 10_000):
                raise ValueError("power too large")  # verl's eval would hang on 9**9**9
            return SAFE_OPS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")
    return ev(ast.parse(text.strip(" \t"), mode="eval").body)


def is_digit(s):
    try:
        return True, float(str(s).replace("{,}", "") if "{,}" in str(s) else str(s).replace(",", ""))
    except ValueError:
        return False, None


def tora_normalize(answer, pi: float):
    """"$5" → "5", "5%" → "5", "12_3" → 12 (a base; ValueError when not a number), "2\\pi" → 2·pi evaluated."""
    if isinstance(answer, str) and re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if isinstance(answer, str) and (re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer)):
        return answer.replace("\\%", "").replace("%", "")
    if isinstance(answer, str) and "_" in answer:
        return int(float(answer.split("_")[0]))
    if isinstance(answer, str) and "\\pi" in answer:
        idx = answer.find("\\pi")
        while idx != -1:
            star = "*" if idx > 0 and answer[idx - 1].isdigit() else "1*"
            answer = answer[:idx] + f"{star}{pi}" + answer[idx + 3:]
            idx = answer.find("\\pi", idx + 1)
        with contextlib.suppress(Exception):
            answer = safe_eval(answer)  # verl: eval(answer)
    return answer


def math_equal(prediction, reference, include_percentage: bool = True, tolerance: float = 1e-4,
               pi: float = math.pi) -> bool:
    """ToRA: equal as text, as numbers (Q: relative tolerance 1e-4, and x/100 or x·100 also match), or part by part
    for intervals, tuples, points and matrices.   Q: verl 0.9.1's symbolic fallback never succeeds (it uses its
    timeout decorator as a context manager: a TypeError it catches), so it is not ported."""
    prediction, reference = tora_normalize(prediction, pi), tora_normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    try:
        if is_digit(prediction)[0] and is_digit(reference)[0]:
            prediction, reference = is_digit(prediction)[1], is_digit(reference)[1]
            candidates = [reference / 100, reference, reference * 100] if include_percentage else [reference]
            return any(math.isclose(item, prediction, rel_tol=tolerance) for item in candidates)
    except Exception:
        pass
    if not prediction and prediction not in [0, False]:
        return False
    reference, prediction = str(reference).strip(), format_intervals(str(prediction).strip())
    return parts_equal(prediction, reference, include_percentage, tolerance)


def parts_equal(prediction: str, reference: str, include_percentage: bool, tolerance: float) -> bool:
    """math_equal's structural comparisons: brackets dropped, then interval ends, comma parts, points, matrices."""
    pred_str, ref_str = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
            prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for s in "{}()":
        ref_str, pred_str = ref_str.replace(s, ""), pred_str.replace(s, "")
    if pred_str == ref_str:
        return True

    def all_equal(preds, refs):  # a list, not a generator: verl compares every part, so any part may raise
        return len(preds) == len(refs) and all([math_equal(p, r, include_percentage, tolerance)
                                                 for p, r in zip(preds, refs)])
    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]):
        if all_equal(prediction[1:-1].split(","), reference[1:-1].split(",")):
            return True
    if "," in prediction and "," in reference:
        preds, refs = [p.strip() for p in prediction.split(",")], [r.strip() for r in reference.split(",")]
        if len(preds) == len(refs):
            return all_equal(preds, refs)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        preds, refs = prediction[prediction.find("(") + 1:-1].split(","), reference[1:-1].split(",")
        if len(preds) == len(refs) and all_equal(preds, refs):
            return True
    if r"\begin{pmatrix}" in reference and prediction.startswith("Matrix"):
        try:  # verl: sympy's parse_expr (an eval) on the model's text; here a matrix of plain numbers only
            if all_equal(matrix_entries(prediction), reference.split()[1:-1:2]):
                return True
        except Exception:
            pass
    elif r"\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        if isinstance(safe_eval(prediction), list):  # verl: eval(prediction), outside its try
            try:
                rows = (reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
                        .removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}")).split("\\")
                rows = [row.split("&") if "&" in row else row for row in rows]
                if all_equal(safe_eval(prediction), rows):
                    return True
            except Exception:
                pass
    return False


def matrix_entries(text: str) -> list:
    """The entries, row by row, of "Matrix([[1, 2], [3, 4]])" or "Matrix([1, 2])" (a column) holding plain
    numbers; ValueError for anything else (verl's sympy would also take symbols and expressions)."""
    rows = safe_eval(re.fullmatch(r"Matrix\((.*)\)", text, re.DOTALL).group(1))
    rows = [row if isinstance(row, list) else [row] for row in rows] if isinstance(rows, list) else None
    if not rows or len({len(row) for row in rows}) != 1 or not all(
            type(x) in (int, float) for row in rows for x in row):
        raise ValueError(f"not a matrix of numbers: {text[:40]}")
    return [x for row in rows for x in row]


def format_intervals(prediction: str) -> str:
    """sympy's Interval(a, b) → [a, b]; .Ropen → [a, b); .Lopen → (a, b]; .open → (a, b)."""
    for key, (left, right) in {"Interval": "[]", "Interval.Ropen": "[)", "Interval.Lopen": "(]",
                               "Interval.open": "()"}.items():
        match = re.match(f"^{re.escape(key)}\\((.*)\\)$", prediction)
        if match:
            return f"{left}{match.group(1)}{right}"
    return prediction


def prime_math(solution_str: str, ground_truth: str) -> float:
    """1.0 when the matched answer passes grade_answer, or math_equal (with pi and 3.14 when \\pi appears)."""
    solution_str, ground_truth = str(solution_str), str(ground_truth)
    answer = match_answer(solution_str)
    if grade_answer(answer, ground_truth):
        return 1.0
    try:
        if "\\pi" in answer or "\\pi" in ground_truth:
            return float(any([math_equal(answer, ground_truth, pi=pi) for pi in [math.pi, 3.14]]))
        return float(math_equal(answer, ground_truth))
    except Exception:
        return 0.0
