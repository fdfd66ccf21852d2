"""Checks that need what CI lacks: a GPU (`gpu_check`) or the authors' own modules (`compare_reference`). Run from the
repository root as `python -m ddl_lab.checks.<name>`; results in `ddl_lab/checks/results/`."""
