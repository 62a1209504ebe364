"""The Hydra configs (`conf/` in a checkout), shipped as the package specrepro.conf."""
