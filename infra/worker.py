"""A user's function run in a process of its own, with a time limit on each call, so that a call that hangs, exits
or kills its process is an error for that call only. rewards.py runs a custom reward.function here; the built-in
rules stay in the training process (they are the library's own code, and bounded).

    worker = FunctionWorker("my_reward.py", "compute_score", timeout_s=30)   # imports the file there; may raise
    results = worker.call_all([dict(data_source=…, solution_str=…, ground_truth=…, extra_info=…), …])
    # one per call: what the function returned, or an exception (CallFailed: it raised, timed out, ended its process)

How a call is bounded: in the worker, a timer (SIGALRM) interrupts a call still running after timeout_s, and an
`async def` function's calls, run together as verl's reward loop runs them, are each cancelled after timeout_s; a
call stuck where neither reaches (inside C code) gets no answer, and the parent kills the worker GRACE_S later. A
worker that dies or is killed is started again for the calls after the lost one, at most MAX_LOST times a batch.

This file is also the worker's program (`python infra/worker.py FD`): it imports the standard library and the
user's file only, so a (re)start takes ~0.1 s instead of the ~2.5 s that importing the library (torch) takes.
"""
import asyncio
import importlib.util
import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import Pipe
from multiprocessing.connection import Connection

GRACE_S = 2.0  # after timeout_s without an answer, how long the parent still waits before it kills the worker
MAX_LOST = 3  # workers lost (hung or dead) in one batch before its remaining calls fail unrun


class CallFailed(Exception):
    """A call that failed in the worker; its message reads "<ExceptionType>: <message>"."""


class WorkerStartError(Exception):
    """The worker could not import the file or find the function; the message says which."""


class FunctionWorker:
    """One persistent worker process for the function `name` of the file `path`. `stop`: an object whose
    check_overdue(seconds) raises when a stop signal came more than `seconds` ago (runs.StopSignal), or None."""

    def __init__(self, path: str, name: str, timeout_s: float, stop=None):
        self.path, self.name, self.timeout_s, self.stop = path, name, timeout_s, stop
        self.proc = self.conn = None
        self.is_async = self.start()

    def start(self) -> bool:
        """Start the worker and import the function there; True when it is an `async def`. WorkerStartError when
        the import fails, ends the process, or takes longer than timeout_s."""
        mine, theirs = Pipe()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),))
        theirs.close()
        self.conn = mine
        self._finalizer = weakref.finalize(self, stop_process, self.proc, mine)
        mine.send({"path": self.path, "name": self.name, "sys_path": sys.path})
        kind, payload = self.answer(time.monotonic() + self.timeout_s, f"the import of {self.path}")
        if kind != "ready":
            self.close()
            raise WorkerStartError(payload)
        return payload

    def answer(self, deadline: float, what: str):
        """The worker's next message, waiting until `deadline` (and stop.check_overdue); ("lost", reason) when
        none comes in time or the worker ended."""
        while True:
            if self.stop is not None:
                try:
                    self.stop.check_overdue(self.timeout_s)
                except BaseException:
                    self.close()
                    raise
            wait = min(deadline - time.monotonic(), 0.2)
            try:
                if wait > 0 and not self.conn.poll(wait):
                    continue
                if wait <= 0 and not self.conn.poll(0):
                    self.close()
                    return "lost", (f"TimeoutError: {what} took longer than reward.timeout_s={self.timeout_s:g} s, "
                                    f"and its worker was stopped")
                return self.conn.recv()
            except (EOFError, OSError):
                reason = exit_reason(self.proc)
                self.close()
                return "lost", f"WorkerDied: the reward worker ended ({reason}) during {what}"

    def call_all(self, calls: list[dict]) -> list:
        """fn(**kwargs) for each call, in the worker: its result, or a CallFailed. A sync function's calls run one
        after another and a lost worker is blamed on the call it was running; an async function's calls run
        together, so a lost worker fails all of them that had not answered."""
        results, todo, lost = [None] * len(calls), list(range(len(calls))), 0
        while todo:
            if lost == MAX_LOST:
                for i in todo:
                    results[i] = CallFailed(f"WorkerDied: not run, the reward worker was lost {lost} times in this "
                                            f"batch (a call hung past reward.timeout_s or ended the process)")
                break
            if self.proc is None:
                try:
                    self.is_async = self.start()
                except WorkerStartError as e:
                    for i in todo:
                        results[i] = CallFailed(f"WorkerDied: the reward worker could not start again: {e}")
                    break
            todo, lost = self.run_batch(calls, todo, results), lost + 1
        return results

    def run_batch(self, calls: list[dict], todo: list[int], results: list) -> list[int]:
        """Send the calls `todo` and fill `results` as answers come; returns the calls left to retry on a new
        worker (empty unless the worker was lost during a sync call: then the calls after that one)."""
        try:
            self.conn.send(([calls[i] for i in todo], self.timeout_s))
        except OSError:
            pass  # the worker is gone: answer() says how
        pending = set(range(len(todo)))
        while pending:
            # sync: each call has timeout_s from the previous answer; async: all run at once from the start
            message = self.answer(time.monotonic() + self.timeout_s + GRACE_S, "this call")
            if message[0] == "lost":
                first = min(pending)
                if self.is_async:
                    for j in pending:
                        results[todo[j]] = CallFailed(message[1])
                    return []
                results[todo[first]] = CallFailed(message[1])
                return [todo[j] for j in sorted(pending) if j != first]
            _, j, ok, value = message
            results[todo[j]] = value if ok else CallFailed(value)
            pending.discard(j)
        return []

    def close(self) -> None:
        """Stop the worker (killed if it does not leave at once); the next call_all starts a new one."""
        if self.proc is not None:
            self._finalizer()
        self.proc = self.conn = None


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
# The worker's side


class CallTimeout(BaseException):
    """Raised into a call by the timer; a BaseException, so that a function's `except Exception` does not swallow
    it."""


def import_function(path: str, name: str):
    """The function `name` of the file at `path` (name defaults to compute_score upstream, as in verl), its module
    registered in sys.modules so that pickle finds what it defines; WorkerStartError saying what is wrong."""
    module_name = "custom_reward_" + re.sub(r"\W", "_", os.path.splitext(os.path.abspath(path))[0])
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # SystemExit at import too
        raise WorkerStartError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise WorkerStartError(f"{path} has no function `{name}`; callables found there: {found}")
    return fn


def call_one(fn, kwargs: dict, timeout_s: float):
    """(True, fn(**kwargs)) or (False, "<Type>: <message>"), interrupted after timeout_s."""
    def expire(signum, frame):
        raise CallTimeout

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return True, fn(**kwargs)
    except CallTimeout:
        return False, f"TimeoutError: this call took longer than reward.timeout_s={timeout_s:g} s"
    except BaseException as e:  # sys.exit() in a call is an error for that call, not the end of the worker
        return False, f"{type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


async def call_together(fn, calls: list[dict], timeout_s: float, send) -> None:
    """Every call of an async function at once, each cancelled after timeout_s; answers sent as they come."""
    async def one(j, kwargs):
        try:
            send(j, True, await asyncio.wait_for(fn(**kwargs), timeout_s))
        except asyncio.TimeoutError:
            send(j, False, f"TimeoutError: this call took longer than reward.timeout_s={timeout_s:g} s")
        except BaseException as e:
            send(j, False, f"{type(e).__name__}: {e}")
    await asyncio.gather(*(one(j, kwargs) for j, kwargs in enumerate(calls)))


def serve(conn: Connection) -> None:
    """Import the function, say so, then answer batches of calls until the parent closes the connection."""
    setup = conn.recv()
    sys.path[:] = setup["sys_path"]
    try:
        fn = import_function(setup["path"], setup["name"])
    except WorkerStartError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", inspect.iscoroutinefunction(fn)))

    def send(j, ok, value):
        try:
            conn.send(("result", j, ok, value))
        except Exception as e:  # a result pickle cannot carry
            conn.send(("result", j, False, f"TypeError: the result cannot be sent back ({type(e).__name__}: {e})"))

    while True:
        try:
            calls, timeout_s = conn.recv()
        except EOFError:
            return
        if inspect.iscoroutinefunction(fn):
            asyncio.run(call_together(fn, calls, timeout_s, send))
        else:
            for j, kwargs in enumerate(calls):
                send(j, *call_one(fn, kwargs, timeout_s))


def leave_with_parent(parent: int) -> None:
    """A worker whose parent died (even by SIGKILL) leaves within a second, whatever call it is running."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # the call's timer is for the main thread
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    # The run's process decides when the worker stops: Ctrl-C (sent to the whole process group) and SIGTERM
    # (Slurm signals every process of the job) are for it, not for a call in progress.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=leave_with_parent, args=(os.getppid(),), daemon=True).start()
    serve(Connection(int(sys.argv[1])))
