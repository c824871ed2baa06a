"""An LLM judge as a scorer (reward.sources=[judge]): each response is written into a prompt template and sent to a
model behind an OpenAI-compatible endpoint (vLLM's server, or any other); its answer, parsed, is the score.

    python -m vllm.entrypoints.openai.api_server --model models/SmolLM2-135M-Instruct --port 8000 &   # a local judge
    accelerate launch ppo.py --config configs.yaml reward.sources=judge reward.judge.parser=yes_no \\
        reward.judge.base_url=http://127.0.0.1:8000/v1 reward.judge.prompt_template=examples/judge_prompt.txt

reward.sources=[rule,judge] with reward.weights adds the rule's and the judge's scores. Before any model loads,
check_judge asks the endpoint which models it serves: one that does not answer, or does not serve reward.judge.model,
stops the run in one sentence naming the key. The judge's raw answers are shown in the sample table.

The judge keeps `max_concurrency` requests in flight at once, each given `timeout_s` seconds, and one that timed out,
could not connect or got a 429 or 5xx is retried `max_retries` times, after backoff_s, 2·backoff_s, … seconds
(with_retries, which the reward server's scorer, remote.py, shares).
A sample whose request still fails, or whose answer does not parse, scores 0 and counts in reward/judge_errors; when
that is every sample of a batch the run stops (rewards.RewardError), as for a failing reward function. A judge reply
that is not a chat completion (a proxy's HTML page, no choices) is such an error. The API key (the variable
reward.judge.api_key_env names) goes only in the Authorization header to base_url, and only where that is https or
this machine (a loopback address; key_may_go_to; start-up says which in one line): redirects are not followed, and
an error that quotes the key shows *** instead.
"""
import asyncio
import difflib
import functools
import ipaddress
import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Optional

import torch

from infra.config import ConfigError
from rewards import count_failures, Scores

# ---------------------------------------------------------------------------------------
# Answer → score

NUMBER = r"-?\d+(?:\.\d+)?"
SCALED = re.compile(rf"(?<![\w.])({NUMBER})\s*(?:/|out\s+of|of)\s*(\d+(?:\.\d+)?)(?!\w|\.\d)", re.IGNORECASE)
LONE = re.compile(rf"(?<![\w./]){NUMBER}")  # a number on its own: not the 10 of "7/10", nor a part of "v1.5"


def parse_number(answer: str, low: float, high: float) -> float:
    """(x − low) / (high − low), x the judge's score, which must lie in [low, high]; a ValueError otherwise.
    x is the X of the answer's last "X/Y", "X out of Y" or "X of Y", whose scale Y must be `high` ("7/10",
    "7 out of 10", "7.5 of 10" → 7, 7, 7.5 with high = 10; "4/5" is refused), or with no such phrase the answer's
    last number ("Score: 7" → 7)."""
    scaled = SCALED.findall(answer)
    if scaled:
        x, scale = (float(v) for v in scaled[-1])
        if scale != high:
            raise ValueError(f"the judge scored out of {scale:g}, not reward.judge.max_score={high:g} (answer "
                             f"{answer[:200]!r})")
    else:
        found = LONE.findall(answer)
        if not found:
            raise ValueError(f"no number in the judge's answer {answer[:200]!r}")
        x = float(found[-1])
    if not low <= x <= high:
        raise ValueError(f"the judge's score {x:g} is outside [{low:g}, {high:g}] (answer {answer[:200]!r})")
    return (x - low) / (high - low)


def parse_yes_no(answer: str, low: float, high: float) -> float:
    """1.0 when the answer's last word that is yes or no is yes, 0.0 when it is no; a ValueError when there is
    neither. (low and high are the number parser's; unused.)"""
    words = [w for w in re.findall(r"[a-z]+", answer.lower()) if w in ("yes", "no")]
    if not words:
        raise ValueError(f"neither yes nor no in the judge's answer {answer[:200]!r}")
    return float(words[-1] == "yes")


PARSERS = {"number": parse_number, "yes_no": parse_yes_no}  # reward.judge.parser → (answer, low, high) → score


# ---------------------------------------------------------------------------------------
# The prompt


PLACEHOLDERS = ("prompt", "response", "ground_truth")  # what render fills in


def read_template(path: Optional[str]) -> str:
    """The text of reward.judge.prompt_template, which must show the judge the {response} and spell each placeholder
    right: a {word} that is one of PLACEHOLDERS but for its case or a letter or two ({respnse}, {Ground Truth})
    would be sent as written. Other braces (JSON, LaTeX's \\boxed{answer}) stay as they are."""
    if not path:
        raise ConfigError("reward.judge.prompt_template is not set: give a text file holding the judge's prompt, "
                          "with {response} (and optionally {prompt}, {ground_truth}) in it")
    if not os.path.isfile(path):
        raise ConfigError(f"reward.judge.prompt_template: file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"reward.judge.prompt_template: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                          f"offset {e.start}); save it as UTF-8") from None
    allowed = ", ".join(f"{{{name}}}" for name in PLACEHOLDERS)
    for word in re.findall(r"\{([\w \-]{1,40})\}", template):
        near = difflib.get_close_matches(word.lower().replace(" ", "_").replace("-", "_"), PLACEHOLDERS, n=1,
                                         cutoff=0.75)
        if near and word not in PLACEHOLDERS:
            raise ConfigError(f"reward.judge.prompt_template: {path} has {{{word}}}, which is not a placeholder and "
                              f"would reach the judge as written; the placeholders are {allowed} (did you mean "
                              f"{{{near[0]}}}?)")
    if "{response}" not in template:
        raise ConfigError(f"reward.judge.prompt_template: {path} has no {{response}}, so the judge would never see "
                          f"the response; put {{response}} where it goes")
    return template


def prompt_text(prompt) -> str:
    """A row's prompt as the judge reads it: the text, or a chat's messages as "role: content" lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def render(template: str, row: dict, response: str) -> str:
    """The template with {prompt}, {response} and {ground_truth} replaced, in one pass (a response holding
    "{prompt}" stays as it is; other braces, e.g. JSON, too)."""
    values = {"prompt": prompt_text(row["prompt"]), "response": response,
              "ground_truth": "" if row.get("ground_truth") is None else str(row["ground_truth"])}
    return re.sub(rf"\{{({'|'.join(PLACEHOLDERS)})\}}", lambda m: values[m.group(1)], template)


# ---------------------------------------------------------------------------------------
# The endpoint


def key_may_go_to(base_url: str) -> bool:
    """The API key is sent only over https or to this machine (localhost or a loopback address, 127.0.0.1, ::1):
    over plain http to another host, anyone on the way could read it."""
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme == "https" or parts.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(parts.hostname or "").is_loopback
    except ValueError:
        return False


def api_key(cfg) -> str:
    """The key in $reward.judge.api_key_env where key_may_go_to(base_url), else "EMPTY" (vLLM's server takes any key
    unless started with one)."""
    key = os.environ.get(cfg.api_key_env)
    return key if key and key_may_go_to(cfg.base_url) else "EMPTY"


def key_line(cfg) -> Optional[str]:
    """The start-up line on where the API key goes, or None when $api_key_env holds none."""
    if not os.environ.get(cfg.api_key_env):
        return None
    if key_may_go_to(cfg.base_url):
        return f"judge: the API key in ${cfg.api_key_env} is sent to {cfg.base_url} (https or this machine) only"
    return (f"judge: the API key in ${cfg.api_key_env} is NOT sent to {cfg.base_url}: it is plain http to another "
            f"machine, and a key goes only over https or to a loopback address (reward.judge.api_key_env)")


def client(cfg, timeout: float, *, asynchronous: bool = False):
    """An OpenAI client of base_url whose key (from reward.judge.api_key_env) goes in the Authorization header to
    base_url and nowhere else: redirects are not followed (the openai client follows them by default; httpx keeps
    the key on a redirect from http to https, and the prompt on a 307 to any host), so a judge that redirects is an
    error naming where to. No retries: Judge.ask's own, with their backoff."""
    import openai

    Client, Http = ((openai.AsyncOpenAI, openai.DefaultAsyncHttpxClient) if asynchronous
                    else (openai.OpenAI, openai.DefaultHttpxClient))
    return Client(base_url=cfg.base_url, api_key=api_key(cfg), timeout=timeout, max_retries=0,
                  http_client=Http(follow_redirects=False, timeout=timeout))


def without_key(text: str, cfg) -> str:
    """`text` (an error's message, which may quote a server's reply) with the API key, where there is one, replaced
    by ***: the key never reaches the console, warnings or metrics."""
    key = os.environ.get(cfg.api_key_env)
    return text.replace(key, "***") if key and len(key) >= 4 else text


def served_model(cfg) -> str:
    """The model to ask: reward.judge.model, which the endpoint must serve, or (null) the only one it serves."""
    # The probe waits at least 10 s, whatever reward.judge.timeout_s (a per-answer limit) says.
    with client(cfg, max(cfg.timeout_s, 10.0)) as probe:
        try:
            served = [m.id for m in probe.models.list()]
        except Exception as e:  # no server, not an OpenAI API, a refused key: one sentence, whichever it is
            raise ConfigError(f"reward.judge.base_url={cfg.base_url}: no OpenAI-compatible server answers there "
                              f"({type(e).__name__}: {without_key(error_text(e), cfg)}); start one (python -m "
                              f"vllm.entrypoints.openai.api_server --model MODEL --port 8000) or correct the "
                              f"key") from None
    if cfg.model is None:
        if len(served) != 1:
            raise ConfigError(f"reward.judge.model is null but {cfg.base_url} serves {served}; name the one to ask")
        return served[0]
    if cfg.model not in served:
        raise ConfigError(f"reward.judge.model={cfg.model!r} is not served at {cfg.base_url} (it serves {served})")
    return cfg.model


def error_text(e: Exception) -> str:
    """An endpoint error in a few words: a redirect names where to; other text is cut to 200 characters."""
    response = getattr(e, "response", None)
    if response is not None and response.is_redirect:
        return f"it redirects to {response.headers.get('location')}, which is not followed: give that as base_url"
    return " ".join(str(e).split())[:200]


def check_judge(cfg) -> None:
    """Before any model loads: the endpoint answers and serves the model, the template is there, the range is one."""
    if not cfg.base_url:
        raise ConfigError("reward.judge.base_url is not set: give the judge's OpenAI-compatible endpoint, e.g. "
                          "http://127.0.0.1:8000/v1")
    if not cfg.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"reward.judge.base_url={cfg.base_url!r} has no scheme: write it as http://{cfg.base_url} "
                          f"(or https://)")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.api_key_env):  # the value is not quoted: it may be a key
        raise ConfigError("reward.judge.api_key_env must be the name of an environment variable (letters, digits and "
                          "_, e.g. OPENAI_API_KEY) that holds the key: a key written in a config is saved in the "
                          "run's config.yaml")
    if cfg.parser not in PARSERS:
        raise ConfigError(f"reward.judge.parser={cfg.parser!r} is not one of {', '.join(PARSERS)}")
    read_template(cfg.prompt_template)
    if cfg.parser == "number" and not cfg.min_score < cfg.max_score:
        raise ConfigError(f"reward.judge.min_score ({cfg.min_score}) must be below reward.judge.max_score "
                          f"({cfg.max_score})")
    served_model(cfg)
    if key_line(cfg) and os.environ.get("RANK", "0") == "0":
        print(key_line(cfg), flush=True)


# ---------------------------------------------------------------------------------------
# Scoring a batch


def answer_of(reply) -> str:
    """A chat completion's text; a ValueError for a reply that is not one (the openai client returns the body of a
    reply that is not JSON, e.g. a proxy's HTML page, as a str) or has no choices."""
    if isinstance(reply, str):
        raise ValueError(f"the endpoint answered {' '.join(reply.split())[:80]!r}, not a chat completion")
    if not getattr(reply, "choices", None):
        raise ValueError("the endpoint's chat completion has no choices")
    content = reply.choices[0].message.content
    return content if isinstance(content, str) else ""


@dataclass(frozen=True)
class Judged:
    scores: list[float]  # in [0, 1] (PARSERS); 0.0 where the sample erred
    answers: list[str]  # the judge's raw answers; "(no answer: <exception>)" where none came
    errors: int  # samples whose request failed or whose answer did not parse
    first_error: Optional[str]


class Judge:
    """reward.judge bound once: judge(rows, texts) → Judged, every request of the batch at once (bounded)."""

    def __init__(self, cfg, stop=None):
        """`stop`: runs.StopSignal, which cuts the requests in flight reward.judge.timeout_s after it (None: none)."""
        self.cfg, self.template, self.model = cfg, read_template(cfg.prompt_template), served_model(cfg)
        self.stop = stop
        self.parse = functools.partial(PARSERS[cfg.parser], low=cfg.min_score, high=cfg.max_score)

    def __call__(self, rows: list[dict], texts: list[str]) -> Judged:
        answers = asyncio.run(self.ask_all([render(self.template, row, text) for row, text in zip(rows, texts)]))
        scores, raw, errors = [], [], []
        for answer in answers:
            raw.append(answer if isinstance(answer, str) else f"(no answer: {type(answer).__name__})")
            try:
                if isinstance(answer, BaseException):
                    raise answer
                scores.append(self.parse(answer))
            except Exception as e:
                scores.append(0.0)
                errors.append(without_key(f"{type(e).__name__}: {error_text(e)}", self.cfg))
        return Judged(scores, raw, len(errors), errors[0] if errors else None)

    async def ask_all(self, prompts: list[str]) -> list:
        """Each prompt's answer, or the exception its last attempt raised; max_concurrency requests in flight, cut
        reward.judge.timeout_s after a stop signal (gather_or_stop)."""
        limit = asyncio.Semaphore(self.cfg.max_concurrency)
        async with client(self.cfg, self.cfg.timeout_s, asynchronous=True) as judge:
            return await gather_or_stop([self.ask(judge, limit, p) for p in prompts], self.stop, self.cfg.timeout_s,
                                        f"a request to the judge {self.cfg.base_url}", "reward.judge.timeout_s")

    async def ask(self, client, limit: asyncio.Semaphore, prompt: str) -> str:
        """One chat completion, retried (with_retries) after a timeout, a lost connection, a 429 or a 5xx."""
        import openai

        async def request():
            reply = await client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}],
                max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature)
            return answer_of(reply)
        retried = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)  # timeouts too
        return await with_retries(request, retried, limit, self.cfg)


async def with_retries(request, retried: tuple, limit: asyncio.Semaphore, cfg):
    """await request() holding a slot of `limit`; after an exception in `retried` wait cfg.backoff_s·2^attempt
    seconds (holding no slot) and try again, cfg.max_retries times, then raise it."""
    for attempt in range(cfg.max_retries + 1):
        try:
            async with limit:
                return await request()
        except retried:
            if attempt == cfg.max_retries:
                raise
        await asyncio.sleep(cfg.backoff_s * 2 ** attempt)


async def gather_or_stop(awaitables: list, stop, seconds: float, what: str, key: str) -> list:
    """Each awaitable's result, or the exception it raised (asyncio.gather's return_exceptions=True); but when a stop
    signal (runs.StopSignal; None: none) came more than `seconds` (the request's timeout, `key`) ago and some still
    wait, they are cancelled and runs.Interrupted names `what` and `key`: a preempted run waits for a slow server at
    most one request's timeout (exit 143), not every retry's."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    while True:
        _, pending = await asyncio.wait(tasks, timeout=0.2) if tasks else (None, ())
        if not pending:
            return [t.exception() or t.result() for t in tasks]
        if stop is not None and stop.overdue(seconds):
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            stop.check_overdue(seconds, what, key)


class JudgeScorer:
    """rewards.SCORERS["judge"]: the judge's parsed answers as scores, its raw ones as extras (the sample table)."""

    def __init__(self, cfg_reward, setup):
        self.judge = Judge(cfg_reward.judge, setup.stop)

    def __call__(self, rows: list[dict], texts: list[str], ro=None) -> Scores:
        judged = self.judge(rows, texts)
        count_failures("the judge", judged.errors, len(texts), judged.first_error)
        return Scores(torch.tensor(judged.scores, dtype=torch.float32),
                      extras=[{"judge_answer": answer} for answer in judged.answers],
                      metrics={"reward/judge_errors": float(judged.errors),
                               "reward/judge_score_mean": sum(judged.scores) / max(len(texts), 1)})


def check_judge_source(cfg_reward, trust_remote_code: bool) -> None:
    """rewards.CHECKS' line for reward.sources=[judge]."""
    check_judge(cfg_reward.judge)
