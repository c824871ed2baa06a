"""DPO: preference optimisation on the pairs themselves, no reward model and no sampling (Rafailov et al., 2023), with
its relatives IPO (Azar et al., 2023) and SimPO (Meng et al., 2024) in the table LOSSES.

    python tools/prepare_data.py --task arithmetic-preferences --output data/preferences   # the demo pairs
    python tools/prepare_data.py --task arithmetic --output data/arithmetic                # validation prompts
    accelerate launch dpo.py --config configs.yaml                                         # the demo (make dpo)
    accelerate launch dpo.py --config configs.yaml dpo.loss_type=ipo dpo.beta=0.5
    accelerate launch dpo.py --config configs.yaml dpo.model_path=outputs/sft/final        # SFT → DPO
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml dpo.py --config configs.yaml
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 dpo.py --config configs.yaml
    python dpo.py --help                                                                    # every dpo.* key
    accelerate launch ppo.py --config configs.yaml model.path=outputs/dpo/final            # DPO → PPO

The demo (make dpo: LoRA in the top 8 of SmolLM2-135M's 30 layers, β 0.1, lr 5e-4, 16 pairs a step, fp32) raised greedy
val/score/mean on 200 arithmetic prompts from 0.48 to 0.805 in 20 steps, 2.5 minutes of training on 2 CPU cores,
at 0.34× the time a step of TRL's DPOTrainer (bench/dpo_bench.py); a 40-step run fell back to 0.61 as the chosen
answers' log-probs fell too, hence 20 steps (bench/RESULTS.md).

The loss of a pair (x, y_w, y_l), y_w chosen, y_l rejected, with Δ(y) = log π(y|x) − log π_ref(y|x):

    sigmoid   −(1−ε)·log σ(β·(Δ(y_w) − Δ(y_l))) − ε·log σ(−β·(Δ(y_w) − Δ(y_l)))       DPO; ε > 0: conservative DPO
    ipo       (Δ̄(y_w) − Δ̄(y_l) − 1/(2β))²                                             Δ̄ = Δ / |y|, per token
    simpo     −(1−ε)·log σ(β·(ℓ(y_w) − ℓ(y_l)) − γ) − …                                 ℓ = log π(y|x) / |y|, no π_ref

and its metrics carry TRL's names: rewards/chosen = β·Δ(y_w) (SimPO: β·ℓ(y_w)), rewards/rejected, rewards/margins
(their difference), rewards/accuracies (the share of pairs where chosen's is higher), logps/chosen, logps/rejected.

How this departs from the paper, and from TRL's DPOTrainer:
1. Under LoRA the reference π_ref is the policy with its adapter switched off (no second copy, as ppo.py's
   ref_logprobs); with lora_rank=0 it is a frozen copy of model_path. dpo.precompute_ref_log_probs computes it for
   every training pair once, before the first step (one no-grad pass), instead of at every step.
2. A pair's prompt is run once for both answers (dpo.share_prompt_prefix, as ppo.py runs a prompt's n samples; not
   under FSDP2), or with dpo.use_remove_padding packed into one row: the same numbers within fp32 rounding.
3. Log-probabilities are summed over the response tokens; IPO and SimPO average them (PER_TOKEN), as TRL does
   (its IPO is length-normalised too, which the IPO authors confirmed).
4. Losses are normalised by the pairs of the whole batch over all processes, so gradient accumulation and the
   number of processes do not change the gradient.
5. Validation answers the task's prompts greedily and scores them by its rule (val/score/mean, as ppo.py), beside
   the loss and rewards/* on held-out pairs (val/rewards/accuracies: TRL's eval accuracy).
"""
import functools
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from data import load_preferences, load_rl_dataset, tokenize_completions
from infra import cli
from infra.batches import Forward
from infra.config import ConfigError, RewardConfig
from infra.config_offline import DPOStage
from infra.metrics import console_line
from infra.models import load_reference
from infra.offline import (batch_indices, begin, check_batch, check_folders, checkpoint_or_stop, completion_batch,
                           finish, held_out_slices, load_policy_to_train, open_log, Skips)
from infra.optim import make_optimizer, train_step
from infra.runs import StopSignal
from kl import ref_logprobs
from rewards import rule_needing_truth
from validation import greedy_validation

# ---------------------------------------------------------------------------------------
# The losses: (chosen, rejected, β, ε, γ) → per pair (B,), where chosen and rejected are Δ(y_w), Δ(y_l) (B,) each,
# or for REFERENCE_FREE losses log π alone; PER_TOKEN ones get them averaged over the response's tokens.


def sigmoid_loss(chosen, rejected, beta: float, label_smoothing: float, gamma: float):
    """h = β·(Δ_w − Δ_l);  L = −(1 − ε)·log σ(h) − ε·log σ(−h)

    DPO (Rafailov et al., 2023, eq. 7); ε > 0 is conservative DPO (Mitchell, 2023), TRL's label_smoothing."""
    h = beta * (chosen - rejected)
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def ipo_loss(chosen, rejected, beta: float, label_smoothing: float, gamma: float):
    """L = (Δ̄_w − Δ̄_l − 1/(2τ))²,  τ = β   (Azar et al., 2023, eq. 17)"""
    return (chosen - rejected - 1 / (2 * beta)) ** 2


def simpo_loss(chosen, rejected, beta: float, label_smoothing: float, gamma: float):
    """h = β·(ℓ_w − ℓ_l) − γ, ℓ = log π(y|x) / |y|;  L = −(1 − ε)·log σ(h) − ε·log σ(−h)

    SimPO (Meng et al., 2024, eq. 6), no reference; ε as TRL's CPOTrainer(loss_type="simpo") applies it."""
    h = beta * (chosen - rejected) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


LOSSES = {"sigmoid": sigmoid_loss, "ipo": ipo_loss, "simpo": simpo_loss}
REFERENCE_FREE = {"simpo"}  # Δ is log π alone: no reference model, no reference pass
PER_TOKEN = {"ipo", "simpo"}  # log-probabilities averaged over the response's tokens, not summed


def sequence_logprobs(token_logprobs, response_mask, per_token: bool):
    """Σ_t log π(y_t | x, y_<t) over the response's real tokens, or that sum / |y| (per_token): (B, Tr) → (B,)."""
    total = (token_logprobs * response_mask).sum(1)
    return total / response_mask.sum(1).clamp(min=1) if per_token else total


def pair_terms(logps, ref_logps, d) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's losses (b,) and its metric sums (7,): Σ loss, Σ accuracy, Σ margin, Σ rewards/chosen,
    Σ rewards/rejected, Σ logps/chosen, Σ logps/rejected. logps, ref_logps: (2b,), the chosen answers first."""
    chosen, rejected = (logps - ref_logps).chunk(2)  # Δ(y_w), Δ(y_l): (b,) each
    losses = LOSSES[d.loss_type](chosen, rejected, d.beta, d.label_smoothing, d.simpo_gamma)
    r_w, r_l = (d.beta * chosen).detach(), (d.beta * rejected).detach()  # TRL's rewards
    logp_w, logp_l = logps.detach().chunk(2)
    sums = torch.stack([losses.detach().sum(), (r_w > r_l).sum(), (r_w - r_l).sum(), r_w.sum(), r_l.sum(),
                        logp_w.sum(), logp_l.sum()])
    return losses, sums


SUM_NAMES = ["loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
             "logps/rejected"]
CURVES = ["loss", "rewards/accuracies", "rewards/margins", "val/rewards/accuracies", "val/score/mean", "grad_norm"]


# ---------------------------------------------------------------------------------------
# Log-probabilities of the pairs


def pair_batch(pairs, pad_id: int, device) -> dict:
    """b pairs (prompt_ids, [chosen_ids, rejected_ids]) → ppo.py's batch of 2b rows, the chosen answers first."""
    prompts = [p for p, _ in pairs] * 2
    return completion_batch(prompts, [r[0] for _, r in pairs] + [r[1] for _, r in pairs], pad_id, device)


def reference_logps(ref, policy, mb, fwd: Forward, d):
    """Σ log π_ref of each row's response (per token for PER_TOKEN losses), (2b,); 0 for a REFERENCE_FREE loss."""
    if d.loss_type in REFERENCE_FREE:
        return torch.zeros(mb["responses"].shape[0], device=mb["responses"].device)
    with torch.no_grad():
        return sequence_logprobs(ref_logprobs(ref, policy, mb, fwd), mb["response_mask"], d.loss_type in PER_TOKEN)


def precompute_ref_logprobs(ref, policy, pairs, micro: int, fwd: Forward, d, pad_id: int, device):
    """departure 1: reference_logps of every pair, once: (N, 2) chosen and rejected, on the CPU."""
    out = torch.zeros(len(pairs), 2)
    for i in range(0, len(pairs), micro):
        logps = reference_logps(ref, policy, pair_batch(pairs[i:i + micro], pad_id, device), fwd, d)
        out[i:i + micro] = torch.stack(logps.float().cpu().chunk(2), 1)
    return out


@torch.no_grad()
def evaluate(policy, ref, pairs, micro: int, fwd: Forward, d, pad_id: int, accelerator, sharded: bool) -> dict:
    """The loss and rewards/* over held-out pairs (each process takes every num_processes-th micro-batch)."""
    policy.eval()
    sums = torch.zeros(len(SUM_NAMES), dtype=torch.float64, device=accelerator.device)
    for i in held_out_slices(len(pairs), micro, accelerator, sharded):
        mb = pair_batch(pairs[i or 0:(i or 0) + micro], pad_id, accelerator.device)
        logps = sequence_logprobs(fwd.logprobs(policy, mb)[0], mb["response_mask"], d.loss_type in PER_TOKEN)
        terms = pair_terms(logps, reference_logps(ref, policy, mb, fwd, d), d)[1]
        if i is not None:  # None: forwards only to keep FSDP2's gathers in step with the other processes
            sums += terms.double()
    policy.train()
    return dict(zip(SUM_NAMES, (accelerator.reduce(sums, "sum") / len(pairs)).tolist()))


# ---------------------------------------------------------------------------------------
# Inputs, checked before any model loads


def check_inputs(cfg: DPOStage, num_processes: int, print0=print) -> dict:
    """Everything before the model loads, for `num_processes` processes: the config's loss, the folders, the pairs
    (tokenised once), the validation prompts and the batch sizes; `dpo.py --check` stops here."""
    d = cfg.dpo
    if d.loss_type not in LOSSES:
        raise ConfigError(f"dpo.loss_type={d.loss_type!r} is not a loss in dpo.LOSSES; choose one of {sorted(LOSSES)}")
    tokenizer = check_folders(d, "dpo")
    loaded = {}
    for name, path in (("train", d.train_files), ("val", d.val_files)):
        if path:
            rows, read = load_preferences(path)
            loaded[name], stats = tokenize_completions(rows, ("chosen", "rejected"), tokenizer, d.max_length,
                                                       d.overlong, path)
            print0(f"{name} pairs: {read | stats}")
    val_prompts = []
    if d.val_prompts:
        rule_of = lambda source: rule_needing_truth(source, RewardConfig())  # noqa: E731
        val_prompts, stats = load_rl_dataset(d.val_prompts, tokenizer, d.max_length, "left", rule_of)
        val_prompts = val_prompts[:d.val_max_samples or None]
        print0(f"val prompts: {stats}, using {len(val_prompts)}")
    local, micro = check_batch(d, "dpo", num_processes, len(loaded["train"]), "pairs", print0)
    return {"tokenizer": tokenizer, "train": loaded["train"], "val": loaded.get("val", [])[:d.val_max_rows or None],
            "val_prompts": val_prompts, "local": local, "micro": micro}


def check_only(cfg: DPOStage, num_processes: int) -> str:
    """`dpo.py --check`: check_inputs, then one line; no model is loaded."""
    checked = check_inputs(cfg, num_processes)
    return f"{num_processes} process(es), {checked['local']} pairs each a step; the inputs are there; no model loaded"


# ---------------------------------------------------------------------------------------
# Training


def main(cfg: DPOStage):
    d = cfg.dpo
    accelerator, lock, resume_from, finished = begin(cfg, "dpo")  # the lock is held until the process ends
    if finished:
        return
    print0, device = accelerator.print, accelerator.device
    # ---- inputs: pairs tokenised once, sizes checked before the model is loaded
    inputs = check_inputs(cfg, accelerator.num_processes, print0)
    tokenizer, train_pairs, local, micro = inputs["tokenizer"], inputs["train"], inputs["local"], inputs["micro"]
    pad_id = tokenizer.pad_token_id

    # ---- policy and reference (departure 1): sharded (FSDP2 launcher) or the policy under DDP; optimiser, resume
    # ref: with full weights a frozen copy of model_path, loaded once the policy is placed; under LoRA None (the
    # policy with its adapter off is the reference), as for a REFERENCE_FREE loss (no reference at all)
    frozen_copy = None
    if not d.lora_rank and d.loss_type not in REFERENCE_FREE:
        frozen_copy = functools.partial(load_reference, d.model_path, trust_remote_code=d.trust_remote_code)
    policy, ref, fwd, sharded = load_policy_to_train(accelerator, d, "policy", reference=frozen_copy)
    optimizer, scheduler = make_optimizer(policy, d.optim, d.total_steps)
    models = {"model": (policy, optimizer)}
    logger, start, skipped = open_log(accelerator, cfg, "dpo", resume_from, models, scheduler)
    ref_table = None
    if d.precompute_ref_log_probs and d.loss_type not in REFERENCE_FREE:
        ref_table = precompute_ref_logprobs(ref, policy, train_pairs, micro, fwd, d, pad_id, device)
        print0(f"reference log-probs of {len(train_pairs)} pairs computed once")
    policy.train()

    def dpo_loss(batch):
        """A micro-batch's share of the batch's mean loss (departure 4), and its metric sums."""
        inds, pairs = zip(*batch)
        mb = pair_batch(pairs, pad_id, device)
        logps = sequence_logprobs(fwd.logprobs(policy, mb)[0], mb["response_mask"], d.loss_type in PER_TOKEN)
        ref_logps = (reference_logps(ref, policy, mb, fwd, d) if ref_table is None
                     else ref_table[list(inds)].T.reshape(-1).to(device))  # (2b,) chosen first
        losses, sums = pair_terms(logps, ref_logps, d)
        return losses.sum() / local, {"sums": sums}

    def validate(step: int) -> dict:
        """Greedy answers to the task's prompts scored by its rule, and the loss and rewards/* on held-out pairs."""
        metrics = (greedy_validation(policy, tokenizer, inputs["val_prompts"], accelerator, d, sharded)
                   if d.val_prompts else {})
        if inputs["val"]:
            metrics.update({f"val/{k}": v for k, v in evaluate(policy, ref, inputs["val"], micro, fwd, d, pad_id,
                                                                 accelerator, sharded).items()})
        print0(f"validation at step {step}: " + console_line(metrics, sorted(metrics)))
        return metrics

    if d.val_before_train and start == 0:
        logger.log(validate(0), 0)
    stop_signal, skips = StopSignal(verbose=accelerator.is_main_process), Skips(skipped, d.max_skipped_steps)
    bar = tqdm(range(start, d.total_steps), initial=start, total=d.total_steps,
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        # ---- 1. this step's pairs: a slice of the seeded epoch permutation, then this process's share
        inds = batch_indices(step, len(train_pairs), d.batch_size, d.seed)
        mine = [(i, train_pairs[i]) for i in inds[accelerator.process_index * local:][:local]]

        # ---- 2. log-probs of both answers (and the reference's), the loss, backward per micro-batch; one step
        lr = scheduler.get_last_lr()[0]
        grad_norm, per_micro = train_step(policy, optimizer, [mine[i:i + micro] for i in range(0, local, micro)],
                                          dpo_loss, d.max_grad_norm)  # skipped (None) when not finite
        skips.count(grad_norm)
        scheduler.step()

        # ---- 3. metrics: sums over all processes, divided by the batch; validation every eval_freq steps
        sums = (accelerator.reduce(sum(per_micro["sums"]), "sum") / d.batch_size).tolist()
        metrics = {**dict(zip(SUM_NAMES, sums)), "grad_norm": math.nan if grad_norm is None else grad_norm, "lr": lr,
                   "train/skipped_steps": skips.total}
        last = step + 1 == d.total_steps
        if last or (d.eval_freq > 0 and (step + 1) % d.eval_freq == 0):
            metrics.update(validate(step + 1))
        metrics["time/step_s"] = time.perf_counter() - t0
        logger.log(metrics, step + 1)
        print0(f"step {step + 1}  " + console_line(metrics, ["loss", "rewards/accuracies", "rewards/margins",
                                                             "val/score/mean", "lr", "time/step_s"]))
        skips.check(step + 1, "dpo", d.output_dir)  # nothing learnt: no final/

        # ---- 4. checkpoint every save_freq steps and at the end; SIGTERM or Ctrl-C: also, then stop
        checkpoint_or_stop(accelerator, d, step + 1, last, models, {"skipped": skips.total,
                                                                    "lr_steps": scheduler.last_epoch},
                           stop_signal, logger)

    # ---- final/: the policy as a plain causal LM (adapter merged), the next stage's model_path; curves.png
    logger.close()
    finish(accelerator, policy, tokenizer, d, CURVES, sharded)


if __name__ == "__main__":
    cli.run_script(main, __doc__, DPOStage, "dpo.py", check=check_only)
