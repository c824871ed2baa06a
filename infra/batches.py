"""How a PPO batch goes through a model: micro-batches, the forwards that give logprobs, entropies and values in the
run's layout (infra/layouts.py: padded, shared prompt prefix, packed), the fp32 log-softmax / entropy over a long
vocabulary a chunk of positions at a time (LogprobsEntropy), and the compute dtype (`model.dtype` → autocast).

With a frozen trunk (infra/trunk.py) `trunk_states` runs the layers below the adapters once per sequence in
the layout (step 4), and every forward here can start from their output instead (`trunk=L`): the same numbers within
fp32 rounding (tests/test_trunk.py).

Shapes: B sequences, Tq prompt length, Tr response length, V vocab, N packed tokens.
"""
from dataclasses import dataclass, replace
from typing import Optional

import torch

from infra.layouts import (distinct_prompts, first_rows, model_inputs, packed_inputs, response_tokens,
                           shared_inputs, shared_prompt_logits, unpacked)
from infra.trunk import from_trunk, Trunk, trunk_only

LOGITS_CHUNK = 1024  # positions whose fp32 log-softmax is computed at once on a GPU (logits_chunk)
CPU_CHUNK_ELEMENTS = 2 ** 22  # on a CPU: at most this many fp32 values (16 MB) in one chunk's temporaries
PROMPT_KEYS = ("queries", "query_mask", "trunk_prompt")  # a batch's prompt columns (left-padded); others per response

# ---------------------------------------------------------------------------------------
# The compute dtype

@dataclass(frozen=True)
class DtypeChoice:
    """What `model.dtype=auto` resolves to on a device, and why (the start-up log's line)."""
    name: str  # "bf16" or "fp32"
    why: str


def auto_dtype(device_type: str) -> DtypeChoice:
    """bf16 where bf16 matrix products are native: a CUDA GPU with bf16 units (Ampere or later), a CPU with AVX-512
    BF16 or AMX tiles; else fp32. torch.ops.mkldnn._is_mkldnn_bf16_supported() is no guide: it is true on any AVX-512
    CPU, where oneDNN emulates bf16 — a 512×576 by 576×1536 matmul took 36 ms in bf16 and 7.6 ms in fp32 on a Xeon
    without AVX-512 BF16, and `make run` 3× the fp32 step time (bench/bf16_matmul.py)."""
    if device_type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return DtypeChoice("bf16", "this GPU computes bf16 natively")
        return DtypeChoice("fp32", "this GPU has no native bf16 (before Ampere)")
    if torch.cpu._is_amx_tile_supported():
        return DtypeChoice("bf16", "this CPU has AMX tiles")
    if torch.cpu._is_avx512_bf16_supported():
        return DtypeChoice("bf16", "this CPU has AVX-512 BF16")
    return DtypeChoice("fp32", "this CPU has neither AVX-512 BF16 nor AMX, so bf16 would be emulated, slower than fp32")


def resolve_dtype(cfg, device: torch.device, say=print):
    """cfg with model.dtype=auto replaced by what it means on `device` (auto_dtype), said in one line; any other
    cfg unchanged. Everything downstream (forwards, FSDP2, reference, vLLM's rollout.dtype=auto) then reads the very
    config that model.dtype=bf16 or fp32 would have given."""
    if cfg.model.dtype != "auto":
        return cfg
    choice = auto_dtype(device.type)
    say(f"model.dtype=auto: {choice.name}, since {choice.why}")
    return replace(cfg, model=replace(cfg.model, dtype=choice.name))


def autocast_dtype(name: str):
    """`model.dtype` → the autocast dtype (None = plain fp32); auto as on the default device (auto_dtype)."""
    if name == "auto":
        name = auto_dtype("cuda" if torch.cuda.is_available() else "cpu").name
    return {"bf16": torch.bfloat16, "fp32": None}[name]


def autocast(device: torch.device, dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# ---------------------------------------------------------------------------------------
# Logprobs and entropy from logits

def logits_chunk(device: torch.device, vocab: int) -> int:
    """Positions per chunk of chunked_logprobs_entropy. On a CPU few enough that each fp32 temporary stays within
    CPU_CHUNK_ELEMENTS (85 positions of a 49k vocabulary): glibc hands a larger block (over its 32 MB threshold) fresh
    from the kernel at each op, page faults and all: 3× slower (bench/RESULTS.md, 2026-12-02)."""
    return LOGITS_CHUNK if device.type == "cuda" else max(1, CPU_CHUNK_ELEMENTS // vocab)


class LogprobsEntropy(torch.autograd.Function):
    """log softmax(z)[token] and the entropy of softmax(z), z = logits / T, per position: (N, V), (N,) → (N,), (N,);
    forward and backward `chunk` positions at a time, by hand.

        lse = logsumexp(z),  log p = z − lse,  logprob = z[token] − lse,  H = lse − Σ p·z
        ∂logprob/∂z_j = 1[j = token] − p_j,  ∂H/∂z_j = −p_j (log p_j + H),  ∂z/∂logits = 1 / T

    Only lse and H (N,) are kept beside the logits; backward recomputes p a chunk at a time, and no fp32 (N, V) tensor
    outlives its chunk. Autograd through log_softmax and the entropy formula, recomputed under activation checkpointing
    to bound memory, cost more than the head's matmul it follows (bench/logits_memory.py). Computed in fp32,
    or in the logits' dtype where wider (float64: gradcheck)."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature: float, with_entropy: bool, chunk: int):
        ctx.set_materialize_grads(False)  # an output the loss does not use gets no gradient: entropy, mostly
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logprobs, entropy, lse = (logits.new_zeros(len(tokens), dtype=dtype) for _ in range(3))
        for i in range(0, len(tokens), chunk):
            c = slice(i, i + chunk)
            z = logits[c].to(dtype) / temperature  # (c, V), a new tensor even for T = 1: logits stay untouched
            lse[c] = torch.logsumexp(z, -1)
            logprobs[c] = z.gather(-1, tokens[c, None])[:, 0] - lse[c]
            if with_entropy:
                entropy[c] = lse[c] - ((z - lse[c, None]).exp_() * z).sum(-1)
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i in range(0, len(tokens), ctx.chunk):
            c = slice(i, i + ctx.chunk)
            log_p = (logits[c].to(lse.dtype) / ctx.temperature).sub_(lse[c, None])  # (c, V)
            p = log_p.exp()
            if grad_logprobs is None:
                g = torch.zeros_like(p)
            else:
                g = (p * -grad_logprobs[c, None]).scatter_add_(-1, tokens[c, None], grad_logprobs[c, None])
            if grad_entropy is not None:
                g -= log_p.add_(entropy[c, None]).mul_(p).mul_(grad_entropy[c, None])
            grad[c] = g.div_(ctx.temperature)
        return grad, None, None, None, None


def chunked_logprobs_entropy(logits, tokens, temperature: float, with_entropy: bool, chunk: int):
    """log softmax(z / T)[token], and the entropy of softmax(z / T) when with_entropy (else None), per position,
    `chunk` positions at a time (LogprobsEntropy): logits (..., V), tokens (...) → logprobs (...), entropy (...).
    The sampler's distribution is softmax(logits / T)."""
    shape, V = tokens.shape, logits.shape[-1]
    logprobs, entropy = LogprobsEntropy.apply(logits.reshape(-1, V), tokens.reshape(-1), temperature, with_entropy,
                                              chunk)
    return logprobs.view(shape), (entropy.view(shape) if with_entropy else None)


# ---------------------------------------------------------------------------------------
# Micro-batches and the forwards over them

def micro_batch(batch: dict, inds, device):
    """Rows `inds` of the batch, with columns that are padding in every row cut away."""
    mb = {k: v[inds] for k, v in batch.items()}
    q_keep = mb["query_mask"].any(0).nonzero()[0, 0]  # first column any query uses
    r_keep = int(response_tokens(mb).any(0).nonzero()[-1, 0]) + 1  # last column any response uses
    for k, v in mb.items():
        if k in PROMPT_KEYS:
            mb[k] = v[:, q_keep:]
        elif v.dim() >= 2:
            mb[k] = v[:, :r_keep]
    return {k: v.to(device) for k, v in mb.items()}


def same_count(count: int) -> int:
    """The most micro-batches any process makes, on one process: its own count (see split_micro)."""
    return count


def split_micro(inds, lengths, size: int, max_tokens: int = 0, largest_count=same_count):
    """Split indices into micro-batches of `size` rows, or (max_tokens > 0) greedily by a token budget.

    By a budget each process would make its own number of micro-batches from its own lengths, and every forward is
    a round of collectives (FSDP2's all-gathers, DDP's buffer broadcast): a process with fewer would leave the
    others waiting forever. So all make as many as the one that makes most, largest_count(own count)
    (infra.distributed.max_over_processes, as verl all-reduces it), halving their largest micro-batches to get
    there; every process holds as many rows, so there are enough.
    """
    if max_tokens <= 0:
        return [inds[i:i + size] for i in range(0, len(inds), size)]
    order = sorted(inds.tolist(), key=lambda i: lengths[i])
    out, cur, longest = [], [], 0
    for i in order:
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > max_tokens:
            out.append(torch.tensor(cur))
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    out.append(torch.tensor(cur))
    for _ in range(largest_count(len(out)) - len(out)):  # a part of a micro-batch stays within the budget
        big = max(range(len(out)), key=lambda j: len(out[j]))
        out[big:big + 1] = list(out[big].tensor_split(2))
    return out


def trunk_hidden(mb: dict, layout: str):
    """The trunk's output for the one call of a padded or packed forward: (B, Tq+Tr, H) or (1, N, H)."""
    if layout == "padded":
        return torch.cat([mb["trunk_prompt"], mb["trunk_response"]], 1)
    _, prompt_mask, row_of = distinct_prompts(mb)  # packed_inputs' row: the distinct prompts, then the responses
    prompts = mb["trunk_prompt"][first_rows(row_of, len(prompt_mask))]  # (U, Tq, H)
    return torch.cat([prompts[prompt_mask.bool()], mb["trunk_response"][response_tokens(mb).bool()]])[None]


def trunk_states(model, mb, dtype, layout: str, layers: int) -> dict:
    """The trunk's output (decoder layer layers−1) at every prompt and response position of each row, computed once in
    the layout: {"trunk_prompt": (B, Tq, H), "trunk_response": (B, Tr, H)}, fp32 (the residual stream's dtype).

    Only layers 0 … layers−1 run (trunk.trunk_only), each call's head at one position. Shared: each distinct prompt
    once, its result given to each of its rows; packed: the row's tokens put back in place, 0 at padding."""
    from transformers import DynamicCache

    Tq = mb["queries"].shape[1]
    with autocast(mb["responses"].device, dtype), trunk_only(model, layers) as out:
        if layout == "shared":
            prompt, response, row_of = shared_inputs(mb)
            cache = DynamicCache()
            model(**prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.reorder_cache(row_of)
            model(**response, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return {"trunk_prompt": out[0][row_of], "trunk_response": out[1]}
        if layout == "packed":
            inputs, _ = packed_inputs(mb)
            model(**inputs, logits_to_keep=1, use_cache=False)
            _, prompt_mask, row_of = distinct_prompts(mb)
            prompt_mask, real, H = prompt_mask.bool(), response_tokens(mb).bool(), out[0].shape[-1]
            prompts = out[0].new_zeros(*prompt_mask.shape, H)  # (U, Tq, H)
            responses = out[0].new_zeros(*real.shape, H)  # (B, Tr, H)
            n_prompt = int(prompt_mask.sum())
            prompts[prompt_mask], responses[real] = out[0][0, :n_prompt], out[0][0, n_prompt:]
            return {"trunk_prompt": prompts[row_of], "trunk_response": responses}
        model(**model_inputs(mb), logits_to_keep=1, use_cache=False)
        return {"trunk_prompt": out[0][:, :Tq], "trunk_response": out[0][:, Tq:]}


def forward_logprobs(model, mb, temperature: float, dtype, with_entropy: bool, layout: str = "padded",
                     trunk: int = 0):
    """log π(response token t | prefix) and the entropy at each response position, (B, Tr) each (batch_layout).
    trunk = L > 0: from mb's trunk states, at decoder layer L (infra/trunk.py)."""
    Tr, mask = mb["responses"].shape[1], response_tokens(mb).bool()
    keep = None
    with autocast(mb["responses"].device, dtype):
        if layout == "shared":
            logits = shared_prompt_logits(model, mb, trunk, logits_to_keep=1)  # (B, Tr, V)
        else:
            inputs, keep = packed_inputs(mb) if layout == "packed" else (model_inputs(mb), None)
            # logits only where they predict a response token: (B, Tr, V) or (K, V), never (B, Tq+Tr, V)
            with from_trunk(model, trunk, trunk_hidden(mb, layout) if trunk else None):
                logits = model(**inputs, logits_to_keep=Tr + 1 if keep is None else keep, use_cache=False).logits
            logits = logits[:, :-1] if keep is None else logits[0]  # (B, Tr, V) or (K, V)
    targets = mb["responses"] if keep is None else mb["responses"][mask]
    logprobs, entropy = chunked_logprobs_entropy(logits, targets, temperature, with_entropy,
                                                 logits_chunk(logits.device, logits.shape[-1]))
    if keep is not None:  # back from (K,) to (B, Tr)
        logprobs = unpacked(logprobs, mask)
        entropy = unpacked(entropy, mask) if with_entropy else None
    return logprobs, entropy


def forward_values(critic, mb, dtype, layout: str = "padded", trunk: int = 0):
    """V(s_t) before each response token, from the same positions as the logprobs: (B, Tr).
    trunk = L > 0: from mb's trunk states, at decoder layer L (infra/trunk.py)."""
    if layout == "shared":
        with autocast(mb["responses"].device, dtype):
            return shared_prompt_logits(critic, mb, trunk)[..., 0].float()
    inputs, keep = packed_inputs(mb) if layout == "packed" else (model_inputs(mb), None)
    Tr, mask = mb["responses"].shape[1], response_tokens(mb).bool()
    hidden = trunk_hidden(mb, layout) if trunk else None  # the trunk's output for this call, or the whole critic
    with autocast(inputs["input_ids"].device, dtype), from_trunk(critic, trunk, hidden):
        values = critic(**inputs, use_cache=False).logits[..., 0].float()  # (B, Tq+Tr) or (1, N)
    if keep is None:
        return values[:, -Tr - 1:-1]
    return unpacked(values[0, keep], mask)


@dataclass(frozen=True)
class Forward:
    """How one run's training forwards read a micro-batch: fixed for the run, bound once (ppo.main)."""
    temperature: float  # the sampler's: log-probabilities of softmax(logits / T)
    dtype: Optional[torch.dtype]  # autocast dtype (None: fp32)
    layout: str  # "padded", "shared" or "packed" (layouts.batch_layout)
    trunk: Optional[Trunk] = None  # frozen layers run once per step (trunk.plan_trunk); None: whole-model forwards

    def logprobs(self, model, mb, with_entropy: bool = False):
        """log π(y_t | prefix) of the response tokens, and their entropies when with_entropy: (B, Tr) each."""
        return forward_logprobs(model, mb, self.temperature, self.dtype, with_entropy=with_entropy,
                                layout=self.layout, trunk=self.trunk.layers if self.trunk else 0)

    def values(self, critic, mb):
        """V(s_t) before each response token: (B, Tr)."""
        shared = self.trunk is not None and self.trunk.critic
        return forward_values(critic, mb, self.dtype, layout=self.layout, trunk=self.trunk.layers if shared else 0)

    def trunk_states(self, policy, mb) -> dict:
        """The trunk's output at every position of mb's rows: trunk_prompt (B, Tq, H), trunk_response (B, Tr, H)."""
        return trunk_states(policy, mb, self.dtype, self.layout, self.trunk.layers)


@torch.no_grad()
def per_token_pass(fn, batch, size, max_tokens, lengths, device, largest_count=same_count):
    """Run fn(micro-batch) over the batch without grad (micro-batches as split_micro makes them); reassemble its
    (b, tr) results as (B, Tr), or its dicts of per-row tensors {key: (b, t, …)} each as (B, T, …), placed as
    micro_batch cut them (PROMPT_KEYS at the end of the prompt columns, other keys at the start of the response
    columns)."""
    out = {}
    for inds in split_micro(torch.arange(len(lengths)), lengths, size, max_tokens, largest_count):
        result = fn(micro_batch(batch, inds, device))
        for key, part in (result.items() if isinstance(result, dict) else [(None, result)]):
            part, prompt = part.float().cpu(), key in PROMPT_KEYS
            B, T = batch["queries" if prompt else "responses"].shape
            whole = out.setdefault(key, torch.zeros(B, T, *part.shape[2:]))
            columns = slice(T - part.shape[1], T) if prompt else slice(0, part.shape[1])
            whole[inds, columns] = part
    return out if isinstance(result, dict) else out[None]


def set_train_mode(models: list, on: bool) -> None:
    """Train mode for the updates, eval mode for the no-grad passes. That only switches gradient checkpointing
    (transformers recomputes only in train mode), since every dropout is 0 (these configs' attention_dropout,
    lora_dropout's default, the critic's head); a lora_dropout > 0 would make the first epoch's ratio differ from 1."""
    for model in models:
        if model is not None:
            model.train(on)
