"""Reward model: a Bradley–Terry scorer trained on preference pairs (its network, RewardModel, and the scorer PPO
calls, RewardModelScorer, are in scorers/model.py: PPO never imports this training script).

    python tools/prepare_data.py --task arithmetic-preferences --output data/preferences   # the demo pairs
    accelerate launch reward_model.py --config configs.yaml                      # the demo, CPU or GPU
    accelerate launch reward_model.py --config configs.yaml reward_model.total_steps=20 reward_model.lora_rank=0
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml reward_model.py --config configs.yaml
    python reward_model.py --help                                                # every config key
    accelerate launch ppo.py --config configs.yaml reward.sources=model reward.model_path=outputs/reward_model/final

The demo (`make reward-model`, the defaults: LoRA in the top 8 of SmolLM2-135M's 30 layers, lr 5e-4, 60 steps
of 16 pairs, fp32) ran in 4.2 min on 2 shared CPU cores to val/rm/accuracy 0.865 on 200 held-out pairs of
`tools/prepare_data.py --task arithmetic-preferences`; by kind: tens 0.99 ("15 + 2 = 17" over "15 + 2 = 27"), format 1.0,
bare 0.65, ones 0.57 (the sum off by 1 or 2 is not learned yet).

At the end <output_dir>/final/ holds a plain AutoModelForSequenceClassification (LoRA merged), its tokenizer
and reward_stats.json (mean/std of its scores on the training responses); final_adapter/ keeps the adapter.

How the text and the reward are formed:
1. A pair is two conversations, [prompt…, assistant: chosen] and [prompt…, assistant: rejected], rendered by the
   reward model's own chat template (no generation prompt). A text prompt is one user turn; without a template the
   text is prompt + response; an empty prompt means chosen/rejected are whole conversations (HH-RLHF) used as they
   are. RewardModelScorer renders PPO's (prompt, response) the same way, so the policy may have another tokenizer.
2. The reward is the `score` head at the last real token, found from the attention mask. HF's own pooling
   takes the last token that is not pad_token_id, wrong when pad == eos ends the text.
3. A pair longer than max_length loses its first tokens (the response's end, where the reward is read, stays)
   or is dropped (reward_model.overlong); start-up counts both, and the pairs with chosen == rejected, dropped.
4. Losses are normalised by the pairs of the whole batch over all processes, so gradient accumulation and
   the number of processes do not change the gradient.

transformers is imported inside the functions that use it: `--help` and a mistake in the config
then answer in about 2 s, without their 3 s import.
"""
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from tqdm import tqdm

from data import load_pairs
from infra import cli, config
from infra.batches import autocast, autocast_dtype
from infra.distributed import distribute, make_accelerator
from infra.metrics import console_line
from infra.models import load_reward_classifier
from infra.offline import (batch_indices, check_batch, check_folders, checkpoint_or_stop, open_log, save_merged,
                           Skips)
from infra.optim import make_optimizer, train_step
from infra.runs import start_run, StopSignal
from rollout import right_pad
from scorers.model import RewardModel

# ---------------------------------------------------------------------------------------
# The loss (the network, RewardModel, is scorers/model.py's)

def bradley_terry_loss(r_chosen, r_rejected, margin, center_coef: float):
    """L = −log σ(r_c − r_r − m) + η·(r_c + r_r)²   per pair, (B,) → (B,)

    Bradley & Terry (1952) as in Ouyang et al. (2022); the margin m as in Llama 2 (Touvron et al., 2023);
    the centring term η as TRL's RewardTrainer (Eisenstein et al., 2023), which pins the mean near 0.
    """
    return -F.logsigmoid(r_chosen - r_rejected - margin) + center_coef * (r_chosen + r_rejected).square()


# ---------------------------------------------------------------------------------------
# Text

def score_pairs(model, pairs, pad_id: int, device, dtype):
    """Chosen and rejected in one forward → r_chosen, r_rejected, margin, each (B,)."""
    input_ids, attention_mask = right_pad([p[0] for p in pairs] + [p[1] for p in pairs], pad_id)  # (2B, T) each
    with autocast(device, dtype):
        r = model(input_ids.to(device), attention_mask.to(device))  # (2B,)
    margin = torch.tensor([p[2] for p in pairs], device=device)
    return r[:len(pairs)], r[len(pairs):], margin


# ---------------------------------------------------------------------------------------
# Evaluation and the final model

@torch.no_grad()
def evaluate(model, pairs, micro: int, pad_id: int, accelerator, dtype) -> dict:
    """Over all pairs (each process scores every num_processes-th micro-batch): loss, accuracy, margin,
    the mean and std of the chosen and rejected scores together (reward_stats.json), and accuracy/<kind>
    for pairs that carry a kind."""
    model.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=accelerator.device)  # loss, correct, r_c − r_r, Σr, Σr²
    kinds = sorted({p[3] for p in pairs if p[3]})
    by_kind = torch.zeros(len(kinds), 2, dtype=torch.float64, device=accelerator.device)  # (correct, pairs) per kind
    for i in range(accelerator.process_index * micro, len(pairs), accelerator.num_processes * micro):
        r_c, r_r, m = score_pairs(model, pairs[i:i + micro], pad_id, accelerator.device, dtype)
        r = torch.cat([r_c, r_r])
        sums += torch.stack([bradley_terry_loss(r_c, r_r, m, 0.0).sum(), (r_c > r_r).sum(), (r_c - r_r).sum(),
                             r.sum(), r.square().sum()]).double()
        for pair, correct in zip(pairs[i:i + micro], (r_c > r_r).tolist()):
            if pair[3]:
                by_kind[kinds.index(pair[3])] += torch.tensor([float(correct), 1.0], device=accelerator.device)
    loss, accuracy, margin, total, total_sq = (accelerator.reduce(sums, "sum") / len(pairs)).tolist()
    by_kind = accelerator.reduce(by_kind, "sum").tolist()
    model.train()
    mean = total / 2  # per response: 2 per pair
    return {"loss": loss, "accuracy": accuracy, "margin": margin, "mean": mean,
            "std": max(total_sq / 2 - mean ** 2, 0.0) ** 0.5,
            **{f"accuracy/{kind}": correct / n for kind, (correct, n) in zip(kinds, by_kind)}}


def save_final(hf_model, tokenizer, stats: dict, output_dir: str) -> None:
    """final/ = a plain sequence classifier (the adapter merged in) + tokenizer + reward_stats.json."""
    final = save_merged(hf_model, tokenizer, output_dir)
    with open(os.path.join(final, "reward_stats.json.tmp"), "w") as f:
        json.dump(stats, f)
    os.replace(os.path.join(final, "reward_stats.json.tmp"), os.path.join(final, "reward_stats.json"))


def non_finite(model, stats: dict):
    """The first weight or score statistic that is NaN or ±inf (a reward model that must not be saved), or None."""
    bad = [f"reward_stats {k}={v}" for k, v in stats.items() if not math.isfinite(v)]
    bad += [f"weight {name}" for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    return bad[0] if bad else None


# ---------------------------------------------------------------------------------------
# Training

@dataclass(frozen=True)
class Inputs:
    """What check_inputs reads: the tokenizer, the pairs, and the sizes checked for the process count."""
    tokenizer: object
    train_pairs: list
    val_pairs: list
    local: int  # pairs per step on one process
    micro: int  # pairs per forward/backward


def check_inputs(cfg: config.RewardModelStage, num_processes: int, print0=print) -> Inputs:
    """Everything before the model loads, for `num_processes` processes: no FSDP launcher, the loggers' packages,
    the model and tokenizer folders, the pairs (tokenised once) and the batch sizes; `reward_model.py --check`
    stops here."""
    rm = cfg.reward_model
    tokenizer = check_folders(rm, "reward_model")
    train_pairs, stats = load_pairs(rm.train_files, tokenizer, rm.max_length, rm.overlong, rm.margin)
    print0(f"train pairs: {stats}")
    val_pairs = []
    if rm.val_files:
        val_pairs, stats = load_pairs(rm.val_files, tokenizer, rm.max_length, rm.overlong, rm.margin)
        val_pairs = val_pairs[:rm.val_max_pairs or None]
        print0(f"val pairs: {stats}, using {len(val_pairs)}")
    local, micro = check_batch(rm, "reward_model", num_processes, len(train_pairs), "pairs", print0)
    return Inputs(tokenizer, train_pairs, val_pairs, local, micro)


def check_only(cfg: config.RewardModelStage, num_processes: int) -> str:
    """`reward_model.py --check`: check_inputs, then one line; no model is loaded."""
    checked = check_inputs(cfg, num_processes, print if os.environ.get("RANK", "0") == "0" else lambda *a: None)
    return f"{num_processes} process(es), {checked.local} pairs each a step; the inputs are there; no model loaded"


def main(cfg: config.RewardModelStage):
    rm = cfg.reward_model
    accelerator = make_accelerator()  # the device, and the launched processes' group (infra/distributed.py)
    print0, device, dtype = accelerator.print, accelerator.device, autocast_dtype(rm.dtype)
    set_seed(rm.seed)
    # before anything loads: output_dir is this run's alone, a checkpoint fits this config, the model exists
    lock, resume_from, finished = start_run(accelerator, cfg, "reward_model")  # the lock is held until the process ends
    if finished:
        return
    # ---- inputs and data: pairs tokenised once, sizes checked before the model is loaded
    inputs = check_inputs(cfg, accelerator.num_processes, print0)
    tokenizer, train_pairs, val_pairs, local, micro = (inputs.tokenizer, inputs.train_pairs, inputs.val_pairs,
                                                       inputs.local, inputs.micro)
    pad_id = tokenizer.pad_token_id

    # ---- model, optimiser, state, resume
    model = RewardModel(load_reward_classifier(rm.model_path, pad_id, lora=rm, trust_remote_code=rm.trust_remote_code))
    model = distribute(model, accelerator, None, trainable=True)  # DDP
    optimizer, scheduler = make_optimizer(model, rm.optim, rm.total_steps)
    model.train()
    models = {"model": (model, optimizer)}
    # optimiser steps taken (batch_indices turns them into pairs) and skipped: checkpointed
    logger, start, skipped = open_log(accelerator, cfg, "reward_model", resume_from, models, scheduler)

    def pair_loss(pairs):
        """Its share of the batch's mean loss (see 4. above), and its Σ loss, correct, r_c − r_r, r_c, r_r."""
        r_c, r_r, m = score_pairs(model, pairs, pad_id, device, dtype)
        loss = bradley_terry_loss(r_c, r_r, m, rm.center_rewards_coef)
        sums = torch.stack([loss.sum(), (r_c > r_r).sum(), (r_c - r_r).sum(), r_c.sum(), r_r.sum()])
        return loss.sum() / local, {"sums": sums.detach()}

    stop_signal, skips = StopSignal(verbose=accelerator.is_main_process), Skips(skipped, rm.max_skipped_steps)
    bar = tqdm(range(start, rm.total_steps), initial=start, total=rm.total_steps,
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        # ---- 1. this step's pairs: a slice of the seeded epoch permutation, then this process's share
        batch = [train_pairs[i] for i in batch_indices(step, len(train_pairs), rm.batch_size, rm.seed)]
        mine = batch[accelerator.process_index * local:(accelerator.process_index + 1) * local]

        # ---- 2.–3. score and backward per micro-batch, then clip and step (skipped when not finite); schedule
        lr = scheduler.get_last_lr()[0]
        micro_batches = [mine[i:i + micro] for i in range(0, local, micro)]
        grad_norm, per_micro = train_step(model, optimizer, micro_batches, pair_loss, rm.max_grad_norm)
        skips.count(grad_norm)  # a non-finite loss or gradient: train_step left the weights as they were
        scheduler.step()

        # ---- 4. metrics: sums over all processes, divided by the batch
        sums = (accelerator.reduce(sum(per_micro["sums"]), "sum") / rm.batch_size).tolist()
        metrics = {"rm/loss": sums[0], "rm/accuracy": sums[1], "rm/margin": sums[2], "rm/chosen_mean": sums[3],
                   "rm/rejected_mean": sums[4], "rm/grad_norm": math.nan if grad_norm is None else grad_norm,
                   "lr": lr, "train/skipped_steps": skips.total}

        # ---- 5. validate every eval_freq steps and at the end
        last = step + 1 == rm.total_steps
        if val_pairs and (last or (rm.eval_freq > 0 and (step + 1) % rm.eval_freq == 0)):
            val = evaluate(model, val_pairs, micro, pad_id, accelerator, dtype)
            metrics.update({f"val/rm/{k}": v for k, v in val.items() if k not in ("mean", "std")})

        # ---- 6. log (rank 0): metrics.jsonl, console, wandb/tensorboard
        metrics["time/step_s"] = time.perf_counter() - t0
        logger.log(metrics, step + 1)
        shown = ["rm/loss", "rm/accuracy", "rm/margin", "val/rm/accuracy",
                 *sorted(k for k in metrics if k.startswith("val/rm/accuracy/")), "lr", "time/step_s"]
        print0(f"step {step + 1}  " + console_line(metrics, shown))
        skips.check(step + 1, "reward_model", rm.output_dir)  # nothing learnt: no final/

        # ---- 7. checkpoint every save_freq steps and at the end; SIGTERM or Ctrl-C: also, then stop
        checkpoint_or_stop(accelerator, rm, step + 1, last, models,
                           {"skipped": skips.total, "lr_steps": scheduler.last_epoch}, stop_signal, logger)

    # ---- the final model: scores' mean/std for PPO, adapter merged, rank 0 writes
    stats_pairs = train_pairs[:rm.stats_max_pairs or None]
    stats = {k: v for k, v in evaluate(model, stats_pairs, micro, pad_id, accelerator, dtype).items()
             if k in ("mean", "std")}
    print0(f"reward_stats over {2 * len(stats_pairs)} training responses: {stats}")
    if problem := non_finite(accelerator.unwrap_model(model), stats):  # the same on every process
        raise SystemExit(f"reward_model.py: {problem} is not finite, so final/ is not written; lower "
                         f"reward_model.optim.lr and train again" if accelerator.is_main_process else 1)
    if accelerator.is_main_process:
        save_final(accelerator.unwrap_model(model).hf, tokenizer, stats, rm.output_dir)
        print0(f"wrote {os.path.join(rm.output_dir, 'final')}")
    accelerator.wait_for_everyone()
    logger.close()
    accelerator.end_training()


if __name__ == "__main__":
    cli.run_script(main, __doc__, config.RewardModelStage, "reward_model.py", check=check_only)
