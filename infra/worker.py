"""A user's function run in worker processes of its own, with a time limit on each call and a bound on each batch, so
that a call that hangs, exits or kills its process is an error for that call only, and a function that hangs on
every call costs its batch seconds, not one timeout per call. rewards.py runs a custom reward.function here; the
built-in rules stay in the training process (they are the library's own code, and bounded).

    worker = FunctionWorker("my_reward.py", "compute_score", timeout_s=30, pool=Pool(max_concurrency=8,
                            max_timeouts=8))  # starts the processes, imports the file in each; may raise
    results = worker.call_all([dict(data_source=…, solution_str=…, ground_truth=…, extra_info=…), …])
    # one per call: what the function returned, or a CallFailed (it raised, timed out, ended its process, not run)

How a call is bounded: in its worker, a timer (SIGALRM) interrupts a call still running after timeout_s, and an
`async def` function's calls, run together as verl's reward loop runs them, are each cancelled after timeout_s; a
call stuck where neither reaches (inside C code) gets no answer, and the parent kills its worker GRACE_S later.
How a batch is bounded: pool.max_concurrency workers run its calls at once (each runs a sync function's
calls one at a time; an async function's batch is shared out among them), and once pool.max_timeouts calls have
timed out the calls not yet started fail unrun, so a function that hangs on every call ends its batch within
hung_batch_s. A worker that dies or is killed is started again for the calls after it, at most MAX_LOST times a
batch. The first timeout of a batch, and the limit when it is reached, are printed as they happen, by every process
(each has its own workers).

The worker's program is infra/worker_program.py (`python infra/worker_program.py FD`): it imports the standard
library, this file and the user's file only, so a (re)start takes ~0.1 s instead of the ~2.5 s that importing the
library (torch) takes.
"""
import importlib.util
import inspect
import math
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Optional

GRACE_S = 2.0  # after timeout_s without an answer, how long the parent still waits before it kills the worker
MAX_LOST = 3  # workers lost (hung or dead) per process of the pool in a batch before its queued calls fail unrun
START_S = 10.0  # the least time a worker gets to start and import the file (an interpreter on a busy machine: ~1 s)
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_program.py")  # what a worker runs


class CallFailed(Exception):
    """A call that failed in the worker, or was not run; its message reads "<ExceptionType>: <message>"."""


class WorkerStartError(Exception):
    """The worker could not import the file or find the function; the message says which."""


@dataclass(frozen=True)
class Pool:
    """How a FunctionWorker runs a batch. `key`: the config section its messages name (reward.timeout_s …)."""
    max_concurrency: int = 1  # worker processes, running calls at once
    max_timeouts: int = 0  # timed-out calls after which a batch's calls not yet started fail unrun; 0 = no limit
    key: str = "reward"


def hung_batch_s(timeout_s: float, pool: Pool, calls: int) -> float:
    """The longest a batch of `calls` takes when every call hangs: rounds of max_concurrency calls at once, each
    ended by timeout_s + GRACE_S, until max_timeouts of them have timed out (a call the timer ends keeps its worker;
    a killed worker's restart, ~0.1 s plus the user's imports, comes on top from the second round on)."""
    return math.ceil(min(calls, pool.max_timeouts or calls) / pool.max_concurrency) * (timeout_s + GRACE_S)


@dataclass
class Slot:
    """One worker process, and the calls of the batch it runs now: {position in what it was sent: the call's index}
    for those not answered yet (empty when idle), due by `deadline` (time.monotonic())."""
    proc: subprocess.Popen
    conn: Connection
    stop: weakref.finalize  # stop_process(proc, conn), once: at close, or when this process exits
    deadline: float
    ready: bool = False  # it has imported the function
    job: dict = field(default_factory=dict)

    def kill(self) -> None:
        """Stop it now, in whatever call: it is hung, or its calls are given up on."""
        self.proc.kill()
        self.stop()


@dataclass
class Batch:
    """A call_all in progress: each call's result (None until it has one), the shares not yet sent, the calls timed
    out and workers lost so far, and why the shares still queued fail unrun (None: they run)."""
    calls: list
    results: list
    queue: deque
    timeouts: int = 0
    lost: int = 0
    not_run: Optional[str] = None


class FunctionWorker:
    """pool.max_concurrency persistent worker processes for the function `name` of the file `path`, each call limited
    to timeout_s. `stop`: an object whose check_overdue(seconds) raises when a stop signal came more than `seconds`
    ago (runs.StopSignal), or None."""

    def __init__(self, path: str, name: str, timeout_s: float, stop=None, pool: Pool = Pool()):
        self.path, self.name, self.timeout_s, self.stop, self.pool = path, name, timeout_s, stop, pool
        self.slots, self.is_async = [self.spawn() for _ in range(pool.max_concurrency)], None  # importing together
        self.params = []  # the function's parameter names, "**" where it takes **kwargs (parameters)
        while not all(slot.ready for slot in self.slots):
            i, message = self.next_answer(f"the import of {path}")
            if message[0] != "ready":
                self.close()
                raise WorkerStartError(message[1])
            self.slots[i].ready, self.slots[i].deadline, self.is_async = True, math.inf, message[1]
            self.params = message[2]

    @property
    def proc(self) -> Optional[subprocess.Popen]:
        """The first worker's process (None once stopped)."""
        return self.slots[0].proc if self.slots[0] is not None else None

    def spawn(self) -> Slot:
        """A new worker, which imports the function and says so ("ready") within timeout_s (at least START_S)."""
        mine, theirs = Pipe()
        proc = subprocess.Popen([sys.executable, PROGRAM, str(theirs.fileno())], pass_fds=(theirs.fileno(),))
        theirs.close()
        mine.send({"path": self.path, "name": self.name, "sys_path": sys.path, "key": self.pool.key})
        deadline = time.monotonic() + max(self.timeout_s, START_S)
        return Slot(proc, mine, weakref.finalize(self, stop_process, proc, mine), deadline)

    def next_answer(self, what: str) -> tuple[int, tuple]:
        """(slot index, message) of the next busy or starting worker to answer, waiting no later than the earliest
        deadline (and stop.check_overdue); the message is ("lost", reason, timed out?) when that worker ended or is
        overdue (take then stops it)."""
        key = self.pool.key
        while True:
            if self.stop is not None:
                try:
                    self.stop.check_overdue(self.timeout_s)
                except BaseException:
                    self.close(now=True)
                    raise
            waiting = {slot.conn: i for i, slot in enumerate(self.slots) if slot and (slot.job or not slot.ready)}
            first = min(waiting.values(), key=lambda i: self.slots[i].deadline)
            ready = wait(list(waiting), timeout=max(0.0, min(self.slots[first].deadline - time.monotonic(), 0.2)))
            if ready:
                i = waiting[ready[0]]
                try:
                    return i, self.slots[i].conn.recv()
                except (EOFError, OSError):
                    return i, ("lost", f"WorkerDied: the {key} worker ended ({exit_reason(self.slots[i].proc)}) "
                                       f"during {what}", False)
            if time.monotonic() >= self.slots[first].deadline:
                limit = (f"{key}.timeout_s={self.timeout_s:g} s" if self.slots[first].ready else
                         f"{max(self.timeout_s, START_S):g} s")
                return first, ("lost", f"TimeoutError: {what} took longer than {limit}, and its worker was stopped",
                               self.slots[first].ready)

    def call_all(self, calls: list[dict]) -> list:
        """fn(**kwargs) for each call, in the workers: its result, or a CallFailed. A sync function's calls go one at
        a time to each worker, and a lost worker is blamed on the call it was running; an async function's calls are
        shared out among the workers at once, and a lost worker fails all of its share that had not answered."""
        share = max(1, math.ceil(len(calls) / len(self.slots))) if self.is_async else 1
        batch = Batch(calls, [None] * len(calls), deque(list(range(start, min(start + share, len(calls))))
                                                        for start in range(0, len(calls), share)))
        while self.dispatch(batch):
            self.take(batch, *self.next_answer("this call"))
        for i, slot in enumerate(self.slots):  # workers lost or stopped start again now, ready by the next batch
            if slot is None:
                self.slots[i] = self.spawn()
        return batch.results

    def dispatch(self, batch: Batch) -> bool:
        """Stop the batch once it has a reason (stop_batch), start lost workers again and give each idle one the
        next share; False when nothing is running."""
        self.stop_batch(batch)
        for i, slot in enumerate(self.slots):
            if batch.queue and slot is None:
                self.slots[i] = self.spawn()  # after a lost worker
            elif batch.queue and slot.ready and not slot.job:
                share = batch.queue.popleft()
                slot.job, slot.deadline = dict(enumerate(share)), time.monotonic() + self.timeout_s + GRACE_S
                try:
                    slot.conn.send(([batch.calls[j] for j in share], self.timeout_s))
                except OSError:
                    pass  # the worker is gone: next_answer says how
        # a worker still starting is waited for only while there are calls for it; next_answer takes its "ready" later
        return any(slot is not None and (slot.job or (batch.queue and not slot.ready)) for slot in self.slots)

    def stop_batch(self, batch: Batch) -> None:
        """Once pool.max_timeouts calls have timed out, every call not yet answered fails: those queued unrun, those
        running stopped with their workers (so that the batch ends now: hung_batch_s); once MAX_LOST workers per
        process were lost, the queued ones fail unrun. Said on the console at once."""
        key, limit, t = self.pool.key, self.pool.max_timeouts, self.timeout_s
        if batch.not_run is None and limit and batch.timeouts >= limit:
            batch.not_run = (f"NotRun: the batch stopped after {batch.timeouts} of its calls took longer than "
                             f"{key}.timeout_s={t:g} s ({key}.max_timeouts={limit})")
            running = [i for i, slot in enumerate(self.slots) if slot and slot.job]
            left = sum(map(len, batch.queue)) + sum(len(self.slots[i].job) for i in running)
            for i in running:
                for j in self.slots[i].job.values():
                    batch.results[j] = CallFailed(batch.not_run)
                self.slots[i].kill()
                self.slots[i] = None
            if left:
                warn(f"{batch.timeouts} {key} calls of this batch took longer than {key}.timeout_s={t:g} s "
                     f"({key}.max_timeouts={limit}): its other {left} calls are not run, each an error")
        if batch.not_run is None and batch.lost >= MAX_LOST * len(self.slots):
            batch.not_run = (f"WorkerDied: not run, the {key} worker was lost {batch.lost} times in this batch (a call "
                             f"hung past {key}.timeout_s or ended the process)")
        while batch.queue and batch.not_run:
            for j in batch.queue.popleft():
                batch.results[j] = CallFailed(batch.not_run)

    def take(self, batch: Batch, i: int, message: tuple) -> None:
        """Note worker i's message: ready, a call's result ("ok", "error" or "timeout"), or that it could not import
        the file again or was lost (stopped here; the calls it had not answered fail)."""
        slot, kind = self.slots[i], message[0]
        if kind == "ready":
            slot.ready, slot.deadline = True, math.inf
        elif kind == "result":
            _, position, status, value = message
            batch.results[slot.job.pop(position)] = value if status == "ok" else CallFailed(value)
            self.count_timeouts(batch, status == "timeout")
            if not slot.job:
                slot.deadline = math.inf
        else:  # "error" (a restarted worker could not import the file) or "lost"
            for j in slot.job.values():
                batch.results[j] = CallFailed(message[1])
            self.count_timeouts(batch, len(slot.job) if kind == "lost" and message[2] else 0)
            if not slot.ready:
                batch.not_run = f"WorkerDied: the {self.pool.key} worker could not start again: {message[1]}"
            batch.lost += 1
            slot.kill()
            self.slots[i] = None

    def count_timeouts(self, batch: Batch, new: int) -> None:
        """Add `new` timed-out calls to the batch's count; the first is said on the console at once."""
        if new and not batch.timeouts:
            limit = self.pool.max_timeouts
            warn(f"a {self.pool.key} call took longer than {self.pool.key}.timeout_s={self.timeout_s:g} s, an error "
                 f"for its sample" + (f"; after {limit} such calls in a batch ({self.pool.key}.max_timeouts) the "
                                      f"batch's calls not yet started are not run" if limit else ""))
        batch.timeouts += new

    def close(self, now: bool = False) -> None:
        """Stop the workers (each killed if it does not leave at once, or `now`); the next call_all starts new ones."""
        for i, slot in enumerate(self.slots):
            if slot is not None and now:
                slot.kill()
            elif slot is not None:
                slot.stop()
            self.slots[i] = None


def warn(message: str) -> None:
    """A warning printed at once, by every process that has one (naming the process where there are several)."""
    rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    print(f"warning{f' (process {rank})' if rank else ''}: {message}", file=sys.stderr, flush=True)


def stop_process(proc: subprocess.Popen, conn: Connection) -> None:
    conn.close()  # the worker leaves on end-of-file between calls
    try:
        proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def exit_reason(proc: subprocess.Popen) -> str:
    """How a worker that closed its end ended: "exit code 3", "killed by SIGKILL"."""
    try:
        code = proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return "it closed its connection"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


# ---------------------------------------------------------------------------------------
# The user's file, read in the worker programs (infra/worker_program.py, agents/episodes.py): its function and the
# names of its parameters (by which rewards.py tells its calling convention)


def import_function(path: str, name: str, dicts: bool = False):
    """The function `name` of the file at `path` (name defaults to compute_score upstream, as in verl), its module
    registered in sys.modules so that pickle finds what it defines; WorkerStartError saying what is wrong. dicts: a
    dict is accepted too (a dict of environments, agents/peers.py)."""
    module_name = "custom_reward_" + re.sub(r"\W", "_", os.path.splitext(os.path.abspath(path))[0])
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # SystemExit at import too
        raise WorkerStartError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn) and not (dicts and isinstance(fn, dict)):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise WorkerStartError(f"{path} has no function `{name}`; callables found there: {found}")
    return fn


def parameters(fn) -> list[str]:
    """fn's parameter names, and "**" where it takes **kwargs ([] where Python cannot read its signature): rewards.py
    tells a reward function's calling convention by them."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [("**" if p.kind is p.VAR_KEYWORD else p.name) for p in params if p.kind is not p.VAR_POSITIONAL]
