"""Issue 48, classes 4, 5, 6 (the API key) and 7: the servers a run talks to fail loudly, early and safely.

The rollout server (rollout_kinds/server.py), the reward server (scorers/remote.py) and the judge (scorers/judge.py)
are each checked at start-up, before any model loads, with one request where one finds what step 1 would; every
answer is checked against what was asked (a server that is not exactly vLLM is one sentence naming it and what it
answered); every wait is bounded by a documented key, and a stop signal cuts it within that bound (exit 143 or 130,
the sentence saying why). The servers are stand-ins written here (http.server in a thread, as tests/test_judge.py's),
answering as their real counterparts do or as a broken one would; the runs are real ppo.py processes on a tiny model.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from conftest import arithmetic_run_folder, free_port, make_tiny_model, REPO

VOCAB = 200  # the vocabulary the Client tests check against (the tiny model's is config.json's vocab_size)


class StandIn(BaseHTTPRequestHandler):
    """A server whose answers the test picks by `mode` (a class attribute of the subclass `serve` makes). As vLLM's
    OpenAI-compatible server: GET /v1/models, POST /v1/completions (n choices, token ids in the tiny vocabulary and
    their log-probs), and 200 to the weight pushes. As a reward server (OpenRLHF's format): POST /reward answers
    {"rewards": [...]} for the start-up probe's one empty response, and a batch as `mode` says. As a judge: /v1/chat/
    completions. Modes: no_models, no_token_ids, fewer, outside_vocab, silent (accepts, never answers: GET and POST),
    silent_completions, slow_batches (a reward batch waits), huge (rewards of 1e300), html (a proxy's page)."""
    mode, seen = "ok", None

    def log_message(self, *args):
        pass

    def reply(self, answer, status=200, kind="application/json"):
        body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def hang(self):
        self.server.release.wait(120)  # the test's end releases it

    def do_GET(self):
        if self.mode == "silent":
            return self.hang()
        if self.mode == "html":
            return self.reply(b"<html>502 Bad Gateway</html>", kind="text/html")
        self.reply({"object": "list", "data": [] if self.mode == "no_models" else [{"id": "policy"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.server.seen.append((self.path, self.headers.get("Authorization"), body))
        if self.mode == "silent":
            return self.hang()
        if self.path == "/v1/completions":
            return self.completions(body)
        if self.path == "/reward":
            return self.rewards(body)
        if self.path == "/v1/chat/completions":
            return self.reply({"id": "1", "object": "chat.completion", "created": 0, "model": "judge", "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "yes"}}]})
        if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/collective_rpc", "/reset_prefix_cache"):
            return self.reply(b"Success", kind="text/plain")  # the weight pushes
        self.reply({"detail": "Not Found"}, status=404)

    def completions(self, body):
        if self.mode == "silent_completions":
            self.server.first_completion.set()
            return self.hang()
        tokens = [7 + (i % 50) for i in range(body["max_tokens"])]
        if self.mode == "outside_vocab":
            tokens[-1] = VOCAB + 1000
        choice = {"index": 0, "text": "", "token_ids": tokens, "logprobs": {"token_logprobs": [-1.0] * len(tokens)}}
        if self.mode == "no_token_ids":
            del choice["token_ids"]
        count = body["n"] - (self.mode == "fewer")
        self.reply({"id": "c", "object": "text_completion", "choices": [dict(choice, index=i) for i in range(count)]})

    def rewards(self, body):
        if self.mode == "html":
            return self.reply(b"<html>502 Bad Gateway</html>", kind="text/html")
        if self.mode == "huge":
            return self.reply({"rewards": [1e300] * len(body["query"])})
        if self.mode == "slow_batches" and body["responses"] != [""]:  # the start-up probe is answered at once
            self.server.first_batch.set()
            return self.hang()
        self.reply({"rewards": [0.5] * len(body["query"])})


@pytest.fixture
def serve():
    """serve(mode) → the url of a stand-in answering in that mode; all are stopped (hanging answers released) at the
    test's end."""
    servers = []

    def start(mode):
        server = ThreadingHTTPServer(("127.0.0.1", 0), type("Mode", (StandIn,), {"mode": mode}))
        server.daemon_threads, server.seen = True, []
        server.release, server.first_completion, server.first_batch = (threading.Event(), threading.Event(),
                                                                        threading.Event())
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        start.last = server
        return f"http://127.0.0.1:{server.server_address[1]}"
    yield start
    for server in servers:
        server.release.set()
        server.shutdown()
        server.server_close()


def config(*overrides):
    from infra.cli import load_config
    return load_config(os.path.join(REPO, "configs.yaml"), list(overrides))


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


# ---- class 4: the rollout server, checked at start-up and trusted for nothing


@pytest.mark.parametrize("overrides, message", [
    (["rollout.server.url=127.0.0.1:8000"],
     r"^rollout.server.url='127.0.0.1:8000' has no scheme: write it as http://127.0.0.1:8000 \(or https://\)$"),
    (["rollout.server.url={closed}"], r"^rollout.server.url=http://127.0.0.1:\d+: URLError: .*refused.*; start one"),
    (["rollout.server.url={silent}", "rollout.server.timeout_s=1"],
     r"^rollout.server.url=http://127.0.0.1:\d+: no answer within rollout.server.timeout_s=1 s; start one"),
    (["rollout.server.url={no_models}"],
     r"^rollout.server.url=http://127.0.0.1:\d+: GET /v1/models answered b'{\"object\": \"list\", \"data\": \[\]}', "
     r"not a list of models as vLLM's server answers"),
    (["rollout.server.cpus=4096"], r"^rollout.server.cpus='4096' names core\(s\) \[4096\] that this process cannot "
                                   r"run on \(it may use \["),
    (["rollout.server.cpus=3-1"], r"^rollout.server.cpus='3-1' names core\(s\) \[\] that this process cannot run on"),
    (["rollout.server.cpus=first"], r"^rollout.server.cpus='first' is not a list of cores such as 1, 0,2 or 2-3$"),
])
def test_the_rollout_servers_keys_are_checked_before_any_model_loads(serve, overrides, message):
    """rollout.check_rollout (ppo.py's first check, before anything loads) runs the server kind's check: a url
    without a scheme, where nothing listens, where something accepts but never answers (within
    rollout.server.timeout_s, not vLLM's 600 s), or a server serving no model; cpus that are no cores of this
    process. Each is one sentence naming the key; the silent one costs its timeout, no more."""
    from infra.config import ConfigError
    from rollout import check_rollout
    urls = {"closed": closed_port_url(), "silent": serve("silent"), "no_models": serve("no_models")}
    cfg = config("rollout.name=server", *(o.format(**urls) for o in overrides))
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        check_rollout(cfg)
    assert re.search(message, str(e.value)), str(e.value)
    assert time.monotonic() - start < 5


def test_a_bad_rollout_server_url_stops_ppo_before_the_policy_loads(tmp_path):
    """ppo.py with a url where nothing listens and a model.path that does not exist: the sentence is the url's
    (checked first, before the model folder, so before any model could load), exit 1, no traceback."""
    url = closed_port_url()
    proc = subprocess.run([sys.executable, "ppo.py", "--config", "configs.yaml", "rollout.name=server",
                           f"rollout.server.url={url}", f"model.path={tmp_path}/missing",
                           f"trainer.output_dir={tmp_path}/out"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"ppo.py: rollout.server.url={url}: URLError: ")


@pytest.mark.parametrize("mode, message", [
    ("no_token_ids", r"answered a completion with a choice without a list of token_ids \(answer: "),
    ("fewer", r"answered a completion with 1 choices for n=2 \(answer: "),
    ("outside_vocab", rf"answered a completion with token ids outside the policy's vocabulary of {VOCAB} "
                      rf"\(\[{VOCAB + 1000}\]\)"),
    ("silent_completions", r"^the rollout server at http://127.0.0.1:\d+/v1/completions: no answer within "
                           r"rollout.server.timeout_s=1 s$"),
])
def test_a_server_that_is_not_exactly_vllm_is_one_sentence_naming_it(serve, mode, message):
    """Client.complete checks each answer against what was asked: n choices, each with token ids in the policy's
    vocabulary and one log-prob per token; a server that accepts a request but never answers costs
    rollout.server.timeout_s. Each is a RunError (ppo.py prints it as one sentence, exit 1) naming the server."""
    from infra.runs import RunError
    from rollout_kinds.server import Client
    url = serve(mode)
    client = Client(url, 4, 1.0, VOCAB)
    body = {"model": "policy", "prompt": [1, 2, 3], "n": 2, "max_tokens": 4}
    start = time.monotonic()
    with pytest.raises(RunError) as e:
        client.complete([body, body])
    assert re.search(message, str(e.value)) and url in str(e.value), str(e.value)
    assert str(e.value).count("\n") == 0 and time.monotonic() - start < 5
    if mode != "silent_completions":
        assert str(e.value).startswith(f"the rollout server at {url} answered a completion with ")


def test_vllms_own_answers_pass_the_checks(serve):
    """The stand-in's answers as vLLM gives them: n choices of token ids and log-probs, in prompt order."""
    from rollout_kinds.server import Client
    body = {"model": "policy", "prompt": [1, 2, 3], "n": 2, "max_tokens": 3}
    assert Client(serve("ok"), 4, 5.0, VOCAB).complete([body, dict(body, n=1)]) == [
        [([7, 8, 9], [-1.0] * 3)] * 2, [([7, 8, 9], [-1.0] * 3)]]


def ppo_through(url, root, out, *overrides):
    return [sys.executable, "ppo.py", "--config", "configs.yaml", f"model.path={root}/model",
            f"data.train_files={root}/train.parquet", f"data.val_files={root}/val.parquet", "rollout.name=server",
            f"rollout.server.url={url}", "rollout.max_response_length=4", "data.max_prompt_length=128",
            "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2", "trainer.total_steps=2",
            "trainer.save_freq=0", "trainer.test_freq=0", "trainer.sample_freq=0", "trainer.val_before_train=false",
            "trainer.max_kl=0", "model.dtype=fp32", "rollout.dtype=fp32", "model.lora_rank=4",
            "model.target_modules=q_proj,v_proj", "algorithm.adv_estimator=grpo", "trainer.plot_curves=false",
            f"trainer.output_dir={out}", *overrides]


def start(cmd):
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return arithmetic_run_folder(tmp_path_factory.mktemp("serverfaults"), 8, 4)


def test_a_run_whose_server_answers_token_ids_outside_the_vocabulary_stops_in_one_sentence(serve, root, tmp_path):
    """ppo.py through a stand-in that answers as vLLM but for one token id beyond the policy's vocabulary (it used
    to index the embedding out of range, a traceback): exit 1, the last line of stderr the server's sentence."""
    url = serve("outside_vocab")
    vocab = json.loads((root / "model" / "config.json").read_text())["vocab_size"]
    proc = start(ppo_through(url, root, tmp_path / "out"))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith(
        f"ppo.py: the rollout server at {url} answered a completion with token ids outside the policy's vocabulary "
        f"of {vocab} ([{VOCAB + 1000}])")


# ---- class 5: a stop signal cuts every wait on a server within its stated bound


def test_a_second_sigint_while_running_ahead_stops_at_once(serve, root, tmp_path):
    """rollout.steps_ahead=1 through a server that never answers (rollout.server.timeout_s=120): Ctrl-C is noted,
    a second one stops the run at once: exit 130, its sentence last, within seconds, not after the generation
    thread's request times out (ThreadPoolExecutor's threads held the exit until then)."""
    url = serve("silent_completions")
    server = serve.last
    proc = start(ppo_through(url, root, tmp_path / "out", "rollout.steps_ahead=1", "rollout.server.timeout_s=120"))
    try:
        assert server.first_completion.wait(240), proc.stderr.read() if proc.poll() is not None else "no request"
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and time.monotonic() - stopped < 30, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ("ppo.py: stopped by SIGINT a second time, at once; the last checkpoint "
                                               "is kept: run the same command again to resume")
    assert "Traceback" not in stderr


def test_sigterm_during_a_slow_reward_server_exits_143_within_its_timeout(serve, root, tmp_path):
    """reward.sources=[remote] through a server that answers the start-up probe and then holds every batch: SIGTERM
    while step 1 waits on it stops the run reward.remote.timeout_s (3 s) after the signal, exit 143, with the stop
    sentence naming the server and the key; it used to wait out every retry, fail every sample and exit 1."""
    url = serve("ok")  # the rollout
    reward_url = serve("slow_batches") + "/reward"
    server = serve.last
    proc = start(ppo_through(url, root, tmp_path / "out", "reward.sources=[remote]", f"reward.remote.url={reward_url}",
                             "reward.remote.timeout_s=3", "reward.remote.max_retries=2", "reward.remote.backoff_s=1"))
    try:
        assert server.first_batch.wait(240), proc.stderr.read() if proc.poll() is not None else "no request"
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and time.monotonic() - stopped < 3 + 10, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"ppo.py: stopped by SIGTERM while a request to the reward server {reward_url} was still running 3 s later "
        f"(reward.remote.timeout_s); this step is not saved, the last checkpoint is kept: run the same command again "
        f"to resume")
    assert "Traceback" not in stderr


class SignalledAgo:
    """runs.StopSignal as it is `since` seconds after a SIGTERM."""

    def __init__(self, since):
        self.signum, self.since = signal.SIGTERM, time.monotonic() - since

    def overdue(self, seconds):
        from infra.runs import StopSignal
        return StopSignal.overdue(self, seconds)

    def check_overdue(self, seconds, what, key):
        from infra.runs import StopSignal
        StopSignal.check_overdue(self, seconds, what, key)


def test_a_stop_cuts_the_judges_requests_within_its_timeout(tmp_path):
    """The judge's requests (each retried) to an endpoint that lists its model and never answers a chat: after a
    SIGTERM they are cut reward.judge.timeout_s after the signal (runs.Interrupted, exit 143 in a run); without a
    signal the same requests are counted errors after their retries."""
    from infra.runs import Interrupted
    from scorers.judge import Judge
    silent_chat = type("SilentChat", (StandIn,), {"do_POST": StandIn.hang})
    server = ThreadingHTTPServer(("127.0.0.1", 0), silent_chat)
    server.daemon_threads, server.release = True, threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    template = tmp_path / "t.txt"
    template.write_text("Is {response} right?")
    try:
        cfg = config("reward.sources=[judge]", f"reward.judge.base_url=http://127.0.0.1:{server.server_address[1]}/v1",
                     f"reward.judge.prompt_template={template}", "reward.judge.parser=yes_no",
                     "reward.judge.timeout_s=1", "reward.judge.max_retries=3", "reward.judge.backoff_s=0.1")
        rows = [{"prompt": "q", "ground_truth": "1"}] * 2
        start_s = time.monotonic()
        with pytest.raises(Interrupted) as e:
            Judge(cfg.reward.judge, stop=SignalledAgo(since=0))(rows, ["a", "b"])
        assert 1 <= time.monotonic() - start_s < 3 and e.value.signum == signal.SIGTERM
        assert str(e.value) == (f"stopped by SIGTERM while a request to the judge {cfg.reward.judge.base_url} was "
                                f"still running 1 s later (reward.judge.timeout_s); this step is not saved, the last "
                                f"checkpoint is kept: run the same command again to resume")
        judged = Judge(cfg.reward.judge)(rows, ["a", "b"])
        assert judged.errors == 2 and "APITimeoutError" in judged.first_error
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


# ---- the reward server and the judge: one request at start-up, every answer checked


@pytest.mark.parametrize("where, message", [
    ("closed", r"got ConnectError: .*refused"),
    ("ok:/missing", r"got ServerError: HTTP 404: {\"detail\": \"Not Found\"}"),
    ("html:/reward", r"got ServerError: the answer is not JSON \(Expecting value: line 1 column 1 \(char 0\)\): "
                     r"b'<html>502 Bad Gateway</html>'"),
    ("huge:/reward", r"got ServerError: a reward is beyond reward.max_abs_score=1e\+06: \[1e\+300\]"),
    ("silent:/reward", r"got ReadTimeout: no answer within reward.remote.timeout_s=1 s"),
])
def test_the_reward_server_is_asked_once_at_start_up(serve, where, message):
    """rewards.check_reward_inputs (before any model loads) sends the reward server one sample, an empty response:
    nothing listening, a wrong path, a page that is not JSON, a reward beyond reward.max_abs_score and a server
    that never answers (within reward.remote.timeout_s) are each one sentence naming reward.remote.url."""
    from infra.config import ConfigError
    from rewards import check_reward_inputs
    if where == "closed":
        url = closed_port_url() + "/reward"
    else:
        mode, path = where.split(":")
        url = serve(mode) + path
    cfg = config("reward.sources=[remote]", f"reward.remote.url={url}", "reward.remote.timeout_s=1").reward
    start_s = time.monotonic()
    with pytest.raises(ConfigError) as e:
        check_reward_inputs(cfg)
    assert str(e.value).startswith(f"reward.remote.url={url}: one sample (an empty response) sent at start-up got ")
    assert re.search(message, str(e.value)) and time.monotonic() - start_s < 5, str(e.value)
    check_reward_inputs(config("reward.sources=[remote]", f"reward.remote.url={serve('ok')}/reward").reward)


def test_a_servers_reward_beyond_max_abs_score_is_an_error_for_its_samples():
    """read_rewards (every batch's answer): a finite but huge reward (1e300 would make every update non-finite) is
    beyond reward.max_abs_score, so its request's samples score 0 and count in reward/remote_errors."""
    from scorers.remote import read_rewards, ServerError
    assert read_rewards(b'{"rewards": [1.5, -2]}', 2, 1e6) == ([1.5, -2.0], {})
    for body in (b'{"rewards": [1.5, 1e300]}', b'{"rewards": [-2000001]}'):
        with pytest.raises(ServerError, match=r"a reward is beyond reward.max_abs_score="):
            read_rewards(body, len(json.loads(body)["rewards"]), 2e6 if b"2000001" in body else 1e6)
    with pytest.raises(ServerError, match="not all finite numbers"):
        read_rewards(b'{"rewards": [NaN]}', 1, 1e6)


def test_the_judge_is_refused_for_a_url_without_scheme_or_a_template_not_utf8(serve, tmp_path):
    """reward.judge.base_url without http(s):// is one sentence before any request; a prompt template that is not
    UTF-8 (Latin-1 here) is one sentence naming the file and the byte, not a UnicodeDecodeError."""
    from infra.config import ConfigError
    from scorers.judge import check_judge, read_template
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Réponse: {response}".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        read_template(str(latin1))
    assert str(e.value) == (f"reward.judge.prompt_template: {latin1} is not UTF-8 text (byte 0xe9 at offset 1); "
                            f"save it as UTF-8")
    good = tmp_path / "good.txt"
    good.write_text("Réponse: {response}", encoding="utf-8")
    assert read_template(str(good)) == "Réponse: {response}"
    cfg = config("reward.sources=[judge]", "reward.judge.base_url=127.0.0.1:8000/v1",
                 f"reward.judge.prompt_template={good}").reward.judge
    with pytest.raises(ConfigError, match=r"^reward.judge.base_url='127.0.0.1:8000/v1' has no scheme: write it as "
                                          r"http://127.0.0.1:8000/v1 \(or https://\)$"):
        check_judge(cfg)


# ---- class 6: the API key goes only over https or to this machine


def test_the_api_key_goes_only_over_https_or_to_this_machine():
    """key_may_go_to: https anywhere, and plain http to localhost or a loopback address; never plain http to another
    host, where anyone on the way could read it."""
    from scorers.judge import key_may_go_to
    assert all(key_may_go_to(u) for u in ("https://api.openai.com/v1", "http://127.0.0.1:8000/v1",
                                          "http://localhost:8000/v1", "http://127.3.2.1/v1", "http://[::1]:8000/v1"))
    assert not any(key_may_go_to(u) for u in ("http://api.example.com/v1", "http://192.0.2.7:8000/v1",
                                              "http://[fd00::2]:8000/v1", "http://127.0.0.1.example.com/v1"))


def test_the_judge_sends_the_key_where_it_may_and_says_so_at_start_up(serve, tmp_path, monkeypatch, capsys):
    """A judge on this machine gets the key in its Authorization header, and start-up says so in one line; the
    same judge reached at a non-loopback address of this machine over plain http gets "EMPTY" instead, and start-up
    says the key is not sent and why."""
    from scorers.judge import check_judge, Judge
    import socket
    template = tmp_path / "t.txt"
    template.write_text("Is {response} right?")
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", "sk-secret-1234")
    url = serve("ok")
    server = serve.last
    keys = ("reward.sources=[judge]", f"reward.judge.prompt_template={template}", "reward.judge.parser=yes_no",
            "reward.judge.api_key_env=JUDGE_KEY_FOR_TEST")
    cfg = config(*keys, f"reward.judge.base_url={url}/v1").reward.judge
    check_judge(cfg)
    assert capsys.readouterr().out == (f"judge: the API key in $JUDGE_KEY_FOR_TEST is sent to {url}/v1 (https or this "
                                       f"machine) only\n")
    Judge(cfg)([{"prompt": "q"}], ["a"])
    assert server.seen[-1][1] == "Bearer sk-secret-1234"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # an address of this machine that is not loopback
        try:
            s.connect(("192.0.2.255", 1))
            address = s.getsockname()[0]
        except OSError:
            address = None
    if address is None or address.startswith("127."):
        return  # this machine has no other address: the loopback half above is the test
    wide = ThreadingHTTPServer((address, 0), type("Wide", (StandIn,), {"mode": "ok"}))
    wide.daemon_threads, wide.seen, wide.release = True, [], threading.Event()
    threading.Thread(target=wide.serve_forever, daemon=True).start()
    try:
        far = f"http://{address}:{wide.server_address[1]}/v1"
        cfg = config(*keys, f"reward.judge.base_url={far}").reward.judge
        check_judge(cfg)
        assert capsys.readouterr().out == (
            f"judge: the API key in $JUDGE_KEY_FOR_TEST is NOT sent to {far}: it is plain http to another machine, "
            f"and a key goes only over https or to a loopback address (reward.judge.api_key_env)\n")
        Judge(cfg)([{"prompt": "q"}], ["a"])
        assert wide.seen[-1][1] == "Bearer EMPTY"
        assert not any("sk-secret" in json.dumps(seen) for seen in wide.seen)
    finally:
        wide.shutdown()
        wide.server_close()


# ---- class 7: what was still unclear


def test_a_config_key_with_an_invisible_character_is_shown_escaped_and_named(tmp_path):
    """A zero-width space in a key (from the command line or a file) is printed as \\u200b and named, so that the
    message does not read `unknown config key rollout.n; did you mean rollout.n?`."""
    from infra.cli import load_config
    from infra.config import ConfigError
    expected = ("unknown config key `rollout.n\\u200b`: it holds U+200B ZERO WIDTH SPACE, which may be invisible; "
                "did you mean `rollout.n`?")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.n\u200b=3"])
    assert str(e.value) == expected
    config_file = tmp_path / "c.yaml"
    config_file.write_text("rollout:\n  n\u200b: 3\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(str(config_file), [])
    assert str(e.value) == expected
    with pytest.raises(ConfigError, match=r"^unknown config key `rollout.nn`; did you mean `rollout.n`\?$"):
        load_config(None, ["rollout.nn=3"])


def test_the_teacher_is_refused_for_a_smaller_vocabulary_or_a_k1_loss(tmp_path):
    """check_teacher, before any model loads: a teacher whose tokenizer is the policy's but whose config.json
    vocab_size is smaller than the policy's (the policy may sample ids it has no row for: a traceback after both
    models loaded) is one sentence; so is mode=loss with k1, whose gradient is zero in expectation (TeacherConfig's
    docstring says to use k3): refused, not warned. k3 with mode=loss, and k1 with mode=reward, pass."""
    from infra.config import ConfigError
    from infra.models import check_teacher
    policy = make_tiny_model(tmp_path / "policy")
    small = make_tiny_model(tmp_path / "small")
    settings = json.loads((tmp_path / "small" / "config.json").read_text())
    vocab = settings["vocab_size"]
    (tmp_path / "small" / "config.json").write_text(json.dumps(dict(settings, vocab_size=vocab - 10)))
    model = SimpleNamespace(path=policy, tokenizer_path=None, trust_remote_code=False)
    teacher = config(f"algorithm.teacher.path={small}").algorithm.teacher
    with pytest.raises(ConfigError) as e:
        check_teacher(teacher, model)
    assert str(e.value) == (f"algorithm.teacher.path={small}: its config.json's vocab_size {vocab - 10} is smaller "
                            f"than the policy's {vocab}, so the policy can sample token ids the teacher has no "
                            f"log-probability for; distil from a teacher with at least the policy's vocab_size")
    same = make_tiny_model(tmp_path / "same", seed=1)
    with pytest.raises(ConfigError, match=r"^algorithm.teacher.mode=loss with algorithm.teacher.kl_estimator=k1: "
                                          r"k1's gradient is zero in expectation"):
        check_teacher(config(f"algorithm.teacher.path={same}", "algorithm.teacher.mode=loss").algorithm.teacher, model)
    check_teacher(config(f"algorithm.teacher.path={same}", "algorithm.teacher.mode=loss",
                         "algorithm.teacher.kl_estimator=k3").algorithm.teacher, model)
    check_teacher(config(f"algorithm.teacher.path={same}").algorithm.teacher, model)


SLOW_ENV = '''
import os, time

class Slow:
    """Each step takes 3 s (within rollout.multi_turn.env_timeout_s), after writing the file $SLOW_ENV_MARK."""

    def reset(self, row):
        pass

    def step(self, text):
        open(os.environ["SLOW_ENV_MARK"], "w").close()
        time.sleep(3)
        return {"observations": [{"role": "user", "content": "again"}], "reward": 1.0, "done": False}
'''


def test_sigterm_to_every_process_during_an_environment_step_is_a_stop_not_an_environment_failure(root, tmp_path):
    """SIGTERM to every process of a run (as Slurm sends it on preemption) while the environment's steps run: the
    episode processes leave it to the run (as the reward workers do), so the step ends with its episodes whole
    (agent/env_errors_share 0, no environment error on the console) and the run stops as a stop: a checkpoint,
    exit 143, its sentence last. The episode processes used to die of it, and the step's episodes were counted
    environment failures."""
    import psutil
    from conftest import read_metrics
    (tmp_path / "slow.py").write_text(SLOW_ENV)
    mark = tmp_path / "mark"
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", f"model.path={root}/model",
           f"data.train_files={root}/train.parquet", f"data.val_files={root}/val.parquet", "rollout.name=hf",
           "rollout.max_response_length=4", "data.max_prompt_length=128", "data.train_batch_size=2", "rollout.n=2",
           "actor.ppo_mini_batch_size=2", "trainer.total_steps=3", "trainer.save_freq=0", "trainer.test_freq=0",
           "trainer.val_before_train=false", "trainer.max_kl=0", "model.dtype=fp32", "model.lora_rank=4",
           "model.target_modules=q_proj,v_proj", "algorithm.adv_estimator=grpo", "trainer.plot_curves=false",
           f"trainer.output_dir={tmp_path}/out", "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=2",
           f"rollout.multi_turn.env={tmp_path}/slow.py:Slow"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", SLOW_ENV_MARK=str(mark)))
    try:
        deadline = time.monotonic() + 240
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # every episode is in its step
        family = psutil.Process(proc.pid).children(recursive=True)
        assert any("episodes.py" in " ".join(p.cmdline()) for p in family)
        for p in [psutil.Process(proc.pid), *family]:
            p.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    assert stdout.strip().splitlines()[-1].startswith("stopped by SIGTERM after step 1, checkpoint saved"), stdout
    steps = [m for m in read_metrics(tmp_path / "out") if m["step"] > 0]
    assert [m["step"] for m in steps] == [1] and steps[0]["agent/env_errors_share"] == 0, steps
    assert "killed by SIGTERM" not in stderr and "Traceback" not in stderr, stderr[-3000:]
