"""verl 0.9.1's rule rewards (verl/utils/reward_score), ported so that a response scores here exactly as in verl.

tests/test_verl_rewards.py compares every route with verl's, case by case. verl's quirks are kept, each noted below
(Q:). One departure, by design: model text is never `eval`'d. verl's prime-math grader evals a \\pi answer, or a
"[…]" against a pmatrix, and parses "Matrix(…)" with sympy's eval; here only arithmetic on numbers, tuples and lists
is evaluated, and "Matrix(…)" only of plain numbers, so `abs(-2)*\\pi` or `Matrix([[x]])` scores differently.
Sources: gsm8k.py; math_reward.py (Hendrycks' MATH, MIT); math_dapo.py (Minerva); prime_math/ (PRM800K, ToRA;
Apache-2.0 and MIT). verl is Apache-2.0.
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
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ---- numina_* (prime_math/: PRM800K's grade_answer, then ToRA's math_equal)

PRM_UNITS = ["degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
             "year", "foot", "feet", "inch", "yard", "liter"]


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


def match_answer(response: str) -> str:
    """The answer in a response: after the last "answer:"/"answer is", before "is the answer", the last box, then
    after the last "is ", "=", ": " … (each marker in turn, on what the ones before left)."""
    def after(markers, keep_before=False):
        nonlocal response
        for marker in markers:
            idx = response.lower().rfind(marker)
            if idx != -1:
                response = (response[:idx] if keep_before else response[idx + len(marker):]).strip()
    after(["answer:", "answer is", "answers are"])
    after(["is answer", "is the answer", "are answers", "are the answers"], keep_before=True)
    boxed = prime_boxed(response)
    if boxed:
        response = boxed
    if ". " in response:
        response = response[:response.lower().rfind(". ")].strip()
    after(["be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"])
    return response


def prime_boxed(string: str):
    """The stripped inside of the first {…} after the last \\boxed (or \\fbox); None without one."""
    idx = last_box(string)
    end = closing_brace(string, idx) if idx >= 0 else None
    return None if end is None else string[string.find("{", idx) + 1:end].strip()


def grade_answer(given_answer: str, ground_truth: str) -> bool:
    """PRM800K: equal after Hendrycks' normalisation, or after prm_normalize, or element by element under sympy.
    Q: unreduced fractions must match as written; an integer answer must match an integer exactly."""
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
        else:
            correct = str_is_int(t) == str_is_int(g) and equal_under_sympy(t, g)
        if not correct:
            return False
    return True


def normalize_answer(answer: str) -> str:
    """PRM800K's copy of Hendrycks' normalisation: stripped, \\text{…} unwrapped, then strip_string."""
    answer = answer.strip()
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    answer = answer if m is None else m.group("text").strip()
    try:
        return strip_string(answer)
    except Exception:
        return answer


def prm_normalize(expr: str) -> str:
    """PRM800K's normalisation before sympy: \\text{…}, $, %, units and "million" etc. handled, LaTeX → text via
    pylatexenc, lower case, "7 3/4" → "7+3/4", integral floats → ints.   Q: units are cut inside words too."""
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    expr = expr if m is None else m.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for unit in PRM_UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if "," not in expr and str_is_int(expr):
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


def str_is_int(x: str) -> bool:
    """x (thousands commas removed) is a finite number within 1e-7 of an integer."""
    try:
        x = float(strip_thousands_commas(x))
        return abs(x - int(round(x))) <= 1e-7
    except Exception:  # not a number, inf, nan
        return False


def is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def strip_thousands_commas(expr: str) -> str:
    """"1,234,567" → "1234567", leaving tuple commas ("1,2") alone."""
    previous = None
    while expr != previous:
        previous, expr = expr, re.sub(r"(\d)(,)(\d\d\d)($|\D)", r"\1\3\4", expr)
    return expr


def split_tuple(expr: str) -> list:
    """"(1,2)" → ["1", "2"]; anything else → [expr]."""
    expr = strip_thousands_commas(expr)
    if len(expr) == 0:
        return []
    if len(expr) > 2 and expr[0] in "()[]" and expr[-1] in "()[]" and all(ch not in expr[1:-1] for ch in "()[]"):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def equal_under_sympy(ground_truth: str, given: str) -> bool:
    """sympy.simplify((ground_truth) − (given)) == 0, unless the text has > 2 distinct letters or large powers."""
    import sympy
    from sympy.parsing import sympy_parser
    expr = f"({ground_truth})-({given})"
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr or re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr):
        return False
    try:
        with time_limit(10):
            parsed = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=(
                sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)))
            return sympy.simplify(parsed) == 0
    except Exception:  # a timeout too: verl runs this in a child process with a 10 s limit, and scores 0 then
        return False


@contextlib.contextmanager
def time_limit(seconds: float):
    """TimeoutError inside the block after `seconds` (SIGALRM, main thread only; elsewhere no limit)."""
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


def to_float(s):
    """float(s) without its "{,}" (else its ","); None when it is not a number."""
    try:
        return float(str(s).replace("{,}", "") if "{,}" in str(s) else str(s).replace(",", ""))
    except ValueError:
        return None


def tora_normalize(answer, pi: float):
    """"$5" → "5", "5%" → "5", "12_3" → 12 (a base; ValueError when not a number), "2\\pi" → 2·pi evaluated."""
    if isinstance(answer, str) and re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if isinstance(answer, str) and re.match(r"^\d+(\.\d+)?\\?%$", answer):
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


def math_equal(prediction, reference, pi: float = math.pi) -> bool:
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
    pred_number, ref_number = to_float(prediction), to_float(reference)
    if pred_number is not None and ref_number is not None:
        return any(math.isclose(x, pred_number, rel_tol=1e-4) for x in [ref_number / 100, ref_number, ref_number * 100])
    if not prediction and prediction not in [0, False]:
        return False
    return parts_equal(format_intervals(str(prediction).strip()), str(reference).strip())


def parts_equal(prediction: str, reference: str) -> bool:
    """math_equal's structural comparisons: brackets dropped, then interval ends, comma parts, points, matrices."""
    pred_str, ref_str = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
            prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    if re.sub(r"[{}()]", "", pred_str) == re.sub(r"[{}()]", "", ref_str):
        return True

    def all_equal(preds, refs):  # a list, not a generator: verl compares every part, so any part may raise
        return len(preds) == len(refs) and all([math_equal(p, r) for p, r in zip(preds, refs)])
    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]):
        if all_equal(prediction[1:-1].split(","), reference[1:-1].split(",")):
            return True
    if "," in prediction and "," in reference:
        preds, refs = [p.strip() for p in prediction.split(",")], [r.strip() for r in reference.split(",")]
        if len(preds) == len(refs):
            return all_equal(preds, refs)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        return all_equal(prediction[prediction.find("(") + 1:-1].split(","), reference[1:-1].split(","))
    if r"\begin{pmatrix}" in reference and prediction.startswith("Matrix"):
        try:  # verl: sympy's parse_expr (an eval) on the model's text; here a matrix of plain numbers only
            return all_equal(matrix_entries(prediction), reference.split()[1:-1:2])
        except Exception:
            return False
    if r"\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        if isinstance(safe_eval(prediction), list):  # verl: eval(prediction), outside its try
            rows = (reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
                    .removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}")).split("\\")
            rows = [row.split("&") if "&" in row else row for row in rows]
            try:
                return all_equal(safe_eval(prediction), rows)
            except Exception:
                return False
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
    match = re.match(r"^Interval(|\.Ropen|\.Lopen|\.open)\((.*)\)$", prediction)
    if match is None:
        return prediction
    left, right = {"": "[]", ".Ropen": "[)", ".Lopen": "(]", ".open": "()"}[match.group(1)]
    return f"{left}{match.group(2)}{right}"
