"""The worker's program (`python infra/worker_program.py FD`), which infra/worker.FunctionWorker starts: it imports the
user's function (worker.import_function), says so, then answers each batch of calls its parent sends over the pipe
FD, a sync function's calls one at a time, each under a timer (call_one), an async function's all at once, each
cancelled after timeout_s (call_together).

It imports the standard library, infra/worker.py and the user's file only, so a (re)start takes ~0.1 s instead of the
~2.5 s that importing the library (torch) takes. A worker whose parent is gone (its pipe closed, or the parent
killed) leaves at once, and quietly.
"""
import asyncio
import inspect
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: infra/ importable
from infra.worker import import_function, parameters, WorkerStartError  # noqa: E402


class CallTimeout(BaseException):
    """Raised into a call by the timer; a BaseException, so that a function's `except Exception` does not swallow
    it."""


def call_one(fn, kwargs: dict, timeout_s: float, key: str):
    """(status, value): ("ok", fn(**kwargs)), ("error", "<Type>: <message>"), or ("timeout", why) once interrupted
    after timeout_s."""
    def expire(signum, frame):
        raise CallTimeout

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return "ok", fn(**kwargs)
    except CallTimeout:
        return "timeout", f"TimeoutError: this call took longer than {key}.timeout_s={timeout_s:g} s"
    except BaseException as e:  # sys.exit() in a call is an error for that call, not the end of the worker
        return "error", f"{type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


async def call_together(fn, calls: list[dict], timeout_s: float, key: str, send) -> None:
    """Every call of an async function at once, each cancelled after timeout_s; answers sent as they come."""
    async def one(j, kwargs):
        try:
            send(j, "ok", await asyncio.wait_for(fn(**kwargs), timeout_s))
        except asyncio.TimeoutError:
            send(j, "timeout", f"TimeoutError: this call took longer than {key}.timeout_s={timeout_s:g} s")
        except BaseException as e:
            send(j, "error", f"{type(e).__name__}: {e}")
    await asyncio.gather(*(one(j, kwargs) for j, kwargs in enumerate(calls)))


def serve(conn: Connection) -> None:
    """Import the function, say so, then answer batches of calls until the parent closes the connection. A parent
    that is gone (end of file, a broken pipe) ends the worker at once and quietly: no traceback, nothing flushed
    into a pipe nobody reads."""
    def send(message):
        try:
            data = pickle.dumps(message)
        except Exception as e:  # a result pickle cannot carry
            data = pickle.dumps(("result", message[1], "error",
                                 f"TypeError: the result cannot be sent back ({type(e).__name__}: {e})"))
        try:
            conn.send_bytes(data)
        except OSError:
            os._exit(0)

    try:
        setup = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    sys.path[:] = setup["sys_path"]
    try:
        fn = import_function(setup["path"], setup["name"])
    except WorkerStartError as e:
        send(("error", str(e)))
        return
    send(("ready", inspect.iscoroutinefunction(fn), parameters(fn)))
    key = setup["key"]
    while True:
        try:
            calls, timeout_s = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if inspect.iscoroutinefunction(fn):
            asyncio.run(call_together(fn, calls, timeout_s, key, lambda j, *answer: send(("result", j, *answer))))
        else:
            for j, kwargs in enumerate(calls):
                send(("result", j, *call_one(fn, kwargs, timeout_s, key)))


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
