"""Attention kernels side by side: SDPA as transformers runs it, with SDPA's own GQA on CPU, and
`hardware.row_invariant`'s.

The row-invariant attention (models/attention.py) runs every forward after a cache one query row at a time, in
fp32 on the upcast query, keys and values. Prints, in one process (interleaved, medians of repeats), the
1-token forward time of each on a 200-token cache, the cost of a T-token forward relative to each one's own
1-token forward (the verify cost), and `ar` throughput on GSM8K prompts with both (outputs may differ: the two
round differently). `sdpa_repeat_kv` is transformers' own choice, which copies the keys and values of every layer
n_rep times for a multi-token forward; `sdpa` (the harness's) lets SDPA group the heads itself (`enable_gqa`,
bit-identical). The oneDNN linear kernel throughout, its inputs padded to `hardware.linear_min_rows` rows in every
setting, as runs pad them: `hardware.row_invariant` pads one row to at least two, which alone makes a 1-token
forward slower at `linear_min_rows=1`, so the settings differ in attention only.

    .venv/bin/python experiments/bench_attention.py --threads 1                   # bf16
    .venv/bin/python experiments/bench_attention.py --threads 1 --dtype float32
"""

from __future__ import annotations

from functools import partial

from bench_kernels import benchmark_args, compare_settings
from specrepro.config import HardwareConfig
from specrepro.models.attention import ATTENTIONS, set_attention
from specrepro.models.kernels import set_linear_kernel


def use(attention: str, model, cpu_gqa: bool = True) -> None:
    min_rows = HardwareConfig().linear_min_rows
    set_linear_kernel(model, "onednn", min_rows, row_invariant=attention == "row_invariant")
    set_attention(model, attention, cpu_gqa)


if __name__ == "__main__":
    settings = {"sdpa_repeat_kv": partial(use, "sdpa", cpu_gqa=False)}
    settings.update({kind: partial(use, kind) for kind in ATTENTIONS})
    compare_settings(settings, benchmark_args(__doc__.splitlines()[0], "bfloat16"))
