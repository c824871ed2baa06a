"""Multi-turn rollouts (agents/multi_turn.py): tool calls parsed, tools run, their answers written through the chat template with
response_mask 0, the sampler's logprobs agreeing with the trainer's on every model token, and ppo.py end to end,
on 1 process and on 2 (FSDP2, where every process must run the same number of generate calls).

Most tests use a scripted stand-in backend (ScriptedBackend), so that what the model "says" is fixed; the others a
tiny model taught to call the tool (`caller_model`), through HF generate and vLLM.
"""
import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, as_rows, free_port, make_tiny_model, make_tokenizer, read_metrics
from infra.config import ConfigError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
TOOLS_FILE = '''
import time

def add(text):
    a, b = text.split("+")
    return int(a) + int(b)

def slow(text):
    time.sleep(30)

def shout(word="", times=1):
    return (word.upper() + " ") * times
'''
# scored on the last turn, and it needs the conversation: 1 only after a tool call answered with the right sum
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert set(extra_info) >= {"turns", "tool_calls", "tool_results", "num_turns"}, sorted(extra_info)
    called = extra_info["num_turns"] == 4 and extra_info["tool_results"] == [ground_truth]
    return {"score": float(called and solution_str.strip() == ground_truth), "num_turns": extra_info["num_turns"]}
'''


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS_FILE)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def chat(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def question(a, b):
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


# ---------------------------------------------------------------------------------------
# Parsing calls


def test_hermes_calls_are_read_and_malformed_ones_say_why():
    """<tool_call> JSON with name and arguments (an object, or a JSON string of one) is a call; bad JSON, a missing
    key, an unknown tool and an unclosed tag each give a call with an error, in the order written."""
    from agents.tools import parse_hermes
    names = {"add", "shout"}
    text = ('<tool_call>{"name": "shout", "arguments": {"word": "hi"}}</tool_call> and '
            '<tool_call>{"name": "add", "arguments": "{\\"text\\": \\"1+2\\"}"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in parse_hermes(text, names)] == [
        ("shout", {"word": "hi"}, None), ("add", {"text": "1+2"}, None)]
    assert parse_hermes("no call here, just <b>text</b>", names) == []
    bad = parse_hermes('<tool_call>{"name": "add", "arguments": {</tool_call><tool_call>{"arguments": {}}</tool_call>'
                       '<tool_call>{"name": "rm", "arguments": {}}</tool_call><tool_call>{"name": "add"', names)
    assert [c.error is not None for c in bad] == [True] * 4
    assert "JSONDecodeError" in bad[0].error and "KeyError" in bad[1].error
    assert "no tool named 'rm'" in bad[2].error and "not closed" in bad[3].error


def test_tag_calls_are_read_in_order_and_unclosed_ones_say_why():
    """<name>text</name> for a known tool is a call with the stripped text; other tags are text; calls keep the
    order they were written in; an opening tag never closed is a call with an error."""
    from agents.tools import parse_tag
    calls = parse_tag("<shout> hi </shout> then <b>x</b> <add>1+2</add> <add>3+", {"add", "shout"})
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [("shout", "hi", True), ("add", "1+2", True),
                                                                       ("add", "3+", False)]
    assert "<add> is not closed by </add>" in calls[2].error
    assert parse_tag("<calc>1+2</calc>", {"add"}) == []


# ---------------------------------------------------------------------------------------
# Tools


def test_tools_answer_fail_time_out_and_are_cut(tools_file):
    """A tool's return value as text; a raising tool, a malformed call and a tool slower than the timeout answer
    an error (the slow one without holding up the rest); a long answer is cut and marked."""
    from agents.tools import run_tools, tool_targets, ToolCall
    from agents.episodes import ObjectHost
    host = ObjectHost(tool_targets([f"{tools_file}:add", f"{tools_file}:slow", f"{tools_file}:shout"]), 0.5)
    calls = [ToolCall("add", "2+3"), ToolCall("add", "x+1"), ToolCall("slow", ""), ToolCall("?", "{", "bad JSON"),
             ToolCall("shout", {"word": "ab", "times": 40})]
    start = time.monotonic()
    try:
        results = run_tools(calls, host, max_chars=60)
    finally:
        host.close()
    assert time.monotonic() - start < 3
    assert [r.ok for r in results] == [True, False, False, False, True]
    assert results[0].text == "5"
    assert results[1].text.startswith("error: ValueError")
    assert results[2].text == "error: the tool took longer than 0.5 s"
    assert results[3].text == "error: bad JSON"
    assert results[4].text == "AB " * 20 + "...(truncated)"


@pytest.mark.parametrize("spec, sentence", [
    ("{tmp}/none.py:add", "rollout.multi_turn.tools: file {tmp}/none.py does not exist"),
    ("{tools}:nothing", "rollout.multi_turn.tools: {tools} has no function `nothing`"),
    ("add", "rollout.multi_turn.tools: 'add' must be path/to/file.py:function"),
])
def test_a_bad_tool_spec_is_one_sentence_naming_the_key(tools_file, tmp_path, spec, sentence):
    from agents.tools import PARSERS, ToolEnvironment
    with pytest.raises(ConfigError) as e:
        ToolEnvironment([spec.format(tmp=tmp_path, tools=tools_file)], PARSERS["tag"], 1.0, 64, 8)
    assert sentence.format(tmp=tmp_path, tools=tools_file) in str(e.value)


def test_the_demo_calculator_is_exact_and_runs_no_code():
    """examples/calculator.py: exact sums, products, fractions; anything but arithmetic raises."""
    sys.path.insert(0, os.path.join(REPO, "examples"))
    from calculator import calc
    assert (calc("347 + 589"), calc("(2 + 3) * -4"), calc("1 / 4"), calc("0.5 + 1")) == ("936", "-20", "1/4", "3/2")
    for bad in ['__import__("os")', "2 ** 10", "x + 1", "1 +"]:
        with pytest.raises(ValueError):
            calc(bad)


# ---------------------------------------------------------------------------------------
# The turns, with a scripted backend


class ScriptedBackend:
    """A rollout backend whose model follows a script: reply(context text, sample j) → the next turn's text; EOS
    appended, the turn cut to its budget. Sampler logprobs are −0.01·(position + 1), so they can be traced.
    Records (number of prompts, n, max_tokens) for each generate call."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.calls = tokenizer, reply, []
        self.eos_ids = {tokenizer.eos_token_id}

    def generate(self, rows, n, temperature, seed=None):
        from rollout import right_pad, Rollout
        prompts = [row["prompt_ids"] for row in rows]
        max_tokens = [row["max_tokens"] for row in rows] if any("max_tokens" in row for row in rows) else None
        self.calls.append((len(prompts), n, max_tokens))
        rows = []
        for i, p in enumerate(prompts):
            budget = max_tokens[i] if max_tokens else 10**6
            for j in range(n):
                text = self.reply(self.tokenizer.decode(p), j) + self.tokenizer.eos_token
                rows.append(self.tokenizer(text, add_special_tokens=False)["input_ids"][:budget])
        responses, mask = right_pad(rows, self.tokenizer.pad_token_id)
        logprobs = -0.01 * (torch.arange(responses.shape[1]) + 1.0).expand(responses.shape) * mask
        return Rollout(responses, mask, logprobs)

    def sync_weights(self, model):
        pass

    def close(self):
        pass


def calculator_script(context: str, j: int) -> str:
    """Sample 0 calls <add> and then copies the answer; sample 1 answers at once; sample 2 calls with a space in
    front (`<add> 3+4</add>`), and again whenever it sees that call before (later turns are n=1 calls: j = 0)."""
    asked = context.rsplit("What is ", 1)[1].split("?")[0].replace(" ", "")
    if "<|im_start|>tool" not in context.rsplit("What is ", 1)[1]:
        return {0: f"<add>{asked}</add>", 1: "7", 2: f"<add> {asked}</add>"}[j]
    return f"<add> {asked}</add>" if "<add> " in context else context.rsplit("<|im_start|>tool\n", 1)[1].split(
        "<|im_end|>")[0]


def hermes_script(context: str, j: int) -> str:
    """Sample 0 calls shout in Hermes' format, sample 1 calls add with text it cannot add (the tool raises), sample
    2 writes a call that is not JSON; after a tool answer, each replies with the answer's first word."""
    if "<|im_start|>tool" not in context.rsplit("What is ", 1)[1]:
        return ['<tool_call>{"name": "shout", "arguments": {"word": "hi", "times": 2}}</tool_call>',
                '<tool_call>{"name": "add", "arguments": {"text": "1+"}}</tool_call>',
                '<tool_call>{"name": </tool_call>'][j]
    return context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0].split()[0]


# name → (format, tools, script, max_turns, max_length, questions, n): the scenarios whose outputs agents/multi_turn.py gave at
# b8b4a16, before environments (tests/agent_before.json; recorded by running these scenarios through that
# commit's AgentRollout)
BEFORE_AFTER = {
    "tag": ("tag", ["add"], "calculator_script", 3, 128, [(3, 4), (12, 30)], 3),
    "tag_tight": ("tag", ["add"], "calculator_script", 3, 30, [(3, 4)], 3),
    "hermes": ("hermes", ["add", "shout"], "hermes_script", 2, 400, [(3, 4)], 3),
}


def agent_rollout(tokenizer, tools_file, reply=calculator_script, max_turns=3, max_length=128, reduce_max=None,
                  fmt="tag", tools=("add",)):
    from agents.multi_turn import AgentRollout, TurnSettings
    from agents.tools import PARSERS, ToolEnvironment
    environment = ToolEnvironment([f"{tools_file}:{t}" for t in tools], PARSERS[fmt], 1.0, 64, 8)
    settings = TurnSettings(max_turns, max_length, 512, environment)
    backend = ScriptedBackend(tokenizer, reply)
    return AgentRollout(backend, tokenizer, settings, **({"reduce_max": reduce_max} if reduce_max else {})), backend


@pytest.mark.parametrize("name", sorted(BEFORE_AFTER))
def test_the_tool_environment_gives_what_agent_py_gave_before_environments(tokenizer, tools_file, name):
    """The built-in tool environment (environments.ToolEnvironment, each call in a process of its own) gives, token
    for token, the rows, masks, sampler logprobs, conversations and agent/* metrics that agents/multi_turn.py's in-process tools
    gave at b8b4a16 on the same scripted scenarios (tests/agent_before.json)."""
    import json
    fmt, tools, script, max_turns, max_length, questions, n = BEFORE_AFTER[name]
    with open(os.path.join(REPO, "tests", "agent_before.json")) as f:
        before = json.load(f)[name]
    ro_, _ = agent_rollout(tokenizer, tools_file, globals()[script], max_turns, max_length, fmt=fmt, tools=tools)
    try:
        prompts = as_rows([chat(tokenizer, question(a, b)) for a, b in questions])
        ro = ro_.generate(prompts, n=n, temperature=1.0, seed=0)
    finally:
        ro_.s.environment.close()
    assert ro.responses.tolist() == before["responses"] and ro.response_mask.tolist() == before["response_mask"]
    assert ro.attention_mask.tolist() == before["attention_mask"] and ro.logprobs.tolist() == before["logprobs"]
    assert ro.conversations == before["conversations"] and ro.metrics == before["metrics"]
    assert ro.token_rewards is None and ro.prompts is None  # no rewards, the rows' own prompts


def test_each_row_is_the_conversation_as_the_chat_template_writes_it(tokenizer, tools_file):
    """Decoded, prompt + response row is exactly the chat template's rendering of the prompt and the turns (the
    template's newline after the final EOS aside); response_mask is 1 on the model's turns and 0 on the tool answers
    between them, which the attention mask covers; the sampler's logprobs sit on the model's tokens, 0 elsewhere."""
    ro_, backend = agent_rollout(tokenizer, tools_file)
    prompts = [chat(tokenizer, question(3, 4)), chat(tokenizer, question(12, 30))]
    ro = ro_.generate(as_rows(prompts), n=3, temperature=1.0, seed=0)
    assert ro.responses.shape == ro.response_mask.shape == ro.attention_mask.shape == ro.logprobs.shape
    for row in range(6):
        prompt_messages = question(*((3, 4) if row < 3 else (12, 30)))
        L = int(ro.attention_mask[row].sum())
        assert ro.attention_mask[row, :L].all() and not ro.attention_mask[row, L:].any()
        text = tokenizer.decode(prompts[row // 3] + ro.responses[row, :L].tolist())
        want = tokenizer.apply_chat_template(prompt_messages + ro.conversations[row]["turns"], tokenize=False)
        assert text == want.removesuffix("\n")
        model_tokens = ro.response_mask[row, :L].bool()
        tool_text = tokenizer.decode(ro.responses[row, :L][~model_tokens])
        assert all(f"<|im_start|>tool\n{r}<|im_end|>" in tool_text for r in ro.conversations[row]["tool_results"])
        assert "<add>" not in tool_text and (ro.logprobs[row, :L][~model_tokens] == 0).all()
        assert (ro.logprobs[row, :L][model_tokens] < 0).all()
    sums = [c["tool_results"] for c in ro.conversations]
    assert sums == [["7"], [], ["7", "7"], ["42"], [], ["42", "42"]]
    assert [c["num_turns"] for c in ro.conversations] == [4, 2, 6, 4, 2, 6]  # verl's count: prompt + turns + rounds
    assert [c["turns"][-1]["content"] for c in ro.conversations] == ["7", "7", "<add> 3+4</add>", "42", "7",
                                                                     "<add> 12+30</add>"]


def test_the_last_turns_call_is_not_run_and_later_turns_get_the_rest_of_the_budget(tokenizer, tools_file):
    """max_turns bounds the assistant turns: the call in the last one is counted well-formed but not run. Each later
    turn is one generate call with n=1 per waiting sample and its budget, max_response_length minus the row so far;
    an answer that leaves no room for the model ends the episode at its call."""
    ro_, backend = agent_rollout(tokenizer, tools_file, max_turns=2)
    prompts = [chat(tokenizer, question(3, 4))]
    ro = ro_.generate(as_rows(prompts), n=3, temperature=1.0)
    assert [len(c["tool_results"]) for c in ro.conversations] == [1, 0, 1]
    assert [c["num_turns"] for c in ro.conversations] == [4, 2, 4]
    (first, n1, budgets1), (waiting, n2, budgets2) = backend.calls
    assert (first, n1, budgets1, waiting, n2) == (1, 3, None, 2, 1)
    tool = ro_.template.tokens([{"role": "tool", "name": "add", "content": "7"}])
    lengths = [len(tokenizer(call + tokenizer.eos_token)["input_ids"]) + len(tool)
               for call in ("<add>3+4</add>", "<add> 3+4</add>")]
    assert budgets2 == [128 - x for x in lengths]
    assert ro.metrics["agent/well_formed_share"] == pytest.approx(2 / 3)
    assert ro.metrics["agent/tool_calls_mean"] == pytest.approx(2 / 3)
    assert ro.metrics["agent/turns_mean"] == pytest.approx(5 / 3)

    tight, backend = agent_rollout(tokenizer, tools_file, max_turns=3, max_length=lengths[0])
    ro = tight.generate(as_rows(prompts), n=1, temperature=1.0)
    assert len(backend.calls) == 1 and ro.conversations[0]["tool_results"] == []
    assert ro.response_mask.all()  # no tool tokens were appended


def test_every_process_runs_the_same_generate_calls(tokenizer, tools_file):
    """When another process has more samples waiting for a turn (reduce_max says so), this one pads its call with
    stand-ins to the same size, and calls generate even with none waiting; the stand-ins' outputs are dropped."""
    prompts = [chat(tokenizer, question(3, 4))]
    alone, _ = agent_rollout(tokenizer, tools_file, max_turns=2)
    padded, backend = agent_rollout(tokenizer, tools_file, max_turns=2, reduce_max=lambda x: 5)
    want, got = alone.generate(as_rows(prompts), 3, 1.0), padded.generate(as_rows(prompts), 3, 1.0)
    assert [c[0] for c in backend.calls] == [1, 5] and backend.calls[1][2][2:] == [1, 1, 1]
    assert torch.equal(want.responses, got.responses) and want.conversations == got.conversations

    never, backend = agent_rollout(tokenizer, tools_file, reply=lambda context, j: "7", max_turns=3,
                                   reduce_max=lambda x: 2)
    never.generate(as_rows(prompts), 2, 1.0)
    assert [c[0] for c in backend.calls] == [1, 2, 2]  # nothing waits here, yet both later turns are called


def test_the_reward_function_reads_the_conversation(tokenizer, tools_file, tmp_path):
    """compute_score gets the last turn as solution_str and, in extra_info, the turns, the tool calls, their
    results and num_turns (rewards.score_responses, as ppo.py hands them over)."""
    from infra.rollout_common import with_conversations
    from rewards import load_reward_function, score_responses
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    ro_, _ = agent_rollout(tokenizer, tools_file)
    ro = ro_.generate(as_rows([chat(tokenizer, question(3, 4))]), n=3, temperature=1.0)
    rows = with_conversations([{"data_source": "x", "ground_truth": "7", "extra_info": {"index": 0}}] * 3, ro)
    texts = [c["turns"][-1]["content"] for c in ro.conversations]
    compute_score = load_reward_function(f"{tmp_path}/reward.py", timeout_s=30.0)  # in its worker process
    try:
        scores, extras, errors = score_responses(compute_score, rows, texts)
    finally:
        compute_score.close()
    assert (scores, extras["num_turns"], errors) == ([1.0, 0.0, 0.0], [4.0, 2.0, 6.0], 0)


def test_a_template_that_cannot_write_tool_messages_stops_at_start_up(tokenizer):
    """A chat template that does not close assistant turns with the EOS (so nothing marks where a tool answer
    goes) is refused with one sentence, before any rollout."""
    from agents.multi_turn import ToolTemplate
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="does not end an assistant turn with its EOS"):
        ToolTemplate(odd)
    assert ToolTemplate(tokenizer).text([{"role": "tool", "content": "7"}]) == (
        "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------
# Forwards over rows with gaps


@pytest.mark.parametrize("layout", ["padded", "shared", "packed"])
def test_forwards_attend_to_tool_answers_in_every_layout(tiny_model_dir, layout):
    """With response_attention_mask, each layout's logprobs at every response token equal a plain forward over the
    whole sequence (prompt, turns, tool answers): the tool tokens are seen, though response_mask is 0 there."""
    from transformers import AutoModelForCausalLM
    from infra.batches import forward_logprobs
    from infra.layouts import use_varlen_attention
    from rollout import left_pad, right_pad

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    if layout == "packed":
        model = copy.deepcopy(model)
        use_varlen_attention(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 150, (k,), generator=g).tolist() for k in (5, 8)]
    prompts = [prompts[0], prompts[0], prompts[1]]  # rows 0 and 1 share a prompt, as n samples do
    rows = [torch.randint(3, 150, (k,), generator=g).tolist() for k in (9, 4, 12)]
    masks = [[1, 1, 0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1]]
    queries, query_mask = left_pad(prompts, 0)
    responses, attention = right_pad(rows, 0)
    mb = dict(queries=queries, query_mask=query_mask, responses=responses, response_mask=right_pad(masks, 0)[0],
              response_attention_mask=attention)
    with torch.no_grad():
        got, _ = forward_logprobs(model, mb, 1.0, None, with_entropy=False, layout=layout)  # (B, Tr)
        for i, (p, r) in enumerate(zip(prompts, rows)):
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]  # (L, V)
            want = logits.log_softmax(-1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            assert torch.allclose(got[i, :len(r)], want, atol=1e-5), (layout, i)


# ---------------------------------------------------------------------------------------
# A tiny model taught to call the tool: HF, vLLM, ppo.py


SUMS = [(3, 4), (5, 6), (2, 9), (8, 1), (7, 7), (4, 10)]


def fit_caller(model, tokenizer, steps=200, lr=3e-3):
    """Teach `model` both turns on SUMS: the question → <add>a+b</add>, the tool's answer → that answer; and to
    answer "hello" to anything else ("Say hello.")."""
    from agents.multi_turn import ToolTemplate
    template, eos = ToolTemplate(tokenizer), tokenizer.eos_token
    seqs = []
    for a, b in SUMS:
        p = chat(tokenizer, question(a, b))
        call = tokenizer(f"<add>{a}+{b}</add>{eos}", add_special_tokens=False)["input_ids"]
        tool = template.tokens([{"role": "tool", "name": "add", "content": str(a + b)}])
        answer = tokenizer(f"{a + b}{eos}", add_special_tokens=False)["input_ids"]
        seqs += [(p, call), (p + call + tool, answer)]
    seqs.append((chat(tokenizer, [{"role": "user", "content": "Say hello."}]),
                 tokenizer(f"hello{eos}", add_special_tokens=False)["input_ids"]))
    T = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), T), -100)
    for i, (p, a) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.fixture(scope="module")
def caller_dir(tmp_path_factory):
    """A tiny model folder that calls <add> on SUMS and says hello otherwise, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = make_tiny_model(tmp_path_factory.mktemp("caller") / "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = fit_caller(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer)
    model.save_pretrained(path)
    return path


def rollout_config(model_dir, tools_file, name):
    from infra.cli import load_config
    return load_config(None, [f"model.path={model_dir}", f"rollout.name={name}", "rollout.dtype=fp32",
                              "data.max_prompt_length=48", "rollout.max_response_length=40",
                              "rollout.multi_turn.enable=true", f"rollout.multi_turn.tools=[{tools_file}:add]",
                              "rollout.multi_turn.format=tag", "rollout.multi_turn.max_turns=2"])


class OneProcess:
    is_main_process, num_processes, device = True, 1, torch.device("cpu")

    @staticmethod
    def unwrap_model(model):
        return model


def trainer_logprobs(model, prompts, ro, n):
    """The trainer's forward (padded layout, response_attention_mask) at every response position.  (B·n, Tr)"""
    from infra.batches import forward_logprobs
    from rollout import left_pad
    queries, query_mask = left_pad([p for p in prompts for _ in range(n)], 0)
    mb = dict(queries=queries, query_mask=query_mask, responses=ro.responses, response_mask=ro.response_mask,
              response_attention_mask=ro.attention_mask)
    with torch.no_grad():
        return forward_logprobs(model, mb, 1.0, None, with_entropy=False)[0]


@pytest.fixture(scope="module")
def caller(caller_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return (AutoModelForCausalLM.from_pretrained(caller_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(caller_dir))


def test_hf_rollout_calls_the_tool_and_answers_with_its_result(caller, caller_dir, tools_file):
    """Through HF generate, greedy, the taught model calls <add> on every sum, reads the tool's answer and replies
    with it; every sample is a well-formed call."""
    from agents.multi_turn import check_multi_turn
    from rollout import make_rollout
    model, tokenizer = caller
    cfg = rollout_config(caller_dir, tools_file, "hf")
    ro_ = make_rollout(cfg, model, tokenizer, OneProcess(), turns=check_multi_turn(cfg, tokenizer))
    ro = ro_.generate(as_rows([chat(tokenizer, question(a, b)) for a, b in SUMS]), n=1, temperature=0.0)
    assert [c["turns"][-1]["content"] for c in ro.conversations] == [str(a + b) for a, b in SUMS]
    assert ro.metrics["agent/well_formed_share"] == 1.0 and ro.logprobs is None
    assert (ro.response_mask < ro.attention_mask).any(1).all()  # a gap in every row


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_vllm_turns_match_hf_and_its_logprobs_match_the_trainers(caller, caller_dir, tiny_model_dir, tools_file):
    """An fp32 vLLM engine (the random tiny model, then the taught weights synced in): greedy multi-turn rows
    equal HF's token for token, masks included; sampled at T=1 from a seed, the sampler's logprobs equal the
    trainer's forward over the gapped rows on every model token (mean |Δ| < 1e-4), and are 0 on tool tokens."""
    from transformers import AutoModelForCausalLM
    from agents.multi_turn import AgentRollout, check_multi_turn
    from infra.distributed import max_over_processes
    from rollout import make_rollout
    model, tokenizer = caller
    cfg = rollout_config(tiny_model_dir, tools_file, "vllm")  # the engine starts from other weights
    random_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = make_rollout(cfg, random_model, tokenizer, OneProcess())
    vllm_ro = AgentRollout(engine, tokenizer, check_multi_turn(cfg, tokenizer), max_over_processes)
    hf_cfg = rollout_config(caller_dir, tools_file, "hf")
    hf_ro = make_rollout(hf_cfg, model, tokenizer, OneProcess(), turns=check_multi_turn(hf_cfg, tokenizer))
    try:
        engine.sync_weights(model)
        prompts = [chat(tokenizer, question(a, b)) for a, b in SUMS]
        v, h = vllm_ro.generate(as_rows(prompts), 1, 0.0), hf_ro.generate(as_rows(prompts), 1, 0.0)
        assert torch.equal(v.responses, h.responses) and torch.equal(v.response_mask, h.response_mask)
        assert v.conversations == h.conversations and v.metrics["agent/tool_calls_mean"] == 1.0

        n = 4
        sampled = vllm_ro.generate(as_rows(prompts), n, 1.0, seed=3)
        mask, gaps = sampled.response_mask.bool(), sampled.attention_mask.bool() & ~sampled.response_mask.bool()
        assert gaps.any(1).float().mean() > 0.5, "expected most samples to call the tool"
        diff = (sampled.logprobs - trainer_logprobs(model, prompts, sampled, n)).abs()[mask]
        print(f"\nvLLM fp32 vs trainer over gapped rows: |Δlogprob| mean {diff.mean():.2e} max {diff.max():.2e}")
        assert diff.mean() < 1e-4 and diff.max() < 1e-3
        assert (sampled.logprobs[gaps] == 0).all()
    finally:  # the engine's process groups and the tool workers end here, not at a later test's expense
        vllm_ro.close()
        hf_ro.close()


# ---------------------------------------------------------------------------------------
# ppo.py end to end


@pytest.fixture(scope="module")
def agent_workdir(caller_dir, tools_file, tmp_path_factory):
    """Prompts on SUMS (ground truth the sum), a reward that needs the conversation, and the tools."""
    import data
    root = tmp_path_factory.mktemp("agent_run")
    rows = [{"prompt": question(a, b), "ground_truth": str(a + b), "data_source": "x"} for a, b in SUMS[:4]] * 4
    data.write_parquet(rows, str(root / "train.parquet"))
    data.write_parquet(rows[:4], str(root / "val.parquet"))
    hello = [{"prompt": [{"role": "user", "content": "Say hello."}], "ground_truth": "hello", "data_source": "x"}]
    # with data.shuffle=false and 2 processes, process 0 gets rows 0-1 and process 1 rows 2-3 of each batch
    data.write_parquet((rows[:2] + hello * 2) * 4, str(root / "lopsided.parquet"))
    (root / "reward.py").write_text(REWARD_FILE)
    return root


def agent_args(root, model_dir, tools_file, out, *overrides):
    return ["ppo.py", "--config", "configs.yaml", f"model.path={model_dir}", f"data.train_files={root}/train.parquet",
            f"data.val_files={root}/val.parquet", f"reward.function={root}/reward.py:compute_score",
            "rollout.name=hf", "rollout.max_response_length=40", "data.max_prompt_length=48",
            "rollout.multi_turn.enable=true", f"rollout.multi_turn.tools=[{tools_file}:add]",
            "rollout.multi_turn.format=tag", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
            "algorithm.adv_estimator=grpo", "trainer.total_steps=2", "trainer.test_freq=2", "trainer.sample_freq=1",
            "trainer.max_kl=0", "model.dtype=fp32", "model.lora_rank=8", "model.target_modules=q_proj,v_proj",
            "trainer.plot_curves=false", f"trainer.output_dir={out}", *overrides]


def run(cmd):
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_ppo_trains_on_multi_turn_rollouts_and_logs_the_calls(agent_workdir, caller_dir, tools_file, tmp_path):
    """ppo.py with rollout.multi_turn: the reward reads each conversation (it scores 1 only after an answered call),
    agent/* are logged at every step and val/agent/* with validation, and the sample table shows the turns."""
    proc = run([sys.executable, *agent_args(agent_workdir, caller_dir, tools_file, tmp_path / "out")])
    metrics = read_metrics(tmp_path / "out")
    train = [m for m in metrics if "score/mean" in m]
    assert len(train) == 2 and all(m["agent/well_formed_share"] > 0.5 and m["reward/num_turns"] > 3 for m in train)
    assert train[0]["score/mean"] > 0.5  # the taught model calls, reads and answers: the reward sees it
    assert train[-1]["val/agent/well_formed_share"] == 1.0 and train[-1]["val/score/mean"] == 1.0
    assert re.search(r"<add>(\d+)\+(\d+)</add> ⟶ (\d+) ⟶ \3 ", proc.stdout)  # call ⟶ the tool's answer ⟶ reply


@pytest.mark.skipif(sys.platform != "linux", reason="gloo on CPU, as tests/test_fsdp.py")
def test_fsdp2_two_processes_with_lopsided_turns_do_not_hang(agent_workdir, caller_dir, tools_file, tmp_path):
    """FSDP2 on 2 processes with HF generate (a collective under FSDP2): greedy, process 0's prompts always call the
    tool and process 1's never do, so only the turn count reduced over processes (AgentRollout.reduce_max) keeps
    process 1 generating with stand-ins while process 0 runs its second turn. The run finishes and logs."""
    out = tmp_path / "fsdp"
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/fsdp2.yaml",
         "--num_processes", "2", "--main_process_port", str(free_port()),
         *agent_args(agent_workdir, caller_dir, tools_file, out, f"data.train_files={agent_workdir}/lopsided.parquet",
                     "data.shuffle=false", "rollout.temperature=0", "trainer.sample_freq=0",
                     "trainer.val_before_train=false")])
    train = [m for m in read_metrics(out) if "score/mean" in m]
    assert len(train) == 2 and all(m["agent/tool_calls_mean"] == pytest.approx(0.5) for m in train)


HELLO_ENV = '''
from agents.environments import Step

class Hello:
    """Asks for hello extra_info["turns"] times, rewarding each turn that says it; a game of more than one turn
    says so in its info (env/long), a game of one says nothing."""
    def reset(self, row):
        self.left = row["extra_info"]["turns"]
        self.info = {"long": True} if self.left > 1 else {}
    def step(self, text):
        self.left -= 1
        return Step([{"role": "user", "content": "Say hello."}], reward=float(text.strip() == "hello"),
                    done=self.left == 0, info=self.info)
'''


@pytest.mark.skipif(sys.platform != "linux", reason="gloo on CPU, as tests/test_fsdp.py")
def test_fsdp2_two_processes_stay_in_step_with_episodes_of_different_lengths(agent_workdir, caller_dir, tmp_path):
    """ppo.py with rollout.multi_turn.env on 2 FSDP2 processes (HF generate, a collective): process 0's games last
    3 turns and process 1's 1, so process 1 generates stand-ins while process 0 plays on. The run finishes; the
    turns are the environments' (mean 2, in training and validation), and the reward is the environment's return,
    its turns' rewards at their tokens (the rows' rule adds 0); validation's score counts them too. best/ is kept
    by val/env/long, a number the game's infos give."""
    import data
    (tmp_path / "hello.py").write_text(HELLO_ENV)
    hello = [{"prompt": [{"role": "user", "content": "Say hello."}], "ground_truth": "hello",
              "data_source": "environment", "extra_info": {"turns": turns}} for turns in (3, 3, 1, 1)]
    data.write_parquet(hello * 4, str(tmp_path / "hello.parquet"))
    out = tmp_path / "out"
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/fsdp2.yaml",
         "--num_processes", "2", "--main_process_port", str(free_port()),
         *agent_args(agent_workdir, caller_dir, "", out, f"data.train_files={tmp_path}/hello.parquet",
                     f"data.val_files={tmp_path}/hello.parquet", "reward.function=", "rollout.multi_turn.tools=[]",
                     f"rollout.multi_turn.env={tmp_path}/hello.py:Hello", "rollout.multi_turn.max_turns=4",
                     "rollout.max_response_length=80", "trainer.best_metric=val/env/long",
                     "data.shuffle=false", "rollout.temperature=0", "trainer.sample_freq=0")])
    train = [m for m in read_metrics(out) if "score/mean" in m]
    assert len(train) == 2 and all(m["agent/turns_mean"] == pytest.approx(2.0) for m in train)
    assert all(m["score/mean"] == 0 for m in train)  # the rule's: the environment's rewards are on the tokens
    assert all(m["reward/mean"] == pytest.approx(m["agent/env_return_mean"]) for m in train)  # no KL in the reward
    assert all(m["agent/env_return_mean"] > 0 for m in train)  # some hellos: the equality is not 0 = 0
    assert train[-1]["val/agent/turns_mean"] == pytest.approx(2.0)
    assert train[-1]["val/score/mean"] == pytest.approx(train[-1]["val/agent/env_return_mean"])
    # env/long: process 0's games give it, process 1's never do; its mean is over the samples that gave it
    assert all(m["env/long"] == 1.0 for m in train) and train[-1]["val/env/long"] == 1.0
    with open(out / "best" / "state.json") as f:  # trainer.best_metric=val/env/long: an environment's info
        assert json.load(f)["best"] == {"step": 2, "value": 1.0}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any from_pretrained of a model (not a tokenizer) fails the test."""
    import transformers

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"a model was loaded ({cls.__name__}) before the check")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


@pytest.mark.parametrize("override, sentence", [
    ("rollout.multi_turn.tools=[]", "rollout.multi_turn.enable=true needs tools"),
    ("rollout.multi_turn.format=xml", "rollout.multi_turn.format='xml' is not one of hermes, tag"),
    ("rollout.multi_turn.tools=[{tmp}/gone.py:add]", "rollout.multi_turn.tools: file {tmp}/gone.py does not exist"),
])
def test_a_bad_multi_turn_input_stops_before_any_model_loads(agent_workdir, caller_dir, tools_file, tmp_path,
                                                             no_model_loads, override, sentence):
    import ppo
    from infra.cli import load_config
    args = agent_args(agent_workdir, caller_dir, tools_file, tmp_path / "out", override.format(tmp=tmp_path))
    with pytest.raises(ConfigError) as e:
        ppo.main(load_config(f"{REPO}/configs.yaml", args[3:]))
    assert sentence.format(tmp=tmp_path) in str(e.value) and "\n" not in str(e.value)
