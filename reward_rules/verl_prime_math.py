"""verl 0.9.1's prime_math grader (verl/utils/reward_score/prime_math/: PRM800K's grade_answer, then ToRA's
math_equal), the rule of the numina_* data sources, ported so that a response scores here exactly as in verl.

tests/test_verl_rewards.py compares it with verl's, case by case; verl's quirks are kept, each noted below (Q:).
Two departures, by design: a ground truth that reads "nan" matches nothing (verl_rules.is_nan_text); and model
text is never `eval`'d. verl's grader evals a \\pi answer, or a "[…]" against a
pmatrix, and parses "Matrix(…)" with sympy's eval; here only arithmetic on numbers, tuples and lists is evaluated,
and "Matrix(…)" only of plain numbers, so `abs(-2)*\\pi` or `Matrix([[x]])` scores differently.
Sources: PRM800K (MIT), ToRA (MIT), via verl (Apache-2.0).
"""
import ast
import contextlib
import logging
import math
import operator
import re
import signal
import threading

from reward_rules.verl_rules import closing_brace, is_nan_text, last_box, strip_string


# ---- numina_* (prime_math/: PRM800K's grade_answer, then ToRA's math_equal)

PRM_UNITS = ["degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
             "year", "foot", "feet", "inch", "yard", "liter"]


def prime_math(solution_str: str, ground_truth: str) -> float:
    """1.0 when the matched answer passes grade_answer, or math_equal (with pi and 3.14 when \\pi appears); 0.0 for
    a ground truth that reads "nan" (verl_rules.is_nan_text)."""
    solution_str, ground_truth = str(solution_str), str(ground_truth)
    if is_nan_text(ground_truth):
        return 0.0
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
