"""Issue 31: the scorer table (rewards.SCORERS) and its Scores, reward.sources with weights and the old reward.type, a new
scorer in one class and one line, step rewards on the tokens that end each step and what they do to the advantages,
a remote reward server in OpenRLHF's format and its failure modes, and on-policy distillation's teacher."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny_model, make_tokenizer
from infra.cli import load_config
from infra.config import ConfigError

ROWS = [{"data_source": "arithmetic", "ground_truth": g, "extra_info": {}, "prompt": "Q", "prompt_text": "Q: "}
        for g in ("7", "8", "9")]
LENGTH_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": len(solution_str) / 10, "chars": float(len(solution_str))}
'''
STEP_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Each line is a step, rewarded 0.1 × its number (1, 2, …); the score: whether the last line is the truth."""
    ends = [i + 1 for i, c in enumerate(solution_str) if c == "\\n"] + [len(solution_str)]
    if extra_info.get("no_steps"):
        return 0.0
    return {"score": float(solution_str.split("\\n")[-1] == ground_truth), "step_ends": ends,
            "step_rewards": [0.1 * (k + 1) for k in range(len(ends))]}
'''


def merging_tokenizer():
    """The tests' byte-level BPE with merges ("What" one token, " answer" another): make_tokenizer's 200 is below
    its 259-symbol alphabet, so it merges nothing."""
    return make_tokenizer(vocab_size=400)


def reward_cfg(*overrides):
    return load_config(None, list(overrides)).reward


# ---- sources, weights, the old spelling, a new scorer


def test_sources_add_up_with_their_weights_and_each_is_logged(tmp_path):
    """reward.sources=[rule,function] with weights [2, 0.5]: each score is 2·rule + 0.5·function, the means of each
    source are logged as reward/<source>/mean, and the function's extra number as reward/chars."""
    from rewards import Scorer
    path = tmp_path / "length.py"
    path.write_text(LENGTH_REWARD)
    scorer = Scorer(reward_cfg("reward.sources=[rule,function]", "reward.weights=[2,0.5]",
                               f"reward.function={path}:compute_score"), "cpu", None)
    got = scorer(ROWS, ["7", "3 + 5 = 8", "no"])
    rule, length = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.1, 0.9, 0.2])
    assert torch.allclose(got.scores, 2 * rule + 0.5 * length)
    assert got.metrics["reward/rule/mean"] == pytest.approx(2 / 3)
    assert got.metrics["reward/function/mean"] == pytest.approx(0.4)
    assert got.metrics["reward/chars"] == pytest.approx(4.0) and got.metrics["reward/errors"] == 0
    assert got.token_rewards is None and got.extras == [{}, {}, {}]


def test_the_old_reward_type_is_mapped_or_refused_in_one_sentence():
    """reward.type=rule/model/judge read as sources; both and rule+judge are refused with the new spelling; two
    spellings at once, a weight count that is not the source count, a source twice, an unused reward.function, and
    an unknown source each fail at start-up in one sentence naming the key."""
    from rewards import reward_sources
    from rewards import check_reward_inputs
    assert reward_sources(reward_cfg()) == [("rule", 1.0)]
    assert reward_sources(reward_cfg("reward.type=rule", "reward.function=f.py:g")) == [("function", 1.0)]
    assert reward_sources(reward_cfg("reward.type=model")) == [("model", 1.0)]
    assert reward_sources(reward_cfg("reward.type=judge")) == [("judge", 1.0)]
    cases = [(["reward.type=both"], "reward.type=both is now spelled reward.sources=[rule,model]"),
             (["reward.type=rule+judge"], "reward.sources=[rule,judge] with reward.weights"),
             (["reward.type=model", "reward.sources=[model]"], "two spellings of one setting"),
             (["reward.sources=[rule,model]", "reward.weights=[1]"], "reward.weights has 1 numbers for the 2"),
             (["reward.sources=[rule,rule]"], "names a source twice"),
             (["reward.sources=[rule]", "reward.function=f.py:g"], "does not read it"),
             (["reward.sources=[function]"], "reward.function is not set"),
             (["reward.sources=[rule,nope]"], "reward.sources: 'nope' is not one of rule, function, model")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
            check_reward_inputs(reward_cfg(*overrides))
        assert str(e.value).count(". ") == 0, str(e.value)


class LengthPenalty:
    """The README's worked example, as written there: −len/100 for each response."""

    def __init__(self, cfg_reward, setup):
        pass

    def __call__(self, rows, texts, ro=None):
        from rewards import Scores
        return Scores(torch.tensor([-len(t) / 100 for t in texts]))


def test_a_new_scorer_is_one_class_and_one_table_line(monkeypatch):
    """LengthPenalty (one class) and one line in SCORERS make reward.sources=[rule,length] a valid run: the start-up
    check accepts it and the score is rule − len/100, logged as reward/length/mean."""
    import rewards as scorers
    monkeypatch.setitem(scorers.SCORERS, "length", LengthPenalty)
    cfg = reward_cfg("reward.sources=[rule,length]")
    scorers.check_reward_inputs(cfg)
    got = scorers.Scorer(cfg, "cpu", None)(ROWS[:2], ["7", "9"])
    assert got.scores.tolist() == pytest.approx([0.99, -0.01])
    assert got.metrics["reward/length/mean"] == pytest.approx(-0.01)


# ---- token rewards


def rollout_of(tokenizer, texts):
    """A rollout.Rollout of these responses, each its tokens + EOS, right-padded."""
    from rollout import right_pad, Rollout
    ids = [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in texts]
    responses, mask = right_pad(ids, tokenizer.pad_token_id)
    return Rollout(responses, mask)


def test_step_rewards_land_on_the_tokens_that_end_each_step(tmp_path):
    """A reward.function returning step_rewards with the character offsets where its steps end: each reward lands on
    the token that holds the step's last character by the tokenizer's own offsets (return_offsets_mapping), the
    EOS and padding get none, a response without steps gets zeros, and the score stays the function's."""
    from rewards import decode_responses
    from rewards import Scorer
    path = tmp_path / "steps.py"
    path.write_text(STEP_REWARD)
    tok = merging_tokenizer()
    texts = ["What is 3 + 4?\nThe answer is\n7", "hello world\nyes", "no"]
    ro = rollout_of(tok, texts)
    assert decode_responses(tok, ro) == texts
    rows = [dict(ROWS[0]), dict(ROWS[0], ground_truth="yes"), dict(ROWS[0], extra_info={"no_steps": True})]
    scorer = Scorer(reward_cfg(f"reward.function={path}:compute_score"), "cpu", None, tokenizer=tok)
    got = scorer(rows, texts, ro)
    assert got.scores.tolist() == [1.0, 1.0, 0.0] and got.metrics["reward/step_samples"] == 2
    expected = torch.zeros(ro.responses.shape)
    for i, text in enumerate(texts[:2]):
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ends = [j + 1 for j, c in enumerate(text) if c == "\n"] + [len(text)]
        for k, end in enumerate(ends):
            token = next(t for t, (start, stop) in enumerate(offsets) if start < end <= stop)
            expected[i, token] += 0.1 * (k + 1)
    assert torch.allclose(got.token_rewards, expected) and expected[:2].count_nonzero() == 5
    assert got.token_rewards[2].abs().sum() == 0


def test_token_ends_hold_for_a_tokenisation_the_tokenizer_would_not_make():
    """Offsets come from decoding the sampled tokens incrementally: a response sampled as single characters (which
    a fresh tokenisation of its text would merge) still gets each token's own end."""
    from scorers.steps import token_ends
    tok = merging_tokenizer()
    chars = [tok.convert_tokens_to_ids(c) for c in "What"]
    assert len(tok("What", add_special_tokens=False).input_ids) < 4 and token_ends(tok, chars) == [1, 2, 3, 4]


def test_step_rewards_change_gae_as_computed_by_hand():
    """Token rewards r = [0.5, 0, 0] plus the score 1 at the last token, V = [0.2, 0.4, 0.1], γ = 1, λ = 0.5:
    δ = [0.5 + 0.4 − 0.2, 0.1 − 0.4, 1 − 0.1] = [0.7, −0.3, 0.9]; Â_2 = 0.9, Â_1 = −0.3 + 0.45 = 0.15,
    Â_0 = 0.7 + 0.075 = 0.775, where without the step reward Â_0 = 0.275 and the rest are the same. GRPO, RLOO and
    REINFORCE++-baseline see the per-response sum: the same as all of it at the last token."""
    from advantages import gae, grpo, reinforce_plus_plus_baseline, rloo, Settings
    from kl import kl_penalty_rewards
    mask, zeros = torch.ones(1, 3), torch.zeros(1, 3)
    rewards = kl_penalty_rewards(torch.tensor([1.0]), zeros, mask, 0.1, torch.tensor([[0.5, 0.0, 0.0]]))
    assert rewards.tolist() == [[0.5, 0.0, 1.0]]
    s = Settings(1.0, 0.5, 2, True, False)
    values = torch.tensor([[0.2, 0.4, 0.1]])
    assert gae(rewards, mask, values, s)[0].tolist()[0] == pytest.approx([0.775, 0.15, 0.9])
    assert gae(kl_penalty_rewards(torch.tensor([1.0]), zeros, mask, 0.1), mask, values, s)[0].tolist()[0] == \
        pytest.approx([0.275, 0.15, 0.9])
    dense = torch.tensor([[0.5, 0.0, 1.0], [0.0, 0.2, 0.0]])
    at_end = torch.tensor([[0.0, 0.0, 1.5], [0.0, 0.0, 0.2]])
    for estimator in (grpo, rloo, reinforce_plus_plus_baseline):
        assert torch.allclose(estimator(dense, torch.ones(2, 3), None, s)[0],
                              estimator(at_end, torch.ones(2, 3), None, s)[0])


def test_samples_carry_token_rewards_and_extras_through_rounds():
    """Samples.cat of a round with token rewards and one without: zeros stand for the missing ones, padded to the
    longest response; the extras follow their rows, and take keeps both."""
    from infra.rollout_common import Samples

    def samples(T, rewards, extra):
        return Samples([{}], torch.zeros(1, T, dtype=torch.long), torch.ones(1, T), None, ["x"], torch.zeros(1),
                       torch.zeros(1, dtype=torch.bool), token_rewards=rewards, extras=[extra])
    both = Samples.cat([samples(2, None, {"a": 1}), samples(3, torch.tensor([[1.0, 2.0, 3.0]]), {"b": 2})], 0)
    assert both.token_rewards.tolist() == [[0, 0, 0], [1, 2, 3]] and both.extras == [{"a": 1}, {"b": 2}]
    assert both.take([1]).extras == [{"b": 2}] and both.take([1]).token_rewards.tolist() == [[1, 2, 3]]
    assert Samples.cat([samples(2, None, {})], 0).token_rewards is None


def test_the_sampler_adds_the_rollouts_token_rewards_to_the_scorers(tmp_path):
    """Step 2–3 (rollout.generate, then rewards.score_samples) with a rollout that rewards a turn during the
    rollout (Rollout.token_rewards, as an environment would) and a step-reward function: Samples.token_rewards is
    the sum of the two, the score is the function's, and each sample's extras travel in Samples.extras."""
    from rewards import Scores
    from infra.rollout_common import Samples
    from rewards import score_samples
    from rewards import Scorer
    path = tmp_path / "steps.py"
    path.write_text(STEP_REWARD)
    tok = merging_tokenizer()
    texts = ["What is\n7", "8"]
    turn_rewards = torch.zeros(rollout_of(tok, texts).responses.shape)  # (2, Tr)
    turn_rewards[0, 1] = 0.5

    class Rollout:
        eos_ids = {tok.eos_token_id}

        def generate(self, rows, n, temperature, seed=None):
            ro = rollout_of(tok, texts)
            ro.token_rewards = turn_rewards
            return ro
    accelerator = SimpleNamespace(device=torch.device("cpu"), reduce=lambda x, op: x)
    cfg = load_config(None, [f"reward.function={path}:compute_score", "rollout.n=2"])
    scorer = Scorer(cfg.reward, "cpu", None, tokenizer=tok)
    rows = [dict(ROWS[0], prompt_ids=[1])]
    ro = Rollout().generate(rows, 2, 1.0, seed=0)
    got, metrics = score_samples([r for r in rows for _ in range(2)], ro, scorer, tok, {tok.eos_token_id}, cfg,
                                 accelerator)
    alone = scorer([ROWS[0]] * 2, texts, rollout_of(tok, texts))
    assert isinstance(got, Samples) and isinstance(alone, Scores) and got.scores.tolist() == [1.0, 0.0]
    assert torch.allclose(got.token_rewards, alone.token_rewards + turn_rewards)
    assert got.extras == [{}, {}] and metrics["reward/function/mean"] == 0.5


# ---- a remote reward server


class RewardServer:
    """An OpenRLHF-style reward server on localhost: reads data["query"] only (as openrlhf/cli/serve_rm.py) and
    answers {"rewards", "scores", "extra_logs"}; a query holding a keyword misbehaves: BADJSON, SHORT (one reward
    too few), BUSY (a 503 the first time), SLOW (answers after 2 s)."""

    def __init__(self):
        self.requests, self.in_flight, self.most_in_flight, self.busy_seen = [], 0, 0, set()
        lock, server = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    server.requests.append(data)
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                try:
                    self.answer(data["query"])
                finally:
                    with lock:
                        server.in_flight -= 1

            def answer(self, queries):
                time.sleep(0.05)
                text = " ".join(queries)
                if "SLOW" in text:
                    time.sleep(2.0)
                if "BUSY" in text and text not in server.busy_seen:
                    server.busy_seen.add(text)
                    return self.reply(503, b"busy")
                if "BADJSON" in text:
                    return self.reply(200, b"{not json")
                rewards = [float(len(q)) for q in queries][:len(queries) - ("SHORT" in text)]
                self.reply(200, json.dumps({"rewards": rewards, "scores": rewards,
                                            "extra_logs": {"dummy_scores": rewards}}).encode())

            def reply(self, status, body):
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # SLOW: the client gave up waiting, as it should
                    pass

            def log_message(self, *args):
                pass
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    s.httpd.shutdown()


def remote_scorer(url, *overrides):
    from rewards import Scorer
    return Scorer(reward_cfg("reward.sources=[remote]", f"reward.remote.url={url}", "reward.remote.backoff_s=0.05",
                             *overrides), "cpu", None, tokenizer=merging_tokenizer())


def test_a_server_written_for_openrlhf_scores_unchanged(server):
    """The batch goes in request_size pieces, at most max_concurrency at once, each holding OpenRLHF's keys
    (query = the prompt and response decoded with their special tokens, prompts, labels); the answer's "rewards" are
    the scores, its extra_logs logged as reward/remote/<key>."""
    tok = merging_tokenizer()
    texts = ["7", "8 8", "9 9 9", "hello", "yes"]
    rows = [dict(ROWS[0], prompt_ids=tok("What is", add_special_tokens=False).input_ids, ground_truth=str(i))
            for i in range(5)]
    ro = rollout_of(tok, texts)
    got = remote_scorer(server.url, "reward.remote.request_size=2", "reward.remote.max_concurrency=2")(rows, texts, ro)
    queries = [q for r in sorted(server.requests, key=lambda r: r["labels"]) for q in r["query"]]
    assert queries == [f"What is{t}<|im_end|>" for t in texts]
    assert sorted(len(r["query"]) for r in server.requests) == [1, 2, 2] and server.most_in_flight == 2
    assert all({"query", "prompts", "labels"} <= set(r) for r in server.requests)
    assert got.scores.tolist() == [float(len(q)) for q in queries] and got.metrics["reward/remote_errors"] == 0
    assert got.metrics["reward/remote/dummy_scores"] == pytest.approx(sum(len(q) for q in queries) / 5)


def test_a_failing_server_costs_its_samples_and_all_failing_stops_the_run(server):
    """One sample per request: bad JSON, a wrong count and a timeout (reward.remote.timeout_s 0.5, no retry) score 0
    and count in reward/remote_errors, with a warning; a 503 is retried and then scores; when every request fails,
    RewardError says so in one sentence with the first error."""
    from rewards import RewardError
    texts = ["fine", "BADJSON", "SHORT", "SLOW", "BUSY"]
    scorer = remote_scorer(server.url, "reward.remote.request_size=1", "reward.remote.timeout_s=0.5",
                           "reward.remote.max_retries=1", "reward.remote.max_concurrency=8")
    with pytest.warns(UserWarning, match=r"the reward server .* failed on 3/5 samples"):
        got = scorer(ROWS[:1] * 5, texts)
    assert got.scores.tolist() == [len("Q: fine"), 0.0, 0.0, 0.0, len("Q: BUSY")]
    assert got.metrics["reward/remote_errors"] == 3
    with pytest.raises(RewardError, match=r"failed on all 2 samples of a batch.*first error: ServerError") as e:
        scorer(ROWS[:2], ["BADJSON", "SHORT"])
    assert str(e.value).count(". ") == 0


def test_a_remote_source_needs_an_address():
    """reward.sources=[remote] without an http(s) reward.remote.url: one sentence naming the key."""
    from rewards import check_reward_inputs
    with pytest.raises(ConfigError, match=r"reward.remote.url=None: give the reward server's address"):
        check_reward_inputs(reward_cfg("reward.sources=[remote]"))


# ---- on-policy distillation


def test_a_teacher_equal_to_the_policy_adds_exactly_zero_and_a_hand_case():
    """mode=reward: teacher log-probs equal to the policy's add exactly 0 to the token rewards, whatever the
    estimator; log π = [−1, −2], log π_teacher = [−1.5, −1], coef 0.5, k1: −0.5·(log π − log π_teacher) = [−0.25,
    0.5], added to the scorers' token rewards. mode=loss leaves the rewards alone."""
    from kl import distillation_rewards as distilled
    old = torch.tensor([[-1.0, -2.0]])
    for estimator in ("k1", "k2", "k3", "abs"):
        teacher = SimpleNamespace(mode="reward", coef=0.5, kl_estimator=estimator)
        assert distilled(None, {"old_logprobs": old, "teacher_logprobs": old.clone()}, teacher).abs().sum() == 0
    teacher = SimpleNamespace(mode="reward", coef=0.5, kl_estimator="k1")
    batch = {"old_logprobs": old, "teacher_logprobs": torch.tensor([[-1.5, -1.0]])}
    assert distilled(torch.tensor([[1.0, 0.0]]), batch, teacher).tolist() == [[0.75, 0.5]]
    assert distilled(None, batch, SimpleNamespace(mode="loss", coef=0.5, kl_estimator="k1")) is None


def test_the_teacher_in_the_actor_loss():
    """mode=loss: ActorLoss adds coef·KL(π ‖ π_teacher) (k3 here) to each token's loss, and nothing for a teacher
    equal to the policy; teacher/kl_mean logs the k1 estimate either way. A stand-in forward gives the log-probs."""
    from infra.batches import Forward
    from losses import Counts
    from ppo import ActorLoss
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)

    class Fixed(Forward):
        def logprobs(self, model, mb, with_entropy=False):
            return logprobs, torch.zeros_like(logprobs)
    mb = {"loss_mask": torch.tensor([[1, 1, 0]]), "advantages": torch.zeros(1, 3)}
    counts = Counts(2.0, 1.0)

    def loss_with(teacher_logprobs, **keys):
        cfg = load_config(None, ["algorithm.teacher.path=t", "algorithm.teacher.mode=loss",
                                 "algorithm.teacher.coef=0.5", "algorithm.teacher.kl_estimator=k3",
                                 *[f"{k}={v}" for k, v in keys.items()]])
        return ActorLoss.from_config(cfg, Fixed(1.0, None, "padded"))(None, {**mb, "teacher_logprobs":
                                                                             teacher_logprobs}, counts)
    base, _ = loss_with(logprobs.detach())
    teacher = torch.tensor([[-1.5, -1.0, -3.0]])
    loss, metrics = loss_with(teacher)
    log_r = teacher[0, :2] - logprobs.detach()[0, :2]  # log π_teacher − log π on the two tokens of loss_mask
    assert (loss - base).item() == pytest.approx(0.5 * ((log_r.exp() - 1) - log_r).mean().item())
    assert metrics["teacher/kl_mean"] == pytest.approx((-log_r).mean().item())
    assert loss_with(teacher, **{"algorithm.teacher.mode": "reward"})[0].item() == pytest.approx(base.item())


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path):
    """check_teacher: a teacher whose tokenizer is the policy's passes; one with another vocabulary is one sentence
    naming algorithm.teacher.path, before any model loads."""
    from infra.models import check_teacher
    policy = make_tiny_model(tmp_path / "policy")
    model = SimpleNamespace(path=policy, tokenizer_path=None, trust_remote_code=False)
    check_teacher(SimpleNamespace(path=make_tiny_model(tmp_path / "same", seed=1), mode="reward"), model)
    other = make_tiny_model(tmp_path / "other", tokenizer=make_tokenizer(vocab_size=300))
    with pytest.raises(ConfigError, match=r"algorithm.teacher.path=.*other: its tokenizer's vocabulary is not the") as e:
        check_teacher(SimpleNamespace(path=other, mode="reward"), model)
    assert str(e.value).count(". ") == 0


def test_ppo_with_step_rewards_and_its_own_start_as_teacher(tmp_path):
    """ppo.py end to end for 2 steps with a step-reward function and, as teacher (mode=reward), the folder the policy
    starts from: at step 1 (LoRA's B = 0, the policy is its start) teacher/kl_mean is 0, so the rewards are the
    score plus the step rewards (≥ 0.1 for every response, whose end is a step): reward/mean ≥ score/mean + 0.1; the
    teacher's pass is timed, and after an update (REINFORCE++, which reads each token's reward) the policy has moved
    away from the teacher."""
    import data
    import subprocess
    import sys
    from conftest import read_metrics, REPO
    from test_ppo import base_args
    make_tiny_model(tmp_path / "model")
    rows = data.make_arithmetic(40, seed=0)
    data.write_parquet(rows[:32], str(tmp_path / "train.parquet"))
    data.write_parquet(rows[32:], str(tmp_path / "val.parquet"))
    (tmp_path / "steps.py").write_text(STEP_REWARD)
    out = tmp_path / "out"
    args = [a for a in base_args(tmp_path, out) if not a.startswith("reward.function")]
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", *args, f"reward.function={tmp_path}/steps.py",
           f"algorithm.teacher.path={tmp_path}/model", "algorithm.teacher.coef=1.0", "trainer.total_steps=2",
           "algorithm.adv_estimator=reinforce_plus_plus",  # takes the token rewards as they are
           "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.sample_freq=0",
           "trainer.plot_curves=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [m for m in read_metrics(out) if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2] and all("time/teacher_s" in m for m in steps)
    assert abs(steps[0]["teacher/kl_mean"]) < 1e-5 and abs(steps[1]["teacher/kl_mean"]) > 1e-5
    assert steps[0]["reward/step_samples"] == 16 and steps[0]["reward/mean"] >= steps[0]["score/mean"] + 0.1 - 1e-6
