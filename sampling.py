"""Steps 1–3 of ppo.py: prompts in the data order → n responses each (rollout.py, agents/multi_turn.py) → scores (rewards.py),
the score shaped for length, and DAPO's dynamic sampling over rounds of that (ppo.py's departure 6); with
rollout.steps_ahead = k, each step's generation k steps early, in a background thread (departure 8).

    sample = Sampler(rollout, tokenizer, scorer, accelerator, cfg, sizes.prompts)    # bound once (ppo.main)
    samples, metrics = sample.batch(state, train_rows, step, times)                  # every step: Samples
    sample.sync_weights(policy, version)                                             # step 8
"""
import functools
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate import Accelerator

from agents import multi_turn as agent
from advantages import varied_groups
from infra import config
from infra.config import ConfigError
from infra.metrics import timed
from rewards import decode_responses, overlong_reward, score_on_every_process
from rollout import cut_off, left_pad, Rollout
from rewards import Scorer


@dataclass
class Samples:
    """Prompts with their n responses and scores: row i·n + j is sample j of the prompt rows[i·n]."""
    rows: list  # (B,) the prompts' data rows, each n times
    responses: torch.Tensor  # (B, Tr) right-padded
    response_mask: torch.Tensor  # (B, Tr)
    rollout_logprobs: Optional[torch.Tensor]  # (B, Tr) the sampler's, or None
    texts: list  # (B,) the decoded responses
    scores: torch.Tensor  # (B,) the task scores, length shaping included
    truncated: torch.Tensor  # (B,) bool: cut off at rollout.max_response_length without EOS
    attention_mask: Optional[torch.Tensor] = None  # (B, Tr) multi-turn: 1 on the tool answers too (Rollout's)
    token_rewards: Optional[torch.Tensor] = None  # (B, Tr) the scorers' and the rollout's token rewards, or None
    extras: list = field(default_factory=list)  # (B,) per sample, the scorers' rewards.Scores.extras ("pred" …)
    versions: Optional[torch.Tensor] = None  # (B,) the policy version that sampled each: the actor's updates before

    def as_batch(self, pad_id: int) -> dict:
        """ppo.py's batch of step 2: queries and query_mask (B, Tq), left-padded; responses, response_mask and, where
        the sampler gave them, rollout_logprobs (B, Tr); with multi-turn response_attention_mask (B, Tr)."""
        queries, query_mask = left_pad([row["prompt_ids"] for row in self.rows], pad_id)  # (B, Tq)
        batch = dict(queries=queries, query_mask=query_mask, responses=self.responses, response_mask=self.response_mask)
        if self.rollout_logprobs is not None:
            batch["rollout_logprobs"] = self.rollout_logprobs
        if self.attention_mask is not None:  # multi-turn: the tool answers, which the forwards attend to
            batch["response_attention_mask"] = self.attention_mask
        return batch

    def take(self, rows: list[int]) -> "Samples":
        return Samples(*[None if v is None else [v[i] for i in rows] if isinstance(v, list) else v[rows]
                         for v in vars(self).values()])

    @staticmethod
    def cat(parts: list, pad_id: int) -> "Samples":
        """All rows of `parts`, in order; the (B, Tr) tensors right-padded to the longest (masks, logprobs with 0)."""
        T = max(p.responses.shape[1] for p in parts)

        def padded(name, value):  # a part without token rewards has zeros where another has some
            tensors = [getattr(p, name) for p in parts]
            if all(x is None for x in tensors):
                return None
            tensors = [torch.zeros(p.responses.shape) if x is None else x for p, x in zip(parts, tensors)]
            return torch.cat([torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value) for x in tensors])
        return Samples([row for p in parts for row in p.rows], padded("responses", pad_id),
                       padded("response_mask", 0), padded("rollout_logprobs", 0.0), [x for p in parts for x in p.texts],
                       torch.cat([p.scores for p in parts]), torch.cat([p.truncated for p in parts]),
                       padded("attention_mask", 0), padded("token_rewards", 0.0), [x for p in parts for x in p.extras],
                       None if parts[0].versions is None else torch.cat([p.versions for p in parts]))



@dataclass(frozen=True)
class Generated:
    """One batch's prompts and their responses, before scoring: what the generation thread hands the loop."""
    rows: list  # (B/n,) this process's prompts' data rows
    rollout: Rollout
    version: int  # the policy version that sampled it (Sampler.version then)
    seconds: float  # the generation's own time
    data_position: tuple  # (epoch, position) of the data order before these prompts: where a resumed run draws again


@dataclass
class Sampler:
    """Steps 1–3: prompts in the data order, n responses each, decoded, scored on every process, and the score shaped
    for length (reward.overlong_penalty; DAPO's soft punishment, rewards.overlong_reward); with dynamic sampling, in
    rounds (departure 6); with rollout.steps_ahead = k, generated k steps early (departure 8). Bound once (main)."""
    rollout: object  # a backend of rollout.KINDS, or agent.AgentRollout around one
    tokenizer: object
    scorer: Scorer  # reward.sources, weighted
    accelerator: Accelerator
    cfg: config.Config
    prompts: int  # this process's prompts per step (Sizes.prompts)
    version: Optional[int] = None  # the policy version the rollout holds: the steps that updated the actor
    ahead: deque = field(default_factory=deque)  # k > 0: Futures of Generated for the next steps, the oldest first
    pool: Optional[ThreadPoolExecutor] = None  # k > 0: the one thread that generates

    def batch(self, state, train_rows: list, step: int, times: dict) -> tuple[Samples, dict]:
        """This process's prompts × n samples for `step`, and the metrics of their rounds. With
        algorithm.filter_groups a round keeps only the prompts whose n scores differ (advantages.varied_groups), and
        rounds go on until every process has its share; the first ones kept make the batch."""
        if self.version is None:  # the first step of a run, or of a resumed one: the actor's updates so far
            self.version = max(0, state.step - self.cfg.critic.warmup_steps)
        if self.cfg.rollout.steps_ahead:
            return self.batch_ahead(state, train_rows, step, times)
        t, fg, n = self.cfg.trainer, self.cfg.algorithm.filter_groups, self.cfg.rollout.n
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        kept, metrics, rounds = [], defaultdict(list), 0  # kept: Samples of the prompts kept, one per round
        while rounds == 0 or (fg.enable and groups_short(kept, self.prompts, n, self.accelerator)):
            if rounds == fg.max_num_gen_batches:
                short = groups_short(kept, self.prompts, n, self.accelerator)
                raise ConfigError(f"algorithm.filter_groups: after {rounds} rounds of {self.cfg.data.train_batch_size} "
                                  f"prompts a process still lacks {short} of its {self.prompts} prompts whose samples "
                                  f"score differently (the data is too easy or too hard for this policy); raise "
                                  f"algorithm.filter_groups.max_num_gen_batches")
            # ---- 1. sample prompts: one global batch from a seeded permutation, this process's slice of it
            mine = self.draw(state, train_rows)
            # ---- 2–3. generate n responses per prompt, score them
            got, reward_metrics = self(mine, step_seed(t.seed, step, rank + rounds * world), times)
            varied = varied_groups(got.scores, n) if fg.enable else torch.ones(len(mine), dtype=torch.bool)  # (B/n,)
            kept.append(got.take(varied.repeat_interleave(n).nonzero()[:, 0].tolist()))
            for key, value in {**reward_metrics, "sampling/varied_frac": varied.float().mean().item()}.items():
                metrics[key].append(value)  # a mean over rounds
            rounds += 1
        samples = Samples.cat(kept, self.tokenizer.pad_token_id).take(list(range(self.prompts * n)))
        return samples, {**metrics, "sampling/rounds": rounds}

    def draw(self, state, train_rows: list) -> list:
        """Step 1: the next global batch of the seeded data order (state's position moves on), this process's slice."""
        inds = state.next_prompts(len(train_rows), self.cfg.data.train_batch_size, self.cfg.trainer.seed,
                                  self.cfg.data.shuffle)
        rank = self.accelerator.process_index
        return [train_rows[i] for i in inds[rank * self.prompts:(rank + 1) * self.prompts]]

    def __call__(self, prompt_rows: list, seed: int, times: dict) -> tuple[Samples, dict]:
        """Steps 2 and 3 for these prompts."""
        return self.score(self.generate(prompt_rows, seed, data_position=None), times)

    def generate(self, prompt_rows: list, seed: int, data_position: Optional[tuple]) -> Generated:
        """Step 2, and nothing that talks to the other processes: with rollout.steps_ahead it runs in the generation
        thread, beside the loop's own collectives."""
        t0 = time.perf_counter()
        ro = agent.generate_for(self.rollout, prompt_rows, self.cfg.rollout.n, self.cfg.rollout.temperature,
                                seed=seed)  # the rows: an environment starts from them
        return Generated(prompt_rows, ro, self.version, time.perf_counter() - t0, data_position)

    def score(self, got: Generated, times: dict) -> tuple[Samples, dict]:
        """Step 3 for one generated batch, on every process together."""
        ro_cfg, r, n, ro = self.cfg.rollout, self.cfg.reward, self.cfg.rollout.n, got.rollout
        times["time/gen_s"] = times.get("time/gen_s", 0.0) + got.seconds
        rows = [row for row in got.rows for _ in range(n)]  # row i·n + j: sample j of prompt i
        rows = agent.with_conversations(rows, ro)  # multi-turn: the reward reads each conversation
        with timed(times, "time/reward_s"):
            texts = decode_responses(self.tokenizer, ro)
            scored = score_on_every_process(functools.partial(self.scorer, rows, texts, ro), self.accelerator)
            scores, token_rewards = scored.scores, add_token_rewards(scored.token_rewards, ro.token_rewards)  # (B,)
            lengths = (ro.response_mask if ro.attention_mask is None else ro.attention_mask).sum(1)  # (B,) tool too
            truncated = cut_off(ro.responses, lengths, ro_cfg.max_response_length, self.rollout.eos_ids)  # (B,)
            scores = scores + r.overlong_penalty * truncated.float()
            if r.overlong_buffer_len:
                scores = scores + overlong_reward(lengths, ro_cfg.max_response_length, r.overlong_buffer_len,
                                                  r.overlong_penalty_factor)
        versions = torch.full((len(rows),), got.version)  # (B,)
        return (Samples(rows, ro.responses, ro.response_mask, ro.logprobs, texts, scores, truncated, ro.attention_mask,
                        token_rewards, scored.extras, versions), {**scored.metrics, **ro.metrics})

    # ---------------------------------------------------------------------------------------
    # Running ahead (rollout.steps_ahead = k > 0, ppo.py's departure 8)

    def batch_ahead(self, state, train_rows: list, step: int, times: dict) -> tuple[Samples, dict]:
        """The batch of `step`, generated when step − k began (from the policy before update step − k); the batch of
        step + k is drawn now and generated in the thread while this one is scored and trained. The first step, and
        the first after a resume, generate the batches of step … step + k in turn from the weights at hand."""
        k = self.cfg.rollout.steps_ahead
        while len(self.ahead) <= k and step + len(self.ahead) <= self.cfg.trainer.total_steps:
            self.ahead.append(self.submit(state, train_rows, step + len(self.ahead)))
        with timed(times, "time/gen_wait_s"):
            got = self.ahead.popleft().result()
        staleness = self.version - got.version
        check_staleness(staleness, k, step)
        samples, metrics = self.score(got, times)
        return samples, {**{key: [value] for key, value in metrics.items()}, "sampling/varied_frac": [1.0],
                         "sampling/rounds": 1, "rollout/staleness_mean": float(staleness),
                         "rollout/staleness_max": float(staleness)}

    def submit(self, state, train_rows: list, step: int) -> Future:
        """Draw `step`'s prompts now, in the data order, and generate them in the thread (or here, in turn, with
        rollout.background=false: the same schedule without overlap)."""
        position = (state.epoch, state.position)
        mine = self.draw(state, train_rows)
        seed = step_seed(self.cfg.trainer.seed, step, self.accelerator.process_index)  # the synchronous loop's
        if not self.cfg.rollout.background:
            future = Future()
            future.set_result(self.generate(mine, seed, position))
            return future
        self.pool = self.pool or ThreadPoolExecutor(1, thread_name_prefix="rollout")
        return self.pool.submit(self.generate, mine, seed, position)

    def idle(self):
        """The rollout, once no generation is in flight: validation and weight pushes use it alone."""
        for future in self.ahead:
            future.result()
        return self.rollout

    def sync_weights(self, model, version: int) -> None:
        """Step 8: the actor's weights after `version` updates into the rollout, between two generations (never
        during one: a generation in flight finishes first, from the weights it began with)."""
        self.idle().sync_weights(model, version)
        self.version = version

    def saved(self, state) -> dict:
        """state's plain data for a checkpoint, its data position set back to the first batch drawn but not yet
        trained: a resumed run draws those prompts again, and generates them from the checkpoint's weights."""
        saved = state.state_dict()
        if self.ahead:
            saved["epoch"], saved["position"] = self.ahead[0].result().data_position
        return saved

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        self.rollout.close()


def add_token_rewards(a, b):
    """The sum of two optional token-reward tensors (B, Tr): None when both are."""
    return a if b is None else b if a is None else a + b


def shown_samples(samples: Samples, count: int) -> list[tuple]:
    """`count` samples spread over the batch as infra.metrics.sample_table's rows: the prompt's end, the response
    (with multi-turn its transcript), its score, and the judge's answer where a judge scored it."""
    shown = list(range(0, len(samples.rows), max(1, len(samples.rows) // count)))[:count]
    return [(samples.rows[i]["prompt_text"][-40:], agent.transcript(samples.rows[i], samples.texts[i]),
             samples.scores[i].item(), samples.extras[i].get("judge_answer", "")) for i in shown]


def check_staleness(staleness: int, k: int, step: int) -> None:
    """A batch sampled more than rollout.steps_ahead versions before the policy it would train is never trained."""
    if not 0 <= staleness <= k:
        raise RuntimeError(f"the batch of step {step} was sampled {staleness} policy versions before the one it "
                           f"would train, outside rollout.steps_ahead={k}: refused (a bug in the schedule)")


def groups_short(kept: list, need: int, n: int, accelerator) -> int:
    """The prompts still missing on the process that lacks most (the same number on every process)."""
    have = sum(len(samples.rows) for samples in kept) // n
    return int(accelerator.reduce(torch.tensor(float(max(need - have, 0)), device=accelerator.device), "max").item())


def step_seed(seed: int, step: int, stream: int) -> int:
    """The seed of one random stream of one step: seed·100_003 + step·1_009 + stream, with two primes so that no
    two (seed, step) pairs give the same number. stream: the process index + round × processes for sampling (round:
    dynamic sampling's, 0 without), −1 for the mini-batch order (the same on every process)."""
    return seed * 100_003 + step * 1_009 + stream
