"""A run's `ar` reference: the `ar` run on the same prompts, weights, hardware and decoding that its speedups and
`lossless` compare to (`identity.reference_key`), found among the complete runs or run first by the runner."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from specrepro.errors import SpecReproError
from specrepro.tracking import RunRecord, complete_runs


def find_reference(cfg: DictConfig, ref_key: str) -> RunRecord | None:
    """The newest complete `ar` run with the same reference key."""
    candidates = [
        run
        for run in complete_runs(cfg.results_dir)
        if run.metrics.get("method") == "ar" and run.metrics.get("reference_key") == ref_key
    ]
    return RunRecord(max(candidates, key=lambda run: (run.mtime, run.dir)).dir) if candidates else None


def reference_config(cfg: DictConfig) -> DictConfig:
    """The config of `cfg`'s `ar` reference: the same run with method `ar`, untimed beside anything. Resumed even
    under `resume=false`, which redoes the run asked for, not its reference: one that a parallel job finished while
    this one waited for its lock is reused, not decoded again under the records that job's run already used."""
    content = OmegaConf.to_container(cfg, resolve=True)
    content.update(method={"name": "ar"}, run_name=None, reference=False, resume=True)
    content["timing"].update(paired=False, torch_ar=False)
    return OmegaConf.create(content)


def reference_samples(reference: RunRecord, records: list) -> list[dict]:
    """The `ar` reference's samples; one line, before anything is decoded, when it lacks some record this run
    decodes (a complete record whose generations were cut or edited): no speedup or lossless left out unsaid."""
    rows = reference.rows()
    missing = sorted({record.id for record in records} - {row["id"] for row in rows})
    if missing:
        raise SpecReproError(
            f"the `ar` reference {reference.dir.name} is complete but has no samples for "
            f"{len(missing)} record(s) ({', '.join(map(str, missing[:3]))}): its generations.jsonl "
            f"was cut or edited; delete {reference.dir} to run it again"
        )
    return rows


def decoded_by_other_code(results_dir, setting: str, name: str) -> list[str]:
    """The names of the complete runs of this setting (`setting_key`) but not of this name: other code made them."""
    return sorted(
        run.dir.name
        for run in complete_runs(results_dir)
        if run.metrics.get("setting_key") == setting and run.dir.name != name
    )
