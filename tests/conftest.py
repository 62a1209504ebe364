"""Shared fixtures: tiny random LLaMAs (milliseconds per step) and the embedded model (integration)."""

from __future__ import annotations

import itertools
import os
from unittest import mock

import pytest
import torch

from specrepro.config import RandomArchConfig
from specrepro.decoding.sampling import Sampling
from specrepro.models.kernels import set_linear_kernel
from specrepro.models.loading import random_llama

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if "PYTEST_XDIST_WORKER" in os.environ:  # `make test` runs a worker per core: one torch thread each, in the
    os.environ["OMP_NUM_THREADS"] = "1"  # CLI processes the tests start too (hardware.threads=null follows it)
    torch.set_num_threads(1)


def greedy_beside_ar(decoder, ar, prompts, budgets=(1, 6, 40), stop_at_eos=True):
    """Each of the decoder's greedy generations over `prompts` x `budgets`, asserted token for token equal to `ar`'s
    and counted consistently (every step commits its accepted drafts plus one token): stopping at the model's EOS
    (with `stop_at_eos`), then over the whole budget. A test adds its method's own checks on what this yields."""
    for eos_ids in (decoder.eos_ids, set()) if stop_at_eos else (set(),):
        decoder.eos_ids = ar.eos_ids = eos_ids
        for budget, prompt in itertools.product(budgets, prompts):
            reference = ar.generate(prompt, Sampling(), budget)
            generation = decoder.generate(prompt, Sampling(), budget)
            assert generation.token_ids == reference.token_ids
            assert sum(generation.accepted) + 1 == len(generation.token_ids)
            yield generation


SYNCING_OPS = ("aten::_local_scalar_dense", "aten::nonzero")  # `int()`, `.item()`, `bool()`; a mask's indices
# ops that check their input on the host on a CPU only (a GPU asserts on the device): their reads are not counted
HOST_CHECKS_ON_CPU_ONLY = ("aten::_assert_async", "aten::one_hot")


def host_reads(decoder, prompt, budget: int, sampling: Sampling | None = None) -> int:
    """How many times a generation (greedy unless `sampling` says) read tensor values to the host (each a sync on a
    GPU): by `int()`, `.item()`, `bool()`, `.tolist()` or `.cpu()`, or by ops whose output size is data (`nonzero`,
    indexing by a boolean mask). The CPU profiler sees all but `.tolist()` and `.cpu()` (no copy here), counted as
    they are called; a read inside an op that checks its input on the host only here is not counted."""
    calls = []

    def counted(method):
        def read(tensor, *args, **kwargs):
            calls.append(1)
            return method(tensor, *args, **kwargs)

        return read

    def checked_on_cpu_only(event) -> bool:
        while event is not None and event.name not in HOST_CHECKS_ON_CPU_ONLY:
            event = event.cpu_parent
        return event is not None

    with mock.patch.multiple(torch.Tensor, tolist=counted(torch.Tensor.tolist), cpu=counted(torch.Tensor.cpu)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            decoder.generate(prompt, sampling or Sampling(), budget)
    return len(calls) + sum(e.name in SYNCING_OPS and not checked_on_cpu_only(e) for e in prof.events())


def tiny_llama(vocab_size: int = 64, seed: int = 0, num_layers: int = 2, logit_scale: float = 1.0):
    """A tiny random LLaMA; logit_scale > 1 sharpens its next-token distributions. Its linears are oneDNN's, the
    default of `hardware.linear_kernel`, so that in-process tests run what users run (on this model only)."""
    model = random_llama(RandomArchConfig(vocab_size=vocab_size, seed=seed, num_layers=num_layers)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return set_linear_kernel(model, "onednn")


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache)."""
    from specrepro.models import load_model

    from specrepro.config import ModelConfig

    loaded = load_model(ModelConfig(name="smollm2_135m", source="embedded"), torch.device("cpu"), torch.float32)
    set_linear_kernel(loaded.model, "onednn")  # as tiny_llama's
    return loaded


@pytest.fixture(scope="module")
def target():
    """A tiny 64-token LLaMA: the target of the decoder tests."""
    return tiny_llama(vocab_size=64, seed=1)


@pytest.fixture(scope="module")
def draft():
    """A one-layer tiny LLaMA over the same vocabulary: their draft."""
    return tiny_llama(vocab_size=64, seed=2, num_layers=1)


# What makes a test slow: the embedded model (a fixture, or the `embedded` marker where it loads the model itself),
# a process of its own (the CLI, a pipeline, a notebook kernel, a build), found through the helpers it calls, or
# heavy work in process: a statistical test of sampling (test_lossless_sampling's `exact` distribution and its
# `p_value` over thousands of generations) or torch.compile tracing graphs (test_compiled). A test slow for
# another reason carries `@pytest.mark.slow` itself.
SLOW_FIXTURES = {"embedded", "exact"}
SLOW_CALLS = {"subprocess", "Popen", "nbclient", "NotebookClient", "p_value"}
SLOW_MODULES = {"tests/test_compiled.py"}


def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test that loads the embedded model, starts a process or does the heavy work above
    (`make test-fast` leaves them out), so that a new test is sorted by what it does, not by remembering a marker."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        functions = [getattr(item, "function", None)] + [
            defs[-1].func
            for name in getattr(item, "fixturenames", ())
            for defs in [fixtures.name2fixturedefs.get(name) if fixtures else None]
            if defs
        ]
        if (
            item.get_closest_marker("embedded")
            or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
            or item.nodeid.split("::")[0] in SLOW_MODULES
            or any(_starts_a_process(f, set()) for f in functions if f is not None)
        ):
            item.add_marker(pytest.mark.slow)


def _starts_a_process(function, seen: set) -> bool:
    """Whether `function` or a function of the tests it calls (at any depth) names one of `SLOW_CALLS`."""
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = set()
    todo = [code]
    while todo:
        current = todo.pop()
        names.update(current.co_names)
        todo += [const for const in current.co_consts if hasattr(const, "co_names")]
    if names & SLOW_CALLS:
        return True
    called = (getattr(function, "__globals__", {}).get(name) for name in names)
    return any(
        _starts_a_process(f, seen) for f in called if callable(f) and getattr(f, "__module__", "").startswith("tests")
    )
