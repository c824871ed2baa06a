"""Issue 24: nothing a user made is ever deleted, a reward cannot hang or kill the run, a run that cannot learn
stops, and every damaged file is named. (Bad inputs that fail before any model loads are in test_faults.py.)

Exports (tools/merge_lora.py, tools/prepare_model.py) refuse to replace what they did not write; a custom reward
runs in a worker process (infra/worker.py) where a call that hangs, exits or kills it is an error for that sample;
checkpoints carry a manifest (sizes, sha256, the base model's fingerprint) that resuming checks first; a full disk
or a read-only folder ends the run in one sentence. The disk faults are real: a tiny tmpfs in a user and mount
namespace (`unshare`), skipped where the system does not allow one.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import make_tiny_model, read_metrics, REPO
from infra import cli
from infra.config import ConfigError
from test_faults import no_model_loads, ppo_config, write  # noqa: F401 (no_model_loads is a fixture)
from test_ppo import base_args, run_ppo, workdir  # noqa: F401 (workdir is a fixture)

QUIET = ["trainer.test_freq=0", "trainer.sample_freq=0", "trainer.plot_curves=false", "trainer.val_before_train=false"]


def files_of(folder) -> dict:
    """{relative path: bytes} of every file under folder: what must come through a refused export unchanged."""
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


# ---- exports never delete what they did not write


@pytest.fixture(scope="module")
def adapter(workdir):  # noqa: F811
    """A LoRA adapter over workdir's tiny model, saved as ppo.py's final/ is (the base named by its path)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    base = str(workdir / "model")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=["q_proj"]))
    path = workdir / "adapter"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return path


def test_merge_lora_refuses_a_non_empty_output_and_never_replaces_its_inputs(workdir, adapter, tmp_path):  # noqa: F811
    """merge_lora.py ADAPTER OUT with OUT holding a file: exit 1, one sentence, the file kept (it used to be wiped).
    Even with --overwrite, OUT = the base model, the adapter, or a folder holding the adapter is refused and left
    as it was; --overwrite on any other folder replaces it, and a user's folder named OUT.tmp beside it survives."""
    from tools.merge_lora import merge_lora
    out = tmp_path / "merged"
    write(out / "notes.txt", "mine")
    proc = subprocess.run([sys.executable, "tools/merge_lora.py", str(adapter), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"tools/merge_lora.py: the output folder {out} exists and is not empty (1 entry, e.g. notes.txt); choose "
        f"a new or empty folder, or pass --overwrite to replace it")
    assert (out / "notes.txt").read_text() == "mine"
    base, before = workdir / "model", {p: files_of(p) for p in (workdir / "model", adapter)}
    for target, what in ((base, f"is the input {base}"), (adapter, f"is the input {adapter}"),
                         (workdir, f"holds the input {adapter}")):
        with pytest.raises(ConfigError) as e:
            merge_lora(str(adapter), str(target), overwrite=True)
        assert str(e.value) == f"the output folder {target} {what}, which writing it would delete; choose another " \
                               f"output folder"
    assert {p: files_of(p) for p in before} == before
    write(tmp_path / "merged.tmp" / "keep.txt", "also mine")
    merge_lora(str(adapter), str(out), overwrite=True)
    assert (out / "config.json").exists() and not (out / "notes.txt").exists()
    assert (tmp_path / "merged.tmp" / "keep.txt").read_text() == "also mine"
    assert sorted(os.listdir(tmp_path)) == ["merged", "merged.tmp"]  # no temporary folder left behind


def test_merge_lora_refuses_pickle_adapters_and_code_in_the_base(workdir, adapter, tmp_path):  # noqa: F811
    """An adapter saved as adapter_model.bin (a pickle) is refused with the command that converts it, and a base
    whose config maps to code in its folder needs --trust-remote-code; neither loads anything, nothing runs."""
    from tools.merge_lora import merge_lora
    from test_faults import PAYLOAD, planted_folder
    pickled = tmp_path / "pickled"
    shutil.copytree(adapter, pickled)
    (pickled / "adapter_model.safetensors").unlink()
    subprocess.run([sys.executable, "-c", PAYLOAD.format(marker=tmp_path / "RAN",
                                                         paths=[str(pickled / "adapter_model.bin")])], check=True)
    with pytest.raises(ConfigError, match=r"adapter_model.bin holds pickle weights, which this tool does not load "
                                          r"\(unpickling can run code\): convert it once"):
        merge_lora(str(pickled), str(tmp_path / "out"))
    planted = planted_folder(tmp_path / "planted", workdir, tmp_path)
    with pytest.raises(ConfigError, match=r"which runs only with --trust-remote-code; "):
        merge_lora(str(adapter), str(tmp_path / "out"), base=str(planted))
    assert not (tmp_path / "RAN").exists() and not (tmp_path / "out").exists()


def test_prepare_model_refuses_a_non_empty_output(tmp_path):
    """prepare_model.py --output DIR, DIR holding something other than a model: refused before any work, kept."""
    write(tmp_path / "out" / "notes.txt", "mine")
    proc = subprocess.run([sys.executable, "tools/prepare_model.py", "--output", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        f"tools/prepare_model.py: the output folder {tmp_path}/out exists and is not empty (1 entry, e.g. "
        f"notes.txt); choose a new or empty folder, or pass --overwrite to replace it")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


# ---- no code from a model folder


def test_a_yes_piped_into_the_run_does_not_run_a_model_folders_code(workdir, tmp_path):  # noqa: F811
    """`yes | python ppo.py model.path=<a folder whose config maps to its own planted.py>`: transformers used to ask
    on stdin and run the code on `y`; now the run ends in one sentence naming model.trust_remote_code, exit 1, and
    the code never ran. With model.trust_remote_code=true the check lets the folder through (the user's choice)."""
    from infra.checks import check_model_path
    from test_faults import planted_folder
    planted = planted_folder(tmp_path / "planted", workdir, tmp_path)
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", *base_args(workdir, tmp_path / "out"),
           f"model.path={planted}"]
    proc = subprocess.run(cmd, cwd=REPO, input="y\n" * 100, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"ppo.py: model.path: {planted}/config.json maps its classes to code in the folder (planted.py), which runs "
        f"only with model.trust_remote_code=true")
    assert not (tmp_path / "RAN").exists()
    check_model_path(str(planted), "model.path", trust_remote_code=True)


# ---- real disk faults: a small tmpfs of our own


def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(not can_mount_tmpfs(), reason="no user+mount namespaces here (unshare), so no "
                                                               "small filesystem to fill")


def in_namespace(script: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a shell script in a new user and mount namespace, where it may mount a tmpfs of a chosen size."""
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


SAVE_ON_FULL_DISK = """
import os, sys
sys.path.insert(0, {repo!r})
from transformers import AutoModelForCausalLM, AutoTokenizer
from infra.config import SaveError
from infra.models import save_pretrained_atomic
os.makedirs({out!r})
with open(os.path.join({out!r}, "weights.txt"), "w") as f:
    f.write("the model that was there")
try:
    save_pretrained_atomic(AutoModelForCausalLM.from_pretrained({model!r}), AutoTokenizer.from_pretrained({model!r}),
                           {out!r}, overwrite=True)
except SaveError as e:
    print("SaveError:", e)
print(sorted(os.listdir(os.path.dirname({out!r}))), sorted(os.listdir({out!r})), open({out!r} + "/weights.txt").read())
"""


@needs_tmpfs
def test_a_full_disk_while_exporting_leaves_the_old_folder_as_it_was(workdir, tmp_path):  # noqa: F811
    """save_pretrained_atomic (final/, merge_lora, prepare_model) on a disk too small for the model: one SaveError
    naming the folder and the OS's reason (safetensors' writer reports it as its own error), the folder there
    before unchanged, no temporary folder left."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = write(tmp_path / "save.py", SAVE_ON_FULL_DISK.format(repo=REPO, model=str(workdir / "model"),
                                                                   out=f"{mnt}/final"))
    proc = in_namespace(f"mount -t tmpfs -o size=600k tmpfs {mnt} && {sys.executable} {script}")
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith(f"SaveError: cannot write {mnt}/final (No space left on device); it is as it was "
                                f"before"), proc.stdout + proc.stderr[-3000:]
    assert lines[-1] == "['final'] ['weights.txt'] the model that was there"


def ppo_command(workdir, out, *overrides):  # noqa: F811
    return " ".join([sys.executable, "ppo.py", "--config", "configs.yaml", *base_args(workdir, out), *QUIET,
                     *overrides])


@needs_tmpfs
def test_a_full_disk_while_checkpointing_names_the_folder_and_a_rerun_resumes(workdir, tmp_path):  # noqa: F811
    """output_dir on a 300 KiB disk: step_1's checkpoint fits, step_2's does not. The run ends with exit 1 and one
    sentence naming step_2, the reason and that step_1 is intact (no traceback, no half-written step_2.tmp); once
    the disk is larger, the same command resumes from step_1 and finishes."""
    mnt, out = tmp_path / "mnt", tmp_path / "mnt" / "out"
    mnt.mkdir()
    cmd = ppo_command(workdir, out, "trainer.save_freq=1", "trainer.keep_checkpoints=5", "trainer.total_steps=3")
    proc = in_namespace(f"mount -t tmpfs -o size=300k tmpfs {mnt} && {{ {cmd}; echo exit=$?; ls {out}; "
                        f"mount -o remount,size=20m {mnt} && {cmd} && ls {out}; }}")
    first, _, second = proc.stdout.partition("exit=")
    assert second.startswith("1\n"), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (f"ppo.py: cannot write the checkpoint {out}/step_2 (No space left on device); it is not kept, the "
            f"checkpoint step_1 is intact: free space or fix the permissions, then run the same command again to "
            f"resume from step_1") in proc.stderr and "Traceback" not in proc.stderr
    listed = second.split("\n")
    assert "step_1" in listed and "step_2" not in listed[:listed.index("step_1") + 2] and "step_2.tmp" not in listed
    assert f"resumed from {out}/step_1 at step 1" in second and f"policy saved to {out}/final" in second


@needs_tmpfs
def test_a_file_of_the_run_made_read_only_during_the_run_ends_in_one_sentence(workdir, tmp_path):  # noqa: F811
    """metrics.jsonl made read-only once step 1's checkpoint exists (a read-only bind mount over it: root ignores
    file modes, and the folder itself cannot be remounted while the run holds its lock file open): the next append
    ends the run with exit 1 and one sentence naming the file and what is kept, instead of a raw OSError."""
    mnt, out = tmp_path / "mnt", tmp_path / "mnt" / "out"
    mnt.mkdir()
    cmd = ppo_command(workdir, out, "trainer.save_freq=1", "trainer.total_steps=8")
    proc = in_namespace(f"mount -t tmpfs -o size=20m tmpfs {mnt} && {{ {cmd} & while [ ! -d {out}/step_1 ]; do "
                        f"sleep 0.05; done; mount --bind {out}/metrics.jsonl {out}/metrics.jsonl && "
                        f"mount -o remount,bind,ro {out}/metrics.jsonl; wait $!; echo exit=$?; }}")
    assert "exit=1" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    step = proc.stderr.split("ppo.py: cannot append step ")[1].split()[0]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ppo.py: cannot append step {step} to {out}/metrics.jsonl (Read-only file system); the lines and checkpoints "
        f"before it are kept: free space or fix the permissions, then run the same command again to resume")


# ---- a custom reward runs in a worker: it cannot hang or end the run


MISBEHAVING = """
import os, signal, sys, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    what = solution_str
    if what == "hang":
        time.sleep(1000)
    if what == "stuck":  # where SIGALRM cannot reach: the parent must kill the worker
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(1000)
    if what == "exit":
        sys.exit(3)
    if what == "_exit":
        os._exit(4)
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "swallow":  # an `except Exception` cannot swallow the timeout
        try:
            time.sleep(1000)
        except Exception:
            return 1.0
    return {"score": 1.0, "pid": float(os.getpid())}

async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    import asyncio
    if solution_str == "hang":
        await asyncio.sleep(1000)
    await asyncio.sleep(0.2)
    return 1.0
"""


def rows_for(*responses):
    return [{"data_source": "x", "ground_truth": "1", "extra_info": {}} for _ in responses], list(responses)


def test_a_call_that_hangs_exits_or_kills_its_worker_is_an_error_for_that_sample_only(tmp_path):
    """In one batch, calls that hang (also where SIGALRM cannot reach, and inside `except Exception`), call sys.exit,
    os._exit, or SIGKILL their own process each score 0.0 as an error naming what happened, within timeout_s
    (+ 2 s for the one the parent must kill); every other call scores, in a worker that is not this process."""
    import rewards
    path = write(tmp_path / "r.py", MISBEHAVING)
    worker = rewards.load_reward_function(f"{path}:compute_score", 0.5)
    bad = ["hang", "stuck", "exit", "_exit", "swallow"]
    rows, responses = rows_for(*[x for b in bad for x in (b, "ok")])
    start = time.perf_counter()
    with pytest.warns(UserWarning, match=r"reward function failed on 5/10 samples .* first: TimeoutError: this call "
                                         r"took longer than reward.timeout_s=0.5 s"):
        scores, extras, errors = rewards.score_responses(worker, rows, responses)
    assert time.perf_counter() - start < 0.5 * 3 + 2.0 + 3.0  # the timer: hang, swallow; the kill: stuck; restarts
    assert scores == [0.0, 1.0] * 5 and errors == 5
    assert os.getpid() not in extras["pid"]
    results = worker.call_all([dict(data_source="x", solution_str=b, ground_truth="1") for b in bad])
    assert [str(r) for r in results] == [
        "TimeoutError: this call took longer than reward.timeout_s=0.5 s",
        "TimeoutError: this call took longer than reward.timeout_s=0.5 s, and its worker was stopped",
        "SystemExit: 3",
        "WorkerDied: the reward worker ended (exit code 4) during this call",
        "TimeoutError: this call took longer than reward.timeout_s=0.5 s"]
    # a function that ends its worker on every call costs at most MAX_LOST restarts a batch, not one per sample
    results = worker.call_all([dict(data_source="x", solution_str=b, ground_truth="1") for b in
                               ("kill", "_exit", "_exit", "ok", "ok")])
    assert [str(r) for r in results] == [
        "WorkerDied: the reward worker ended (killed by SIGKILL) during this call"] + [
        "WorkerDied: the reward worker ended (exit code 4) during this call"] * 2 + [
        "WorkerDied: not run, the reward worker was lost 3 times in this batch (a call hung past reward.timeout_s or "
        "ended the process)"] * 2


def test_an_async_reward_runs_its_calls_together_and_a_hung_one_times_out(tmp_path):
    """An `async def` function (verl's reward loop style) still runs a batch concurrently in the worker: 4 calls of
    0.2 s take well under 0.8 s, and one that never returns is cancelled after timeout_s, an error for it alone."""
    import rewards
    path = write(tmp_path / "r.py", MISBEHAVING)
    worker = rewards.load_reward_function(f"{path}:async_score", 1.0)
    start = time.perf_counter()
    assert rewards.score_responses(worker, *rows_for("a", "b", "c", "d")) == ([1.0] * 4, {}, 0)
    assert time.perf_counter() - start < 0.7
    with pytest.warns(UserWarning, match=r"failed on 1/3 samples .*TimeoutError"):
        assert rewards.score_responses(worker, *rows_for("a", "hang", "c")) == ([1.0, 0.0, 1.0], {}, 1)


class StopAfter:
    """runs.StopSignal's check_overdue, with the signal `since` seconds before the first check."""

    def __init__(self, since):
        self.signum, self.since = signal.SIGTERM, time.monotonic() - since

    def check_overdue(self, seconds):
        from infra.runs import StopSignal
        StopSignal.check_overdue(self, seconds)


def test_a_stop_signal_ends_a_hung_call_within_the_timeout(tmp_path):
    """After SIGTERM, a worker's wait gives up once reward.timeout_s has passed since the signal (Interrupted:
    exit code 143, its sentence), and the hung worker is stopped."""
    from infra.runs import Interrupted
    from infra.worker import FunctionWorker
    worker = FunctionWorker(str(write(tmp_path / "r.py", MISBEHAVING)), "compute_score", 30, StopAfter(since=29))
    start = time.perf_counter()
    with pytest.raises(Interrupted) as e:
        worker.call_all([dict(data_source="x", solution_str="stuck", ground_truth="1")])
    assert time.perf_counter() - start < 3 and e.value.signum == signal.SIGTERM and worker.proc is None
    assert str(e.value).startswith("stopped by SIGTERM while a reward call was still running 30 s later "
                                   "(reward.timeout_s); this step is not saved")


EVERY_CALL_EXITS = """
import os
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    os._exit(3)
"""
SOME_CALLS_HANG = """
import sys, time
calls = 0
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if calls % 4 == 0:
        time.sleep(1000)
    if calls % 4 == 1:
        sys.exit(0)
    return 1.0
"""


def test_a_reward_that_hangs_or_exits_on_some_samples_trains_on_and_counts_them(workdir, tmp_path):  # noqa: F811
    """A reward that hangs on every fourth call and calls sys.exit on another fourth (either used to stop the run:
    forever, or with exit 0): the run trains to the end (exit 0, final/ written), those 8 of 16 samples counted in
    reward/errors, the others scoring 1. (One worker process, so that its count of calls is the batch's.)"""
    reward = write(tmp_path / "r.py", SOME_CALLS_HANG)
    out = tmp_path / "out"
    run_ppo(workdir, out, f"reward.function={reward}:compute_score", "reward.timeout_s=0.3", "trainer.total_steps=1",
            "reward.max_concurrency=1", *QUIET)
    (line,) = read_metrics(out)
    assert line["reward/errors"] == 8 and line["score/mean"] == 0.5
    assert (out / "final" / "adapter_model.safetensors").exists()


def test_a_reward_that_ends_its_process_on_every_call_stops_the_run_in_one_sentence(workdir, tmp_path):  # noqa: F811
    """os._exit in every call (it used to end the whole run with exit 0, nothing trained, no message): exit 1, one
    sentence with the first error, no checkpoint."""
    reward = write(tmp_path / "r.py", EVERY_CALL_EXITS)
    out = tmp_path / "out"
    proc = run_ppo(workdir, out, f"reward.function={reward}:compute_score", *QUIET, expect_ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "ppo.py: the reward function failed on all 16 samples of a batch, so training would learn from zeros; the "
        "first error: WorkerDied: the reward worker ended (exit code 3) during this call")
    assert not any(name.startswith("step_") for name in os.listdir(out))


HANGS_AFTER_STEP_1 = """
import time
calls = 0
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if calls > 16:  # step 1 has 4 prompts × 4 samples
        open({marker!r}, "w").close()
        time.sleep(1000)
    return 1.0
"""


def test_sigterm_while_a_reward_call_hangs_stops_the_run_within_the_timeout(workdir, tmp_path, leftovers):  # noqa: F811
    """SIGTERM while step 2's reward call hangs (it was noted, then waited on forever): the run stops within
    reward.timeout_s of the signal, exit 143, with the sentence; step 1's checkpoint is kept, step 2 not saved, and the
    hung worker is not left behind. (One worker process, so that its count of calls is the run's.)"""
    marker, out = tmp_path / "hanging", tmp_path / "out"
    reward = write(tmp_path / "r.py", HANGS_AFTER_STEP_1.format(marker=str(marker)))
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", *base_args(workdir, out), *QUIET,
           f"reward.function={reward}:compute_score", "reward.timeout_s=4", "trainer.save_freq=1",
           "reward.max_concurrency=1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    start = time.perf_counter()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and time.perf_counter() - start < 4 + 4, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "ppo.py: stopped by SIGTERM while a reward call was still running 4 s later (reward.timeout_s); this step is "
        "not saved, the last checkpoint is kept: run the same command again to resume")
    assert sorted(p for p in os.listdir(out) if p.startswith("step_")) == ["step_1"]
    assert leftovers.after() == []


SLOW_VALIDATION = """
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    open({marker!r}, "w").close()
    time.sleep(0.4)
    return 1.0
"""


def test_sigterm_during_the_validation_before_training_exits_with_a_sentence(workdir, tmp_path):  # noqa: F811
    """The signal handler is installed before the first validation (SIGTERM there used to exit 143 silently):
    the validation ends, then the run stops with exit 143 and a sentence, before step 1, writing nothing."""
    marker, out = tmp_path / "validating", tmp_path / "out"
    reward = write(tmp_path / "r.py", SLOW_VALIDATION.format(marker=str(marker)))
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", *base_args(workdir, out),
           f"reward.function={reward}:compute_score", "trainer.val_before_train=true"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ("ppo.py: stopped by SIGTERM during the validation before training; "
                                               "nothing was trained")
    assert not any(name.startswith(("step_", "final")) for name in os.listdir(out))


# ---- runs that cannot learn stop


def strict_json_lines(path) -> list:
    def refuse(name):
        raise AssertionError(f"{name} in {path}")
    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def test_a_run_whose_every_step_is_skipped_stops_without_a_final_model(workdir, tmp_path):  # noqa: F811
    """A reward of 3e38 (let through by reward.max_abs_score=1e39) makes every loss non-finite, so every step is
    skipped: after trainer.max_skipped_steps in a row the run stops (it used to run to the end and write an
    untrained final/, exit 0) with exit 1 and the reason; metrics.jsonl is strict JSON, the non-finite losses as
    null."""
    out = tmp_path / "out"
    proc = run_ppo(workdir, out, f"reward.function={workdir}/nan_reward.py:compute_score", "reward.max_abs_score=1e39",
                   "trainer.total_steps=6", "trainer.max_skipped_steps=2", "trainer.save_freq=1", *QUIET,
                   expect_ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ppo.py: stopping at step 2: the last 2 steps each skipped an optimiser step because the loss or gradient "
        f"was not finite (NaN or inf: a reward too large, or a learning rate too high), so the model is not learning "
        f"(trainer.max_skipped_steps=2); final/ is not written and the checkpoint step_1 is kept ({out})")
    lines = strict_json_lines(out / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2] and lines[-1]["loss/policy"] is None
    assert not (out / "final").exists()


def test_reward_model_stops_after_its_skipped_steps_without_a_final_model(workdir, tmp_path):  # noqa: F811
    """reward_model.py with lr=1e30: step 1 blows the weights up, steps 2 and 3 are skipped; with
    reward_model.max_skipped_steps=2 it stops at step 3 with the reason, exit 1, and no final/."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = tmp_path / "rm"
    pairs = [{"prompt": f"What is {a} + 1?", "chosen": f"{a + 1} good", "rejected": f"{a + 1} bad"} for a in range(8)]
    pq.write_table(pa.Table.from_pylist(pairs), str(tmp_path / "pairs.parquet"))
    cmd = [sys.executable, "reward_model.py", "--config", "configs.yaml", f"reward_model.model_path={workdir}/model",
           f"reward_model.train_files={tmp_path}/pairs.parquet", "reward_model.val_files=null",
           f"reward_model.output_dir={out}", "reward_model.batch_size=4", "reward_model.total_steps=6",
           "reward_model.optim.lr=1e30", "reward_model.optim.warmup_ratio=0", "reward_model.lora_rank=0",
           "reward_model.save_freq=0", "reward_model.max_skipped_steps=2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "reward_model.py: stopping at step 3: the last 2 steps each skipped an optimiser step")
    assert "(reward_model.max_skipped_steps=2); final/ is not written" in proc.stderr
    assert [line["train/skipped_steps"] for line in strict_json_lines(out / "metrics.jsonl")] == [0, 1, 2]
    assert not (out / "final").exists()


# ---- checkpoints verify themselves


@pytest.fixture(scope="module")
def two_steps(workdir, tmp_path_factory):  # noqa: F811
    """A finished 2-step run with checkpoints step_1 and step_2 (each with its manifest)."""
    out = tmp_path_factory.mktemp("two_steps") / "out"
    run_ppo(workdir, out, "trainer.total_steps=2", "trainer.save_freq=1", "trainer.keep_checkpoints=5", *QUIET)
    return out


def copy_run(run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    shutil.rmtree(out / "final")
    return out


def tensors_file(checkpoint):
    (name,) = os.listdir(checkpoint / "tensors")
    return checkpoint / "tensors" / name


def flip_a_byte(path, at=-100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_checkpoint_records_its_files_and_its_base_model(two_steps):
    """manifest.json lists every file the checkpoint wrote with its size and sha256, and the base model's path and
    fingerprint."""
    from infra.manifests import fingerprint, sha256_of
    manifest = json.loads((two_steps / "step_2" / "manifest.json").read_text())
    on_disk = {os.path.relpath(os.path.join(root, n), two_steps / "step_2")
               for root, _, names in os.walk(two_steps / "step_2") for n in names} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and {"state.json", "rng_0.json"} <= on_disk
    for name, entry in manifest["files"].items():
        path = two_steps / "step_2" / name
        assert entry == {"size": path.stat().st_size, "sha256": sha256_of(str(path))}
    (key, base), = manifest["base_models"].items()
    assert key == "model.path" and base["fingerprint"] == fingerprint(base["path"]) is not None


def test_resume_auto_skips_a_damaged_checkpoint_for_the_newest_intact_one(workdir, two_steps, tmp_path):  # noqa: F811
    """A byte flipped in step_2's tensors (it used to end in `AssertionError: metadata is None` after the models
    loaded): resume=auto says step_2 is damaged and why, resumes from step_1, and moves step_2 aside, unlost."""
    out = copy_run(two_steps, tmp_path)
    damaged = tensors_file(out / "step_2")
    flip_a_byte(damaged)
    proc = run_ppo(workdir, out, "trainer.total_steps=3", "trainer.save_freq=1", "trainer.keep_checkpoints=5", *QUIET)
    assert (f"trainer.resume=auto: skipped the damaged step_2 ({damaged} has changed since it was written (its sha256 "
            f"differs)); resuming from {out}/step_1") in proc.stdout
    assert f"resumed from {out}/step_1 at step 1" in proc.stdout
    assert [line["step"] for line in read_metrics(out)] == [1, 2, 3]
    [aside] = os.listdir(out / "abandoned")
    assert "step_2" in os.listdir(out / "abandoned" / aside)


def cut(path, size: int):
    path.write_bytes(path.read_bytes()[:size])


@pytest.mark.parametrize("damage, problem", [
    (lambda step: cut(tensors_file(step), 5000), "{file} is 5000 bytes, {size} when it was written"),
    (lambda step: cut(step / "state.json", 16), "{step}/state.json is 16 bytes, {size} when it was written"),
    (lambda step: (step / "rng_0.json").unlink(), "{step}/rng_0.json is missing"),
    (lambda step: (step / "manifest.json").write_text("{"), "{step}/manifest.json is damaged (JSONDecodeError)"),
], ids=["truncated tensors", "cut state.json", "missing file", "damaged manifest"])
def test_resuming_a_damaged_checkpoint_names_the_file_before_any_model_loads(workdir, two_steps, tmp_path,  # noqa: F811
                                                                            no_model_loads, damage, problem):
    """trainer.resume=<a damaged step_2>: one sentence naming the damaged file and how it differs, before any model
    loads (a corrupt state.json used to raise JSONDecodeError after they had)."""
    import ppo
    out = copy_run(two_steps, tmp_path)
    step = out / "step_2"
    sizes = {name: entry["size"] for name, entry in json.loads((step / "manifest.json").read_text())["files"].items()}
    file = tensors_file(step)
    size = sizes["state.json"] if "state.json" in problem else sizes[os.path.relpath(file, step)]
    damage(step)
    with pytest.raises(ConfigError) as e:
        ppo.main(ppo_config(workdir, out, f"trainer.resume={step}", "trainer.total_steps=3"))
    assert str(e.value) == (f"trainer.resume: the checkpoint {step} is damaged: "
                            f"{problem.format(step=step, file=file, size=size)}; give another checkpoint, or auto (the "
                            f"newest intact one), or off")


def test_resume_auto_with_no_intact_checkpoint_fails_naming_each(workdir, two_steps, tmp_path,  # noqa: F811
                                                                 no_model_loads):
    """Every checkpoint damaged: resume=auto names each and how, and says how to start over; nothing loads."""
    import ppo
    out = copy_run(two_steps, tmp_path)
    for step in ("step_1", "step_2"):
        flip_a_byte(out / step / "state.json", at=2)
    with pytest.raises(ConfigError) as e:
        ppo.main(ppo_config(workdir, out, "trainer.total_steps=3"))
    assert str(e.value) == (
        f"trainer.resume=auto: no checkpoint in {out} is intact: step_2 ({out}/step_2/state.json has changed since it "
        f"was written (its sha256 differs)); step_1 ({out}/step_1/state.json has changed since it was written (its "
        f"sha256 differs)); set trainer.resume=off to start over (they are then moved to {out}/abandoned/)")


def test_a_checkpoint_without_a_manifest_still_names_a_damaged_file(workdir, two_steps, tmp_path):  # noqa: F811
    """A checkpoint from before manifests with truncated tensors (torch's loader logged a traceback and raised
    `AssertionError: metadata is None`): one sentence naming the file, exit 1, no traceback."""
    out = copy_run(two_steps, tmp_path)
    (out / "step_2" / "manifest.json").unlink()
    tensors_file(out / "step_2").write_bytes(tensors_file(out / "step_2").read_bytes()[:5000])
    proc = run_ppo(workdir, out, "trainer.total_steps=3", *QUIET, expect_ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ppo.py: the checkpoint {out}/step_2 cannot be read: {tensors_file(out / 'step_2')} is "
                           f"damaged (Error while deserializing header: ")
    assert last.endswith("); resume from an earlier checkpoint, or start over with resume=off")


def test_new_weights_at_the_base_models_path_fail_the_resume(workdir, tmp_path, no_model_loads):  # noqa: F811
    """The base model replaced by other weights under the same path (resume compared only the path, and went on
    with the old adapter on a different base): one sentence naming the key, before any model loads."""
    import ppo
    base, out = tmp_path / "base", tmp_path / "out"
    shutil.copytree(workdir / "model", base)
    run_ppo(workdir, out, f"model.path={base}", "trainer.total_steps=1", *QUIET)  # a subprocess: models load there
    make_tiny_model(base, seed=1)  # the same architecture and size, other weights
    with pytest.raises(ConfigError) as e:
        ppo.main(ppo_config(workdir, out, f"model.path={base}", "trainer.total_steps=2"))
    assert str(e.value).startswith(f"model.path: the model at {base} is not the one {out}/step_1 was trained from "
                                   f"(its config or weights changed since: fingerprint ")
    assert str(e.value).endswith("now); put that model back, or train from the new one in another output_dir (or "
                                 "with trainer.resume=off)")


# ---- issue 34: best/ is restored only when intact, and exports stay out of a run's own folders


def test_a_best_damaged_during_the_run_is_said_once_and_never_restored(workdir, tmp_path):  # noqa: F811
    """A 3-step run validating every step (rollout.val_n=2), best/ kept by val/score/mean with a rollback tolerance
    of 0.5: validation scores 1 at step 1 and 0 after, and the reward's first call of step 2's validation flips a
    byte of best/'s tensors. A rollback used to load them unchecked and step_2 then saved them with a fresh, valid
    manifest. Now: one sentence naming the damaged file, no rollback (train/rollbacks stays 0) and none tried again
    at step 3, exit 0; best/ is left as it is (still failing its own manifest), and the later checkpoints hold the
    trained weights, intact. Every val/ metric logged is one that start-up's check_best_metric allows."""
    import torch
    from infra.manifests import checkpoint_problem
    from test_ppo import checkpoint_tensors, write_reward
    out, counter, marker = tmp_path / "run", tmp_path / "val_calls", tmp_path / "damaged"
    reward = write_reward(tmp_path / "reward.py", f"""
    if index < 64:  # training rows
        return sum(c.isdigit() for c in text) / 8.0
    with open({str(counter)!r}, "a") as f:
        f.write("x")
    calls = os.path.getsize({str(counter)!r})
    if calls > 32:  # past step 1's validation (16 prompts × 2): damage best/ once
        try:
            os.close(os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return 0.0
        tensors = os.path.join({str(out / "best" / "tensors")!r}, os.listdir({str(out / "best" / "tensors")!r})[0])
        data = bytearray(open(tensors, "rb").read())
        data[-100] ^= 0xFF
        open(tensors, "wb").write(bytes(data))
    return 1.0 if calls <= 32 else 0.0
""")
    proc = run_ppo(workdir, out, reward, "trainer.total_steps=3", "trainer.test_freq=1", "trainer.save_freq=1",
                   "trainer.keep_checkpoints=3", "trainer.best_metric=val/score/mean", "trainer.rollback_tolerance=0.5",
                   "rollout.val_n=2", "rollout.val_temperature=1.0", *QUIET[1:])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    damaged = tensors_file(out / "best")
    problem = f"{damaged} has changed since it was written (its sha256 differs)"
    assert proc.stdout.count("no rollback at step") == 1 and "rollback at step" not in proc.stdout.replace(
        "no rollback at step", "")
    assert (f"no rollback at step 2: val/score/mean 0 fell more than trainer.rollback_tolerance 0.5 below its best, "
            f"1 at step 1, but best/ cannot be restored ({problem}); training goes on from the current weights, and "
            f"best/ is written anew when val/score/mean beats 1") in proc.stdout
    lines = [line for line in read_metrics(out) if line["step"] > 0]
    assert [line["val/score/mean"] for line in lines] == [1.0, 0.0, 0.0]
    assert [line["train/rollbacks"] for line in lines] == [0, 0, 0]
    assert checkpoint_problem(str(out / "best")) == problem  # not re-recorded
    assert all(checkpoint_problem(str(out / f"step_{n}")) is None for n in (1, 2, 3))
    best, step_2 = checkpoint_tensors(out / "best"), checkpoint_tensors(out / "step_2")
    assert not all(torch.equal(best[k], step_2[k]) for k in best)  # a rollback would have made them equal
    state = json.loads((out / "step_3" / "state.json").read_text())
    assert state["best"] == {"step": 1, "value": 1.0, "problem": problem}  # a resumed run does not try again
    from validation import logged_names
    cfg = ppo_config(workdir, out, "rollout.val_n=2", "rollout.val_temperature=1.0")
    logged = {key for line in lines for key in line if key.startswith("val/")}
    allowed = logged_names(cfg, {"arithmetic"})
    assert logged <= allowed and allowed - logged == {"val/maj@2/mean", "val/arithmetic/maj@2"}  # no "pred": no maj


class OneProcess:
    """The accelerator keep_best needs, for one process."""
    is_main_process, num_processes = True, 1

    def wait_for_everyone(self):
        pass


@pytest.fixture
def best_saved(tmp_path):
    """keep_best on a Linear layer after one Adam step, in an output_dir whose run recorded a base fingerprint:
    the first validation (1.0, step 1) saved best/. Returns (keep: value, step → keep_best's sentence, state, the
    layer, output_dir)."""
    import torch
    from infra.train_state import keep_best, TrainState
    from kl import KLController
    out = tmp_path / "run"
    write(out / "base_models.json", json.dumps({"model.path": {"path": "m", "fingerprint": "a" * 64}}))
    cfg = cli.load_config(None, ["trainer.best_metric=val/score/mean", "trainer.rollback_tolerance=0.5",
                                 f"trainer.output_dir={out}", "data.val_files=v.parquet"])
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state = TrainState(KLController("fixed", 0.1, 6.0, 10000), {})

    def keep(value, step):
        state.step = step
        return keep_best(OneProcess(), cfg, {"val/score/mean": value}, state, {"policy": (layer, optimizer)})
    assert keep(1.0, 1) is None and (out / "best" / "manifest.json").exists()
    return keep, state, layer, out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no process group: as meant
@pytest.mark.parametrize("damage, problem", [
    (lambda out: shutil.rmtree(out / "best"), "{out}/best is missing"),
    (lambda out: write(out / "base_models.json", json.dumps({"model.path": {"path": "m", "fingerprint": "b" * 64}})),
     "model.path: the model at m is not the one {out}/best was trained from (its config or weights changed since: "
     "fingerprint aaaaaaaaaaaa then, bbbbbbbbbbbb now)"),
    (lambda out: (out / "best" / "rng_0.json").unlink(), "{out}/best/rng_0.json is missing"),
], ids=["missing", "other base weights", "a file missing"])
def test_a_rollback_to_a_best_that_resume_would_refuse_is_skipped_once(best_saved, damage, problem):
    """best/ checked as resume checks a checkpoint (its files, and the base fingerprint its manifest recorded
    against this run's): when it fails, keep_best says so in one sentence, restores nothing, and tries no rollback
    again; a better validation then writes a fresh best/, which a later fall rolls back to."""
    import torch
    keep, state, layer, out = best_saved
    damage(out)
    weights = layer.weight.detach().clone()
    sentence = keep(0.0, 2)
    assert sentence.startswith("no rollback at step 2: val/score/mean 0 fell more than trainer.rollback_tolerance 0.5 "
                               "below its best, 1 at step 1, but best/ cannot be restored (")
    assert f"({problem.format(out=out)}); training goes on" in sentence and state.rollbacks == 0
    assert torch.equal(layer.weight, weights) and keep(0.0, 3) is None  # said once
    write(out / "base_models.json", json.dumps({"model.path": {"path": "m", "fingerprint": "a" * 64}}))
    assert keep(2.0, 4) is None and state.best == {"step": 4, "value": 2.0}  # a fresh best/
    at_best = layer.weight.detach().clone()
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert keep(0.5, 5).startswith("rollback at step 5:") and state.rollbacks == 1
    assert torch.equal(layer.weight, at_best)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_validation_without_the_best_metric_keeps_no_best_and_says_so(best_saved):
    """Only an environment's val/env/<key> can be missing at a validation (no sample gave it): keep_best writes
    nothing, rolls nothing back, and returns the sentence ppo.py prints."""
    from infra.train_state import keep_best
    keep, state, layer, out = best_saved
    cfg = cli.load_config(None, ["trainer.best_metric=val/score/mean", "trainer.rollback_tolerance=0.5",
                                 f"trainer.output_dir={out}", "data.val_files=v.parquet"])
    state.step = 2
    sentence = keep_best(OneProcess(), cfg, {"val/env/won": 0.0}, state, {"policy": (layer, None)})
    assert sentence == ("no best/ at step 2: trainer.best_metric=val/score/mean is not among this validation's metrics: "
                        "no sample's environment gave it in its infos (they gave val/env/won)")
    assert state.best == {"step": 1, "value": 1.0} and state.rollbacks == 0


@pytest.mark.parametrize("inside", ["step_2/hf", "step_1", "final/merged", "best/hf", "abandoned/x/hf", "step_9.tmp"])
def test_exports_into_a_runs_own_folders_are_refused(workdir, two_steps, tmp_path, no_model_loads, inside):  # noqa: F811
    """tools/export.py and tools/merge_lora.py with an output folder in a checkpoint, best/, final/ or abandoned/ of
    the run (which it prunes or overwrites later, deleting the export): one sentence, before any model loads,
    nothing written."""
    from tools.export import export
    from tools.merge_lora import merge_lora
    out = copy_run(two_steps, tmp_path)
    shutil.copytree(two_steps / "final", out / "final")
    (out / "best").mkdir()
    before = files_of(out)
    target = out / inside
    managed = out / inside.split("/")[0]
    for tool in (lambda: export(str(out / "step_2"), str(target)), lambda: merge_lora(str(out / "final"), str(target))):
        with pytest.raises(ConfigError) as e:
            tool()
        assert str(e.value) == (f"the output folder {target} {'is' if target == managed else 'lies in'} {managed}, "
                                f"which its run writes, prunes or replaces by itself; choose a folder outside the "
                                f"run's checkpoints, best/, final/ and abandoned/")
    assert files_of(out) == before


def test_export_checks_the_checkpoint_as_resume_does(workdir, two_steps, tmp_path, no_model_loads):  # noqa: F811
    """tools/export.py read a checkpoint without its manifest: a damaged file is now named and refused (exit 1, one
    sentence), and so is a base model whose fingerprint differs from the one the manifest recorded, before any model
    loads. (test_ppo.py's export test exports intact checkpoints through the same checks.)"""
    from tools.export import export
    out = copy_run(two_steps, tmp_path)
    flip_a_byte(tensors_file(out / "step_1"))
    proc = subprocess.run([sys.executable, "tools/export.py", str(out / "step_1"), str(tmp_path / "one")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and not (tmp_path / "one").exists()
    assert proc.stderr.strip().splitlines()[-1] == (
        f"tools/export.py: the checkpoint {out}/step_1 is damaged: {tensors_file(out / 'step_1')} has changed since it "
        f"was written (its sha256 differs); export another checkpoint")
    manifest = json.loads((out / "step_2" / "manifest.json").read_text())
    manifest["base_models"]["model.path"]["fingerprint"] = "0" * 64  # as if trained from other weights at that path
    (out / "step_2" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as e:
        export(str(out / "step_2"), str(out / "step_2_hf"))
    assert str(e.value).startswith(f"model.path: the model at {workdir}/model is not the one {out}/step_2 was trained "
                                   f"from (its config or weights changed since: fingerprint 000000000000 then, ")
    assert str(e.value).endswith(" now), so its adapter or weights would be put on other weights; put that model back "
                                 f"at {workdir}/model")
    assert not (out / "step_2_hf").exists()


def test_a_best_whose_state_cannot_be_read_is_set_aside_on_resume(tmp_path):
    """runs.set_aside_later read best/state.json unguarded (a damaged one was a JSONDecodeError traceback at
    start-up): resuming at step 2 now moves an unreadable best/ aside, unlost and never trusted, keeping step_1 and
    step_2."""
    from infra.runs import best_step, set_aside_later
    out = tmp_path / "run"
    for step in (1, 2):
        (out / f"step_{step}").mkdir(parents=True)
    write(out / "best" / "state.json", '{"step": 1')
    set_aside_later(str(out), 2, str(out / "metrics.jsonl"))
    assert best_step(str(out)) is None and sorted(os.listdir(out)) == ["abandoned", "step_1", "step_2"]
    (aside,) = os.listdir(out / "abandoned")
    assert (out / "abandoned" / aside / "best" / "state.json").read_text() == '{"step": 1'
