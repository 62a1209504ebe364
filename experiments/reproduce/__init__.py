"""The reproduce pipelines (`experiments/reproduce/` in a checkout), shipped as the package specrepro.pipelines."""
