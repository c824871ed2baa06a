"""The processes below an episode worker (agents/episodes.py), whatever their session: the worker is a child
subreaper, so that what a process it hosts starts and leaves behind (a daemon, a double fork, start_new_session)
becomes its child rather than init's; it kills those it inherits within a second (end_inherited) and, at close or
when its parent is gone (kill_group_when_orphaned), every process descended from it (end_everything). The process of
an object it hosts is killed by the kernel when the worker ends (die_with_parent); one that ends on its own is reaped
with its exit status (child_exit). Linux (/proc, prctl); elsewhere the process group alone.
"""
import ctypes
import os
import signal
import time
from typing import Optional


def become_subreaper() -> None:
    """Make the orphans of this process's descendants its own children, not init's (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def descendants(root: int) -> list[int]:
    """Every live process below `root` in the process tree (/proc; its children first), whatever its session."""
    children = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the fields after "(command)": state, ppid
        except (ValueError, OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo += children.get(pid, [])
    return found


def kill_all(pids: list[int]) -> None:
    """SIGKILL each pid, then reap those that are this process's children."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # not ours: its own parent (killed too) or init reaps it


def child_exit(pid: int) -> str:
    """How a child that closed its pipe ended: "exit code 3", "killed by SIGKILL"."""
    for _ in range(50):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "it ended"
        if done:
            code = os.waitstatus_to_exitcode(status)
            return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        time.sleep(0.01)
    return "it closed its pipe"


def end_inherited(known: set[int]) -> None:
    """Kill what this subreaper inherited (the children that are not an object's: orphans of a process an object
    started, which left the group), with whatever they started."""
    me = os.getpid()
    inherited = [pid for pid in descendants(me) if pid not in known and parent_of(pid) == me]
    kill_all([p for pid in inherited for p in [pid, *descendants(pid)]])


def parent_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (ValueError, OSError, IndexError):
        return None


def end_everything() -> None:
    """Kill every process descended from this one, in or out of its group, then the group (this process too)."""
    kill_all(descendants(os.getpid()))
    os.killpg(0, signal.SIGKILL)


def kill_group_when_orphaned(parent: int) -> None:
    """The run's process is gone (even by SIGKILL): end this whole process group within a second."""
    while os.getppid() == parent:
        time.sleep(1.0)
    end_everything()
