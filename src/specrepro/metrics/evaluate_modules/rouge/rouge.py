"""ROUGE-L / ROUGE-2 F-measure (rouge-score, Porter stemming) as a local `evaluate` module.

Load it with `evaluate.load(<this directory>)`: no hub access. The scoring itself is
`specrepro.metrics.quality.rouge`, so per-sample and corpus scores share one definition.
"""

import datasets
import evaluate

from specrepro.metrics.quality import rouge


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Mean ROUGE-L and ROUGE-2 F-measure (rouge-score, use_stemmer=True).",
            citation="Lin, 2004. ROUGE: A Package for Automatic Evaluation of Summaries.",
            inputs_description="predictions: list of str; references: list of str (one per prediction).",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        scores = [rouge(prediction, reference) for prediction, reference in zip(predictions, references)]
        return {key: sum(s[key] for s in scores) / max(len(scores), 1) for key in ("rouge_l", "rouge_2")}
