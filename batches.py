"""How a PPO batch goes through a model: micro-batches, their layout, logprobs, entropies and values.

Three layouts of a micro-batch for the training forwards (`batch_layout`), all giving the same numbers
within fp32 rounding (tests/test_packing.py):
    padded   left-padded queries + right-padded responses, (B, Tq+Tr)
    shared   each distinct prompt run once, its KV cache gathered to its n responses
             (model.share_prompt_prefix, the default)
    packed   the real tokens of every row in one row (1, N), attention per sequence
             (model.use_remove_padding; attention per sequence through `varlen_sdpa`)
and the fp32 log-softmax / entropy over a long vocabulary, `LOGITS_CHUNK` positions at a time.

Shapes: B sequences, Tq prompt length, Tr response length, V vocab, N packed tokens.
"""
import torch
from torch.utils.checkpoint import checkpoint

from utils import autocast

LOGITS_CHUNK = 1024  # positions whose fp32 log-softmax is computed at once (see chunked_logprobs_entropy)

# ---------------------------------------------------------------------------------------
# Logprobs and entropy from logits

def logprobs_from_logits(logits, tokens):
    """log softmax(logits)[token]: (..., V), (...) → (...)."""
    return torch.gather(logits.log_softmax(-1), -1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits):
    """H = logsumexp(z) − Σ softmax(z)·z, per position: (..., V) → (...)."""
    return torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)


def _logprobs_entropy(logits, tokens, temperature: float, with_entropy: bool):
    z = logits.float() / temperature  # the sampler's distribution is softmax(z / T)
    logprobs = logprobs_from_logits(z, tokens)
    return logprobs, (entropy_from_logits(z) if with_entropy else torch.zeros_like(logprobs))


def chunked_logprobs_entropy(logits, tokens, temperature: float, with_entropy: bool, chunk: int):
    """logprobs_from_logits and entropy_from_logits of softmax(z / T), `chunk` positions at a time.

    The fp32 (…, V) intermediates exist for one chunk at a time; in the backward pass each chunk is
    recomputed (activation checkpointing), so a long vocabulary never sits in fp32 for the whole batch.
    logits (..., V), tokens (...) → logprobs (...), entropy (...).
    """
    shape, V = tokens.shape, logits.shape[-1]
    z, t = logits.reshape(-1, V), tokens.reshape(-1)
    chunk = chunk if chunk > 0 else len(t)
    parts = []
    for i in range(0, len(t), chunk):
        args = (z[i:i + chunk], t[i:i + chunk], temperature, with_entropy)
        parts.append(checkpoint(_logprobs_entropy, *args, use_reentrant=False) if z.requires_grad
                     else _logprobs_entropy(*args))
    logprobs, entropy = (torch.cat(p).view(shape) for p in zip(*parts))
    return logprobs, (entropy if with_entropy else None)


# ---------------------------------------------------------------------------------------
# Attention over packed sequences

def varlen_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                max_length_q=None, **kwargs):
    """Attention over packed sequences at the cost of each sequence alone, for any device.

    query (1, H, N, D), key and value (1, Hkv, N, D): S sequences laid end to end, sequence s at
    cu_seq_lens_q[s]:cu_seq_lens_q[s+1] (the arguments flash-attention's varlen kernel takes). They are
    scattered into (S, H, T, D), T = max_length_q, right-padded with zeros, where causal SDPA lets each
    real token see exactly its own sequence's past; then gathered back. Transformers' SDPA path would
    instead build an N×N block-diagonal mask and spend N² attention on it (S² times too much).
    Without cu_seq_lens_q (generation, padded forwards) this is transformers' SDPA unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    lengths = cu_seq_lens_q.diff()  # (S,)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=query.device), lengths)  # (N,)
    pos = torch.arange(query.shape[2], device=query.device) - cu_seq_lens_q[seq]  # (N,) offset in its sequence

    def unpack(x):  # (1, H, N, D) → (S, H, T, D)
        out = x.new_zeros(len(lengths), x.shape[1], max_length_q, x.shape[3])
        out[seq, :, pos] = x[0].transpose(0, 1)
        return out

    out = torch.nn.functional.scaled_dot_product_attention(
        unpack(query), unpack(key), unpack(value), dropout_p=dropout, is_causal=True, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1])  # (S, H, T, D)
    return out[seq, :, pos][None], None  # (1, N, H, D), as transformers' attention functions return


def varlen_mask(attention_mask=None, batch_size=1, q_length=1, kv_length=1, **kwargs):
    """The mask `varlen_sdpa` is given: SDPA's for padded batches; none for one row without a padding mask
    (a packed row, whose boundaries come as cu_seq_lens, or one plain sequence, which is causal)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and batch_size == 1 and q_length == kv_length:
        return None  # not the N×N block-diagonal mask transformers would build for a packed row
    return sdpa_mask(attention_mask=attention_mask, batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     **kwargs)


def use_varlen_attention(model) -> None:
    """Switch `model` (a transformers model, or a PEFT / accelerate wrapper of one) to `varlen_sdpa`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("varlen_sdpa", varlen_sdpa)
    AttentionMaskInterface.register("varlen_sdpa", varlen_mask)
    model.set_attn_implementation("varlen_sdpa")


# ---------------------------------------------------------------------------------------
# Micro-batches and the forwards over them

def batch_layout(cfg_model, distributed_type: str) -> str:
    """How training forwards lay out a micro-batch: "packed", "shared" (prompt prefix) or "padded"."""
    if cfg_model.use_remove_padding:
        return "packed"
    # HF drops the KV cache under gradient checkpointing; FSDP2 with two forwards per backward is untested
    if cfg_model.share_prompt_prefix and not cfg_model.gradient_checkpointing and distributed_type != "FSDP":
        return "shared"
    return "padded"


def model_inputs(mb: dict, packed: bool):
    """The forward's inputs, and where in its output the predictions of the response tokens are.

    Padded: left-padded queries + right-padded responses, (B, Tq+Tr); positions restart after the
    left padding. The state before response token t ends at position Tq + t − 1, so the last Tr + 1
    outputs minus the final one predict the response: `keep = Tr + 1`, then drop the last.
    Packed (model.use_remove_padding): the real tokens of every row in one row (1, N), positions
    restarting at 0 per sequence, and where each sequence starts (cu_seq_lens, as flash-attention's
    varlen kernel takes them; varlen_sdpa elsewhere); `keep` is the (K,) flat positions,
    K = real response tokens.
    """
    query_mask, response_mask = mb["query_mask"].bool(), mb["response_mask"].bool()
    input_ids = torch.cat([mb["queries"], mb["responses"]], dim=1)
    token_mask = torch.cat([query_mask, response_mask], dim=1)  # (B, Tq+Tr)
    if not packed:
        position_ids = (token_mask.long().cumsum(1) - 1).clamp(min=0)
        return dict(input_ids=input_ids, attention_mask=token_mask.long(), position_ids=position_ids), None
    flat_index = token_mask.flatten().cumsum(0).view(token_mask.shape) - 1  # (B, Tq+Tr) index into the packed row
    keep = flat_index[:, query_mask.shape[1]:][response_mask] - 1  # (K,) the position before each response token
    lengths = token_mask.sum(1)  # (B,)
    position_ids = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths.tolist()])
    cu_seq_lens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()  # (B+1,) where each sequence starts
    longest = int(lengths.max())
    return dict(input_ids=input_ids[token_mask][None], position_ids=position_ids[None], attention_mask=None,
                cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=longest, max_length_k=longest), keep


def micro_batch(batch: dict, inds, device):
    """Rows `inds` of the batch, with columns that are padding in every row cut away."""
    mb = {k: v[inds] for k, v in batch.items()}
    q_keep = mb["query_mask"].any(0).nonzero()[0, 0]  # first column any query uses
    r_keep = int(mb["response_mask"].any(0).nonzero()[-1, 0]) + 1  # last column any response uses
    for k, v in mb.items():
        if k in ("queries", "query_mask"):
            mb[k] = v[:, q_keep:]
        elif v.dim() == 2:
            mb[k] = v[:, :r_keep]
    return {k: v.to(device) for k, v in mb.items()}


def split_micro(inds, lengths, size: int, max_tokens: int = 0):
    """Split indices into micro-batches of `size` rows, or (max_tokens > 0) greedily by a token budget."""
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
    return out + [torch.tensor(cur)]


def shared_prompt_logits(model, mb, **prompt_kwargs):
    """The model's outputs (logits, or values for a critic) at the positions that predict the response
    tokens, with each distinct prompt run once: (B, Tr, ·).

    With n responses per prompt most of a padded forward recomputes the same prompt n times. Here the
    distinct prompts go through the model once; their KV cache is gathered to the B rows (index_select
    keeps the autograd graph, so gradients still reach weights through the prompt) and the responses
    attend to it. Equal to the padded path within fp32 rounding (tests/test_packing.py).
    """
    from transformers import DynamicCache

    queries, query_mask, responses = mb["queries"], mb["query_mask"], mb["responses"]
    distinct, row_of = torch.unique(torch.cat([queries, query_mask], 1), dim=0, return_inverse=True)
    prompt_ids, prompt_mask = distinct.split(queries.shape[1], dim=1)  # (U, Tq) each
    cache = DynamicCache()  # filled by the first call, read by the second (a critic does not return it)
    prompt = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(1) - 1).clamp(
        min=0), past_key_values=cache, use_cache=True, **prompt_kwargs).logits[:, -1:]  # (U, 1, ·)
    cache.reorder_cache(row_of)  # (U, …) → (B, …): each row gets its prompt's keys and values
    positions = query_mask.sum(1, keepdim=True) + torch.arange(responses.shape[1], device=responses.device)
    out = model(input_ids=responses, attention_mask=torch.cat([query_mask, mb["response_mask"]], 1),
                position_ids=positions, past_key_values=cache, use_cache=True)
    return torch.cat([prompt[row_of], out.logits[:, :-1]], dim=1)  # (B, 1 + Tr − 1, ·)


def forward_logprobs(model, mb, temperature: float, dtype, with_entropy: bool, layout: str = "padded"):
    """log π(response token t | prefix) and the entropy at each response position, (B, Tr) each.
    layout: "padded", "packed" (model.use_remove_padding) or "shared" (model.share_prompt_prefix)."""
    Tr, mask = mb["responses"].shape[1], mb["response_mask"].bool()
    keep = None
    with autocast(mb["responses"].device, dtype):
        if layout == "shared":
            logits = shared_prompt_logits(model, mb, logits_to_keep=1)  # (B, Tr, V)
        else:
            inputs, keep = model_inputs(mb, layout == "packed")
            # logits only where they predict a response token: (B, Tr, V) or (K, V), never (B, Tq+Tr, V)
            logits = model(**inputs, logits_to_keep=Tr + 1 if keep is None else keep, use_cache=False).logits
            logits = logits[:, :-1] if keep is None else logits[0]  # (B, Tr, V) or (K, V)
    targets = mb["responses"] if keep is None else mb["responses"][mask]
    logprobs, entropy = chunked_logprobs_entropy(logits, targets, temperature, with_entropy, LOGITS_CHUNK)
    if keep is not None:  # back from (K,) to (B, Tr)
        logprobs = torch.zeros(mask.shape, device=logits.device).masked_scatter(mask, logprobs)
        entropy = torch.zeros(mask.shape, device=logits.device).masked_scatter(mask, entropy) if with_entropy else None
    return logprobs, entropy


def forward_values(critic, mb, dtype, layout: str = "padded"):
    """V(s_t) before each response token, from the same positions as the logprobs: (B, Tr)."""
    if layout == "shared":
        with autocast(mb["responses"].device, dtype):
            return shared_prompt_logits(critic, mb)[..., 0].float()
    inputs, keep = model_inputs(mb, layout == "packed")
    Tr, mask = mb["responses"].shape[1], mb["response_mask"].bool()
    with autocast(inputs["input_ids"].device, dtype):
        values = critic(**inputs, use_cache=False).logits[..., 0].float()  # (B, Tq+Tr) or (1, N)
    if keep is None:
        return values[:, -Tr - 1:-1]
    return torch.zeros(mask.shape, device=values.device).masked_scatter(mask, values[0, keep])


@torch.no_grad()
def per_token_pass(fn, batch, size, max_tokens, lengths, device):
    """Run fn(micro-batch) → (b, tr) over the batch without grad; reassemble the (B, Tr) result."""
    out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    for inds in split_micro(torch.arange(len(lengths)), lengths, size, max_tokens):
        result = fn(micro_batch(batch, inds, device)).float().cpu()
        out[inds, :result.shape[1]] = result
    return out
