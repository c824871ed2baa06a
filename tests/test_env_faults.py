"""Environments, tools and step rewards that fail, lie or grow (issue 48, classes 1–3 and 6's environment points):
a source failing on every sample stops the rollout in one sentence naming it and its first error, a partial failure
is a console line; what crosses from an episode's process is plain values, its rewards finite and within
reward.max_abs_score; messages, step rewards and rollout.val_n are bounded before the expensive work; a message's
role is one the chat template knows; what a tool or an environment starts, in a new session too, ends with the run.
The model is the scripted stand-in of tests/test_agent.py.
"""
import math
import subprocess
import warnings

import pytest

from conftest import as_rows, make_tokenizer
from infra.config import ConfigError
from test_agent import chat, question, ScriptedBackend
from test_environments import rows_of

FILE = '''
import math, subprocess, sys
from agents.environments import Step

class Point:
    """A user's own class: the trainer cannot import this file, so pickle cannot carry it there."""
    def __init__(self, x, y):
        self.x, self.y = x, y
    def __str__(self):
        return f"Point({self.x}, {self.y})"

class Unprintable:
    def __str__(self):
        raise RuntimeError("no text for you")

def point(text):
    return Point(1, 2)

def unprintable(text):
    return Unprintable()

def echo(text):
    return text

def broken(text):
    raise ValueError("this tool is broken")

DAEMON = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(300)"

def daemon(path):
    """Starts a process in a session of its own, which writes its pid to `path` and outlives the call unless
    someone ends it."""
    subprocess.Popen([sys.executable, "-c", DAEMON, path], start_new_session=True)
    return "started"

class Daemons:
    """An environment whose step starts such a process by a double fork (its parent exits at once)."""
    def reset(self, row):
        self.path = row["extra_info"]["path"]
    def step(self, text):
        subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                        "sys.argv[1], sys.argv[2]], start_new_session=True)", DAEMON, self.path], check=True)
        return Step([{"role": "user", "content": "again"}], reward=1.0, done=True)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("env_faults")
    (root / "faults.py").write_text(FILE)
    return root


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def tool_rollout(tokenizer, files, tools, script, max_turns=2):
    from agents.multi_turn import AgentRollout, PARSERS, TurnSettings
    from agents.tools import ToolEnvironment
    environment = ToolEnvironment([f"{files}/faults.py:{t}" for t in tools], PARSERS["tag"], 5.0, 200, 4)
    backend = ScriptedBackend(tokenizer, lambda context, j: script if "tool" not in context else "done")
    return AgentRollout(backend, tokenizer, TurnSettings(max_turns, 2000, 64, environment))


def test_a_tool_answer_of_the_users_own_class_reaches_the_model_as_its_text(tokenizer, files):
    """REGRESSION: a tool answering an object of a class its file defines (which the trainer cannot import) killed
    the run with ModuleNotFoundError from unpickling; it is converted to its str() in the call's process, and an
    object whose __str__ raises answers a sentence saying so, the run going on."""
    ro_ = tool_rollout(tokenizer, files, ["point", "unprintable", "echo"],
                       "<point>x</point><unprintable>x</unprintable><echo>a</echo>")
    try:
        ro = ro_.generate(as_rows([chat(tokenizer, question(1, 2))]), 1, 1.0)
    finally:
        ro_.close()
    results = ro.conversations[0]["tool_results"]
    assert results[0] == "Point(1, 2)" and results[2] == "a"
    assert results[1].startswith("error: ") and "Unprintable" in results[1] and "no text for you" in results[1]


def alive(pid: int) -> bool:
    """Is `pid` a live process (not a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_file(path, seconds: float = 10.0) -> int:
    import time
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


def test_processes_a_tool_or_an_environment_starts_in_a_new_session_end_with_the_run(tokenizer, files, tmp_path):
    """A tool and an environment start processes that leave the worker's process group (start_new_session; a
    double fork whose middle process exits): each wrote its pid, and once the rollouts are closed neither is
    alive, nor any other process listed with their command line."""
    from test_environments import env_rollout
    tools = tool_rollout(tokenizer, files, ["daemon"], f"<daemon>{tmp_path}/tool.pid</daemon>")
    env = env_rollout(tokenizer, f"{files}/faults.py:Daemons", max_turns=2)
    try:
        tools.generate(as_rows([chat(tokenizer, question(1, 2))]), 1, 1.0)
        env.generate(rows_of(tokenizer, [{"path": f"{tmp_path}/env.pid"}]), 1, 1.0)
        pids = [wait_for_file(tmp_path / "tool.pid"), wait_for_file(tmp_path / "env.pid")]
    finally:
        tools.close()
        env.close()
    assert [alive(pid) for pid in pids] == [False, False]
    out = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout
    assert [line for line in out.splitlines() if str(tmp_path) in line and line.split()[1][0] != "Z"] == []
