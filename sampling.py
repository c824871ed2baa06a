"""Steps 1–3 of ppo.py: prompts in the data order → n responses each (rollout.py, agent.py) → scores (rewards.py),
the score shaped for length, and DAPO's dynamic sampling over rounds of that (ppo.py's departure 6).

    sample = Sampler(rollout, tokenizer, scorer, accelerator, cfg, sizes.prompts)    # bound once (ppo.main)
    samples, metrics = sample.batch(state, train_rows, step, times)                  # every step: rollout.Samples
"""
from collections import defaultdict
from dataclasses import dataclass

import torch
from accelerate import Accelerator

import agent
from advantages import varied_groups
from infra import config
from infra.config import ConfigError
from infra.metrics import timed
from rewards import decode_responses, overlong_reward, score_on_every_process, Scorer
from rollout import cut_off, Samples



@dataclass(frozen=True)
class Sampler:
    """Steps 1–3: prompts in the data order, n responses each, decoded, scored on every process, and the score shaped
    for length (reward.overlong_penalty; DAPO's soft punishment, rewards.overlong_reward); with dynamic sampling, in
    rounds (departure 6). Bound once (main)."""
    rollout: object  # rollout.HFRollout or rollout.VLLMRollout, or agent.AgentRollout around one
    tokenizer: object
    scorer: Scorer
    accelerator: Accelerator
    cfg: config.Config
    prompts: int  # this process's prompts per step (Sizes.prompts)

    def batch(self, state, train_rows: list, step: int, times: dict) -> tuple[Samples, dict]:
        """This process's prompts × n samples for `step`, and the metrics of their rounds. With
        algorithm.filter_groups a round keeps only the prompts whose n scores differ (advantages.varied_groups), and
        rounds go on until every process has its share; the first ones kept make the batch."""
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
            inds = state.next_prompts(len(train_rows), self.cfg.data.train_batch_size, t.seed, self.cfg.data.shuffle)
            mine = [train_rows[i] for i in inds[rank * self.prompts:(rank + 1) * self.prompts]]
            # ---- 2–3. generate n responses per prompt, score them
            got, reward_metrics = self(mine, step_seed(t.seed, step, rank + rounds * world), times)
            varied = varied_groups(got.scores, n) if fg.enable else torch.ones(len(mine), dtype=torch.bool)  # (B/n,)
            kept.append(got.take(varied.repeat_interleave(n).nonzero()[:, 0].tolist()))
            for key, value in {**reward_metrics, "sampling/varied_frac": varied.float().mean().item()}.items():
                metrics[key].append(value)  # a mean over rounds
            rounds += 1
        samples = Samples.cat(kept, self.tokenizer.pad_token_id).take(list(range(self.prompts * n)))
        return samples, {**metrics, "sampling/rounds": rounds}

    def __call__(self, prompt_rows: list, seed: int, times: dict) -> tuple[Samples, dict]:
        """Steps 2 and 3 for these prompts."""
        ro_cfg, r, n = self.cfg.rollout, self.cfg.reward, self.cfg.rollout.n
        with timed(times, "time/gen_s"):
            ro = agent.generate_for(self.rollout, prompt_rows, n, ro_cfg.temperature, seed=seed)  # rows: for an env
        rows = [row for row in prompt_rows for _ in range(n)]  # row i·n + j: sample j of prompt i
        rows = agent.with_conversations(rows, ro)  # multi-turn: the reward reads each conversation
        with timed(times, "time/reward_s"):
            texts = decode_responses(self.tokenizer, ro)
            scores, metrics = score_on_every_process(self.scorer, rows, texts, self.accelerator)  # (B,)
            if ro.token_rewards is not None:  # an environment's turn rewards: their sum at the last token (issue 31
                scores = scores + ro.token_rewards.sum(1)  # will keep them at their tokens)
            if self.scorer.judge_answers:  # reward.type=judge: its raw answers, for the sample table
                rows = [{**row, "judge_answer": answer} for row, answer in zip(rows, self.scorer.judge_answers)]
            lengths = (ro.response_mask if ro.attention_mask is None else ro.attention_mask).sum(1)  # (B,) tool too
            truncated = cut_off(ro.responses, lengths, ro_cfg.max_response_length, self.rollout.eos_ids)  # (B,)
            scores = scores + r.overlong_penalty * truncated.float()
            if r.overlong_buffer_len:
                scores = scores + overlong_reward(lengths, ro_cfg.max_response_length, r.overlong_buffer_len,
                                                  r.overlong_penalty_factor)
        return (Samples(rows, ro.responses, ro.response_mask, ro.logprobs, texts, scores, truncated, ro.attention_mask),
                {**metrics, **ro.metrics})


def groups_short(kept: list, need: int, n: int, accelerator) -> int:
    """The prompts still missing on the process that lacks most (the same number on every process)."""
    have = sum(len(samples.rows) for samples in kept) // n
    return int(accelerator.reduce(torch.tensor(float(max(need - have, 0)), device=accelerator.device), "max").item())


def step_seed(seed: int, step: int, stream: int) -> int:
    """The seed of one random stream of one step: seed·100_003 + step·1_009 + stream, with two primes so that no
    two (seed, step) pairs give the same number. stream: the process index + round × processes for sampling (round:
    dynamic sampling's, 0 without), −1 for the mini-batch order (the same on every process)."""
    return seed * 100_003 + step * 1_009 + stream
