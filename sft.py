"""SFT: supervised fine-tuning, the cross-entropy of the assistant's tokens given the conversation before them
(Ouyang et al., 2022, step 1), the first stage of the pipeline: SFT → reward model → PPO, or SFT → DPO → PPO.

    python tools/prepare_data.py --task arithmetic-preferences --output data/preferences   # the demo rows (chosen)
    python tools/prepare_data.py --task arithmetic --output data/arithmetic                # validation prompts
    accelerate launch sft.py --config configs.yaml                                         # the demo (make sft)
    accelerate launch sft.py --config configs.yaml sft.train_files=chats.jsonl sft.lora_rank=0
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml sft.py --config configs.yaml
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 sft.py --config configs.yaml
    python sft.py --help                                                                    # every sft.* key
    accelerate launch dpo.py --config configs.yaml dpo.model_path=outputs/sft/final        # SFT → DPO
    accelerate launch reward_model.py --config configs.yaml reward_model.model_path=outputs/sft/final

The demo (make sft: the demo pairs' right answers, LoRA in the top 8 layers, lr 2e-4, 20 steps of 16 rows) raised
greedy val/score/mean on 200 arithmetic prompts from 0.48 to 0.80 in 72 s of training on 2 CPU cores (bench/RESULTS.md).

The loss of a batch, over the assistant's tokens y_t of every row (the prompt's tokens are context, not targets):

    L = −(1 / N) · Σ_rows Σ_t log π(y_t | x, y_<t),    N = the assistant tokens of the whole batch

How it departs from TRL's SFTTrainer:
1. Rows come as a `messages` chat (every assistant turn is a row, the conversation before it its prompt), as
   `prompt` + `response`, or as preference pairs (their `chosen` side): the demo trains on the demo pairs' right
   answers. The response's tokens are the rest of the rendered conversation after the prompt rendered with its
   generation prompt, so they end with the template's end of turn: the model learns to stop.
2. N counts the batch's assistant tokens over all processes before the first micro-batch, so gradient accumulation
   and the number of processes do not change the gradient (a mean per micro-batch would weight short ones more).
3. Micro-batches go through ppo.py's forwards: padded, each distinct prompt once (sft.share_prompt_prefix; padded
   under FSDP2), or packed into one row without padding (sft.use_remove_padding), the same numbers within fp32
   rounding.
4. Validation answers the task's prompts greedily and scores them by its rule (val/score/mean, as ppo.py and
   dpo.py), beside the loss on held-out rows (val/loss).
"""
import functools
import math
import time

import torch
from tqdm import tqdm

from data import load_rl_dataset, tokenize_completions
from infra import cli
from infra.batches import Forward
from infra.config import RewardConfig
from infra.config_offline import SFTStage
from infra.metrics import console_line
from infra.offline import (batch_indices, begin, check_batch, check_folders, checkpoint_or_stop, completion_batch,
                           finish, held_out_slices, load_policy_to_train, open_log, Skips)
from infra.optim import make_optimizer, train_step
from infra.runs import StopSignal
from infra.tables import load_sft_rows
from rewards import rule_needing_truth
from validation import greedy_validation

CURVES = ["loss", "val/loss", "val/score/mean", "grad_norm"]  # curves.png's panels


def token_nll(logprobs, response_mask, tokens_in_batch: float):
    """−Σ_t log π(y_t | x, y_<t) over the real response tokens, / N: this micro-batch's share of the batch's token-mean
    cross-entropy (departure 2). logprobs, response_mask: (B, Tr)."""
    return -(logprobs * response_mask).sum() / tokens_in_batch


def rows_batch(rows, device, pad_id: int) -> dict:
    """(prompt_ids, [response_ids]) rows → ppo.py's batch of B rows."""
    return completion_batch([p for p, _ in rows], [r[0] for _, r in rows], pad_id, device)


@torch.no_grad()
def held_out_loss(model, rows, micro: int, fwd: Forward, pad_id: int, accelerator, sharded: bool) -> float:
    """The token-mean cross-entropy over held-out rows (each process takes every num_processes-th micro-batch)."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # Σ −log π, tokens
    for start in held_out_slices(len(rows), micro, accelerator, sharded):
        mb = rows_batch(rows[start or 0:(start or 0) + micro], accelerator.device, pad_id)
        nll = token_nll(fwd.logprobs(model, mb)[0], mb["response_mask"], 1.0)
        if start is not None:  # None: a forward only to keep FSDP2's gathers in step with the other processes
            sums += torch.stack([nll, mb["response_mask"].sum()]).double()
    model.train()
    nll, tokens = accelerator.reduce(sums, "sum").tolist()
    return nll / tokens


def check_inputs(cfg: SFTStage, num_processes: int, print0=print) -> dict:
    """Everything before the model loads, for `num_processes` processes: the folders, the rows (tokenised once), the
    validation prompts and the batch sizes; `sft.py --check` stops here."""
    s = cfg.sft
    tokenizer, out = check_folders(s, "sft"), {}
    for name, path in (("train", s.train_files), ("val", s.val_files)):
        if path:
            rows, read = load_sft_rows(path)
            out[name], stats = tokenize_completions(rows, ("response",), tokenizer, s.max_length, s.overlong, path)
            print0(f"{name} rows: {read | stats}")
    out["val"] = out.get("val", [])[:s.val_max_rows or None]
    out["val_prompts"] = []
    if s.val_prompts:
        rule_of = lambda source: rule_needing_truth(source, RewardConfig())  # noqa: E731
        prompts, stats = load_rl_dataset(s.val_prompts, tokenizer, s.max_length, "left", rule_of)
        out["val_prompts"] = prompts[:s.val_max_samples or None]
        print0(f"val prompts: {stats}, using {len(out['val_prompts'])}")
    out["local"], out["micro"] = check_batch(s, "sft", num_processes, len(out["train"]), "rows", print0)
    return {"tokenizer": tokenizer, **out}


def check_only(cfg: SFTStage, num_processes: int) -> str:
    """`sft.py --check`: check_inputs, then one line; no model is loaded."""
    return f"{num_processes} process(es), {check_inputs(cfg, num_processes)['local']} rows each a step; no model loaded"


def main(cfg: SFTStage):
    s = cfg.sft
    accelerator, lock, resume_from, finished = begin(cfg, "sft")  # the lock is held until the process ends
    if finished:
        return
    print0, device = accelerator.print, accelerator.device
    inputs = check_inputs(cfg, accelerator.num_processes, print0)  # rows tokenised once, before the model loads
    tokenizer, train_rows, local, micro = inputs["tokenizer"], inputs["train"], inputs["local"], inputs["micro"]
    pad_id = tokenizer.pad_token_id

    # ---- model (LoRA or full weights) sharded (FSDP2 launcher) or replicated (DDP), its forward; optimiser, resume
    model, _, fwd, sharded = load_policy_to_train(accelerator, s, "model")  # no reference
    optimizer, scheduler = make_optimizer(model, s.optim, s.total_steps)
    models = {"model": (model, optimizer)}
    logger, start, skipped = open_log(accelerator, cfg, "sft", resume_from, models, scheduler)
    model.train()

    def sft_loss(mb_rows, tokens: float):
        """A micro-batch's share of the batch's token-mean cross-entropy (departure 2), and that share again."""
        mb = rows_batch(mb_rows, device, pad_id)
        loss = token_nll(fwd.logprobs(model, mb)[0], mb["response_mask"], tokens)
        return loss, {"nll": loss.detach()}

    def evaluate(step: int) -> dict:
        metrics = (greedy_validation(model, tokenizer, inputs["val_prompts"], accelerator, s, sharded)
                   if s.val_prompts else {})
        if inputs["val"]:
            metrics["val/loss"] = held_out_loss(model, inputs["val"], micro, fwd, pad_id, accelerator, sharded)
        print0(f"validation at step {step}: " + console_line(metrics, sorted(metrics)))
        return metrics

    if s.val_before_train and start == 0:
        logger.log(evaluate(0), 0)
    stop_signal, skips = StopSignal(verbose=accelerator.is_main_process), Skips(skipped, s.max_skipped_steps)
    for step in tqdm(range(start, s.total_steps), initial=start, total=s.total_steps,
                     disable=not accelerator.is_main_process, dynamic_ncols=True):
        t0 = time.perf_counter()
        # ---- 1. this step's rows (a slice of the seeded epoch permutation), this process's share, N over all
        rows = [train_rows[i] for i in batch_indices(step, len(train_rows), s.batch_size, s.seed)]
        mine = rows[accelerator.process_index * local:][:local]
        tokens = sum(len(r[0]) for _, r in rows)  # N: every process's rows' assistant tokens
        # DDP and FSDP2 average the processes' gradients; each process's sum is scaled up to undo that mean
        per_process = tokens / accelerator.num_processes

        # ---- 2. cross-entropy of the assistant's tokens, backward per micro-batch; one optimiser step
        lr = scheduler.get_last_lr()[0]
        grad_norm, per_micro = train_step(model, optimizer, [mine[i:i + micro] for i in range(0, local, micro)],
                                          functools.partial(sft_loss, tokens=per_process), s.max_grad_norm)
        skips.count(grad_norm)
        scheduler.step()

        # ---- 3. metrics, validation every eval_freq steps and at the end, log
        loss = accelerator.reduce(sum(per_micro["nll"]), "sum").item() / accelerator.num_processes
        metrics = {"loss": loss, "tokens": tokens, "grad_norm": math.nan if grad_norm is None else grad_norm,
                   "lr": lr, "train/skipped_steps": skips.total}
        last = step + 1 == s.total_steps
        if last or (s.eval_freq > 0 and (step + 1) % s.eval_freq == 0):
            metrics.update(evaluate(step + 1))
        metrics["time/step_s"] = time.perf_counter() - t0
        logger.log(metrics, step + 1)
        print0(f"step {step + 1}  " + console_line(metrics, ["loss", "val/loss", "val/score/mean", "lr",
                                                             "time/step_s"]))
        skips.check(step + 1, "sft", s.output_dir)  # nothing learnt: no final/

        # ---- 4. checkpoint every save_freq steps and at the end; SIGTERM or Ctrl-C: also, then stop
        checkpoint_or_stop(accelerator, s, step + 1, last, models,
                           {"skipped": skips.total, "lr_steps": scheduler.last_epoch}, stop_signal, logger)

    # ---- final/: a plain causal LM (adapter merged), the next stage's model_path; curves.png
    logger.close()
    finish(accelerator, model, tokenizer, s, CURVES, sharded)


if __name__ == "__main__":
    cli.run_script(main, __doc__, SFTStage, "sft.py", check=check_only)
