"""Objects of a user's file, each hosted in a process of its own: one environment instance per episode
(agents/environments.py), one process per tool call. A call that raises, hangs (even holding the GIL), calls os._exit or
kills its process fails that object only; processes it starts are ended with the run.

    host = ObjectHost({"env": ("my_env.py", "Guess")}, 30, check)   # imports the file in a worker; may raise
    keys = host.open("env", 16)                          # 16 instances of Guess, each in a process forked from it
    results = host.call_all([(key, "reset", (row,)) for key, row in zip(keys, rows)])   # each: value or CallFailed
    host.end(keys)                                       # their processes leave
    host.close()                                         # the worker and every process it or they started

How: the worker (`python agents/episodes.py FD`) imports the files once, in a session of its own, so that its
process group holds it, every process it forks and every process those start. An object is built in a child forked
from it, which answers method calls over a pipe; the worker relays calls and answers, and kills a child still
running a call timeout_s after it began (SIGKILL: it needs no cooperation from the call). close() kills the whole
process group. A worker whose parent is gone (its connection closed, or its parent pid changed) kills its group; a
child whose worker is gone is killed by the kernel (PR_SET_PDEATHSIG). What leaves the group (setsid, a daemon) is
still the worker's: a child subreaper, it kills such processes once their parent ends, and every one at close
(agents/reaping.py). What crosses back is plain values (plain(): a user's own class as its str()), at most
MAX_RESULT_BYTES of them.

The worker imports the standard library, infra/worker.py, agents/reaping.py and the user's files only: it starts in
~0.1 s, and a fork from it takes a few milliseconds.
"""
import dataclasses
import math
import numbers
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from multiprocessing import Pipe
from multiprocessing.reduction import ForkingPickler
from multiprocessing.connection import Connection, wait
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: infra/ importable
from infra.worker import CallFailed, GRACE_S, WorkerStartError, import_function  # noqa: E402
from agents.reaping import (become_subreaper, child_exit, die_with_parent, end_everything,  # noqa: E402
                            end_inherited, kill_group_when_orphaned)


class ObjectHost:
    """The worker of `targets` ({label: (path, name)}): each label's class or function, imported there once."""

    def __init__(self, targets: dict, timeout_s: float, check: Optional[tuple[str, str]] = None):
        """check: (file, function) that the worker calls on each target, check(target, "path:name"), before it says
        it is ready: its ValueError refuses the targets (environments.check_environment_class), what it returns is
        in self.checks; the targets are then classes, each object built by calling it with no arguments."""
        self.timeout_s, self.next_key = timeout_s, 0
        mine, theirs = Pipe()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.conn = mine
        self._finalizer = weakref.finalize(self, end_group, self.proc, mine)
        mine.send({"targets": targets, "check": check, "timeout_s": timeout_s, "sys_path": sys.path})
        message = self.receive(time.monotonic() + max(timeout_s, 10.0))
        if message is None or message[0] != "ready":
            self.close()
            raise WorkerStartError(message[1] if message else f"the worker for {targets} did not start")
        self.checks = message[1]  # {label: what check returned}

    def alive(self) -> bool:
        """False once the worker was closed, lost or ended: start a new ObjectHost."""
        return self.proc is not None and self.proc.poll() is None

    def receive(self, deadline: float):
        """The worker's next message, or None when none comes by `deadline` or the worker ended."""
        try:
            if self.conn.poll(max(0.0, deadline - time.monotonic())):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def open(self, label: str, count: int, builds: Optional[list[tuple]] = None) -> list[int]:
        """`count` new objects of `label` (a class: built with no arguments; a function: itself), each in its own
        process; their keys. builds: per object (route, args, kwargs): built as target[route](*args, **kwargs)
        (route None: target itself; a dict of environments has one per key). A constructor that fails makes every
        call of that object fail with its error."""
        keys = list(range(self.next_key, self.next_key + count))
        self.next_key += count
        self.send([("open", key, label, build) for key, build in zip(keys, builds or [(None, (), {})] * count)])
        return keys

    def call_all(self, calls: list[tuple]) -> list:
        """(key, method, args[, kwargs]) → getattr(object, method)(*args, **kwargs), method None: object(*args,
        **kwargs); all at once, each object's in order. Each result, or a CallFailed (it raised, took longer than
        timeout_s, ended its process, or its object is gone)."""
        if self.proc is None:
            return [CallFailed("WorkerDied: the episode worker was lost before this call")] * len(calls)
        results, pending = [None] * len(calls), set(range(len(calls)))
        self.send([("call", i, call[0], call[1], call[2], call[3] if len(call) > 3 else {}) for i, call in
                   enumerate(calls)])
        per_object = max(Counter(call[0] for call in calls).values(), default=0)  # an object's calls run in turn
        deadline = time.monotonic() + self.timeout_s * per_object + GRACE_S  # the worker times each call itself
        while pending:
            message = self.receive(deadline)
            if message is None:  # the worker itself is gone or stuck: every object it held is lost
                reason = "the episode worker ended" if self.proc.poll() is not None else "the episode worker hung"
                for i in pending:
                    results[i] = CallFailed(f"WorkerDied: {reason}")
                self.close()
                break
            _, i, ok, value = message
            results[i] = value if ok else CallFailed(value)
            pending.discard(i)
        return results

    def end(self, keys: list[int]) -> None:
        """The objects' processes leave (killed at once if they do not)."""
        self.send([("end", key) for key in keys])

    def send(self, messages: list) -> None:
        if self.proc is None:
            return  # lost: call_all answers each call so
        try:
            self.conn.send(messages)
        except OSError:
            pass  # gone: call_all says so

    def close(self) -> None:
        """Kill the worker's process group: the worker, every object's process and whatever they started."""
        if self.proc is not None:
            self._finalizer()
        self.proc = None


def end_group(proc: subprocess.Popen, conn: Connection) -> None:
    """Close the connection, which tells the worker to kill every process descended from it and its group; kill the
    group from here when it has not ended within a few seconds."""
    conn.close()
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group is the worker's session: its pid
    except ProcessLookupError:
        pass
    proc.wait()


# ---------------------------------------------------------------------------------------
# The worker's side: a relay between the parent and one child process per object


MAX_RESULT_BYTES = 64 << 20  # the most a call sends back (pickled): a 1 GB answer fails in its own process


def plain(value, depth: int = 0):
    """`value` as the trainer can unpickle it without the user's files (module docstring): plain types, the
    library's records rebuilt, anything else its str() (a str() that raises: a sentence saying so)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # a subclass of str: its text
    if isinstance(value, numbers.Integral):
        value = int(value)
        return value if abs(value) < 2 ** 1023 else math.inf if value > 0 else -math.inf  # no OverflowError later
    if isinstance(value, numbers.Real):
        return float(value)
    if depth < 32 and isinstance(value, (list, tuple)):
        items = [plain(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if depth < 32 and isinstance(value, dict):
        return {plain(k, depth + 1) if isinstance(k, (str, numbers.Number)) or k is None else as_text(k):
                plain(v, depth + 1) for k, v in value.items()}
    record = library_record(type(value)) if dataclasses.is_dataclass(value) and depth < 32 else None
    if record is not None:
        return record(**{f.name: plain(getattr(value, f.name), depth + 1) for f in dataclasses.fields(record)})
    return as_text(value)


def library_record(cls):
    """The first of cls's bases that is a dataclass of this library (agents/…: Reset, Step), or None."""
    return next((base for base in cls.__mro__ if base.__module__.startswith("agents.")
                 and dataclasses.is_dataclass(base)), None)


def as_text(value) -> str:
    """str(value); a TypeError in one sentence when that raises."""
    try:
        return str.__str__(str(value))
    except BaseException as e:
        raise TypeError(f"the result is a {type(value).__name__} object, whose str() raised "
                        f"{type(e).__name__}: {error_text(e)}") from None


def error_text(e: BaseException) -> str:
    """str(e), or its type's name when that raises."""
    try:
        return str.__str__(str(e))
    except BaseException:
        return f"(a {type(e).__name__} whose str() raised)"


def serve_object(conn: Connection, target, build: bool, route, args: tuple, kwargs: dict) -> None:
    """In the forked child: build the object (target[route](*args, **kwargs); route None: target(…)), then answer
    (method, args, kwargs) until the worker says end."""
    try:
        factory = target if route is None else target[route]
        obj, error = (factory(*args, **kwargs) if build else target), None
    except BaseException as e:
        obj, error = None, f"{type(e).__name__} in the constructor: {e}"
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            close = getattr(obj, "close", None) if build else None
            if callable(close):
                try:
                    close()
                except BaseException:
                    pass  # the episode is over: what its close does is its own
            return
        method, args, kwargs = message
        try:
            if error:
                raise RuntimeError(error)
            fn = obj if method is None else getattr(obj, method)
            result = fn(*args, **kwargs)
            reply = (True, plain(result))
        except BaseException as e:  # SystemExit too: an error for this call
            reply = (False, f"{type(e).__name__}: {error_text(e)}")
        try:
            data = bytes(ForkingPickler.dumps(reply))  # what conn.send(reply) sends
            if len(data) > MAX_RESULT_BYTES:
                data = bytes(ForkingPickler.dumps((False, f"ValueError: the result is {len(data) / 2**20:.0f} MB, more "
                                                          f"than the {MAX_RESULT_BYTES >> 20} MB a call may send back")))
            conn.send_bytes(data)
        except Exception as e:  # a result pickle cannot carry
            conn.send((False, f"TypeError: the result cannot be sent back ({type(e).__name__}: {e})"))


class Relay:
    """The worker's state: the imported targets and, per object key, its child process and the calls it owes."""

    def __init__(self, parent: Connection, targets: dict, timeout_s: float):
        self.parent, self.targets, self.timeout_s = parent, targets, timeout_s
        self.children = {}  # key → (pid, connection)
        self.queued = {}  # key → [(call id, method, args, kwargs)] not yet sent to the child
        self.running = {}  # key → (call id, deadline) of the call the child is running
        self.leaving = []  # (pid, kill after) of the children told to end

    def fork(self, key: int, label: str, build: tuple) -> None:
        mine, theirs = Pipe()
        pid = os.fork()
        if pid == 0:  # the child: keep only its own pipe
            die_with_parent()
            self.parent.close()
            mine.close()
            for _, conn in self.children.values():
                conn.close()
            for sig in (signal.SIGTERM, signal.SIGINT):  # the run's, as the worker's (Slurm signals every process);
                signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN: what the object execs gets the defaults
            target, built = self.targets[label]
            try:
                serve_object(theirs, target, built, *build)
            finally:
                os._exit(0)
        theirs.close()
        self.children[key] = (pid, mine)
        self.queued[key] = []

    def fail(self, call_id: int, reason: str) -> None:
        self.parent.send(("result", call_id, False, reason))

    def kill(self, key: int, reason: str) -> None:
        """End the child of `key`; its running and queued calls fail with `reason`."""
        pid, conn = self.children.pop(key)
        conn.close()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        if key in self.running:
            self.fail(self.running.pop(key)[0], reason)
        for call_id, *_ in self.queued.pop(key, []):
            self.fail(call_id, "WorkerDied: not run, an earlier call of this object failed")

    def dispatch(self) -> None:
        """Send each idle child its next queued call."""
        for key, queue in self.queued.items():
            if queue and key not in self.running:
                call_id, method, args, kwargs = queue.pop(0)
                try:
                    self.children[key][1].send((method, args, kwargs))
                    self.running[key] = (call_id, time.monotonic() + self.timeout_s)
                except Exception as e:  # arguments pickle cannot carry, or the child is gone
                    self.fail(call_id, f"TypeError: the call cannot be sent ({type(e).__name__}: {e})")

    def handle(self, messages: list) -> None:
        for message in messages:
            if message[0] == "open":
                self.fork(message[1], message[2], message[3])
            elif message[0] == "call":
                _, call_id, key, method, args, kwargs = message
                if key in self.children:
                    self.queued[key].append((call_id, method, args, kwargs))
                else:
                    self.fail(call_id, "WorkerDied: this object's process is gone (an earlier call failed)")
            elif message[0] == "end" and message[1] in self.children:
                pid, conn = self.children.pop(message[1])
                self.queued.pop(message[1], None)
                try:
                    conn.send(None)
                except OSError:
                    pass
                conn.close()
                self.leaving.append((pid, time.monotonic() + 1.0))
        self.dispatch()


def serve(conn: Connection) -> None:
    """Import the targets, say so, then relay until the parent closes the connection."""
    setup = conn.recv()
    sys.path[:] = setup["sys_path"]
    targets, checks = {}, {}
    try:
        for label, (path, name) in setup["targets"].items():
            target = import_function(path, name, dicts=setup["check"] is not None)  # a dict of environments too
            if setup["check"]:
                try:
                    checks[label] = import_function(*setup["check"])(target, f"{path}:{name}")
                except ValueError as e:
                    raise WorkerStartError(str(e)) from None
            targets[label] = (target, setup["check"] is not None)  # checked: a class, built per object
    except WorkerStartError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", checks))
    timeout_s = setup["timeout_s"]
    relay, next_reap = Relay(conn, targets, timeout_s), 0.0
    while True:
        by_conn = {c: key for key, (_, c) in relay.children.items()}
        deadlines = [d for _, d in relay.running.values()] + [d for _, d in relay.leaving]
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0
        for ready in wait([conn, *by_conn], timeout=min(wait_s, 1.0)):
            if ready is conn:
                try:
                    relay.handle(conn.recv())
                except (EOFError, OSError):
                    return
                continue
            key = by_conn[ready]
            if key not in relay.children:
                continue
            try:
                ok, value = ready.recv()
            except (EOFError, OSError):
                pid = relay.children[key][0]
                relay.kill(key, f"WorkerDied: the process of this call ended ({child_exit(pid)})")
                continue
            call_id, _ = relay.running.pop(key)
            conn.send(("result", call_id, ok, value))
        now = time.monotonic()
        for key, (_, deadline) in list(relay.running.items()):
            if now > deadline:
                relay.kill(key, f"TimeoutError: the call took longer than {timeout_s:g} s, and its process was killed")
        for pid, kill_after in list(relay.leaving):
            if os.waitpid(pid, os.WNOHANG)[0] or now > kill_after:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
                relay.leaving.remove((pid, kill_after))
        relay.dispatch()
        if now > next_reap:
            end_inherited({pid for pid, _ in relay.children.values()} | {pid for pid, _ in relay.leaving})
            next_reap = now + 1.0


if __name__ == "__main__":
    # Ctrl-C and SIGTERM are for the run's process, which decides when the objects end (close()).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    become_subreaper()
    threading.Thread(target=kill_group_when_orphaned, args=(os.getppid(),), daemon=True).start()
    serve(Connection(int(sys.argv[1])))
    end_everything()  # the parent closed the connection, or died: nothing the worker started outlives it
