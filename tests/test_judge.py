"""MT-Bench judging: rating parsing, FastChat prompt choice, scores, the cache, the OpenAI-compatible
backend against a local server (with 429/500 retries), and a local-judge run through the CLI."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from http.server import BaseHTTPRequestHandler, HTTPServer
from omegaconf import OmegaConf

import pytest

from specrepro.data.records import Record
from specrepro.errors import SpecReproError
from specrepro.models import LoadedModel
from specrepro.metrics.judge import (
    FORCED_RATING_CUE,
    CachedJudge,
    JudgeConfig,
    grade,
    judge_messages,
    judge_prompts,
    local_chat,
    openai_chat,
    parse_rating,
)
from tests.conftest import tiny_llama
from tests.test_runner import FAST, run_dirs, specrepro


@pytest.mark.parametrize(
    "text, rating",
    [
        ("The answer is fine. Rating: [[7]]", 7.0),
        ("Rating: [[8.5]] and later [[2]]", 8.5),
        ("no double brackets, but [6]", 6.0),
        ("Rating: 9/10", None),
        ("", None),
    ],
)
def test_parse_rating(text, rating):
    assert parse_rating(text) == rating


def test_a_number_off_the_1_to_10_scale_is_no_rating():
    """ "[[80]]" was a rating of 80 (a mean of 8 and 80 scored 44), and a cited "[2023]" one of 2023."""
    assert parse_rating("I rate it [[80]] percent") is None
    assert parse_rating("Rating: [[0]]") is None
    assert parse_rating("Per the [2023] report it is fine. [7]") == 7.0
    assert parse_rating("[[85]], I mean [[8.5]]") == 8.5
    records, rows = _records_and_rows()
    metrics, _ = grade(records, rows, lambda messages: "[[8]]" if "answer 1" in messages[1]["content"] else "[[80]]")
    assert metrics["mt_bench_score"] == 8.0 and metrics["mt_bench_unparsed"] == 0.5


def test_reference_guided_prompts_for_math_reasoning_and_coding():
    prompts = judge_prompts()
    questions, answers, refs = ["Q1?", "Q2?"], ["A1", "A2"], ["R1", "R2"]
    first = judge_messages(prompts, "math", questions, answers, refs, 0)
    assert first[1]["content"].count("R1") == 1 and "Q2?" not in first[1]["content"]
    second = judge_messages(prompts, "coding", questions, answers, refs, 1)
    assert all(text in second[1]["content"] for text in ("Q1?", "A1", "Q2?", "A2", "R1", "R2"))
    assert "second" in second[0]["content"]  # the multi-turn system prompt: rate the second answer
    general = judge_messages(prompts, "writing", questions, answers, [], 1)
    assert "Reference" not in general[1]["content"] and "A2" in general[1]["content"]


def _records_and_rows():
    records = [
        Record("1", ["w1", "w2"], fields={"category": "writing", "reference_turns": []}),
        Record("2", ["m1", "m2"], fields={"category": "math", "reference_turns": ["r1", "r2"]}),
    ]
    rows = [{"id": r.id, "samples": [[{"text": f"answer {r.id}.{t}"} for t in (1, 2)]]} for r in records]
    return records, rows


def test_grade_scores_per_category_and_reports_unparsed():
    records, rows = _records_and_rows()
    ratings = {
        "answer 1.1": "[[8]]",
        "answer 1.2": "fine" + FORCED_RATING_CUE + "6]]",
        "answer 2.1": "[[3]]",
        "answer 2.2": "no rating",
    }

    def chat(messages):  # turn 2's prompt holds both answers: look for the second one first
        return next(
            ratings[k] for k in ("answer 1.2", "answer 2.2", "answer 1.1", "answer 2.1") if k in messages[1]["content"]
        )

    metrics, judgments = grade(records, rows, chat, force_rating=True)
    assert len(judgments) == 4
    assert metrics["mt_bench_unparsed"] == 0.25 and metrics["mt_bench_forced"] == 0.25
    assert [j["forced"] for j in judgments] == [False, True, False, False]
    assert metrics["mt_bench_writing"] == 7.0 and metrics["mt_bench_math"] == 3.0
    assert metrics["mt_bench_score"] == pytest.approx((8 + 6 + 3) / 3)
    assert metrics["mt_bench_turn_1"] == 5.5 and metrics["mt_bench_turn_2"] == 6.0


def test_a_judge_rating_in_the_cues_words_is_not_forced_unless_the_judge_forces():
    """GPT-4 often ends a judgment with "\n\nRating: [[8]]", the text FORCED_RATING_CUE appends."""
    records, rows = _records_and_rows()
    metrics, judgments = grade(records, rows, lambda messages: "Helpful and accurate." + FORCED_RATING_CUE + "8]]")
    assert metrics["mt_bench_score"] == 8.0 and metrics["mt_bench_forced"] == 0.0
    assert not any(j["forced"] for j in judgments)


def test_cached_judge_pays_once(tmp_path):
    calls = []
    starts = []

    def backend():
        starts.append(1)
        return lambda messages: calls.append(messages) or "Rating: [[5]]"

    cfg = JudgeConfig(name="local", model=OmegaConf.create({"name": "m"}), max_new_tokens=8)
    messages = [{"role": "user", "content": "judge this"}]
    assert CachedJudge(cfg, tmp_path, backend)(messages) == "Rating: [[5]]"
    again = CachedJudge(cfg, tmp_path, backend)
    assert again(messages) == "Rating: [[5]]"
    assert (len(calls), len(starts), again.hits) == (1, 1, 1)  # the second judge never started its backend
    other = CachedJudge(
        JudgeConfig(name="local", model=OmegaConf.create({"name": "m"}), max_new_tokens=9), tmp_path, backend
    )
    other(messages)
    assert len(calls) == 2  # a different judge setting is a different judgment
    CachedJudge(cfg, tmp_path, backend, weights={})(messages)  # a judge with no weights of its own: the same key
    assert len(calls) == 2
    retrained = CachedJudge(cfg, tmp_path, backend, weights={"model": {"name": "j", "content_digest": "b"}})
    retrained(messages)
    assert len(calls) == 3  # other weights behind the same judge config judge again
    CachedJudge(cfg, tmp_path, backend, hardware={"device": "cpu", "dtype": "bfloat16"})(messages)
    assert len(calls) == 4  # a local judge in bf16 judges again what it judged in fp32


def test_a_local_judge_checkpoint_saved_again_at_its_path_is_part_of_the_judgment_key(tmp_path):
    from specrepro.identity import judge_weights
    from tests.test_config import compose_run

    checkpoint = tmp_path / "judge"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"first")
    cfg = compose_run("dataset=mt_bench", "judge=local", "judge.model.source=hf", f"judge.model.id={checkpoint}")
    first = judge_weights(cfg)
    (checkpoint / "model.safetensors").write_bytes(b"second")
    assert first["model"]["name"] == "judge" and judge_weights(cfg) != first
    assert judge_weights(compose_run("dataset=mt_bench")) == {}  # judge=none


class _ChatServer(BaseHTTPRequestHandler):
    """OpenAI chat completions: answers with the queued statuses first, then a rating."""

    statuses: list[int] = []
    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        status = type(self).statuses.pop(0) if type(self).statuses else 200
        payload = (
            {"error": {"message": "busy"}}
            if status != 200
            else {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Good answer. Rating: [[9]]"}}]}
        )
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def chat_server():
    server = HTTPServer(("127.0.0.1", 0), _ChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _ChatServer.statuses, _ChatServer.requests = [], []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_openai_compatible_backend_retries_429_and_500(chat_server, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
    cfg = JudgeConfig(
        name="openai",
        model="judge-model",
        base_url=chat_server,
        api_key_env="TEST_JUDGE_KEY",
        max_new_tokens=64,
        max_retries=3,
        backoff_s=0.5,
    )
    waits = []
    _ChatServer.statuses = [429, 500]
    text = openai_chat(cfg, sleep=waits.append)([{"role": "user", "content": "rate"}])
    assert parse_rating(text) == 9.0
    assert waits == [0.5, 1.0]  # exponential back-off
    assert len(_ChatServer.requests) == 3
    first = _ChatServer.requests[0]
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer sk-test"
    assert first["body"]["model"] == "judge-model" and first["body"]["temperature"] == 0.0
    assert first["body"]["max_tokens"] == 64

    _ChatServer.statuses = [400]
    with pytest.raises(SpecReproError, match="HTTP 400"):
        openai_chat(cfg, sleep=waits.append)([{"role": "user", "content": "rate"}])
    _ChatServer.statuses = [503, 503, 503, 503]
    with pytest.raises(SpecReproError, match="HTTP 503"):
        openai_chat(cfg, sleep=lambda s: None)([{"role": "user", "content": "rate"}])


def test_openai_backend_without_key_is_one_clear_error(monkeypatch):
    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    with pytest.raises(SpecReproError, match="NO_SUCH_JUDGE_KEY"):
        openai_chat(JudgeConfig(name="openai", model="m", api_key_env="NO_SUCH_JUDGE_KEY"))


def test_a_local_judge_without_a_chat_template_is_one_clear_error():
    """A base model's tokenizer has no chat template: apply_chat_template raised a ValueError's traceback after
    the whole run was decoded."""

    class BaseModelLoader:
        def load_model(self, cfg):
            return LoadedModel(model=tiny_llama(), tokenizer=SimpleNamespace(chat_template=None), name=cfg.name)

    cfg = OmegaConf.create({"name": "local", "model": {"name": "llama2_13b"}})
    with pytest.raises(SpecReproError, match="^judge model 'llama2_13b' has no chat template"):
        local_chat(cfg, BaseModelLoader())


LOCAL_JUDGE = [
    "judge=local",
    "judge.model.name=tiny_random",
    "judge.model.source=random",
    "judge.model.tokenizer=embedded",
    "judge.max_new_tokens=12",
]


def test_local_judge_run_reports_unparsed_fraction_and_reuses_judgments(tmp_path):
    args = ["run", *FAST, "dataset=mt_bench", "dataset.limit=2", "logger=none", *LOCAL_JUDGE]
    specrepro(*args, cwd=tmp_path)
    (run_dir,) = run_dirs(tmp_path).values()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    judgments = [json.loads(line) for line in (run_dir / "judgments.jsonl").read_text().splitlines()]
    assert len(judgments) == metrics["mt_bench_judgments"] == 4  # 2 questions x 2 turns
    unparsed = sum(j["rating"] is None for j in judgments) / 4
    assert metrics["mt_bench_unparsed"] == unparsed  # a random judge rarely rates: reported, not dropped
    cached = sorted((tmp_path / "results" / "judgments").glob("*/*.json"))
    assert len(cached) == 4
    assert json.loads(cached[0].read_text())["hardware"]["device"] == "cpu"  # part of each judgment's key

    proc = specrepro(*args, "resume=false", cwd=tmp_path)
    assert "4 cached" in proc.stderr + proc.stdout
    assert sorted((tmp_path / "results" / "judgments").glob("*/*.json")) == cached
