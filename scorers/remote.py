"""A reward server as a scorer (reward.sources=[remote], RemoteScorer): the batch is POSTed to reward.remote.url as
JSON in OpenRLHF's --remote_rm_url format, so that a server written for OpenRLHF serves this library unchanged:
    {"query": [prompt + response, as OpenRLHF decodes them], "prompts": [...], "labels": [ground truths],
     "responses": [...], "data_sources": [...], "extra_info": [...]}    →    {"rewards": [one number each]}
("scores" is read where "rewards" is missing, as OpenRLHF does; the numbers of its "extra_logs" are logged).

    reward.sources=[remote] reward.remote.url=http://127.0.0.1:5000/get_reward

It keeps `max_concurrency` requests in flight at once, each given `timeout_s` seconds, and one that timed out, could
not connect or got a 429 or 5xx is retried `max_retries` times, after backoff_s, 2·backoff_s, … seconds (the judge's
with_retries); after a stop signal the requests in flight are cut within timeout_s (exit 143). Before any model loads,
check_remote sends one sample (an empty response) and reads its answer: an address where nothing answers, or where
something other than a reward server does, stops the run in one sentence. A sample whose request still fails, or
whose answer does not read (bad JSON, a wrong count, not a finite number within reward.max_abs_score), scores 0 and
counts in reward/remote_errors; when that is every sample of a batch the run stops (rewards.RewardError), as for a
failing reward function.
"""
import asyncio
import functools
import json
import math
import numbers

import torch

from infra.config import ConfigError
from rewards import count_failures, Scores
from scorers.judge import gather_or_stop, with_retries


class ServerError(Exception):
    """A server's answer that is no use: not JSON, no list of rewards, the wrong count, not numbers, or a 4xx."""


def check_remote(cfg, max_abs_score: float) -> None:
    """Before any model loads: reward.remote.url is an http(s) address where a reward server answers one sample (an
    empty response, probe), as a batch's requests will be answered (read_rewards)."""
    if not cfg.url or not cfg.url.startswith(("http://", "https://")):
        raise ConfigError(f"reward.remote.url={cfg.url!r}: give the reward server's address, e.g. "
                          f"http://127.0.0.1:5000/get_reward (a server written for OpenRLHF's --remote_rm_url works)")
    try:
        read_rewards(probe(cfg), 1, max_abs_score)
    except Exception as e:
        raise ConfigError(f"reward.remote.url={cfg.url}: one sample (an empty response) sent at start-up got "
                          f"{type(e).__name__}: {answered(e, cfg)}; a reward server answers {{\"rewards\": [one number "
                          f"per sample]}}") from None


def probe(cfg) -> bytes:
    """The body of the server's answer to one sample with an empty response, within reward.remote.timeout_s (no
    retries); a ServerError for an HTTP error."""
    import httpx

    piece = {"query": [""], "prompts": [""], "labels": [None], "responses": [""], "data_sources": [None],
             "extra_info": [None]}
    response = httpx.post(cfg.url, json=piece, timeout=cfg.timeout_s)
    if response.status_code >= 400:
        raise ServerError(f"HTTP {response.status_code}: {response.text[:200]}")
    return response.content


def answered(e: Exception, cfg) -> str:
    """An error in a few words: a timeout names reward.remote.timeout_s."""
    if "Timeout" in type(e).__name__:
        return f"no answer within reward.remote.timeout_s={cfg.timeout_s:g} s"
    return " ".join(str(e).split())[:300]


def read_rewards(body: bytes, count: int, max_abs_score: float) -> tuple[list[float], dict]:
    """A server's answer → (rewards, extra_logs' lists of numbers); ServerError when it is not JSON holding
    "rewards" (or "scores"): `count` finite numbers within ±max_abs_score (reward.max_abs_score)."""
    try:
        answer = json.loads(body)
    except ValueError as e:
        raise ServerError(f"the answer is not JSON ({e}): {body[:200]!r}") from None
    found = answer.get("rewards", answer.get("scores")) if isinstance(answer, dict) else None
    if not isinstance(found, list):
        raise ServerError(f"the answer has no list \"rewards\" (or \"scores\"): {str(answer)[:200]}")
    if len(found) != count:
        raise ServerError(f"{len(found)} rewards came back for {count} samples")
    if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) for x in found):
        raise ServerError(f"the rewards are not all finite numbers: {str(found)[:200]}")
    if any(abs(x) > max_abs_score for x in found):
        raise ServerError(f"a reward is beyond reward.max_abs_score={max_abs_score:g}: {str(found)[:200]}")
    logs = answer.get("extra_logs") if isinstance(answer.get("extra_logs"), dict) else {}
    numeric = {key: [float(x) for x in v] for key, v in logs.items() if isinstance(v, list) and all(
        isinstance(x, numbers.Real) and math.isfinite(x) for x in v)}
    return [float(x) for x in found], numeric


class RemoteScorer:
    """rewards.SCORERS["remote"]: the batch POSTed to reward.remote.url in request_size pieces (the module's
    docstring has the format), max_concurrency at once, each retried (with_retries); a piece whose request fails or
    whose answer does not read (read_rewards) scores 0, its samples counted in reward/remote_errors."""

    def __init__(self, cfg_reward, setup):
        self.cfg, self.tokenizer, self.stop = cfg_reward.remote, setup.tokenizer, setup.stop
        self.max_abs_score = cfg_reward.max_abs_score

    def payload(self, rows: list[dict], texts: list[str], ro) -> dict:
        """OpenRLHF's query is the prompt and the response decoded together with their special tokens (the EOS, and
        with multi-turn the tool answers); without the tokens (ro None), the prompt's text and the response's."""
        if ro is None or self.tokenizer is None:
            queries = [row.get("prompt_text", "") + text for row, text in zip(rows, texts)]
        else:
            mask = ro.response_mask if ro.attention_mask is None else ro.attention_mask
            queries = [self.tokenizer.decode(row["prompt_ids"] + r[m.bool()].tolist(), skip_special_tokens=False)
                       for row, r, m in zip(rows, ro.responses, mask)]
        return {"query": queries, "prompts": [row.get("prompt_text", "") for row in rows],
                "labels": [row.get("ground_truth") for row in rows], "responses": texts,
                "data_sources": [row.get("data_source") for row in rows],
                "extra_info": [row.get("extra_info") for row in rows]}

    def __call__(self, rows: list[dict], texts: list[str], ro=None) -> Scores:
        whole, size = self.payload(rows, texts, ro), self.cfg.request_size or len(texts)
        pieces = [{key: values[i:i + size] for key, values in whole.items()} for i in range(0, len(texts), size)]
        answers = asyncio.run(self.post_all(pieces))
        scores, logs, errors, first = [], {}, 0, None
        for piece, answer in zip(pieces, answers):
            try:
                if isinstance(answer, BaseException):
                    raise answer
                got, more = read_rewards(answer, len(piece["query"]), self.max_abs_score)
            except Exception as e:
                got, more, errors = [0.0] * len(piece["query"]), {}, errors + len(piece["query"])
                first = first or f"{type(e).__name__}: {e}"
            scores += got
            for key, values in more.items():
                logs.setdefault(key, []).extend(values)
        count_failures(f"the reward server {self.cfg.url}", errors, len(texts), first)
        metrics = {"reward/remote_errors": float(errors),
                   **{f"reward/remote/{key}": sum(v) / len(v) for key, v in logs.items() if v}}
        return Scores(torch.tensor(scores, dtype=torch.float32), metrics=metrics)

    async def post_all(self, pieces: list[dict]) -> list:
        """Each piece's answer (the body), or the exception its last attempt raised; cut reward.remote.timeout_s after
        a stop signal (gather_or_stop)."""
        import httpx

        limit = asyncio.Semaphore(self.cfg.max_concurrency)
        retried = (httpx.TransportError, RetriedStatus)  # timeouts, lost connections; 429, 5xx

        async with httpx.AsyncClient(timeout=self.cfg.timeout_s) as client:
            async def post(piece):
                response = await client.post(self.cfg.url, json=piece)
                if response.status_code == 429 or response.status_code >= 500:
                    raise RetriedStatus(f"HTTP {response.status_code} from {self.cfg.url}")
                if response.status_code >= 400:
                    raise ServerError(f"HTTP {response.status_code} from {self.cfg.url}: {response.text[:200]}")
                return response.content
            return await gather_or_stop([with_retries(functools.partial(post, piece), retried, limit, self.cfg)
                                         for piece in pieces], self.stop, self.cfg.timeout_s,
                                        f"a request to the reward server {self.cfg.url}", "reward.remote.timeout_s")


class RetriedStatus(Exception):
    """A 429 or 5xx: the server is busy or failed; the request is tried again."""


def check_remote_source(cfg_reward, trust_remote_code: bool) -> None:
    """rewards.CHECKS' line for reward.sources=[remote]."""
    check_remote(cfg_reward.remote, cfg_reward.max_abs_score)
