"""The SLURM preset (conf/hydra/launcher/slurm.yaml), without a cluster: hydra's submitit launcher is run as a
sweep runs it, and the job script submitit would hand to sbatch is rendered instead of submitted."""

from __future__ import annotations

import os

import submitit
from hydra import compose, initialize_config_dir
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

from specrepro.cli import CONF_DIR
from specrepro.config import register_configs


def test_the_slurm_preset_puts_each_jobs_resources_in_its_sbatch_script(tmp_path, monkeypatch):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="run",
            return_hydra_config=True,
            overrides=[
                "hydra/launcher=slurm",
                "hydra.launcher.partition=gpu",
                "hydra.launcher.mem_gb=48",
                f"hydra.sweep.dir={tmp_path}",
                "hydra.job.name=specrepro",
            ],
        )
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    del params["_target_"]
    scripts = []

    def render(executor, function, *job_arguments):  # instead of sbatch: the script it would get
        scripts.append(executor._executor._make_submission_file_text("srun python -m specrepro.cli run", "uid"))
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", render)
    fake_bin = tmp_path / "bin"  # submitit checks that `srun` exists before it builds a SLURM executor
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    launcher = SlurmLauncher(**params)
    launcher.config = cfg
    launcher.launch([["method=ar"], ["method=pld"]], initial_job_idx=0)
    script = scripts[0]
    for line in (
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=48GB",
        "#SBATCH --time=240",
        "#SBATCH --partition=gpu",
        "#SBATCH --job-name=specrepro",
        "export WANDB_MODE=offline",
    ):
        assert line in script, (line, script)
