"""Issue 32: a stop is always clean, a hung reward costs seconds not hours, and no run hides that it learnt nothing.

A reward function that hangs on every call ends its batch within the bound its config states (infra/worker.py:
a pool of reward.max_concurrency workers, reward.max_timeouts); a worker whose parent is gone (two signals, SIGKILL,
a killed rank) leaves at once with nothing on stderr; a score beyond reward.max_abs_score is an error for its
sample; a judge that answers garbage or goes away is a counted error. The runs are real `ppo.py` processes on a tiny
model, and `leftovers` (conftest.py) lists every process they leave behind. (A run whose every step was skipped:
tests/test_ppo.py, tests/test_recovery.py; a branch that keeps its config: tests/test_faults.py.)
"""
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import free_port, processes_tagged, REPO
from test_faults import write
from test_ppo import base_args, workdir  # noqa: F401 (workdir is a fixture)

HANGS = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(1000)

def pid(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.3)
    return {"score": 1.0, "pid": float(os.getpid())}

def huge(data_source, solution_str, ground_truth, extra_info=None):
    return 1e308  # finite in Python, inf once a float32 tensor
"""


def calls(n):
    return [dict(data_source="x", solution_str=str(i), ground_truth="1") for i in range(n)]


# ---- a hung reward costs its batch seconds, not one timeout per call


def test_a_reward_that_hangs_on_every_call_ends_its_batch_within_the_stated_bound(tmp_path, capfd):
    """With the defaults (reward.timeout_s 30, max_concurrency 8, max_timeouts 8) a function that hangs on every call
    ends a batch of 16 within hung_batch_s, 32 s, under a minute (it was 16 × 30 s). Measured with the default pool
    and timeout_s=0.5: the batch ends within hung_batch_s(0.5, …) (2.5 s), the first 8 calls time out, the other 8
    fail unrun, the console says so as it happens, and scoring the batch stops the run (every sample failed)."""
    from infra.config_rl import RewardConfig
    from infra.worker import FunctionWorker, hung_batch_s, Pool
    import rewards
    defaults = RewardConfig()
    pool = Pool(defaults.max_concurrency, defaults.max_timeouts)
    assert hung_batch_s(defaults.timeout_s, pool, 16) < 60
    worker = FunctionWorker(str(write(tmp_path / "r.py", HANGS)), "compute_score", 0.5, pool=pool)
    try:
        start = time.perf_counter()
        results = worker.call_all(calls(16))
        assert time.perf_counter() - start < hung_batch_s(0.5, pool, 16)
        assert sorted({str(r) for r in results}) == [
            "NotRun: the batch stopped after 8 of its calls took longer than reward.timeout_s=0.5 s "
            "(reward.max_timeouts=8)", "TimeoutError: this call took longer than reward.timeout_s=0.5 s"]
        assert sum(str(r).startswith("TimeoutError") for r in results) == 8
        assert capfd.readouterr().err.splitlines() == [
            "warning: a reward call took longer than reward.timeout_s=0.5 s, an error for its sample; after 8 such "
            "calls in a batch (reward.max_timeouts) the batch's calls not yet started are not run",
            "warning: 8 reward calls of this batch took longer than reward.timeout_s=0.5 s (reward.max_timeouts=8): "
            "its other 8 calls are not run, each an error"]
        rows = [{"data_source": "x", "ground_truth": "1", "extra_info": {}}] * 4
        with pytest.raises(rewards.RewardError, match="the reward function failed on all 4 samples of a batch"):
            rewards.score_responses(worker, rows, ["a", "b", "c", "d"])
    finally:
        worker.close()


def test_calls_run_in_max_concurrency_processes_and_a_batch_without_a_limit_times_out_each(tmp_path):
    """8 calls of 0.3 s with max_concurrency=4 run in 4 worker processes (none of them this one), every result in
    its call's place; with max_timeouts=0 every hanging call waits out its own timeout, none fails unrun."""
    from infra.worker import FunctionWorker, Pool
    path = str(write(tmp_path / "r.py", HANGS))
    worker = FunctionWorker(path, "pid", 5, pool=Pool(max_concurrency=4))
    try:
        results = worker.call_all(calls(8))
        assert all(r["score"] == 1.0 for r in results)
        assert len({r["pid"] for r in results}) == 4 and os.getpid() not in {r["pid"] for r in results}
    finally:
        worker.close()
    worker = FunctionWorker(path, "compute_score", 0.3, pool=Pool(max_concurrency=2, max_timeouts=0))
    try:
        assert [str(r) for r in worker.call_all(calls(4))] == [
            "TimeoutError: this call took longer than reward.timeout_s=0.3 s"] * 4
    finally:
        worker.close()


def test_a_score_beyond_max_abs_score_or_not_finite_is_an_error_and_all_of_them_stop_the_run(tmp_path):
    """|score| > reward.max_abs_score (or inf, NaN) is an error for its sample, scored 0 and counted; a reward of
    1e308 on every sample (inf as float32: every step used to be skipped, exit 0) stops the run in one sentence."""
    import rewards
    from infra.reward_calls import as_score
    assert as_score(-1e6, 1e6) == (-1e6, {})
    for bad, message in [(2e6, "the reward is 2e+06, beyond reward.max_abs_score=1e+06"),
                         ({"score": -3e7}, "the reward is -3e+07, beyond reward.max_abs_score=1e+06"),
                         (math.inf, "the reward is inf, not a finite number")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            as_score(bad, 1e6)
    rows = [{"data_source": "x", "ground_truth": "1", "extra_info": {}}]
    worker = rewards.load_reward_function(f"{write(tmp_path / 'r.py', HANGS)}:huge", 5)
    try:
        assert rewards.score_responses(worker, rows, ["a"], math.inf) == ([1e308], {}, 0)
        with pytest.raises(rewards.RewardError) as e:
            rewards.score_responses(worker, rows * 3, ["a", "b", "c"], 1e6)
    finally:
        worker.close()
    assert str(e.value) == ("the reward function failed on all 3 samples of a batch, so training would learn from "
                            "zeros; the first error: ValueError: the reward is 1e+308, beyond "
                            "reward.max_abs_score=1e+06")


# ---- a worker whose parent is gone leaves at once, quietly

PARENT = """
import sys
sys.path.insert(0, {repo!r})
from infra.worker import FunctionWorker
worker = FunctionWorker({path!r}, "slow", 30)
try:
    worker.call_all([{{}}] * 2)
except KeyboardInterrupt:
    sys.exit(130)  # as ppo.py leaves on a second Ctrl-C, its workers' finalisers closing their pipes
"""
SLOW = """
import time
def slow():
    open({marker!r}, "w").close()
    time.sleep(0.2)  # ends within the 0.5 s that a closing parent waits before it kills the worker
    print("still printing", flush=True)  # into the parent's stdout, which nobody reads any more
    return 1.0
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["interrupted", "killed"])
def test_a_worker_whose_parent_is_gone_leaves_at_once_without_a_traceback(tmp_path, leftovers, sig):
    """The parent interrupted in a call (its pipe closed: the worker's answer used to end in two chained
    BrokenPipeError tracebacks) or killed by SIGKILL: the worker, finishing its call, leaves within a couple of
    seconds and prints nothing on stderr."""
    marker = tmp_path / "calling"
    write(tmp_path / "r.py", SLOW.format(marker=str(marker)))
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(repo=REPO, path=str(tmp_path / "r.py"))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert processes_tagged(leftovers.tag), "the worker did not start"
    parent.send_signal(sig)
    parent.stdout.close()  # the worker's stdout now leads nowhere
    _, stderr = parent.communicate(timeout=30)
    assert parent.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL)
    assert leftovers.after(5) == [] and stderr == ""


# ---- a real run stopped twice, or losing a process, leaves no traceback and no process

SLOW_VALIDATION = """
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    open({marker!r}, "w").close()
    time.sleep(0.4)
    return 1.0
"""


def start_validating(workdir, tmp_path, *overrides, launcher=(sys.executable,)):  # noqa: F811
    """ppo.py (under `launcher`) in a session of its own, waiting until its reward workers are scoring the
    validation before training; returns (process, out)."""
    marker, out = tmp_path / "validating", tmp_path / "out"
    reward = write(tmp_path / "r.py", SLOW_VALIDATION.format(marker=str(marker)))
    cmd = [*launcher, "ppo.py", "--config", "configs.yaml", *base_args(workdir, out),
           f"reward.function={reward}:compute_score", "trainer.val_before_train=true", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    return proc, out


@pytest.mark.parametrize("rollout", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_two_signals_in_validation_end_in_one_sentence_and_no_process(workdir, tmp_path, leftovers,  # noqa: F811
                                                                      rollout):
    """Ctrl-C (to the whole process group, as a terminal sends it), then SIGTERM (Slurm's preemption; the two are
    one handler) while the reward workers score the first validation: exit 143, the run's sentence is the last line
    of stderr, no traceback (the workers still in a call used to add two), and no process is left: no reward
    worker, and with rollout.name=vllm nothing the engine started."""
    proc, out = start_validating(workdir, tmp_path, f"rollout.name={rollout}")
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ("ppo.py: stopped by SIGTERM a second time, at once; the last "
                                               "checkpoint is kept: run the same command again to resume")
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr
    assert leftovers.after(5) == []
    assert not any(name.startswith(("step_", "final")) for name in os.listdir(out))


def test_killing_rank_1_of_two_leaves_no_worker_traceback_and_no_process(workdir, tmp_path, leftovers):  # noqa: F811
    """Rank 1 killed by SIGKILL while both ranks' reward workers score the first validation: the run fails, rank
    1's workers (their parent gone) and rank 0's leave without a word (no BrokenPipeError, nothing from
    infra/worker.py or infra/worker_program.py on stderr), and no process of the run is left."""
    from test_faults import pid_of_rank
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp_cpu.yaml",
                "--num_processes", "2", "--main_process_port", str(free_port())]
    proc, out = start_validating(workdir, tmp_path, launcher=launcher)
    os.kill(pid_of_rank(1, str(out)), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "BrokenPipeError" not in stderr and "infra/worker" not in stderr, stderr[-3000:]
    assert leftovers.after(10) == []


# ---- a judge that answers garbage or goes away is a counted error


class GarbageJudge(BaseHTTPRequestHandler):
    """/v1/models lists "judge"; /v1/chat/completions answers what the prompt's response asks for: "html" a 200
    page that is not JSON, "empty" JSON without choices, "close" nothing (the connection is dropped)."""

    def log_message(self, *args):
        pass

    def send(self, body: bytes, kind="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.send(json.dumps({"object": "list", "data": [{"id": "judge", "object": "model", "created": 0,
                                                           "owned_by": "x"}]}).encode())

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"][-1]["content"]
        if "html" in prompt:
            self.send(b"<html>502 Bad Gateway</html>", "text/html")
        elif "empty" in prompt:
            self.send(json.dumps({"id": "1", "object": "chat.completion", "created": 0, "model": "judge"}).encode())
        elif "close" in prompt:
            self.close_connection = True
        else:
            self.send(json.dumps({"id": "1", "object": "chat.completion", "created": 0, "model": "judge", "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "yes"}}]}).encode())


def test_a_judge_that_answers_garbage_or_goes_away_is_a_counted_error(tmp_path):
    """A page that is not JSON, JSON without choices, a dropped connection: each an error for its sample alone
    (scored 0, counted), the good answer scored; once the server is gone, every sample is an error within the
    retries, never a hang or a traceback."""
    from infra.cli import load_config
    from scorers.judge import Judge
    server = ThreadingHTTPServer(("127.0.0.1", 0), GarbageJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    template = write(tmp_path / "t.txt", "Is {response} right?")
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    cfg = load_config(None, ["reward.type=judge", f"reward.judge.base_url={url}",
                             f"reward.judge.prompt_template={template}", "reward.judge.parser=yes_no",
                             "reward.judge.timeout_s=5", "reward.judge.max_retries=1",
                             "reward.judge.backoff_s=0.05"]).reward.judge
    judge = Judge(cfg)
    rows = [{"prompt": "q", "ground_truth": "1"}] * 4
    judged = judge(rows, ["html", "empty", "close", "fine"])
    assert judged.scores == [0.0, 0.0, 0.0, 1.0] and judged.errors == 3
    server.shutdown()
    server.server_close()
    start = time.monotonic()
    judged = judge(rows[:2], ["fine", "fine"])
    assert judged.errors == 2 and "APIConnectionError" in judged.first_error and time.monotonic() - start < 10
