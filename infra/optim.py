"""The optimiser step and its schedule: AdamW, linear warmup then cosine, and `train_step` (accumulate over the
micro-batches, average over processes, clip over every shard, skip a non-finite step, apply; or stop at a micro-batch
boundary on a stop signal, StopAtMicroBatch)."""
import math
from contextlib import contextmanager, nullcontext

import torch
from torch.distributed.tensor import DTensor


def lr_lambda(total_steps: int, warmup_ratio: float, scheduler: str, min_lr_ratio: float):
    """Multiplier of the peak lr at step s: linear warmup, then cosine down to min_lr_ratio (or constant)."""
    warmup = int(warmup_ratio * total_steps)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def make_optimizer(model, optim_cfg, total_steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel for all parameters (on CPU 5× faster than torch's default per-tensor loop there)
    optimizer = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                                  weight_decay=optim_cfg.weight_decay, fused=True)
    f = lr_lambda(total_steps, optim_cfg.warmup_ratio, optim_cfg.lr_scheduler, optim_cfg.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def restore_schedule(scheduler, steps_done: int) -> None:
    """Move a fresh LambdaLR to `steps_done` scheduler steps. Its peak lr stays this run's optim.lr, so a
    resumed run with a new lr uses it; the lr is set on the optimiser too (a scheduler only sets it on step)."""
    scheduler.last_epoch, scheduler._step_count = steps_done, steps_done + 1
    for group, base, f in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * f(steps_done)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


@contextmanager
def gradient_sync(model, enabled: bool):
    """DDP: accumulate gradients locally (enabled=False) until the last micro-batch, where they are averaged.

    FSDP2 reduce-scatters every micro-batch's gradients whatever `enabled` says, as verl does: without the sync it
    would hold each parameter's whole unsharded fp32 gradient on every device until the last micro-batch, the
    model's size in fp32 once more. The price is one reduce-scatter per micro-batch instead of per
    optimiser step; the averaged shards add up to the same gradient."""
    fsdp2 = any(hasattr(m, "set_requires_gradient_sync") for m in model.modules())
    with model.no_sync() if not (enabled or fsdp2) and hasattr(model, "no_sync") else nullcontext():
        yield


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """‖g‖₂ over all gradients, every shard included; g is scaled down to max_norm when it is larger."""

    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(total, DTensor):  # each process holds the norm of its shards: combine them (as torchtitan does)
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class StopAtMicroBatch:
    """A stop signal acted on at train_step's next micro-batch boundary: torchrun kills its workers 30 s
    after SIGTERM, too soon to finish a real-size step and then save. `received()` (runs.StopSignal.received, a
    collective) is asked before every micro-batch, so all processes stop at the same one; once it has answered, signum
    holds the signal and every later train_step returns at once."""

    def __init__(self, received):
        self.received, self.signum = received, 0

    def __call__(self) -> int:
        self.signum = self.signum or self.received()
        return self.signum


def train_step(model, optimizer, micro_batches: list, loss_fn, max_grad_norm: float, stop=None):
    """One optimiser step: gradients accumulated over the micro-batches, averaged over processes (DDP: after the
    last one only; FSDP2: reduce-scattered after each, gradient_sync), clipped over every shard, then applied.
    loss_fn(mb) → (loss, metrics dict).

    A non-finite loss or gradient never reaches the weights: the step is skipped and its grad norm is None
    (the same on every process, since the norm is taken after the gradients are averaged). So does a stop signal
    (`stop`: StopAtMicroBatch) seen before any micro-batch: the gradients accumulated so far are dropped.
    Returns (grad norm or None, {metric: [one value per micro-batch]}).
    """
    metrics = {}
    for i, mb in enumerate(micro_batches):
        if stop is not None and stop():
            optimizer.zero_grad(set_to_none=True)
            return None, metrics
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            loss, mb_metrics = loss_fn(mb)
            loss.backward()
        for key, value in mb_metrics.items():
            metrics.setdefault(key, []).append(value)
    grad_norm = clip_grad_norm(model.parameters(), max_grad_norm)
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (grad_norm.item() if finite else None), metrics
