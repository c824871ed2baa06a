"""rewards.default_compute_score gives exactly what verl's gives, case by case, for every route it ports.

verl is installed with `pip install --no-deps --target` into a scratch folder under the temp dir (kept, keyed by
version, so a rerun installs nothing); only its reward modules are imported (verl's package __init__ needs torch
extensions, ray and more: it is bypassed). Skipped, with the reason, where pip cannot install it.
"""
import inspect
import os
import subprocess
import sys
import time

import pytest

import rewards
from reward_rules import routing
from conftest import REPO, bare_packages, make_tiny_model, pip_install, read_metrics

VERL_VERSION = "0.9.1"


@pytest.fixture(scope="module")
def verl_score():
    """verl's own default_compute_score, imported from the scratch install without verl/__init__.py."""
    bare_packages(pip_install(f"verl=={VERL_VERSION}"), "verl", "verl.utils")  # their __init__ imports ray, …
    from verl.utils.reward_score import default_compute_score, prime_math
    # verl runs each sympy comparison in a forked child with a 10 s limit; no case here comes near it, so the
    # comparison runs in-process (the same function, unwrapped) and the test takes seconds, not minutes
    prime_math.are_equal_under_sympy = prime_math.are_equal_under_sympy.__wrapped__
    return default_compute_score


def outcome(fn, *args):
    """repr of what fn returned (types included), or the name of the exception it raised."""
    try:
        return repr(fn(*args))
    except Exception as e:
        return f"raises {type(e).__name__}"


def mismatches(verl_score, data_source, cases):
    """The (response, ground truth, verl's outcome, ours) for every case where the two differ."""
    out = []
    for response, truth in cases:
        theirs, ours = outcome(verl_score, data_source, response, truth), outcome(
            rewards.default_compute_score, data_source, response, truth)
        if theirs != ours:
            out.append((response[-120:], truth, theirs, ours))
    return out


LONG = "Let me think step by step. " * 20  # 540 characters: past verl's 300-character window
UNICODE = "Überlegung: 3 × 4 = 12, 答案 → "


def wrap(answers):
    """Each answer text bare, after long reasoning, before long text, and with unicode around it."""
    return [text for a in answers for text in (a, LONG + a, a + "\n" + LONG, UNICODE + a + " ✓")]


# ---- openai/gsm8k

def gsm8k_cases():
    truths = ["72", "1000000000", "0", "-3", "5", "1234", "18"]
    cases = []
    for t in truths:
        n = int(t)
        answers = [f"#### {t}", f"#### {n + 1}", f"####{t}", f"#### {t}.", f"#### ${t}", f"#### {t}.0",
                   f"#### {n:,}", f"The answer is {t}", f"#### {t}\n#### {n + 1}", f"#### {n + 1}\n#### {t}",
                   f"####  {t}", f"#### -{t}", f"#### {t} apples", "#### 1000000001", "#### 0.0000001", "",
                   f"#### {t}\u00a0", f"#### \u0661\u0662"]
        cases += [(text, t) for text in wrap(answers)]
    return cases


# ---- lighteval/MATH and its copies

MATH_TRUTHS = ["\\frac{8}{7}", "\\frac{1}{2}", "0.8", "\\sqrt{2}", "54", "10", "(1,2)", "x^2+1", "\\text{(C)}",
               "90", "43", "5", "-\\frac{3}{4}", "\\infty", "3\\sqrt{3}"]
MATH_VARIANTS = ["\\frac87", "8/7", "\\dfrac{8}{7}", "\\tfrac{8}{7}", "0.5", ".8", "\\sqrt2", "54 \\text{ apples}",
                 "90^\\circ", "90^{\\circ}", "10\\%", "x = 43", "\\$5", "\\left(1, 2\\right)", "(1, 2)",
                 "x^2 + 1", "\\text{(C)}", "C", "-\\frac34", "\\infty", "3\\sqrt3", "10\\!000", "5.", "\\frac{1}{2}",
                 "\\frac{8}{7}", "54", "\\sqrt{2}", "43", "\\frac{", "\\sqrt", "a \\text{ b} \\text{ c}"]


def math_cases():
    cases = []
    for t in MATH_TRUTHS:
        answers = [f"So the answer is $\\boxed{{{v}}}$." for v in MATH_VARIANTS + [t]]
        answers += [f"\\boxed {t}$ apples", f"\\boxed 54 apples", f"\\fbox{{{t}}}", f"\\boxed{{{t}",
                    f"first \\boxed 5$ then \\boxed{{{t}}}", f"\\boxed{{\\boxed{{{t}}}}}", t, "no box at all",
                    f"\\boxed{{1}} and finally \\boxed{{{t}}}"]
        cases += [(text, t) for text in wrap(answers)]
    return cases


# ---- math, math_dapo, aime*

DAPO_TRUTHS = ["5", "\\frac{1}{2}", "1000", "204", "x+1", "\\sqrt{3}"]


def dapo_cases():
    cases = []
    for t in DAPO_TRUTHS:
        answers = [f"Answer: {t}", f"answer : {t}", f"ANSWER:{t}\nthat is all", f"Answer: ${t}$",
                   f"Answer: \\boxed{{{t}}}", f"Answer: x = {t}", f"\\boxed{{{t}}}", f"\\boxed{{{t}}}" + "." * 120,
                   f"Answer: {t} dollars", f"Answer: a {t}", "Answer: 1,000", "Answer: \\frac12", "Answer: \\sqrt3",
                   "Answer: 7", "no answer here", f"Answer: {t}\nAnswer: 9", f"Answer: 9\nAnswer: {t}",
                   f"Answer: \\text{{{t}}}", f"Answer: {t}^\\circ", f"Answer: {t}.", f"\\boxed{{ {t} }}", ""]
        cases += [(text, t) for text in wrap(answers)]
    return cases


# ---- numina_* (PRIME's math grader)

PRIME_TRUTHS = ["5", "\\frac{1}{2}", "0.5", "(1,2)", "[0, 1)", "2\\pi", "\\sqrt{2}", "x^2+2x+1", "10\\%", "1,000",
                "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "50", "\\text{B}", "-3"]
PRIME_VARIANTS = ["{t}", "{t}.", "${t}$", "x = {t}", "\\boxed{{t}}", "0.50", "1/2", "\\dfrac12", "(1, 2)",
                  "[0,1)", "Interval.Ropen(0, 1)", "2*pi", "6.283", "2\\pi", "\\sqrt2", "2^(1/2)", "(x+1)^2",
                  "x^2 + 2x + 1", "10%", "0.1", "1000", "1,000", "[1, 2]", "[[1], [2]]", "Matrix([[1], [2]])",
                  "50%", "0.5%", "B", "\\text{(B)}", "-3", "- 3", "3", "5_8", "a_b", "7 3/4", "1 million",
                  "5 cm", "5 degrees", "\\infty", "Point(1, 2)", "(1, 2, 3)", "__import__('os')\\pi",
                  "Matrix([1, 2])", "Matrix([[1.0], [2]])", "\\frac{1}{2}\\pi", "2 \\pi", "(1,2)\\pi"]


def prime_cases():
    """Each variant in one of four phrasings (rotating); the first eight also wrapped."""
    templates = ["The answer is {}", "Step 2: so \\boxed{{{}}}", "Answer: {}", "{} is the answer"]
    cases = []
    for t in PRIME_TRUTHS:
        answers = [templates[i % 4].format(v.replace("{t}", t)) for i, v in enumerate(PRIME_VARIANTS)]
        answers += ["nothing to see", "The answer is", t]
        cases += [(text, t) for text in wrap(answers[:8]) + answers[8:]]
    return cases


ROUTES = {
    "openai/gsm8k": gsm8k_cases,
    **dict.fromkeys(["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"], math_cases),
    "math": dapo_cases, "math_dapo": dapo_cases, "math_dapo_reasoning": dapo_cases, "aime2024": dapo_cases,
    "aime25_hard": dapo_cases,
    **dict.fromkeys(routing.NUMINA[:1], prime_cases),
}


@pytest.mark.parametrize("data_source", list(ROUTES))
def test_scores_equal_verls_case_by_case(verl_score, data_source):
    """On every generated case (right, wrong, formatting variants, long text, unicode) both return the same value,
    type included (a float, or DAPO's dict), or both raise."""
    cases = ROUTES[data_source]()
    bad = mismatches(verl_score, data_source, cases)
    assert not bad, f"{len(bad)}/{len(cases)} cases differ from verl, first ones:\n" + "\n".join(map(repr, bad[:10]))


def test_every_numina_source_routes_to_prime_math(verl_score):
    """Each numina_* name gives the same as verl on a right, a wrong and a sympy-equal answer."""
    cases = [("The answer is \\boxed{\\frac{1}{2}}", "0.5"), ("The answer is 3", "5"), ("so x = (x+1)^2", "x^2+2x+1")]
    for source in routing.NUMINA:
        assert not mismatches(verl_score, source, cases), source


def test_verl_routes_every_built_in_verl_name_the_same_way(verl_score):
    """Every data_source this library claims as verl's is one verl scores (it raises for none of them), and
    default_compute_score keeps verl's parameters."""
    own = {"gsm8k", "boxed", "arithmetic", "environment"}  # this library's own
    for source in set(routing.BUILTIN_SCORES) - own:
        verl_score(source, "Answer: 1", "1")
    assert list(inspect.signature(verl_score).parameters) == list(
        inspect.signature(rewards.default_compute_score).parameters)


def test_by_design_departures_never_run_model_text(verl_score):
    """verl evals a \\pi answer with its module's globals (`abs(-2)*\\pi` equals 2π there) and parses Matrix(…) with
    sympy's eval; here neither runs, so those score 0 — the documented departures."""
    assert verl_score("numina_olympiads", "The answer is abs(-2)*\\pi", "2\\pi") == 1.0
    assert rewards.default_compute_score("numina_olympiads", "The answer is abs(-2)*\\pi", "2\\pi") == 0.0
    truth = "\\begin{pmatrix} x \\\\ 2 \\end{pmatrix}"
    assert verl_score("numina_olympiads", "The answer is Matrix([[x], [2]])", truth) == 1.0
    assert rewards.default_compute_score("numina_olympiads", "The answer is Matrix([[x], [2]])", truth) == 0.0


def test_the_lenient_own_rules_differ_from_verl(verl_score):
    """A check that the comparison can fail: the library's own `gsm8k` accepts what verl's openai/gsm8k rejects."""
    assert verl_score("openai/gsm8k", "#### 158.", "158") == 0.0
    assert rewards.default_compute_score("gsm8k", "#### 158.", "158") == 1.0


# ---- a verl-style parquet, end to end

def verl_rows(sources):
    """Rows as verl's examples/data_preprocess writes them: chat prompt, reward_model.ground_truth, extra_info."""
    return [{"data_source": source, "prompt": [{"role": "user", "content": f"What is {i} + 2?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"split": "train", "index": i}}
            for i, source in enumerate(sources)]


def run_ppo(model, train, out, *overrides):
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", f"model.path={model}", f"data.train_files={train}",
           "data.val_files=null", "rollout.name=hf", "rollout.max_response_length=8", "data.max_prompt_length=64",
           "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.total_steps=1",
           "trainer.save_freq=0", "trainer.test_freq=0", "trainer.sample_freq=0", "trainer.plot_curves=false",
           "trainer.val_before_train=false", "trainer.max_kl=0", f"trainer.output_dir={out}", "model.dtype=fp32",
           "model.lora_rank=8", "model.target_modules=q_proj,v_proj", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    return proc, time.perf_counter() - start


def test_unsupported_data_sources_fail_at_start_up_before_any_model_loads(tmp_path):
    """Mixed data_source values: the run stops in one sentence naming the unsupported ones and the fix. The model's
    weights are garbage, so reaching any model load would fail differently: the check came first."""
    import data
    model = make_tiny_model(tmp_path / "model")
    with open(os.path.join(model, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    data.write_parquet(verl_rows(["openai/gsm8k", "math", "apps", "searchR1_nq", "my/data", "aime2024"] * 2),
                       str(tmp_path / "train.parquet"))
    proc, seconds = run_ppo(model, tmp_path / "train.parquet", tmp_path / "out")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    sentence = proc.stderr.strip().splitlines()[-1]
    assert sentence.startswith("ppo.py: the data has data_source values with no built-in reward: 'apps' (verl runs "
                               "the code in a sandbox), 'my/data', 'searchR1_nq' (verl's search-tool task);")
    assert "reward.function=path/to/file.py:compute_score" in sentence and "'math'" not in sentence
    print(f"start-up check: {seconds:.1f} s")


def test_supported_verl_sources_train_with_the_built_in_rules(tmp_path):
    """A verl parquet holding only routed sources (GSM8K, DAPO's math, aime*, numina) trains a step with the
    built-ins: no reward errors, and DAPO's "acc" is logged beside the score."""
    import data
    model = make_tiny_model(tmp_path / "model")
    data.write_parquet(verl_rows(["openai/gsm8k", "math", "aime2024", "numina_cn_k12"] * 2),
                       str(tmp_path / "t.parquet"))
    proc, _ = run_ppo(model, tmp_path / "t.parquet", tmp_path / "out")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    step = [line for line in read_metrics(tmp_path / "out") if line["step"] == 1][0]
    assert step["reward/errors"] == 0 and "reward/acc" in step


def test_a_reward_function_failing_everywhere_stops_the_run_in_one_sentence(tmp_path):
    """A reward file that raises on every sample (here a KeyError) stops ppo.py at the first step with one
    sentence carrying the first error, instead of training the whole run on zeros."""
    import data
    model = make_tiny_model(tmp_path / "model")
    data.write_parquet(verl_rows(["openai/gsm8k"] * 4), str(tmp_path / "t.parquet"))
    (tmp_path / "bad.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                     "    return extra_info['no_such_key']\n")
    proc, _ = run_ppo(model, tmp_path / "t.parquet", tmp_path / "out", f"reward.function={tmp_path}/bad.py")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "ppo.py: the reward function failed on all 8 samples of a batch, so training would learn from zeros; "
        "the first error: KeyError: 'no_such_key'")
