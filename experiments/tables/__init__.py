"""The table specs (`experiments/tables/` in a checkout), shipped as the package specrepro.table_specs."""
