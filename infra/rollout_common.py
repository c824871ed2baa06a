"""What every rollout kind shares (rollout.py's, rollout_kinds/server.py's, agents/multi_turn.py's loop): the Rollout
record they return and the Samples that step 3 makes of it, padded token rows, where a response ends, each prompt's
sampling seed and budget, and the policy's weights (or a LoRA policy's adapter alone) streamed whole for an engine or
a server to load."""
import queue
import random
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import torch

from infra.distributed import whole


@dataclass
class Rollout:
    responses: torch.Tensor  # (B·n, Tr)
    response_mask: torch.Tensor  # (B·n, Tr) 1 = a token the policy sampled
    logprobs: Optional[torch.Tensor] = None  # (B·n, Tr)
    attention_mask: Optional[torch.Tensor] = None  # (B·n, Tr) 1 = any real token, tool answers included; None: as
    #                                                response_mask (one turn)
    conversations: Optional[list[dict]] = None  # per row: turns, tool_calls, tool_results, num_turns (agents/multi_turn.py);
    #                                            environment: a TRL environment's attributes as it ended (agents/tools.py)
    metrics: dict = field(default_factory=dict)  # agent/* (agents/multi_turn.py)
    token_rewards: Optional[torch.Tensor] = None  # (B·n, Tr) an environment's reward of each turn at its last token
    #                                               (agents/multi_turn.py), added to the scorers' (rewards.score_samples); None: none
    prompts: Optional[list[list[int]]] = None  # (B·n,) the prompt ids each row began from, where an environment
    #                                            wrote its own first messages (agents/multi_turn.py); None: the rows' own


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
                       padded("attention_mask", 0), padded("token_rewards", 0.0), [x for p in parts for x in p.extras])


def add_token_rewards(a, b):
    """The sum of two optional token-reward tensors (B, Tr): None when both are."""
    return a if b is None else b if a is None else a + b


def with_conversations(rows: list[dict], ro: Rollout) -> list[dict]:
    """rows with each sample's conversation under "conversation" (the reward's extra_info: rewards.py), when the
    rollout had turns, and the prompt an environment wrote in place of the row's."""
    if ro.conversations is None:
        return rows
    if ro.prompts is not None:  # an environment wrote them: the batch's queries
        rows = [{**row, "prompt_ids": p, "prompt_text": c["prompt_text"]} for row, p, c in
                zip(rows, ro.prompts, ro.conversations)]
    return [{**row, "conversation": c} for row, c in zip(rows, ro.conversations)]


def prompts_and_budgets(rows: list[dict], max_length: int) -> tuple[list[list[int]], list[int]]:
    """The rows' prompt ids, and each one's token budget: its "max_tokens" (a later turn's, agents/multi_turn.py) or
    max_length (rollout.max_response_length)."""
    return [row["prompt_ids"] for row in rows], [row.get("max_tokens", max_length) for row in rows]


def right_pad(seqs: list[list], pad, dtype=torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists → (values, mask), both (B, T), T ≥ 1, padded on the right with `pad`; mask 1 = a real entry."""
    T = max(1, max((len(s) for s in seqs), default=0))
    values = torch.full((len(seqs), T), pad, dtype=dtype)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        values[i, :len(s)] = torch.tensor(s, dtype=dtype)
        mask[i, :len(s)] = 1
    return values, mask


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists → (ids, mask), both (B, T), padded on the left so that every row ends together:
    right padding of the reversed lists, reversed."""
    ids, mask = right_pad([s[::-1] for s in seqs], pad_id)
    return ids.flip(1), mask.flip(1)


def cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """Keep tokens up to and including the first EOS (generate pads finished rows with more)."""
    for t, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[:t + 1]
    return tokens


def cut_off(responses, lengths, max_length: int, eos_ids) -> torch.Tensor:
    """(B,) bool: the responses that reached max_length tokens without ending in an EOS."""
    last_tokens = responses[torch.arange(len(responses)), (lengths - 1).clamp(min=0)]  # (B,)
    return (lengths == max_length) & ~torch.isin(last_tokens, torch.tensor(sorted(eos_ids)))


def prompt_seeds(seed: Optional[int], rank: int, count: int) -> list:
    """Each prompt's sampling seed, drawn from (`seed`, rank): vLLM seeds sample j of a request with seed_i + j, so
    the same call returns the same samples, and ranks draw different ones. None without a seed."""
    rng = random.Random(f"{seed}/{rank}")
    return [None if seed is None else rng.randrange(2**31) for _ in range(count)]


def eos_ids_of(tokenizer, model_config=None) -> set[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
    ids |= set(eos if isinstance(eos, list) else [eos])
    return {i for i in ids if i is not None}


def kv_cache_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values for `tokens` positions: 2 · layers · kv_heads · head_dim · itemsize each."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize * tokens


def policy_weights(model):
    """The policy's weights one at a time, whole, under the plain checkpoint's names: (name, tensor) for an engine.

    Streamed: besides the engine's own copy, one gathered weight exists at a time (with LoRA: W, B and A of
    one layer), not the whole model at once. FSDP2 shards each parameter as a DTensor, gathered here as it comes
    (`whole`: a collective, and every process walks the state dict in the same order). With LoRA the policy's weight
    is W + s·B·A, s = α/r (Hu et al., 2021, eq. 3), formed here, so the training model is never merged and unmerged.
    """
    state = model.state_dict()  # the parameters themselves (FSDP2: their shards), no copies
    for key, w in state.items():
        if ".lora_" in key:
            continue
        w = whole(w)
        if key.endswith(".base_layer.weight"):  # PEFT's LoraLayer: W is frozen in base_layer, B·A beside it
            name = key.removesuffix(".base_layer.weight")
            layer = model.get_submodule(name)
            if not getattr(layer, "merged", False):
                for a in layer.active_adapters:
                    B, A = (whole(state[f"{name}.lora_{m}.{a}.weight"]) for m in "BA")  # (out, r), (r, in)
                    w = w + layer.scaling[a] * (B @ A)
        yield key.removeprefix("base_model.model.").replace(".base_layer.", "."), w


def adapter_weights(model):
    """A PEFT actor's adapter tensors, whole, under the names PEFT saves them by (vLLM's runtime LoRA loading reads
    that folder); gathered one at a time under FSDP2, in the same order on every process."""
    from peft import get_peft_model_state_dict

    for key, w in get_peft_model_state_dict(model).items():
        yield key, whole(w)


class InTurn:
    """Functions run one at a time, in the order submitted, in one daemon thread: ThreadPoolExecutor(1)'s schedule
    (rollout.RunAhead's), but a thread that does not hold up the process's exit, which ThreadPoolExecutor's does (it
    joins its threads at exit): a second Ctrl-C or SIGTERM while a generation runs stops the run at once."""

    def __init__(self, name: str):
        self.todo, self.thread = queue.SimpleQueue(), threading.Thread(target=self.run, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn) -> Future:
        future = Future()
        self.todo.put((future, fn))
        return future

    def run(self) -> None:
        while (job := self.todo.get()) is not None:
            future, fn = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # the waiting thread raises it
                    future.set_exception(e)

    def shutdown(self, cancel: list) -> None:
        """The futures of `cancel` not yet started are cancelled; the one running ends; then the thread."""
        for future in cancel:
            future.cancel()
        self.todo.put(None)
        self.thread.join()
