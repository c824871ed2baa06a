"""The LLM judge (scorers/judge.py): answers parsed into scores, the template, the start-up check, bounded concurrency,
timeouts and retries, errors counted and a batch of errors stopping the run; against a stand-in OpenAI server
(StubServer, in this process) for the timings, and against vLLM's own OpenAI server on a tiny model taught to judge,
end to end through ppo.py.
"""
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from conftest import REPO, arithmetic_run_folder, free_port, make_tiny_model, read_metrics
from infra.cli import load_config
from infra.config import ConfigError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
TEMPLATE = "Q: {prompt}\nA: {response}\nRight?"
ROWS = [{"prompt": "What is 3 + 4?", "ground_truth": "7"}, {"prompt": "What is 5 + 6?", "ground_truth": "11"}]


# ---------------------------------------------------------------------------------------
# Answers, template


def test_the_number_parser_reads_the_last_score_in_range():
    """The answer's last number (not the denominator of "7/10"), scaled from [low, high] to [0, 1]; no number, or
    one outside the range, is a ValueError."""
    from scorers.judge import parse_number
    assert parse_number("8", 0, 10) == 0.8
    assert parse_number("Score: 7/10", 0, 10) == 0.7
    assert parse_number("Step 1 looks fine, step 2 too. Final score: 4.5", 1, 5) == pytest.approx(0.875)
    for bad in ["", "great answer", "11", "-1", "12/10 would be too much"]:
        with pytest.raises(ValueError):
            parse_number(bad, 0, 10)


def test_the_yes_no_parser_reads_the_last_yes_or_no():
    from scorers.judge import parse_yes_no
    assert [parse_yes_no(a, 0, 1) for a in ["Yes.", "No, 3 + 4 is 7.", "no... on reflection, YES"]] == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError):
        parse_yes_no("maybe; it depends", 0, 1)


def test_the_template_is_filled_in_one_pass():
    """{prompt} (a chat as role: content lines), {response} and {ground_truth} are replaced; other braces stay, and a
    response that holds "{prompt}" is not filled in again."""
    from scorers.judge import render
    row = {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "3 + 4"}], "ground_truth": 7}
    out = render('{"question": "{prompt}", "truth": {ground_truth}} {response}', row, "{prompt}!")
    assert out == '{"question": "system: Add.\nuser: 3 + 4", "truth": 7} {prompt}!'
    assert render("{response}|{ground_truth}", {"prompt": "q", "ground_truth": None}, "r") == "r|"


# ---------------------------------------------------------------------------------------
# A stand-in OpenAI server


class StubServer:
    """/v1/models and /v1/chat/completions on localhost, in a thread. answer(prompt) → the reply; `delay` seconds per
    request; the first `failures` requests get a 503. Counts requests and the most in flight at once."""

    def __init__(self, answer=lambda prompt: "yes", delay=0.0, failures=0, models=("judge",)):
        self.answer, self.delay, self.failures, self.models = answer, delay, failures, list(models)
        self.requests, self.in_flight, self.most_in_flight, self.lock = 0, 0, 0, threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                                             "owned_by": "stub"} for m in stub.models]})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests += 1
                    stub.in_flight += 1
                    stub.most_in_flight = max(stub.most_in_flight, stub.in_flight)
                    fail, stub.failures = stub.failures > 0, stub.failures - 1
                try:
                    time.sleep(stub.delay)
                    if fail:
                        return self.reply(503, {"error": {"message": "overloaded", "type": "server_error"}})
                    content = stub.answer(request["messages"][-1]["content"])
                    self.reply(200, {"id": "1", "object": "chat.completion", "created": 0, "model": request["model"],
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": content}}]})
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    pass
                finally:
                    with stub.lock:
                        stub.in_flight -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    servers = []

    def make(**kwargs):
        servers.append(StubServer(**kwargs))
        return servers[-1]
    yield make
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge") / "template.txt"
    path.write_text(TEMPLATE)
    return str(path)


def judge_config(url, template_file, *overrides):
    return load_config(None, ["reward.type=judge", f"reward.judge.base_url={url}",
                              f"reward.judge.prompt_template={template_file}", "reward.judge.parser=yes_no",
                              "reward.judge.backoff_s=0.05", *overrides]).reward


def right_or_wrong(prompt: str) -> str:
    """The stand-in judge: yes when the response is the sum asked for."""
    question, answer = prompt.split("\nA: ")
    a, b = question.removeprefix("Q: What is ").removesuffix("?").split(" + ")
    return "yes" if answer.removesuffix("\nRight?") == str(int(a) + int(b)) else "no"


def test_a_batch_is_scored_with_bounded_concurrency(stub, template_file):
    """Each response gets the judge's parsed answer (yes 1, no 0) and its raw answer; with max_concurrency=2 and
    slow replies, exactly 2 requests are ever in flight at once."""
    from scorers.judge import Judge
    server = stub(answer=right_or_wrong, delay=0.2)
    judge = Judge(judge_config(server.url, template_file, "reward.judge.max_concurrency=2").judge)
    judged = judge(ROWS * 3, ["7", "12", "8", "11", "7", "11"])
    assert judged.scores == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0] and judged.errors == 0
    assert judged.answers == ["yes", "no", "no", "yes", "yes", "yes"]
    assert server.most_in_flight == 2 and server.requests == 6


def test_overloaded_server_is_retried_with_backoff(stub, template_file):
    """Two 503s, then answers: with max_retries=2 the request succeeds on its third attempt, after waiting
    backoff_s + 2·backoff_s; with max_retries=1 it is an error, counted, and scores 0."""
    from scorers.judge import Judge
    server = stub(failures=2)
    judge = Judge(judge_config(server.url, template_file, "reward.judge.max_retries=2",
                               "reward.judge.backoff_s=0.2").judge)
    start = time.monotonic()
    assert judge(ROWS[:1], ["7"]).scores == [1.0]
    assert server.requests == 3 and time.monotonic() - start >= 0.6
    server.failures = 2
    judged = Judge(judge_config(server.url, template_file, "reward.judge.max_retries=1").judge)(ROWS[:1], ["7"])
    assert (judged.scores, judged.errors) == ([0.0], 1) and "InternalServerError" in judged.first_error


def test_a_slow_judge_times_out_into_a_counted_error(stub, template_file):
    """A reply slower than reward.judge.timeout_s: each attempt gives up at the timeout, and after its retries the
    sample is an error (APITimeoutError) that scores 0, well before the server would have answered."""
    from scorers.judge import Judge
    server = stub(delay=5.0)
    judge = Judge(judge_config(server.url, template_file, "reward.judge.timeout_s=0.3",
                               "reward.judge.max_retries=1").judge)
    start = time.monotonic()
    judged = judge(ROWS, ["7", "11"])
    assert time.monotonic() - start < 3.0
    assert (judged.scores, judged.errors) == ([0.0, 0.0], 2) and "APITimeoutError" in judged.first_error
    assert judged.answers == ["(no answer: APITimeoutError)"] * 2


def test_the_scorer_counts_judge_errors_and_stops_when_all_fail(stub, template_file):
    """Scorer with reward.type=judge: an unparseable answer is an error in reward/judge_errors and scores 0, the raw
    answers are each sample's extras; when every sample errs it raises RewardError (the run stops, as for a failing
    reward function). With sources [rule, judge] and weights [0.5, 2] the score is 0.5·rule + 2·judge."""
    from rewards import RewardError
    from rewards import Scorer
    server = stub(answer=lambda prompt: "yes" if "A: 7" in prompt else "I cannot say")
    rows = [{**row, "data_source": "arithmetic", "extra_info": {}} for row in ROWS]
    scorer = Scorer(judge_config(server.url, template_file), "cpu", None)
    with pytest.warns(UserWarning, match="the judge failed on 1/2 samples"):
        got = scorer(rows, ["7", "11"])
    scores, metrics = got.scores, got.metrics
    assert scores.tolist() == [1.0, 0.0] and metrics["reward/judge_errors"] == 1.0
    assert [extra["judge_answer"] for extra in got.extras] == ["yes", "I cannot say"]
    with pytest.raises(RewardError, match="the judge failed on all 2 samples"):
        scorer(rows, ["8", "8"])
    both = Scorer(load_config(None, [f"reward.judge.base_url={server.url}", "reward.sources=[rule,judge]",
                                     "reward.weights=[0.5,2]", f"reward.judge.prompt_template={template_file}",
                                     "reward.judge.parser=yes_no", "reward.judge.backoff_s=0.05"]).reward, "cpu", None)
    with pytest.warns(UserWarning):
        assert both(rows, ["7", "11"]).scores.tolist() == [0.5 + 2.0, 0.5]  # the rule: both right; the judge: one


def test_the_start_up_check_names_the_key(stub, template_file, tmp_path):
    """check_judge: no server at base_url, a model it does not serve, an ambiguous null model, no template, a
    template without {response}: each one sentence naming its key."""
    from scorers.judge import check_judge
    served = stub(models=("a", "b"))
    (tmp_path / "blind.txt").write_text("Is it right?")
    down = f"http://127.0.0.1:{free_port()}/v1"
    cases = [([f"reward.judge.base_url={down}"], f"reward.judge.base_url={down}: no OpenAI-compatible server answers"),
             (["reward.judge.model=c"], f"reward.judge.model='c' is not served at {served.url} (it serves ['a', 'b'])"),
             ([], "reward.judge.model is null but"),
             (["reward.judge.prompt_template=null"], "reward.judge.prompt_template is not set"),
             ([f"reward.judge.prompt_template={tmp_path}/blind.txt"], "has no {response}")]
    for overrides, sentence in cases:
        with pytest.raises(ConfigError) as e:
            check_judge(judge_config(served.url, template_file, *overrides).judge)
        assert sentence in str(e.value) and "\n" not in str(e.value), overrides
    check_judge(judge_config(served.url, template_file, "reward.judge.model=b").judge)


# ---------------------------------------------------------------------------------------
# ppo.py


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge_run")
    arithmetic_run_folder(root, 32, 8)
    return root


def ppo_args(root, out, url, template_file, *overrides):
    return [f"model.path={root}/model", f"data.train_files={root}/train.parquet", f"data.val_files={root}/val.parquet",
            "reward.type=judge", f"reward.judge.base_url={url}", f"reward.judge.prompt_template={template_file}",
            "reward.judge.parser=yes_no", "reward.judge.max_tokens=4", "rollout.name=hf",
            "rollout.max_response_length=8", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
            "algorithm.adv_estimator=grpo", "trainer.total_steps=2", "trainer.test_freq=2", "trainer.sample_freq=1",
            "data.val_max_samples=4", "trainer.max_kl=0", "model.dtype=fp32", "model.lora_rank=8",
            "model.target_modules=q_proj,v_proj", "trainer.plot_curves=false", f"trainer.output_dir={out}",
            *overrides]


def test_a_judge_that_does_not_answer_stops_ppo_before_any_model_loads(workdir, template_file, tmp_path,
                                                                       monkeypatch):
    """ppo.main with reward.type=judge and nothing listening at base_url: one sentence naming the key, and no model
    was loaded first."""
    import transformers
    import ppo

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"a model was loaded ({cls.__name__}) before the check")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ConfigError, match=f"reward.judge.base_url={url}: no OpenAI-compatible server answers"):
        ppo.main(load_config(f"{REPO}/configs.yaml", ppo_args(workdir, tmp_path / "out", url, template_file)))


# ---------------------------------------------------------------------------------------
# vLLM's OpenAI server, on a tiny model taught to judge


def fit_judge(model, tokenizer, examples, steps=300, lr=1e-3):
    """Teach `model` to reply `label` (then EOS) to each (judge prompt, label), through the chat template."""
    seqs = []
    for prompt, label in examples:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        p = tokenizer(text, add_special_tokens=False)["input_ids"]
        seqs.append((p, tokenizer(label + tokenizer.eos_token, add_special_tokens=False)["input_ids"]))
    T = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), T), -100)
    for i, (p, a) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.fixture(scope="module")
def vllm_judge(tmp_path_factory, template_file):
    """vLLM's OpenAI server on a tiny model that answers yes to the right sums of ROWS and no to wrong ones (and to
    whatever a random policy writes); yields its /v1 URL."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from scorers.judge import render
    from test_serve import openai_server
    root = tmp_path_factory.mktemp("vllm_judge")
    path = make_tiny_model(root / "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    examples = [(render(TEMPLATE, row, answer), label) for row in ROWS
                for answer, label in ((row["ground_truth"], "yes"), (str(int(row["ground_truth"]) + 1), "no"))]
    model = fit_judge(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer, examples)
    model.save_pretrained(path)
    with openai_server(path, log_path=root / "server.log") as client:
        yield str(client.base_url).rstrip("/")


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_vllm_server_scores_a_batch_and_its_failures_are_counted(vllm_judge, template_file):
    """Through vLLM's OpenAI server: the taught judge says yes to right sums and no to wrong ones; asked for a number
    instead (parser=number) every answer is unparseable, and given 1 ms every request times out: each an error."""
    from scorers.judge import Judge
    cfg = judge_config(vllm_judge, template_file, "reward.judge.max_tokens=4")
    judged = Judge(cfg.judge)(ROWS * 2, ["7", "12", "8", "11"])
    assert judged.answers == ["yes", "no", "no", "yes"] and judged.scores == [1.0, 0.0, 0.0, 1.0]
    cfg.judge.parser = "number"
    unparsed = Judge(cfg.judge)(ROWS, ["7", "11"])
    assert unparsed.errors == 2 and "no number in the judge's answer 'yes'" in unparsed.first_error
    cfg.judge.parser, cfg.judge.timeout_s, cfg.judge.max_retries = "yes_no", 0.001, 0
    slow = Judge(cfg.judge)(ROWS, ["7", "11"])
    assert slow.errors == 2 and "APITimeoutError" in slow.first_error


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_ppo_scored_by_a_vllm_judge_end_to_end(vllm_judge, workdir, template_file, tmp_path):
    """ppo.py with reward.type=judge against the local vLLM server: every step logs the judge's mean score and
    errors, validation is scored by it (beside the rule, val/rule_score/mean), and the sample table shows its
    answers in a judge column."""
    out = tmp_path / "out"
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", *ppo_args(workdir, out, vllm_judge, template_file)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = [m for m in read_metrics(out) if "score/mean" in m]
    assert len(train) == 2 and all({"reward/judge_score_mean", "reward/judge_errors"} <= set(m) for m in train)
    assert all(m["reward/judge_errors"] < 4 for m in train) and "val/rule_score/mean" in train[-1]
    assert "| score | judge" in proc.stdout
