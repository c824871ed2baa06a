"""Issue 34: settings that would silently train nothing or read wrongly are refused (or warned about once) at start-up,
and malformed model output or judge replies cost their sample, never the run.

Start-up: a trainer.best_metric that validation never logs, a rejection band with its lower bound at or above the
upper one (the default 1 / rollout_rs_threshold included), greedy samples for an estimator that compares them, two
tools of one name, a second --config or a key given twice on the command line, a misspelt placeholder in the judge's
template. Malformed: a tool call whose name is not a string, JSON nested past Python's parser, lone surrogates; a
judge endpoint answering HTML, no choices, a redirect, or quoting the API key back. (best/ and exports, checked as
resume checks a checkpoint, are in test_recovery.py.)
"""
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO
from infra import cli
from infra.config import ConfigError
from test_faults import no_model_loads, ppo_config, write  # noqa: F401 (no_model_loads is a fixture)
from test_ppo import workdir  # noqa: F401 (workdir is a fixture)


def config(*overrides):
    return cli.load_config(f"{REPO}/configs.yaml", list(overrides))


# ---- start-up: what validation logs, the rejection band, greedy groups, tools


def test_a_best_metric_validation_never_logs_fails_before_any_model_loads(workdir, tmp_path, no_model_loads):  # noqa: F811
    """A misspelt trainer.best_metric with trainer.test_freq=0 used to fail only at the validation after the last
    step, losing the run: now ppo.main refuses it once the validation data is read, naming the metric it logs that
    is nearest, before any model loads."""
    import ppo
    cfg = ppo_config(workdir, tmp_path / "out", "trainer.best_metric=val/score/maen", "trainer.test_freq=0")
    with pytest.raises(ConfigError) as e:
        ppo.main(cfg)
    assert str(e.value) == ("trainer.best_metric=val/score/maen is not a metric this run's validation logs (it logs "
                            "val/arithmetic/score, val/score/mean): did you mean val/score/mean?")


def test_the_validation_metrics_follow_the_config():
    """logged_names: val/score/mean and one score per data_source always; pass@1, 2, 4 and 6 and maj@6 per
    source and overall with val_n=6 and a rule; val/rule_score/mean with a judge or a reward model, and then no
    pass@k; val/agent/* with multi-turn only. (test_recovery.py checks the set against what a real run logs.)"""
    from validation import logged_names
    sources = {"gsm8k", "math"}
    assert logged_names(config(), sources) == {"val/score/mean", "val/gsm8k/score", "val/math/score"}
    at_6 = logged_names(config("rollout.val_n=6", "rollout.val_temperature=1.0"), {"gsm8k"})
    assert at_6 == {"val/score/mean", "val/gsm8k/score"} | {
        name for kind in ("pass@1", "pass@2", "pass@4", "pass@6", "maj@6")
        for name in (f"val/{kind}/mean", f"val/gsm8k/{kind}")}
    judged = logged_names(config("reward.type=judge", "rollout.val_n=6", "rollout.val_temperature=1.0"), sources)
    assert judged == {"val/score/mean", "val/gsm8k/score", "val/math/score", "val/rule_score/mean"}
    turns = {"agent/turns_mean": 0.0}
    assert "val/agent/turns_mean" not in logged_names(config(), sources, turns)
    assert "val/agent/turns_mean" in logged_names(config("rollout.multi_turn.enable=true"), sources, turns)


def test_an_environments_info_is_a_best_metric_said_where_a_validation_lacks_it():
    """val/env/<key> (the numbers an environment's infos give, unknown before it runs) passes start-up's check with
    rollout.multi_turn.env set, and only then; a validation that lacks it says so, naming those it has."""
    from infra.train_state import best_metric_missing
    from validation import check_best_metric
    env = ("rollout.multi_turn.enable=true", "rollout.multi_turn.env=examples/guess_number.py:GuessNumber")
    check_best_metric(config(*env, "trainer.best_metric=val/env/won"), {"guess"})
    for overrides in [env + ("trainer.best_metric=val/env/",), ("rollout.multi_turn.enable=true",
                                                                 "trainer.best_metric=val/env/won")]:
        with pytest.raises(ConfigError, match=r"^trainer.best_metric=val/env/(won)? is not a metric this run's"):
            check_best_metric(config(*overrides), {"guess"})
    assert best_metric_missing("val/env/won", {"val/score/mean": 0.1, "val/env/won": 0.0}) is None
    assert best_metric_missing("val/env/wonn", {"val/score/mean": 0.1, "val/env/won": 0.0, "val/env/valid": 1.0}) == (
        "trainer.best_metric=val/env/wonn is not among this validation's metrics: no sample's environment gave it in "
        "its infos (they gave val/env/valid, val/env/won)")


@pytest.mark.parametrize("overrides, start", [
    (["algorithm.rollout_rs_threshold=0.5"],  # the default lower bound, 1 / 0.5 = 2, lies above the upper one
     "the lower bound 1 / algorithm.rollout_rs_threshold = 2 (rollout_rs_threshold_lower=0) is not below "
     "algorithm.rollout_rs_threshold=0.5, so rejection would keep nothing"),
    (["algorithm.rollout_rs_threshold=1"],  # a band of width 0: ρ = 1 exactly
     "the lower bound 1 / algorithm.rollout_rs_threshold = 1 (rollout_rs_threshold_lower=0) is not below "
     "algorithm.rollout_rs_threshold=1"),
    (["algorithm.rollout_rs_threshold=2", "algorithm.rollout_rs_threshold_lower=3"],
     "algorithm.rollout_rs_threshold_lower=3 is not below algorithm.rollout_rs_threshold=2"),
], ids=["default lower above upper", "empty band", "lower above upper"])
def test_a_rejection_band_that_keeps_nothing_is_refused(overrides, start):
    """[rollout_rs_threshold_lower or 1 / rollout_rs_threshold, rollout_rs_threshold] must hold more than one ratio;
    the check used to compare only the key as given, 0, so the derived default passed whatever the upper bound."""
    from infra.checks import check_combinations, rejection_band
    with pytest.raises(ConfigError) as e:
        check_combinations(config(*overrides))
    assert str(e.value).startswith(start)
    assert rejection_band(config().algorithm) == (0.5, 2.0)  # what ppo.policy_loss_mask rejects by


def test_two_tools_with_one_name_are_refused():
    """The model calls a tool by its function's name, so two specs ending in :calc would leave one of them
    unreachable (the last one loaded won): refused, naming both."""
    from infra.checks import check_combinations
    with pytest.raises(ConfigError) as e:
        check_combinations(config("rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[a.py:calc,b.py:calc]"))
    assert str(e.value) == ("rollout.multi_turn.tools: two tools are named 'calc' (a.py:calc, b.py:calc), and the "
                            "model calls a tool by its function's name: rename one")


def test_greedy_samples_for_an_estimator_that_compares_them_are_warned_about_once(capsys):
    """GRPO (and RLOO, REINFORCE++-baseline) at rollout.temperature=0: one warning line on start-up, since every
    sample of a prompt is the same response and every advantage 0; GAE at 0 is not warned about."""
    import ppo
    ppo.check_names(config("algorithm.adv_estimator=grpo", "rollout.temperature=0", "rollout.n=4"))
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["warning: algorithm.adv_estimator=grpo compares the samples of a prompt, and greedy ones "
                     "(rollout.temperature=0) are one response 4 times, so every advantage is 0 and only a KL loss or "
                     "an entropy bonus trains: set rollout.temperature > 0, e.g. 1.0"]
    ppo.check_names(config("algorithm.adv_estimator=gae", "rollout.temperature=0"))
    assert capsys.readouterr().out == ""


# ---- the command line


def test_a_second_config_file_is_refused_in_one_sentence(monkeypatch):
    """`ppo.py --config configs.yaml --config recipes/dapo.yaml` read only the last file, silently: now ppo.py's entry
    (cli.run_script) exits with one sentence naming the flag and both files (Python prints it, exit status 1),
    before main runs."""
    import ppo
    monkeypatch.setattr(sys, "argv", ["ppo.py", "--config", "configs.yaml", "--config=recipes/dapo.yaml"])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        cli.run_script(lambda cfg: pytest.fail("main ran"), ppo.__doc__, ppo.config.Config, "ppo.py")
    assert e.value.code == ("ppo.py: --config is given 2 times (configs.yaml, recipes/dapo.yaml), and only one file "
                            "is read: give one, with the others' changes in it or as key=value overrides")


def test_a_key_given_twice_on_the_command_line_is_warned_about(capsys):
    """The last of two values wins (examples/*.sh put the user's "$@" after their own overrides), said in one line
    naming the key and both values; the same value twice says nothing."""
    cfg = cli.parse_args(["--config", "configs.yaml", "trainer.total_steps=435", "--trainer.total_steps = 1",
                          "trainer.seed=3", "trainer.seed=3"], "")
    assert cfg.trainer.total_steps == 1 and cfg.trainer.seed == 3
    assert capsys.readouterr().out.strip().splitlines() == [
        "warning: `trainer.total_steps` is given twice on the command line ('435', then '1'): the last one, '1', is "
        "used"]


# ---- the judge: its template, its answers, its endpoint

@pytest.mark.parametrize("answer, score", [("7/10", 0.7), ("7 out of 10", 0.7), ("Score: 7", 0.7), ("7.5 of 10", 0.75),
                                           ("Score: 8/10. A 10 would need a proof.", 0.8), ("8 OUT OF 10!", 0.8),
                                           ("I'd say 3 of 10; the 10 steps are wrong", 0.3)])
def test_the_judge_score_is_the_one_its_scale_names(answer, score):
    """The score is X of the last "X/Y", "X out of Y" or "X of Y" (Y the scale, reward.judge.max_score), else the
    last number: "7 out of 10" used to read 10 (the last number), a full score."""
    from scorers.judge import parse_number
    assert parse_number(answer, 0, 10) == pytest.approx(score)


def test_a_judge_scoring_on_another_scale_is_an_error():
    """"4/5" asked for a score out of 10 is neither 4 nor 8 with certainty: a ValueError (a counted judge error)."""
    from scorers.judge import parse_number
    with pytest.raises(ValueError, match=r"the judge scored out of 5, not reward.judge.max_score=10"):
        parse_number("4/5", 0, 10)


@pytest.mark.parametrize("word, near", [("respnse", "response"), ("Response", "response"), ("ground truth",
                                                                                                "ground_truth"),
                                        ("prompts", "prompt")])
def test_a_misspelt_placeholder_in_the_judge_template_is_refused(tmp_path, word, near):
    """{respnse} (or {Response}, {ground truth}, {prompts}) would reach the judge as written: refused, naming the
    word, the placeholders and the nearest one."""
    from scorers.judge import read_template
    path = write(tmp_path / "t.txt", f"Q: {{prompt}}\nA: {{response}} {{{word}}}")
    with pytest.raises(ConfigError) as e:
        read_template(str(path))
    assert str(e.value) == (f"reward.judge.prompt_template: {path} has {{{word}}}, which is not a placeholder and "
                            f"would reach the judge as written; the placeholders are {{prompt}}, {{response}}, "
                            f"{{ground_truth}} (did you mean {{{near}}}?)")


def test_other_braces_in_the_judge_template_stay():
    """JSON and LaTeX braces are not placeholders and pass (render leaves them as they are)."""
    from scorers.judge import read_template, render
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "judge_prompt.txt")
    read_template(path)
    text = 'Reply {"score": n}; the answer is in \\boxed{answer} or {x}. {response}'
    assert render(text, {"prompt": "p"}, "r") == 'Reply {"score": n}; the answer is in \\boxed{answer} or {x}. r'


def test_an_api_key_written_as_the_variable_name_is_refused_without_quoting_it():
    """reward.judge.api_key_env=sk-… (the key itself, which config.yaml would keep): one sentence that does not quote
    the value, before the endpoint is asked."""
    from scorers.judge import check_judge
    cfg = config("reward.type=judge", "reward.judge.base_url=http://127.0.0.1:9/v1",
                 "reward.judge.api_key_env=sk-proj-abc123").reward.judge
    with pytest.raises(ConfigError) as e:
        check_judge(cfg)
    assert "sk-proj" not in str(e.value)
    assert str(e.value).startswith("reward.judge.api_key_env must be the name of an environment variable")


class Endpoint:
    """An OpenAI-compatible endpoint on localhost whose chat completions answer as `mode` says: "ok" (a score),
    "html" (a proxy's page), "empty" (no choices), "redirect" (307 to `elsewhere`), "echo" (401 quoting the
    Authorization header back). Records (path, Authorization) of each request."""

    def __init__(self, mode="ok", elsewhere=None):
        self.mode, self.seen, endpoint = mode, [], self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, body, content_type="application/json", headers=()):
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for header in headers:
                    self.send_header(*header)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                endpoint.seen.append((self.path, self.headers.get("Authorization")))
                self.reply(200, {"object": "list", "data": [{"id": "judge", "object": "model", "created": 0,
                                                             "owned_by": "test"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                endpoint.seen.append((self.path, self.headers.get("Authorization")))
                completion = {"id": "1", "object": "chat.completion", "created": 0, "model": "judge", "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "7 out of 10"}}]}
                if endpoint.mode == "html":
                    return self.reply(200, "<html><body>502 Bad Gateway</body></html>", "text/html")
                if endpoint.mode == "empty":
                    return self.reply(200, {**completion, "choices": []})
                if endpoint.mode == "redirect":
                    return self.reply(307, "", headers=[("Location", f"{elsewhere.url}/chat/completions")])
                if endpoint.mode == "echo":
                    return self.reply(401, {"error": {"message": f"bad key: {self.headers.get('Authorization')}"}})
                self.reply(200, completion)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def endpoints():
    made = []
    yield lambda *args, **kwargs: made.append(Endpoint(*args, **kwargs)) or made[-1]
    for endpoint in made:
        endpoint.server.shutdown()
        endpoint.server.server_close()


KEY = "sk-test-0123456789abcdef"


def judge_of(url, tmp_path, monkeypatch):
    from scorers.judge import Judge
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    template = write(tmp_path / "t.txt", "Rate: {response}")
    return Judge(config("reward.type=judge", f"reward.judge.base_url={url}", f"reward.judge.prompt_template={template}",
                        "reward.judge.api_key_env=JUDGE_TEST_KEY", "reward.judge.max_retries=0").reward.judge)


@pytest.mark.parametrize("mode, error", [
    ("html", "ValueError: the endpoint answered '<html><body>502 Bad Gateway</body></html>', not a chat completion"),
    ("empty", "ValueError: the endpoint's chat completion has no choices"),
    ("echo", "AuthenticationError: Error code: 401 - bad key: Bearer ***"),
])
def test_a_judge_reply_that_is_not_a_completion_is_a_counted_error(endpoints, tmp_path, monkeypatch, mode, error):
    """Besides a good answer ("7 out of 10" → 0.7), an HTML page, an empty `choices` or a 401 are each an error for
    its sample, said in a few words; a reply that quotes the key back shows *** instead (the error reaches the
    console and warnings)."""
    endpoint = endpoints()
    judge = judge_of(endpoint.url, tmp_path, monkeypatch)
    rows = [{"prompt": "What is 3 + 4?", "ground_truth": "7"}] * 2
    assert judge(rows, ["7", "8"]).scores == [0.7, 0.7]
    endpoint.mode = mode
    judged = judge(rows, ["7", "8"])
    assert judged.scores == [0.0, 0.0] and judged.errors == 2 and judged.first_error == error
    assert KEY not in judged.first_error + " ".join(judged.answers)


def test_the_judge_key_goes_only_to_base_url(endpoints, tmp_path, monkeypatch):
    """A judge that redirects its requests elsewhere (307, which would resend the prompt, and with http → https the
    key): not followed, an error naming where to; the other host receives nothing, and every request the endpoint
    saw carried the key in its Authorization header."""
    elsewhere = endpoints()
    endpoint = endpoints("redirect", elsewhere)
    judged = judge_of(endpoint.url, tmp_path, monkeypatch)([{"prompt": "q"}], ["r"])
    assert judged.errors == 1 and judged.first_error == (
        f"APIStatusError: it redirects to {elsewhere.url}/chat/completions, which is not followed: give that as "
        f"base_url")
    assert elsewhere.seen == []
    assert endpoint.seen == [("/v1/models", f"Bearer {KEY}"), ("/v1/chat/completions", f"Bearer {KEY}")]


# ---- malformed tool calls


@pytest.mark.parametrize("body, error", [
    ('{"name": ["calc"], "arguments": {}}', "TypeError: the name must be a string, not list"),
    ('{"name": {"calc": 1}, "arguments": {}}', "TypeError: the name must be a string, not dict"),
    ("[" * 100_000 + "]" * 100_000, "RecursionError: maximum recursion depth exceeded"),
    ('{"name": "calc", "arguments": "' + "[" * 5000 + "]" * 5000 + '"}', "RecursionError"),
], ids=["name a list", "name a dict", "nested brackets", "nested arguments"])
def test_a_malformed_tool_call_is_an_error_for_its_sample(body, error):
    """A name that is not a string (a list used to raise `unhashable type` out of the rollout) and JSON nested past
    Python's parser (RecursionError, not a ValueError) are calls with an error, answered as such; the tool never
    runs."""
    from agents.tools import parse_hermes, run_tools

    class NoHost:  # infra/episodes.ObjectHost, which runs the tools: never asked to
        timeout_s = 1.0

        def open(self, name, count):
            pytest.fail(f"a process was opened for {name}")

        def call_all(self, calls):
            assert calls == [], calls
            return []

        def end(self, keys):
            assert keys == []
    [call] = parse_hermes(f"<tool_call>{body}</tool_call>", {"calc"})
    assert call.name == "?" and error in call.error
    [result] = run_tools([call], NoHost(), max_chars=500)
    assert not result.ok and result.text.startswith("error: the call is not")


def test_lone_surrogates_in_a_tool_call_become_replacement_characters():
    """"\\ud800" in the call's JSON (in a key, a value, or arguments given as a JSON string) is no UTF-8 text, which a
    tokenizer or a log could not write: each lone one becomes U+FFFD; a surrogate pair stays the character it
    encodes."""
    from agents.tools import parse_hermes
    text = ('<tool_call>{"name": "calc", "arguments": {"x\\ud800": ["\\udc80a", "\\ud83d\\ude00"]}}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": "{\\"y\\": \\"\\\\udfff\\"}"}</tool_call>')
    calls = parse_hermes(text, {"calc"})
    assert [(c.arguments, c.error) for c in calls] == [({"x\ufffd": ["\ufffda", "\U0001F600"]}, None),
                                                       ({"y": "\ufffd"}, None)]
    json.dumps([c.arguments for c in calls], ensure_ascii=False).encode("utf-8")  # writable as UTF-8
