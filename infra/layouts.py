"""How a micro-batch is laid out for the training forwards (`batch_layout`), three ways that give the same numbers
within fp32 rounding (tests/test_packing.py):

    padded   left-padded queries + right-padded responses, (B, Tq+Tr)                            model_inputs
    shared   each distinct prompt run once, its KV cache gathered to its n responses            shared_prompt_logits
             (model.share_prompt_prefix, the default)
    packed   real tokens only, in one row (1, N): each distinct prompt once, then every response  packed_inputs
             (model.use_remove_padding; attention through `varlen_sdpa`)

infra/batches.py runs the forwards over them. Shapes: B sequences, U distinct prompts, Tq prompt length, Tr response
length, N packed tokens, H heads, D head size. transformers is imported inside the functions that use it (`--help`
and a config error answer without its 3 s import).
"""
import functools

import torch

from infra.trunk import from_trunk


def batch_layout(cfg_model, sharded: bool) -> str:
    """How training forwards lay out a micro-batch: "packed", "shared" (prompt prefix) or "padded"."""
    if cfg_model.use_remove_padding:
        return "packed"
    # HF drops the KV cache under gradient checkpointing; FSDP2 with two forwards per backward is untested
    if cfg_model.share_prompt_prefix and not cfg_model.gradient_checkpointing and not sharded:
        return "shared"
    return "padded"


def response_tokens(mb: dict):
    """(B, Tr) 1 on every response token a forward attends to: with multi-turn rollouts (agents/multi_turn.py) the model's
    turns and the tool answers between them (`response_attention_mask`), else the response_mask's tokens. The
    losses still read response_mask, 0 on tool answers."""
    return mb.get("response_attention_mask", mb["response_mask"])


def model_inputs(mb: dict):
    """The padded forward's inputs: left-padded queries + right-padded responses, (B, Tq+Tr).

    Positions restart after the left padding. The state before response token t ends at position
    Tq + t − 1, so the last Tr + 1 outputs minus the final one predict the response.
    """
    token_mask = torch.cat([mb["query_mask"], response_tokens(mb)], dim=1)  # (B, Tq+Tr)
    position_ids = (token_mask.cumsum(1) - 1).clamp(min=0)
    return dict(input_ids=torch.cat([mb["queries"], mb["responses"]], dim=1), attention_mask=token_mask,
                position_ids=position_ids)


def packed_inputs(mb: dict):
    """Every distinct prompt once and every response once, real tokens only, in one row (1, N).

    Row: [prompt 0]…[prompt U−1][response 0]…[response B−1]. Positions restart at 0 in each prompt and go
    on from its end in each of its responses. Attention (varlen_sdpa) runs over G = U + B groups: a
    prompt's tokens see that prompt, a response's tokens see their prompt and, causally, themselves.
    Returns the forward's inputs and `keep` (K,), the row positions whose outputs predict the K real
    response tokens: the prompt's last token for the first, then the response's own tokens.

    Example (tests/test_packing.py): prompt A = 11 12 with responses 31 32 and 33, prompt B = 21 22 23 with
    response 41 42; rows A, A, B, so U = 2 (in torch.unique's order), B = 3, G = 5, N = 10:

        row position   0  1 |  2  3  4 |  5  6 |  7 |  8  9
        input_ids     11 12 | 21 22 23 | 31 32 | 33 | 41 42
        position_ids   0  1 |  0  1  2 |  2  3 |  2 |  3  4
        group          0  0 |  1  1  1 |  2  2 |  3 |  4  4

        group 0, prompt A     11 → 11;  12 → 11 12            (each query token → the keys it sees)
        group 1, prompt B     21 → 21;  22 → 21 22;  23 → 21 22 23
        group 2, A's 31 32    31 → 11 12 31;  32 → 11 12 31 32
        group 3, A's 33       33 → 11 12 33
        group 4, B's 41 42    41 → 21 22 23 41;  42 → 21 22 23 41 42
        keep = [1, 5, 1, 4, 8]: 12 predicts 31, 31 predicts 32, 12 predicts 33, 23 predicts 41, 41 predicts 42

    `packed_attention` is no argument of the model's: transformers (5.19.0) hands forward kwargs it does not know
    down through `**kwargs` (…ForCausalLM or …ForTokenClassification → …Model → each decoder layer → the
    attention module, e.g. LlamaAttention.forward in models/llama/modeling_llama.py), whose call of the
    registered attention function (`varlen_sdpa`) passes them on.
    """
    real = response_tokens(mb).bool()  # (B, Tr) the row holds tool answers too
    prompt_ids, prompt_mask, row_of = distinct_prompts(mb)  # (U, Tq), (U, Tq), (B,)
    prompt_mask = prompt_mask.bool()
    Lq, Lr = prompt_mask.sum(1), real.sum(1)  # (U,), (B,) real lengths
    prompt_start = torch.cumsum(Lq, 0) - Lq  # (U,) where each prompt begins in the row
    response_start = Lq.sum() + torch.cumsum(Lr, 0) - Lr  # (B,)
    Lq_b, start_q_b = Lq[row_of], prompt_start[row_of]  # (B,) each response's prompt
    arange = functools.partial(torch.arange, device=Lq.device)
    Tr = real.shape[1]
    position_ids = torch.cat([(prompt_mask.cumsum(1) - 1)[prompt_mask], (Lq_b[:, None] + arange(Tr))[real]])

    # groups: U prompts, then B responses; query slot i of group g sits at key slot offset[g] + i
    Wq, Wk = int(max(Lq.max(), Lr.max())), int(max(Lq.max(), (Lq_b + Lr).max()))
    q_len, offset = torch.cat([Lq, Lr]), torch.cat([torch.zeros_like(Lq), Lq_b])  # (G,) each
    q_start = torch.cat([prompt_start, response_start])  # (G,)
    q_valid = arange(Wq) < q_len[:, None]  # (G, Wq)
    q_index = torch.where(q_valid, q_start[:, None] + arange(Wq), 0)  # (G, Wq)
    j = arange(Wk)[None, :]  # key slot: in the prompt before offset[g], in the group's own tokens after
    k_len = offset + q_len  # (G,)
    k_index = torch.where(j < offset[:, None], torch.cat([prompt_start, start_q_b])[:, None] + j,
                          q_start[:, None] + j - offset[:, None])
    k_index = torch.where(j < k_len[:, None], k_index, 0)  # (G, Wk)
    causal = j[None] <= (offset[:, None] + arange(Wq))[:, :, None]  # (G, Wq, Wk)
    mask = causal & (j < k_len[:, None])[:, None, :]  # padding query rows still see key 0: no empty softmax

    before = response_start[:, None] + arange(Tr) - 1  # (B, Tr): response token t − 1 …
    before[:, 0] = start_q_b + Lq_b - 1  # … and for t = 0 the prompt's last token
    inputs = dict(input_ids=torch.cat([prompt_ids[prompt_mask], mb["responses"][real]])[None],
                  position_ids=position_ids[None], attention_mask=None,
                  packed_attention=dict(q_index=q_index, k_index=k_index, mask=mask, q_valid=q_valid))
    return inputs, before[real]


def unpacked(values, mask):
    """The inverse of values = x[mask]: (K,) values of the real response tokens → (B, Tr), 0 on padding."""
    return torch.zeros(mask.shape, device=values.device).masked_scatter(mask, values)


def distinct_prompts(mb: dict):
    """The micro-batch's distinct prompts, (U, Tq) ids and mask, still left-padded, and row_of (B,): the
    prompt of each row. GRPO-style batches hold each prompt n times."""
    distinct, row_of = torch.unique(torch.cat([mb["queries"], mb["query_mask"]], 1), dim=0, return_inverse=True)
    prompt_ids, prompt_mask = distinct.split(mb["queries"].shape[1], dim=1)
    return prompt_ids, prompt_mask, row_of


def shared_inputs(mb: dict):
    """The shared layout's two calls: each distinct prompt once, (U, Tq), then every response, (B, Tr), attending to
    its prompt's KV cache; and row_of (B,), the prompt of each row."""
    query_mask, responses = mb["query_mask"], mb["responses"]
    prompt_ids, prompt_mask, row_of = distinct_prompts(mb)  # (U, Tq), (U, Tq), (B,)
    prompt = dict(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(1) - 1).clamp(
        min=0))
    positions = query_mask.sum(1, keepdim=True) + torch.arange(responses.shape[1], device=responses.device)
    response = dict(input_ids=responses, attention_mask=torch.cat([query_mask, response_tokens(mb)], 1),
                    position_ids=positions)
    return prompt, response, row_of


def response_attention(mb: dict):
    """(B, 1, Tr, Tq+Tr) bool: response token i sees its real prompt tokens and its real tokens j ≤ i.

    The shared layout's second call from the trunk passes it whole: transformers would size its own mask by the cache
    of layer 0, which a forward from the trunk leaves empty."""
    keys = torch.cat([mb["query_mask"], response_tokens(mb)], 1).bool()  # (B, Tq+Tr)
    Tq, Tr = mb["query_mask"].shape[1], response_tokens(mb).shape[1]
    arange = functools.partial(torch.arange, device=keys.device)
    causal = arange(Tq + Tr)[None, :] <= Tq + arange(Tr)[:, None]  # (Tr, Tq+Tr)
    return (keys[:, None, :] & causal[None])[:, None]


def first_rows(row_of, count: int):
    """(count,): the first row of each group 0 … count−1 of row_of (B,)."""
    rows = torch.arange(len(row_of), device=row_of.device)
    return torch.full((count,), len(row_of), device=row_of.device).scatter_reduce(0, row_of, rows, "amin")


def shared_prompt_logits(model, mb, trunk: int = 0, **prompt_kwargs):
    """The model's outputs (logits, or values for a critic) at the positions that predict the response
    tokens, with each distinct prompt run once: (B, Tr, ·).

    With n responses per prompt most of a padded forward recomputes the same prompt n times. Here the
    distinct prompts go through the model once; their KV cache is gathered to the B rows (index_select
    keeps the autograd graph, so gradients still reach weights through the prompt) and the responses
    attend to it. Equal to the padded path within fp32 rounding (tests/test_packing.py).
    trunk = L > 0: both calls start at layer L from mb's trunk_prompt / trunk_response (infra/trunk.py).
    """
    from transformers import DynamicCache

    prompt, response, row_of = shared_inputs(mb)
    prompt_hidden = response_hidden = None
    if trunk:
        prompt_hidden = mb["trunk_prompt"][first_rows(row_of, len(prompt["input_ids"]))]  # (U, Tq, H)
        response_hidden, response["attention_mask"] = mb["trunk_response"], response_attention(mb)  # (B, Tr, H)
    cache = DynamicCache()  # filled by the first call, read by the second (a critic does not return it)
    with from_trunk(model, trunk, prompt_hidden):
        first = model(**prompt, past_key_values=cache, use_cache=True, **prompt_kwargs).logits[:, -1:]  # (U, 1, ·)
    cache.reorder_cache(row_of)  # (U, …) → (B, …): each row gets its prompt's keys and values
    with from_trunk(model, trunk, response_hidden):
        out = model(**response, past_key_values=cache, use_cache=True)
    return torch.cat([first[row_of], out.logits[:, :-1]], dim=1)  # (B, 1 + Tr − 1, ·)


# ---------------------------------------------------------------------------------------
# Attention over a packed row

def varlen_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, packed_attention=None,
                **kwargs):
    """Attention over a packed row (`packed_inputs`), each group of tokens seeing only what it should.

    query (1, H, N, D), key and value (1, Hkv, N, D). The row's tokens fall into G groups (a prompt, or a
    response with its prompt in front); packed_attention holds for each group the row positions of its
    queries (q_index, (G, Wq)) and keys (k_index, (G, Wk)) and the causal mask between them ((G, Wq, Wk)).
    Gathered into (G, H, W, D), one masked SDPA call does them all; q_valid then picks every real token's
    output back in row order. Transformers' SDPA path would instead build an N×N mask over the whole row.
    Without packed_attention (generation, padded forwards) this is transformers' SDPA unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_attention is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    p = packed_attention
    q, k, v = (x[0][:, index].transpose(0, 1) for x, index in  # (1, H or Hkv, N, D) → (G, H or Hkv, W, D)
               ((query, p["q_index"]), (key, p["k_index"]), (value, p["k_index"])))
    # Grouped-query attention (Hkv < H): each KV head repeated for its H / Hkv query heads, as transformers does
    # whenever it passes a mask. CUDA's flash kernel takes no mask and its memory-efficient one no enable_gqa, so a
    # mask with enable_gqa=True falls to the math kernel, fp32 (G, H, Wq, Wk) scores in every layer.
    if (groups := query.shape[1] // key.shape[1]) > 1:
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))  # (G, H, Wk, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=p["mask"][:, None], dropout_p=dropout,
                                                           scale=scaling)  # (G, H, Wq, D)
    return out.transpose(1, 2)[p["q_valid"]][None], None  # (1, N, H, D), as transformers' attention functions return


def varlen_mask(attention_mask=None, batch_size=1, q_length=1, kv_length=1, **kwargs):
    """The mask `varlen_sdpa` is given: SDPA's for padded batches; none for one row without a padding mask
    (a packed row, whose groups come as packed_attention, or one plain sequence, which is causal)."""
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
