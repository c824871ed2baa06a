"""Trust and faults (issue 12): one run per output_dir, preemption, branches, resuming with a changed config,
and bad input that fails in one sentence before any model loads.

Bad inputs run ppo.main / reward_model.main in this process with model loading made to fail
(`no_model_loads`): the sentence they raise instead proves the check came before any model. A few
subprocess runs cover what only a real process shows: exit codes, a clean stderr, 2 processes, signals,
a lock holder killed with SIGKILL.
"""
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from infra import cli
from infra import config
import data
from conftest import free_port, REPO, make_tokenizer, read_metrics
from test_data import write_invalid_utf8
from test_ppo import base_args, run_ppo, workdir  # noqa: F401 (workdir is a fixture)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any from_pretrained of a model (not a tokenizer) fails the test."""
    import transformers

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"a model was loaded ({cls.__name__}) before the check")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


def write(path, text=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def prompts_file(path, *prompts):
    pq.write_table(pa.table({"prompt": list(prompts)}), str(path))
    return path


def pairs_file(path, **row):
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3", **row}]),
                   str(path))
    return path


def ppo_config(root, out, *overrides):
    return cli.load_config(f"{REPO}/configs.yaml", base_args(root, out) + list(overrides))


def rm_args(root, out):
    return [f"reward_model.model_path={root}/model", f"reward_model.train_files={pairs_file(root / 'pairs.parquet')}",
            "reward_model.val_files=null", f"reward_model.output_dir={out}", "reward_model.batch_size=1",
            "reward_model.lora_rank=0"]


def rm_config(root, out, *overrides):
    return cli.load_config(f"{REPO}/configs.yaml", rm_args(root, out) + list(overrides), root=config.RewardModelStage)


def checkpoint_of(root, out, *overrides):
    """A stand-in step_2 checkpoint in `out`, with the config.yaml of a run made with `overrides`."""
    write(out / "step_2" / "state.json", "{}")
    cli.save(ppo_config(root, out, *overrides), str(out / "config.yaml"))
    return out


def tokenizer_only(path, chat_template=True):
    tok = make_tokenizer()
    if not chat_template:
        tok.chat_template = None
    tok.save_pretrained(path)
    return path


PLANTED = """
open({marker!r}, "w").close()  # what a model folder's code could do: it must never run
"""


def planted_folder(path, root, tmp, part="model"):
    """A copy of the tiny model whose config.json (part="model") or tokenizer_config.json (part="tokenizer") maps its
    classes to planted.py, a file that leaves tmp/RAN behind when imported; the model type and tokenizer class are
    ones transformers does not have, so only that code could load them."""
    import json
    shutil.copytree(root / "model", path)
    name = "config.json" if part == "model" else "tokenizer_config.json"
    config = json.loads((path / name).read_text())
    if part == "model":
        config.update(model_type="planted_llama", auto_map={"AutoConfig": "planted.PlantedConfig",
                                                            "AutoModelForCausalLM": "planted.PlantedModel"})
    else:
        config.update(tokenizer_class="PlantedTokenizer",
                      auto_map={"AutoTokenizer": ["planted.PlantedTokenizer", None]})
    (path / name).write_text(json.dumps(config))
    write(path / "planted.py", PLANTED.format(marker=str(tmp / "RAN")))
    return path


def pickled_folder(path, root, tmp, weights="pytorch_model.bin"):
    """A copy of the tiny model whose weights are a pickle (what torch.save writes) instead of safetensors; it holds
    a payload that would leave tmp/RAN behind if it were ever unpickled."""
    shutil.copytree(root / "model", path)
    (path / "model.safetensors").unlink()
    subprocess.run([sys.executable, "-c", PAYLOAD.format(marker=tmp / "RAN", paths=[str(path / weights)])], check=True)
    return path


def adapter_folder(path, root):
    """A LoRA adapter folder as ppo.py's final/ holds one (adapter_config.json naming its base, and the weights)."""
    import json
    write(path / "adapter_config.json", json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(root / "model"),
                                                    "r": 8, "target_modules": ["q_proj"]}))
    write(path / "adapter_model.safetensors", "")
    return path


def ground_truths_file(path, *truths):
    """Arithmetic prompts (scored by the built-in rule, which compares with the ground truth: the cases set
    reward.function=null) with these truths."""
    pq.write_table(pa.table({"prompt": [f"What is {i} + 1?" for i in range(len(truths))], "ground_truth": list(truths),
                             "data_source": ["arithmetic"] * len(truths)}), str(path))
    return path


GROUND_TRUTH_SENTENCE = ("{tmp}/g.parquet row 1: the ground truth is %s, but data_source 'arithmetic' is scored by "
                         "library.arithmetic_score, which compares each response with it; fill it in or drop the row")


# case → (setup(tmp, root) → overrides, the sentence, formatted with {tmp} and {root})
PPO_CASES = {
    "reward file missing": (lambda tmp, root: [f"reward.function={tmp}/nope.py:compute_score"],
                            "reward.function: file {tmp}/nope.py does not exist"),
    "reward function missing": (lambda tmp, root: [f"reward.function={root}/reward.py:score_it"],
                                "reward.function: {root}/reward.py has no function `score_it`"),
    "reward syntax error": (lambda tmp, root: [f"reward.function={write(tmp / 'bad.py', 'def f(:')}:f"],
                            "reward.function: importing {tmp}/bad.py failed: SyntaxError"),
    "reward import error": (lambda tmp, root: [f"reward.function={write(tmp / 'imp.py', 'import no_such_xyz')}:f"],
                            "failed: ModuleNotFoundError: No module named 'no_such_xyz'"),
    "output_dir unwritable": (lambda tmp, root: [f"trainer.output_dir={write(tmp / 'a_file')}/out"],
                              "trainer.output_dir: cannot write to {tmp}/a_file/out (Not a directory)"),
    "resume path missing": (lambda tmp, root: [f"trainer.resume={tmp}/step_9"],
                            "trainer.resume: {tmp}/step_9 is not a checkpoint"),
    "resume folder renamed": (lambda tmp, root: [f"trainer.resume={write(tmp / 'best' / 'state.json').parent}"],
                              "trainer.resume: {tmp}/best is not a checkpoint (a step_<N> folder"),
    "model path missing": (lambda tmp, root: [f"model.path={tmp}/no_model"],
                           "model.path: {tmp}/no_model is not a folder"),
    "tokenizer but no model": (lambda tmp, root: [f"model.path={tokenizer_only(tmp / 'tok')}"],
                               "model.path: {tmp}/tok holds no model (config.json and *.safetensors weights)"),
    "reward model missing": (lambda tmp, root: ["reward.type=model"], "reward.type=model needs reward.model_path"),
    "data file is a folder": (lambda tmp, root: [f"data.train_files={tmp}"], "data file {tmp} is a directory"),
    "data not utf-8": (lambda tmp, root: [f"data.train_files={write_invalid_utf8(tmp / 'u.parquet')}"],
                       "data file {tmp}/u.parquet holds text that is not valid UTF-8"),
    "prompt of 0 tokens": (lambda tmp, root: [f"model.tokenizer_path={tokenizer_only(tmp / 't', chat_template=False)}",
                                              f"data.train_files={prompts_file(tmp / 'p.parquet', 'What is 1?', '')}"],
                           "{tmp}/p.parquet row 1: the prompt is 0 tokens once rendered"),
    "rollout_is without sampler logprobs": (  # base_args: rollout.name=hf, whose rollout has no logprobs (issue 21)
        lambda tmp, root: ["algorithm.rollout_is=token"],
        "algorithm.rollout_is=token corrects by the sampler's own logprobs, which only rollout.name=vllm or server "
        "gives (rollout.name is hf); use one of them, or set algorithm.rollout_is to off"),
    "rejection without sampler logprobs": (
        lambda tmp, root: ["algorithm.rollout_rs=sequence_mean"],
        "algorithm.rollout_rs=sequence_mean corrects by the sampler's own logprobs, which only rollout.name=vllm"),
    "greedy validation at k": (lambda tmp, root: ["rollout.val_n=4"],
                               "rollout.val_n=4 greedy samples (rollout.val_temperature=0) are one answer 4 times"),
    "rollback without a best metric": (lambda tmp, root: ["trainer.rollback_tolerance=0.1"],
                                       "trainer.rollback_tolerance rolls back to the best checkpoint: set "
                                       "trainer.best_metric too"),
    # issue 24: no code from a model folder, no pickles, no adapter as a model, ground truths checked on reading
    "model folder with code": (lambda tmp, root: [f"model.path={planted_folder(tmp / 'planted', root, tmp)}"],
                               "model.path: {tmp}/planted/config.json maps its classes to code in the folder "
                               "(planted.py), which runs only with model.trust_remote_code=true; set it if you trust "
                               "that code, or give a folder transformers loads by itself"),
    "tokenizer with code": (lambda tmp, root: [f"model.path={planted_folder(tmp / 'p', root, tmp, 'tokenizer')}"],
                            "model.path: {tmp}/p/tokenizer_config.json maps its classes to code in the folder "
                            "(planted.py), which runs only with model.trust_remote_code=true"),
    "critic backbone with code": (lambda tmp, root: ["algorithm.adv_estimator=gae",
                                                     f"critic.model_path={planted_folder(tmp / 'c', root, tmp)}"],
                                  "critic.model_path: {tmp}/c/config.json maps its classes to code in the folder"),
    "pickle weights": (lambda tmp, root: [f"model.path={pickled_folder(tmp / 'pk', root, tmp)}"],
                       "model.path: {tmp}/pk holds only pickle weights (pytorch_model.bin), which this library does "
                       "not load (unpickling can run code); convert them to safetensors once, where you trust the "
                       "file: python -c \"from transformers import LlamaForCausalLM as M; "
                       "M.from_pretrained('{tmp}/pk').save_pretrained('{tmp}/pk')\""),
    "reward model of pickles": (lambda tmp, root: ["reward.type=model",
                                                   f"reward.model_path={pickled_folder(tmp / 'rm', root, tmp)}"],
                                "reward.model_path: {tmp}/rm holds only pickle weights (pytorch_model.bin)"),
    "adapter as model.path": (lambda tmp, root: [f"model.path={adapter_folder(tmp / 'final', root)}"],
                              "model.path: {tmp}/final is a LoRA adapter (adapter_config.json), not a whole model; "
                              "merge it into its base first, python tools/merge_lora.py {tmp}/final "
                              "{tmp}/final-merged, and give {tmp}/final-merged"),
    "NaN ground truth": (lambda tmp, root: [f"data.train_files={ground_truths_file(tmp / 'g.parquet', 3.0, math.nan)}",
                                  "reward.function=null"],
                         GROUND_TRUTH_SENTENCE % "NaN"),
    "null ground truth": (lambda tmp, root: [f"data.train_files={ground_truths_file(tmp / 'g.parquet', '3', None)}",
                                  "reward.function=null"],
                          GROUND_TRUTH_SENTENCE % "null"),
    "empty ground truth": (lambda tmp, root: [f"data.train_files={ground_truths_file(tmp / 'g.parquet', '3', ' ')}",
                                  "reward.function=null"],
                           GROUND_TRUTH_SENTENCE % "empty"),
    "'nan' ground truth": (lambda tmp, root: [f"data.val_files={ground_truths_file(tmp / 'g.parquet', '3', 'nan')}",
                                  "reward.function=null"],
                           GROUND_TRUTH_SENTENCE % "the text 'nan' (a missing number written out)"),
    "fixed key changed on resume": (
        lambda tmp, root: [f"trainer.output_dir={checkpoint_of(root, tmp / 'out', 'model.lora_rank=8')}",
                           "model.lora_rank=4"],
        "`model.lora_rank` cannot change on resume (it was 8 in {tmp}/out/config.yaml, now 4)"),
}


@pytest.mark.parametrize("case", PPO_CASES)
def test_ppo_bad_input_fails_in_one_sentence_before_any_model_loads(workdir, tmp_path, no_model_loads, case):
    """Each bad input raises one sentence naming the key or file (and the fix), and no model was loaded first."""
    import ppo
    setup, message = PPO_CASES[case]
    cfg = ppo_config(workdir, tmp_path / "run", *setup(tmp_path, workdir))
    with pytest.raises((config.ConfigError, data.DataError)) as e:
        ppo.main(cfg)
    assert message.format(tmp=tmp_path, root=workdir) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "RAN").exists(), "code from a model folder, or a pickle, ran"


RM_CASES = {
    "model path missing": (lambda tmp, root: [f"reward_model.model_path={tmp}/nope"],
                           "reward_model.model_path: {tmp}/nope is not a folder"),
    "tokenizer but no model": (lambda tmp, root: [f"reward_model.model_path={tokenizer_only(tmp / 'tok')}"],
                               "reward_model.model_path: {tmp}/tok holds no model"),
    "empty chosen": (lambda tmp, root: [f"reward_model.train_files={pairs_file(tmp / 'p.parquet', chosen='')}"],
                     "{tmp}/p.parquet row 0: `chosen` and `rejected` must not be empty"),
    "non-numeric margin": (lambda tmp, root: [f"reward_model.train_files={pairs_file(tmp / 'p.parquet', margin='x')}"],
                           "{tmp}/p.parquet row 0: `margin` must be a finite number or null, got 'x'"),
    "resume path missing": (lambda tmp, root: [f"reward_model.resume={tmp}/step_3"],
                            "reward_model.resume: {tmp}/step_3 is not a checkpoint"),
    "backbone with code": (lambda tmp, root: [f"reward_model.model_path={planted_folder(tmp / 'b', root, tmp)}"],
                           "reward_model.model_path: {tmp}/b/config.json maps its classes to code in the folder "
                           "(planted.py), which runs only with reward_model.trust_remote_code=true"),
    "backbone of pickles": (lambda tmp, root: [f"reward_model.model_path={pickled_folder(tmp / 'b', root, tmp)}"],
                            "reward_model.model_path: {tmp}/b holds only pickle weights (pytorch_model.bin)"),
}


@pytest.mark.parametrize("case", RM_CASES)
def test_reward_model_bad_input_fails_in_one_sentence_before_any_model_loads(workdir, tmp_path, no_model_loads, case):
    """As for ppo.py: reward_model.py checks its inputs before it loads the backbone."""
    import reward_model
    setup, message = RM_CASES[case]
    cfg = rm_config(workdir, tmp_path / "run", *setup(tmp_path, workdir))
    with pytest.raises((config.ConfigError, data.DataError)) as e:
        reward_model.main(cfg)
    assert message.format(tmp=tmp_path, root=workdir) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "RAN").exists(), "code from a model folder, or a pickle, ran"


@pytest.mark.parametrize("override, sentence", [
    ("rollout.top_p=1.5", "config key `rollout.top_p` must be in (0, 1], got 1.5"),  # found while parsing
    ("actor.optim.betas=[0.9]", "config key `actor.optim.betas` must hold 2 values, got 1: [0.9]"),  # was IndexError
    ("trainer.resume={tmp}/step_5", "trainer.resume: {tmp}/step_5 is not a checkpoint (a step_<N> folder written by "
                                    "a run, under its own name); give one, or auto (the latest in output_dir), or off"),
])
def test_cli_prints_the_sentence_once_without_a_traceback(workdir, tmp_path, override, sentence):
    """`python ppo.py` with a bad input: exit code 1 and stderr ending in the one `ppo.py: …` line, no traceback."""
    proc = run_ppo(workdir, tmp_path / "out", override.format(tmp=tmp_path), expect_ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "ppo.py: " + sentence.format(tmp=tmp_path)


def test_a_model_neither_local_nor_on_the_hub_fails_in_one_sentence(workdir, tmp_path, monkeypatch):
    """model.path that reads as a hub id (no local folder of that name) and that the hub does not give (offline
    here): one sentence naming the key, no traceback, before any model loads."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the subprocess fails at once instead of retrying the network
    proc = run_ppo(workdir, tmp_path / "out", "model.path=nope-org/nope-model", "algorithm.adv_estimator=grpo",
                   expect_ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "ppo.py: model.path: nope-org/nope-model is not a local folder, and the hub did not give it (")


def test_two_processes_print_the_sentence_once(workdir, tmp_path):
    """With 2 processes (DDP over gloo) every rank stops, and only rank 0 prints the sentence. (The launcher,
    torch elastic, then prints its own ChildFailedError report, which ppo.py cannot silence.)"""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "ppo.py", "--config",
           "configs.yaml", *base_args(workdir, tmp_path / "out"), f"trainer.resume={tmp_path}/step_5"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count(f"ppo.py: trainer.resume: {tmp_path}/step_5 is not a checkpoint") == 1


FAILS_ON_RANK_1 = """
import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1's reward service is down")
    return 0.5
"""


def test_a_reward_failing_on_one_of_two_processes_stops_both(workdir, tmp_path):
    """The reward fails on every sample of rank 1's batch only (RewardError there): both processes stop at that
    step, within the timeout (rank 0 used to wait for rank 1 at the next collective), and rank 0 prints rank 1's
    message once."""
    reward = write(tmp_path / "reward.py", FAILS_ON_RANK_1)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp_cpu.yaml",
           "--num_processes", "2", "--main_process_port", str(free_port()), "ppo.py", "--config", "configs.yaml",
           *base_args(workdir, tmp_path / "out"), f"reward.function={reward}:compute_score",
           "trainer.val_before_train=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    sentence = ("ppo.py: the reward function failed on all 8 samples of a batch, so training would learn from zeros; "
                "the first error: RuntimeError: rank 1's reward service is down")
    assert (proc.stdout + proc.stderr).count(sentence) == 1, proc.stderr[-3000:]
    assert not (tmp_path / "out" / "step_1").exists()


# ---- one run per output_dir


HOLD_LOCK = """
import sys, time, types
sys.path.insert(0, {repo!r})
from infra import runs
one_process = types.SimpleNamespace(is_main_process=True, num_processes=1)
lock = runs.lock_output_dir(one_process, {out!r}, "trainer.output_dir")
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_run_fails_naming_the_holder_and_a_killed_holder_leaves_no_lock(workdir, tmp_path, no_model_loads):
    """While another process holds output_dir, ppo.py stops at once naming its pid and host; once that holder
    is killed with SIGKILL (no clean-up at all) the folder is free again and the new run records itself."""
    import ppo
    from infra.runs import lock_output_dir
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(repo=REPO, out=str(out))], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(config.ConfigError) as e:
            ppo.main(ppo_config(workdir, out))
        assert str(e.value) == (f"trainer.output_dir: {out} is in use by another run (pid {holder.pid} on host "
                                f"{socket.gethostname()}); wait for it to end, or choose another output_dir")
    finally:
        holder.kill()
        holder.wait()
    lock = lock_output_dir(types.SimpleNamespace(is_main_process=True, num_processes=1), str(out), "trainer.output_dir")
    assert (out / ".lock").read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
    lock.close()


# ---- preemption


def stop_mid_run(cmd, out, send_signal):
    """Start `cmd`, wait for its first metrics line, call send_signal(proc); returns (proc, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (out / "metrics.jsonl").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    send_signal(proc)
    stdout, stderr = proc.communicate(timeout=240)
    return proc, stdout, stderr


def pid_of_rank(rank: int, marker: str) -> int:
    """The pid of the process whose command line holds `marker` and whose environment has RANK=<rank>."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/environ", "rb") as g:
                cmdline, environ = f.read().decode(errors="replace"), g.read().split(b"\0")
        except OSError:
            continue
        if marker in cmdline and f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no process of rank {rank}")


LONG_RUN = ["trainer.total_steps=500", "trainer.save_freq=0", "trainer.test_freq=0", "trainer.sample_freq=0",
            "trainer.val_before_train=false"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_finishes_the_step_saves_and_exits_non_zero(workdir, tmp_path, sig, leftovers):
    """SIGTERM (Slurm's preemption) or Ctrl-C in the middle of training: the step in progress finishes, a
    checkpoint of it is saved, one line says so, the exit code is 128 + the signal, there is no traceback, and no
    process of the run (its reward workers) is left."""
    out = tmp_path / "out"
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", *base_args(workdir, out), *LONG_RUN]
    proc, stdout, stderr = stop_mid_run(cmd, out, lambda proc: proc.send_signal(sig))
    assert proc.returncode == 128 + sig, stderr[-3000:]
    step = read_metrics(out)[-1]["step"]
    assert f"stopped by {sig.name} after step {step}, checkpoint saved" in stdout
    assert [p for p in os.listdir(out) if p.startswith("step_")] == [f"step_{step}"]
    assert "Traceback" not in stderr and leftovers.after() == []


def test_a_signal_to_one_of_two_processes_stops_both_at_the_same_step(workdir, tmp_path):
    """With 2 processes, SIGTERM to rank 1 alone: the ranks agree (the flag is reduced with max), so both save
    one checkpoint of the same step, and rank 0 says so."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "ppo.py", "--config",
           "configs.yaml", *base_args(workdir, out), *LONG_RUN]
    proc, stdout, stderr = stop_mid_run(cmd, out, lambda proc: os.kill(pid_of_rank(1, str(out)), signal.SIGTERM))
    step = read_metrics(out)[-1]["step"]
    assert proc.returncode != 0 and f"stopped by SIGTERM after step {step}, checkpoint saved" in stdout, stderr[-3000:]
    assert [p for p in os.listdir(out) if p.startswith("step_")] == [f"step_{step}"]


def test_reward_model_stops_on_sigterm_with_a_checkpoint(workdir, tmp_path):
    """reward_model.py handles SIGTERM as ppo.py does: the step finishes, is saved, and the exit code is 143."""
    out = tmp_path / "rm"
    cmd = [sys.executable, "reward_model.py", "--config", "configs.yaml", *rm_args(workdir, out),
           "reward_model.total_steps=500", "reward_model.save_freq=0", "reward_model.eval_freq=0"]
    proc, stdout, stderr = stop_mid_run(cmd, out, lambda proc: proc.send_signal(signal.SIGTERM))
    step = read_metrics(out)[-1]["step"]
    assert proc.returncode == 143 and f"stopped by SIGTERM after step {step}, checkpoint saved" in stdout, stderr
    assert [p for p in os.listdir(out) if p.startswith("step_")] == [f"step_{step}"]


# ---- resuming: branches, a changed config, a cut-off metrics line, a finished run


def test_resuming_an_older_checkpoint_starts_a_branch_with_the_new_lr(workdir, tmp_path, no_model_loads, capsys):
    """A 3-step run (checkpoints 1–3, final/) whose metrics.jsonl ends in a line cut short by a kill, resumed
    from step_1 with a new lr and total_steps=2: the changed keys are listed; step_2, step_3, final/ and the
    metric lines of steps 2–3 move to abandoned/; metrics.jsonl holds one history (steps 0, 1, 2) in which step 2
    ran at the new lr. Each checkpoint keeps the config.yaml it was trained with (issue 32: the abandoned ones used to
    lose theirs), and resuming one of them compares with its own. Run again, it is finished: nothing to train, no
    model loaded, final/ not rewritten."""
    import ppo
    out = tmp_path / "out"
    run_ppo(workdir, out, "trainer.save_freq=1", "trainer.keep_checkpoints=5", "trainer.sample_freq=0")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "score/me')
    proc = run_ppo(workdir, out, "trainer.save_freq=1", "trainer.keep_checkpoints=5", "trainer.sample_freq=0",
                   f"trainer.resume={out}/step_1", "actor.optim.lr=5e-4", "trainer.total_steps=2")
    assert (f"changed since {out}/step_1: actor.optim.lr 0.001 → 0.0005, trainer.total_steps 3 → 2, "
            f"trainer.resume 'auto' → '{out}/step_1'") in proc.stdout
    lines = read_metrics(out)
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert lines[1]["actor/lr"] == 1e-3 and lines[2]["actor/lr"] == 5e-4
    assert sorted(p for p in os.listdir(out) if p.startswith("step_")) == ["step_1", "step_2"]
    [aside] = os.listdir(out / "abandoned")
    assert sorted(os.listdir(out / "abandoned" / aside)) == ["final", "metrics.jsonl", "step_2", "step_3"]
    assert [line["step"] for line in read_metrics(out / "abandoned" / aside)] == [2, 3]
    lr_of = {path: cli.load_config(str(out / path / "config.yaml"), []).actor.optim.lr
             for path in (f"abandoned/{aside}/step_2", f"abandoned/{aside}/step_3", "step_1", "step_2")}
    assert list(lr_of.values()) == [1e-3, 1e-3, 1e-3, 5e-4]
    abandoned = out / "abandoned" / aside / "step_3"
    with pytest.raises(config.ConfigError, match=re.escape(
            f"`model.lora_rank` cannot change on resume (it was 8 in {abandoned}/config.yaml, now 4)")):
        ppo.main(ppo_config(workdir, out, f"trainer.resume={abandoned}", "model.lora_rank=4"))

    before = os.stat(out / "final" / "adapter_model.safetensors").st_mtime_ns
    capsys.readouterr()
    assert ppo.main(ppo_config(workdir, out, "trainer.total_steps=2", "actor.optim.lr=5e-4")) is None
    assert f"nothing to train: {out}/step_2 is at step 2 of trainer.total_steps=2" in capsys.readouterr().out
    assert os.stat(out / "final" / "adapter_model.safetensors").st_mtime_ns == before


def test_a_fresh_start_moves_the_checkpoints_of_an_earlier_run_aside(workdir, tmp_path):
    """trainer.resume=off in a folder holding another run's step_5 and final/: they and its metrics move to
    abandoned/from_step_0_<time>/, so a later resume=auto cannot jump into that other history."""
    out = tmp_path / "out"
    write(out / "step_5" / "state.json", "{}")
    write(out / "final" / "config.json", "{}")
    write(out / "metrics.jsonl", '{"step": 4}\n{"step": 5}\n')
    run_ppo(workdir, out, "trainer.resume=off", "trainer.total_steps=1", "trainer.sample_freq=0")
    [aside] = os.listdir(out / "abandoned")
    assert aside.startswith("from_step_0_")
    assert sorted(os.listdir(out / "abandoned" / aside)) == ["final", "metrics.jsonl", "step_5"]
    assert [line["step"] for line in read_metrics(out / "abandoned" / aside)] == [4, 5]
    assert [line["step"] for line in read_metrics(out)] == [0, 1]
    assert sorted(p for p in os.listdir(out) if p.startswith("step_")) == ["step_1"]


def test_metrics_past_the_checkpoint_and_a_cut_off_line_are_dropped(tmp_path):
    """drop_metrics_after keeps the lines up to the step, moves later ones aside when asked, and skips a line
    that a kill cut short (it would otherwise stop the resume with a JSON error)."""
    from infra.metrics import drop_metrics_after
    path, aside = tmp_path / "metrics.jsonl", tmp_path / "aside.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "a')
    drop_metrics_after(str(path), 2, str(aside))
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n' and aside.read_text() == '{"step": 3}\n'


# ---- reward_model.py: non-finite steps are skipped, a non-finite model is not saved


def test_reward_model_skips_non_finite_steps_and_refuses_to_save_a_non_finite_model(workdir, tmp_path):
    """lr=1e30 blows the weights up at step 1, so later losses are NaN: those steps are skipped and counted,
    and at the end the NaN scores stop the run (exit 1, one sentence) without writing final/."""
    out = tmp_path / "rm"
    pairs = [{"prompt": f"What is {a} + 1?", "chosen": f"{a + 1} good", "rejected": f"{a + 1} bad"} for a in range(8)]
    pq.write_table(pa.Table.from_pylist(pairs), str(tmp_path / "pairs.parquet"))
    cmd = [sys.executable, "reward_model.py", "--config", "configs.yaml", f"reward_model.model_path={workdir}/model",
           f"reward_model.train_files={tmp_path}/pairs.parquet", "reward_model.val_files=null",
           f"reward_model.output_dir={out}", "reward_model.batch_size=4", "reward_model.total_steps=3",
           "reward_model.optim.lr=1e30", "reward_model.optim.warmup_ratio=0", "reward_model.lora_rank=0",
           "reward_model.save_freq=0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert [line["train/skipped_steps"] for line in read_metrics(out)] == [0, 1, 2]
    assert "is not finite, so final/ is not written" in proc.stderr.strip().splitlines()[-1]
    assert not (out / "final").exists()


def test_non_finite_names_the_first_bad_weight_or_statistic():
    """The guard before final/ is written: NaN or inf in a statistic or any weight is found and named."""
    import torch
    from reward_model import non_finite
    model = torch.nn.Linear(2, 1)
    assert non_finite(model, {"mean": 0.1, "std": 1.0}) is None
    assert non_finite(model, {"mean": float("nan"), "std": 1.0}) == "reward_stats mean=nan"
    with torch.no_grad():
        model.bias.fill_(float("inf"))
    assert non_finite(model, {"mean": 0.1, "std": 1.0}) == "weight bias"


PAYLOAD = """
import os, pickle
class Payload:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
for path in {paths!r}:
    with open(path, "wb") as f:
        pickle.dump(Payload(), f)
"""


def test_resuming_never_unpickles_a_planted_file(workdir, tmp_path):
    """A checkpoint is safetensors and JSON only: pickles planted where accelerate's and DCP's loaders would
    unpickle them (custom_checkpoint_0.pkl, the tensors' .metadata, optimizer.bin) are never opened by a
    default `resume=auto` run, which resumes and finishes, and the payload's marker file never appears."""
    out, marker = tmp_path / "out", tmp_path / "payload_ran"
    run_ppo(workdir, out, "trainer.total_steps=2", "trainer.save_freq=1", "trainer.test_freq=0")
    step = out / "step_2"
    planted = [str(step / "custom_checkpoint_0.pkl"), str(step / "tensors" / ".metadata"), str(step / "optimizer.bin")]
    subprocess.run([sys.executable, "-c", PAYLOAD.format(marker=marker, paths=planted)], check=True)
    for name in ("final", "step_1"):
        shutil.rmtree(out / name, ignore_errors=True)
    proc = run_ppo(workdir, out, "trainer.total_steps=3", "trainer.save_freq=1", "trainer.test_freq=0")
    assert f"resumed from {step} at step 2" in proc.stdout
    assert [m["step"] for m in read_metrics(out) if m["step"] > 0] == [1, 2, 3]
    assert not marker.exists(), "a planted pickle was executed"
    # the payload itself works: unpickling one runs it
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({planted[0]!r}, 'rb'))"], check=True)
    assert marker.exists()


# ---- config files (issue 24): a key twice, aliases, values quoted in errors, fixed-length lists

BILLION_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefg", "bcdefgh")) + "trainer:\n  logger: *h\n"


@pytest.mark.parametrize("text, sentence", [
    ("trainer:\n  total_steps: 3\nmodel:\n  lora_rank: 4\ntrainer:\n  save_freq: 1\n",
     "line 5: `trainer` is given twice in the same section (first on line 1); keep one"),
    ("trainer:\n  total_steps: 3\n  total_steps: 4\n",
     "line 3: `total_steps` is given twice in the same section (first on line 2); keep one"),
    (BILLION_LAUGHS, "line 2: `*a` is a YAML alias, which config files may not use; write the value out"),
], ids=["section twice", "key twice", "alias bomb"])
def test_a_config_file_with_a_key_twice_or_an_alias_fails_naming_the_line(tmp_path, text, sentence):
    """PyYAML keeps the last of two equal keys (a second `trainer:` block silently dropped the first) and expands
    aliases without bound (9⁸ strings here: MemoryError after ~45 s): both now fail at once, naming file and line."""
    path = write(tmp_path / "c.yaml", text)
    start = time.perf_counter()
    with pytest.raises(config.ConfigError) as e:
        cli.load_config(str(path))
    assert str(e.value) == f"config file {path} {sentence}" and time.perf_counter() - start < 2


def test_an_error_quotes_at_most_a_few_hundred_characters_of_a_value(tmp_path):
    """A megabyte string given to a boolean key, and a 100 × 100 list given to an integer key (from the command line
    and from a file), each fail with a sentence of under 500 characters that still shows how the value begins."""
    nested = "[" + ", ".join(["[" + ", ".join(["7"] * 100) + "]"] * 100) + "]"
    path = write(tmp_path / "c.yaml", f"trainer:\n  total_steps: {nested}\n")
    for file, overrides, start in ((None, ["data.shuffle=" + "x" * 1_000_000], "'xxx"),
                                   (None, ["model.lora_rank=" + nested], "'[[7, 7"),
                                   (str(path), [], "[[7, 7")):
        with pytest.raises(config.ConfigError) as e:
            cli.load_config(file, overrides)
        assert len(str(e.value)) < 500 and f"got {start}" in str(e.value), str(e.value)[:600]


def test_metrics_jsonl_is_strict_json_with_non_finite_values_as_null(tmp_path):
    """NaN and ±inf are written as null: json.dumps would write NaN / Infinity, which strict JSON readers refuse."""
    from infra.metrics import MetricsLogger
    logger = MetricsLogger(str(tmp_path), [], {}, "p", "n", enabled=True)
    logger.log({"a": float("nan"), "b": float("inf"), "c": -float("inf"), "d": 1.5}, 1)

    def refuse(name):
        raise AssertionError(f"{name} in metrics.jsonl")
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=refuse) == {"step": 1, "a": None, "b": None, "c": None, "d": 1.5}
