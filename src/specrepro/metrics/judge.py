"""MT-Bench single-answer grading (FastChat `llm_judge`): a judge model rates each answer 1-10.

Protocol (FastChat gen_judgment.py, mode "single"): turn 1 is judged with `single-v1`, turn 2 with
`single-v1-multi-turn` (the whole conversation, rating the second answer); math, reasoning and coding are
reference-guided (`single-math-v1`, `single-math-v1-multi-turn`, GPT-4 reference answers). The rating is
the first number from 1 to 10 in "[[x]]" (else "[x]"); a judgment with none counts in `mt_bench_unparsed`
and in no score.
A weak local judge may be given the cue "Rating: [[" after its free judgment (`judge.force_rating`);
ratings obtained that way are counted in `mt_bench_forced`.

Backends: `local`, a Hugging Face model decoding greedily (default the embedded model: weak but real), and
`openai`, any OpenAI-compatible chat-completions endpoint (plain urllib, retries with exponential
back-off on 429/5xx/network errors). Every judgment is cached under
`<cache dir>/<judge>/<hash of the request>.json`, so a re-run never pays twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from specrepro.data.files import resolve_path
from specrepro.errors import SpecReproError
from specrepro.tracking import atomic_write

log = logging.getLogger(__name__)

JUDGE_PROMPTS = "mt_bench/judge_prompts.jsonl"
NEED_REF_CATEGORIES = ("math", "reasoning", "coding")  # FastChat NEED_REF_CATS
_RATING = re.compile(r"\[\[(\d+\.?\d*)\]\]")
_RATING_BACKUP = re.compile(r"\[(\d+\.?\d*)\]")
_RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}
FORCED_RATING_CUE = "\n\nRating: [["


@dataclass
class JudgeConfig:
    name: str = "none"  # none (MT-Bench runs get speed metrics only) | local | openai
    model: Any = None  # local: a model config (conf/model/*); openai: the API's model id
    base_url: str = "https://api.openai.com/v1"  # openai: any OpenAI-compatible server
    api_key_env: Optional[str] = "OPENAI_API_KEY"  # openai: the environment variable holding the key; null = none
    max_new_tokens: int = 2048  # FastChat: 2048
    temperature: float = 0.0  # FastChat: 0
    max_retries: int = 5  # openai: retries after the first try
    backoff_s: float = 2.0  # openai: first wait; doubles each retry
    timeout_s: float = 120.0  # openai: per request
    cache_dir: Optional[str] = None  # default: <results_dir>/judgments
    # local: when the free judgment has no rating, append FORCED_RATING_CUE and let the judge complete it
    # (counted in mt_bench_forced; a rating that still cannot be parsed counts in mt_bench_unparsed)
    force_rating: bool = False


def parse_rating(judgment: str) -> Optional[float]:
    """The first rating on MT-Bench's 1-10 scale in "[[x]]" (FastChat's pattern), else in "[x]"; None when there is
    none (a "[[85]]" or a cited "[2023]" is no rating)."""
    for pattern in (_RATING, _RATING_BACKUP):
        ratings = [float(number) for number in pattern.findall(judgment) if 1 <= float(number) <= 10]
        if ratings:
            return ratings[0]
    return None


def judge_prompts() -> dict[str, dict]:
    lines = resolve_path(JUDGE_PROMPTS).read_text().splitlines()
    return {p["name"]: p for p in map(json.loads, lines) if p["type"] == "single"}


def judge_messages(
    prompts: dict, category: str, questions: list[str], answers: list[str], references: list[str], turn: int
) -> list[dict]:
    """The chat messages FastChat sends the judge for `turn` (0 or 1) of one question."""
    with_reference = category in NEED_REF_CATEGORIES
    if with_reference and len(references) < len(questions):
        raise SpecReproError(f"MT-Bench {category} question has no reference answer for turn {turn + 1}")
    name = ("single-math-v1" if with_reference else "single-v1") + ("-multi-turn" if turn else "")
    prompt = prompts[name]
    if turn == 0:
        fields = {"question": questions[0], "answer": answers[0]}
        if with_reference:
            fields["ref_answer_1"] = references[0]
    else:
        fields = {
            "question_1": questions[0],
            "answer_1": answers[0],
            "question_2": questions[1],
            "answer_2": answers[1],
        }
        if with_reference:
            fields.update(ref_answer_1=references[0], ref_answer_2=references[1])
    return [
        {"role": "system", "content": prompt["system_prompt"]},
        {"role": "user", "content": prompt["prompt_template"].format(**fields)},
    ]


# ---- backends: messages -> judgment text ----


def openai_chat(cfg, sleep: Callable[[float], None] = time.sleep) -> Callable[[list[dict]], str]:
    """Chat completions on an OpenAI-compatible endpoint, with retries and exponential back-off."""
    key = None
    if cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env)
        if not key:
            raise SpecReproError(f"judge=openai needs an API key in ${cfg.api_key_env} (or judge.api_key_env=null)")
    url = cfg.base_url.rstrip("/") + "/chat/completions"

    def chat(messages: list[dict]) -> str:
        body = json.dumps(
            {"model": cfg.model, "messages": messages, "temperature": cfg.temperature, "max_tokens": cfg.max_new_tokens}
        ).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        for attempt in range(cfg.max_retries + 1):
            try:
                request = urllib.request.Request(url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=cfg.timeout_s) as response:
                    return json.loads(response.read())["choices"][0]["message"]["content"]
            except urllib.error.HTTPError as exc:
                if exc.code not in _RETRY_STATUS or attempt == cfg.max_retries:
                    raise SpecReproError(f"judge endpoint {url}: HTTP {exc.code} {exc.reason}") from None
                reason = f"HTTP {exc.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt == cfg.max_retries:
                    raise SpecReproError(f"judge endpoint {url} unreachable: {exc}") from None
                reason = str(exc)
            wait = cfg.backoff_s * 2**attempt
            log.warning("judge endpoint: %s; retry %d/%d in %.1f s", reason, attempt + 1, cfg.max_retries, wait)
            sleep(wait)

    return chat


def local_chat(cfg, loader) -> Callable[[list[dict]], str]:
    """Greedy chat with a local Hugging Face model (the judge's `model` config), through our `ar` decoder."""
    from specrepro.decoding.ar import ARDecoder
    from specrepro.decoding.sampling import Sampling

    judge = loader.load_model(cfg.model)
    if judge.tokenizer is None:
        raise SpecReproError(f"judge model '{cfg.model.name}' has no tokenizer")
    if not judge.tokenizer.chat_template:
        raise SpecReproError(
            f"judge model '{cfg.model.name}' has no chat template (a base model): judge with a chat model, "
            "e.g. model@judge.model=llama2_13b_chat"
        )
    decoder = ARDecoder(judge.model, judge.tokenizer)

    def chat(messages: list[dict]) -> str:
        prompt = judge.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = judge.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        text = decoder.generate(ids, Sampling(), cfg.max_new_tokens, seed=0).text
        if cfg.force_rating and parse_rating(text) is None:
            cued = judge.tokenizer(prompt + text + FORCED_RATING_CUE, add_special_tokens=False)["input_ids"]
            text += FORCED_RATING_CUE + decoder.generate(cued, Sampling(), 4, seed=0).text
        return text

    return chat


def judge_label(cfg) -> str:
    """A directory name for the judge's cache: backend and model."""
    model = cfg.model.name if hasattr(cfg.model, "name") else str(cfg.model)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{cfg.name}-{model}")


class CachedJudge:
    """Judgments keyed by a hash of everything that determines them; the backend starts only on a miss."""

    def __init__(
        self,
        cfg,
        cache_dir: Path,
        backend: Callable[[], Callable[[list[dict]], str]],
        weights: dict | None = None,
        hardware: dict | None = None,
    ):
        self.dir = Path(cache_dir) / judge_label(cfg)
        self.identity = {
            "judge": judge_label(cfg),
            "model": _plain(cfg.model),
            "base_url": cfg.base_url if cfg.name == "openai" else None,
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "force_rating": cfg.force_rating,
        }
        if weights:  # a local judge's checkpoint content (identity.judge_weights); none keeps older keys valid
            self.identity["weights"] = weights
        if hardware:  # what a local judge runs on (device, dtype, kernels): a bf16 judge judges otherwise than fp32
            self.identity["hardware"] = hardware
        self._backend, self._chat = backend, None
        self.hits = self.misses = 0

    def __call__(self, messages: list[dict]) -> str:
        key = hashlib.sha256(json.dumps([self.identity, messages], sort_keys=True).encode()).hexdigest()[:24]
        path = self.dir / f"{key}.json"
        if path.is_file():
            self.hits += 1
            return json.loads(path.read_text())["judgment"]
        self.misses += 1
        if self._chat is None:
            self._chat = self._backend()
        judgment = self._chat(messages)
        atomic_write(path, json.dumps({**self.identity, "messages": messages, "judgment": judgment}, indent=1) + "\n")
        return judgment


def _plain(node):
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def grade(
    records, rows: list[dict], chat: Callable[[list[dict]], str], force_rating: bool = False
) -> tuple[dict, list[dict]]:
    """Judge every turn of sample 0 of each row; (metrics, per-judgment rows). `force_rating`: whether `chat`
    appends FORCED_RATING_CUE to a judgment without a rating (a local judge's `force_rating`); without it no
    judgment counts as forced, though a judge's own "...\n\nRating: [[8]]" holds the cue's text.

    metrics: mt_bench_score (mean rating over parsed judgments), mt_bench_<category>, mt_bench_turn_<t>,
    mt_bench_unparsed (fraction of judgments with no rating), mt_bench_forced (fraction rated only after
    FORCED_RATING_CUE), mt_bench_judgments (their number)."""
    prompts = judge_prompts()
    by_id = {record.id: record for record in records}
    judgments = []
    for row in rows:
        record = by_id[row["id"]]
        category = record.fields.get("category") or "general"
        answers = [turn["text"] for turn in row["samples"][0]]
        references = record.fields.get("reference_turns", [])
        for turn in range(len(answers)):
            messages = judge_messages(prompts, category, record.turns, answers, references, turn)
            text = chat(messages)
            free_text = text.split(FORCED_RATING_CUE)[0]
            judgments.append(
                {
                    "id": record.id,
                    "category": category,
                    "turn": turn + 1,
                    "rating": parse_rating(text),
                    "forced": force_rating and FORCED_RATING_CUE in text and parse_rating(free_text) is None,
                    "judgment": text,
                }
            )
    rated = [j for j in judgments if j["rating"] is not None]
    metrics = {
        "mt_bench_judgments": len(judgments),
        "mt_bench_unparsed": (len(judgments) - len(rated)) / len(judgments) if judgments else float("nan"),
        "mt_bench_forced": _mean(float(j["forced"]) for j in judgments),
        "mt_bench_score": _mean(j["rating"] for j in rated),
    }
    for category in sorted({j["category"] for j in judgments}):
        metrics[f"mt_bench_{category}"] = _mean(j["rating"] for j in rated if j["category"] == category)
    for turn in sorted({j["turn"] for j in judgments}):
        metrics[f"mt_bench_turn_{turn}"] = _mean(j["rating"] for j in rated if j["turn"] == turn)
    return metrics, judgments


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def judge_run(cfg, records, rows: list[dict], loader, run_dir: Path) -> dict:
    """The MT-Bench metrics of a finished run under `cfg.judge` ({} when judge=none); writes judgments.jsonl."""
    from specrepro.identity import judge_weights

    judge_cfg = cfg.judge
    if judge_cfg.name == "none":
        return {}
    if judge_cfg.name == "local":
        backend = lambda: local_chat(judge_cfg, loader)  # noqa: E731  (load the judge only on a cache miss)
    elif judge_cfg.name == "openai":
        backend = lambda: openai_chat(judge_cfg)  # noqa: E731
    else:
        raise SpecReproError(f"judge.name must be none, local or openai; got '{judge_cfg.name}'")
    cache_dir = Path(judge_cfg.cache_dir or Path(cfg.results_dir) / "judgments")
    hardware = _plain(cfg.hardware) | {"device": str(loader.device)} if judge_cfg.name == "local" else None
    judge = CachedJudge(judge_cfg, cache_dir, backend, judge_weights(cfg), hardware)
    metrics, judgments = grade(records, rows, judge, judge_cfg.name == "local" and judge_cfg.force_rating)
    atomic_write(Path(run_dir) / "judgments.jsonl", "".join(json.dumps(j) + "\n" for j in judgments))
    log.info(
        "MT-Bench: %d judgments (%d cached), %.0f%% unparsed",
        len(judgments),
        judge.hits,
        100 * metrics["mt_bench_unparsed"],
    )
    return {**metrics, "mt_bench_judge": judge_label(judge_cfg)}
