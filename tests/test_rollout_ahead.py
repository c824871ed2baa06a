"""rollout.steps_ahead (ppo.py's departure 8): the schedule of rollout.RunAhead, driven as ppo.py's steps 1–3 drive it,
against a stand-in backend that records what it was asked and from which weights, the staleness bound, the start-up refusals, and k = 0 against the loop
before this feature (the base commit's ppo.py, where the repository's history holds it).

The backend kinds themselves are tested in test_rollout.py (vLLM, HF) and test_rollout_server.py (the server, with
ppo.py running ahead end to end).
"""
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict

import pytest
import torch

from conftest import REPO, arithmetic_run_folder, make_tokenizer, read_metrics
from infra.cli import load_config
from infra.config import ConfigError
from infra.train_state import step_seed
from data import draw_prompts
from rewards import score_samples, Scores
from rollout import check_rollout, check_staleness, right_pad, Rollout, RunAhead

BASE = "07768a8"  # main before issue 30 merged: its loop is the one k = 0 must reproduce


class Backend:
    """The rollout protocol, recording each generate call (its prompts, seed, and the weights' version it sampled
    from) and failing if weights arrive while a generation runs. Each response is its prompt's first token and
    the version, so a batch shows which weights made it."""
    gives_logprobs, runs_apart = True, True

    def __init__(self, delay=0.0):
        self.eos_ids, self.version, self.delay, self.calls = {0}, 0, delay, []
        self.busy = threading.Lock()

    def generate(self, rows, n, temperature, seed=None):
        assert self.busy.acquire(blocking=False), "two generations at once"
        try:
            prompts = [row["prompt_ids"] for row in rows]
            self.calls.append(([p[0] for p in prompts], seed, self.version))
            time.sleep(self.delay)
            rows = [[p[0], 100 + self.version] for p in prompts for _ in range(n)]
            responses, mask = right_pad(rows, 0)
            return Rollout(responses, mask, -0.5 * mask.float())
        finally:
            self.busy.release()

    def sync_weights(self, model, version=0):
        assert self.busy.acquire(blocking=False), "weights pushed during a generation"
        self.version = version
        self.busy.release()

    def close(self):
        pass


class OneProcess:
    device, process_index, num_processes = torch.device("cpu"), 0, 1

    @staticmethod
    def reduce(tensor, op):
        return tensor


class CountTokens:
    """A scorer: the response's token count."""

    def __call__(self, rows, texts, ro):
        return Scores(torch.tensor([float(len(t)) for t in texts]))


class State:
    """TrainState's data order: 3 prompts a batch from 24 rows, in order."""
    step, epoch, position = 0, 0, 0

    def next_prompts(self, num_rows, batch_size, seed, shuffle):
        if self.position + batch_size > num_rows:
            self.epoch, self.position = self.epoch + 1, 0
        self.position += batch_size
        return list(range(self.position - batch_size, self.position))

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}


class Loop:
    """ppo.py's steps 1–3 with rollout.steps_ahead = k (its departure-8 branch: draw and submit the batches up to
    step + k, take this step's, score it), its step 8 and its checkpoint's state, over RunAhead and the stand-in
    backend (`rollout`). Each batch's Samples carry `versions`, the policy version that sampled them."""

    def __init__(self, cfg, delay):
        self.cfg, self.rollout, self.ahead, self.tokenizer = cfg, Backend(delay), None, make_tokenizer()

    def batch(self, state, train_rows, step, times):
        if self.ahead is None:  # ppo.main makes it once resumed, at the actor's updates so far
            self.ahead = RunAhead(self.rollout, self.cfg.rollout, version=max(0, state.step - self.cfg.critic.warmup_steps))
        for ahead in self.ahead.wants(step, self.cfg.trainer.total_steps):
            self.ahead.submit((state.epoch, state.position), draw_prompts(state, train_rows, self.cfg, 0, 3),
                              step_seed(self.cfg.trainer.seed, ahead, 0))
        metrics = defaultdict(list)
        rows, ro = self.ahead.next(step, times, metrics)
        samples, scored = score_samples([row for row in rows for _ in range(self.cfg.rollout.n)], ro, CountTokens(),
                                        self.tokenizer, self.rollout.eos_ids, self.cfg, OneProcess())
        samples.versions = torch.full((len(samples.rows),), self.ahead.version - int(metrics["rollout/staleness_max"][0]))
        return samples, {**{key: sum(v) / len(v) for key, v in metrics.items()}, **scored}

    def sync_weights(self, model, version):
        self.ahead.sync_weights(model, version)

    def saved(self, state):
        return self.ahead.rewind(state.state_dict())

    def close(self):
        self.ahead.close()


def sampler(k, background=True, delay=0.0, total_steps=6):
    cfg = load_config(os.path.join(REPO, "configs.yaml"), [
        f"rollout.steps_ahead={k}", f"rollout.background={str(background).lower()}", "rollout.n=2",
        "data.train_batch_size=3", f"trainer.total_steps={total_steps}", "trainer.seed=7"])
    return Loop(cfg, delay)


ROWS = [{"prompt_ids": [i + 1, 50], "data_source": "x", "ground_truth": ""} for i in range(24)]


def run(sample, steps, state=None):
    """ppo.py's calls: a batch per step, then the weights of that step's update (version = step)."""
    state, batches = state or State(), []
    for step in range(state.step + 1, state.step + steps + 1):
        samples, metrics = sample.batch(state, ROWS, step, {})
        batches.append((samples, metrics))
        time.sleep(0.05)  # the update, while the next batch generates
        sample.sync_weights(None, step)
        state.step = step
    return batches, state


def test_one_step_ahead_generates_batch_t_from_the_weights_before_update_t_minus_1():
    """k = 1: batch 1 and 2 from the initial weights, batch t ≥ 2 from version t − 2 (staleness 1, logged per
    sample and as rollout/staleness_*), with the prompts of the synchronous data order and step t's own seed; no
    weights arrive during a generation; and nothing is generated past trainer.total_steps."""
    sample = sampler(k=1, delay=0.1)
    batches, _ = run(sample, 6)
    for t, (samples, metrics) in enumerate(batches, start=1):
        version = max(0, t - 2)
        assert samples.versions.tolist() == [version] * 6
        assert samples.responses[:, 1].tolist() == [100 + version] * 6  # made by those weights
        assert [row["prompt_ids"][0] for row in samples.rows] == [p for p in range(3 * t - 2, 3 * t + 1) for _ in "ab"]
        assert metrics["rollout/staleness_max"] == metrics["rollout/staleness_mean"] == (0.0 if t == 1 else 1.0)
    assert [seed for _, seed, _ in sample.rollout.calls] == [step_seed(7, t, 0) for t in range(1, 7)]
    sample.close()


def test_the_thread_changes_nothing_but_the_timing():
    """The same schedule generated in turn (rollout.background=false) gives the same samples, versions and metrics
    as the background thread, for k = 1 and k = 2."""
    for k in (1, 2):
        threaded, _ = run(sampler(k, delay=0.05), 5)
        in_turn, _ = run(sampler(k, background=False), 5)
        for (a, ma), (b, mb) in zip(threaded, in_turn):
            assert torch.equal(a.responses, b.responses) and torch.equal(a.versions, b.versions)
            assert a.rows == b.rows and torch.equal(a.scores, b.scores)
            assert {key: v for key, v in ma.items() if not key.startswith("time/")} == \
                   {key: v for key, v in mb.items() if not key.startswith("time/")}


def test_k_steps_ahead_keeps_the_staleness_at_k():
    """k = 2: batch t comes from version t − 3 once the pipeline is full, never older."""
    batches, _ = run(sampler(k=2), 6)
    assert [b.versions[0].item() for b, _ in batches] == [0, 0, 0, 1, 2, 3]
    assert [m["rollout/staleness_max"] for _, m in batches] == [0, 1, 2, 2, 2, 2]


def test_a_batch_older_than_k_is_refused():
    """check_staleness passes 0 … k and refuses anything older, in one sentence naming the key; and through the
    sampler: weights pushed twice while a batch waits make it two versions old, which k = 1 refuses."""
    for staleness in (0, 1):
        check_staleness(staleness, 1, 5)
    with pytest.raises(RuntimeError, match=r"step 5 was sampled 2 policy versions .* rollout.steps_ahead=1"):
        check_staleness(2, 1, 5)
    sample, state = sampler(k=1), State()
    sample.batch(state, ROWS, 1, {})  # batch 2 now waits, from version 0
    sample.sync_weights(None, 1)
    sample.sync_weights(None, 2)
    with pytest.raises(RuntimeError, match="refused"):
        sample.batch(state, ROWS, 2, {})


def test_a_checkpoint_sets_the_data_position_back_to_the_batch_not_yet_trained():
    """After step 2 with k = 1, batch 3 is drawn (position 9) but not trained: the saved state holds position 6, so
    a resumed run draws batch 3's prompts again; it generates them from the weights it resumes with (version 2)."""
    sample = sampler(k=1)
    _, state = run(sample, 2)
    assert state.position == 9 and sample.saved(state)["position"] == 6
    resumed_state = State()
    resumed_state.step, resumed_state.position = 2, 6
    resumed = sampler(k=1)
    resumed.rollout.version = 2  # the checkpoint's weights, pushed when the backend was made
    (samples, metrics), = run(resumed, 1, resumed_state)[0]
    assert [row["prompt_ids"][0] for row in samples.rows] == [7, 7, 8, 8, 9, 9]
    assert samples.versions.tolist() == [2] * 6 and metrics["rollout/staleness_max"] == 0.0


@pytest.mark.parametrize("overrides, message", [
    (["rollout.name=sglang"], "rollout.name='sglang' is not one of hf, vllm, server"),
    (["rollout.name=hf", "rollout.steps_ahead=1"],
     "rollout.steps_ahead=1 needs a rollout with weights of its own, and rollout.name=hf samples from the training "
     "weights: use rollout.name=vllm or server"),
    (["rollout.name=server", "rollout.steps_ahead=1", "algorithm.filter_groups.enable=true"],
     "algorithm.filter_groups decides each step's generate rounds by their scores"),
    (["rollout.name=hf", "algorithm.rollout_rs=token"],
     "algorithm.rollout_rs=token corrects by the sampler's own logprobs, which only rollout.name=vllm or server gives"),
])
def test_what_cannot_run_ahead_is_refused_at_start_up(overrides, message):
    cfg = load_config(os.path.join(REPO, "configs.yaml"), overrides)
    with pytest.raises(ConfigError) as e:
        check_rollout(cfg)
    assert message in str(e.value)


@pytest.mark.skipif(subprocess.run(["git", "-C", REPO, "cat-file", "-e", f"{BASE}^{{commit}}"],
                                   capture_output=True).returncode != 0, reason=f"the history lacks {BASE}")
def test_k0_logs_exactly_what_the_loop_before_it_logged(tmp_path):
    """rollout.steps_ahead=0 (the default) is the synchronous loop unchanged: ppo.py of this tree and of the base
    commit, on the same tiny model, data and seed, log the same keys and values at every step (times aside)."""
    arithmetic_run_folder(tmp_path, 32, 8)
    base = tmp_path / "base"
    base.mkdir()
    archive = subprocess.run(["git", "-C", REPO, "archive", BASE], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    overrides = [f"model.path={tmp_path}/model", f"data.train_files={tmp_path}/train.parquet",
                 f"data.val_files={tmp_path}/val.parquet", "rollout.name=hf", "rollout.max_response_length=6",
                 "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=2", "trainer.total_steps=3",
                 "trainer.test_freq=2", "trainer.save_freq=0", "trainer.max_kl=0", "model.dtype=fp32",
                 "model.lora_rank=8", "model.target_modules=q_proj,v_proj", "trainer.plot_curves=false",
                 "algorithm.adv_estimator=gae", "data.val_max_samples=4"]
    for tree, out in ((REPO, tmp_path / "now"), (str(base), tmp_path / "before")):
        proc = subprocess.run([sys.executable, "ppo.py", "--config", "configs.yaml", *overrides,
                               f"trainer.output_dir={out}"], cwd=tree, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        assert proc.returncode == 0, proc.stderr[-3000:]
    now, before = read_metrics(tmp_path / "now"), read_metrics(tmp_path / "before")
    assert len(now) == len(before) == 4

    def untimed(m):
        return {k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))}
    assert [untimed(m) for m in now] == [untimed(m) for m in before]
