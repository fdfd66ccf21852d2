"""Speed and memory benchmarks: each Delta model against its baseline of the same shape and weights, in one process,
as ratios next to an A/A floor. Run from the repository root as `python -m ddl_lab.benchmarks.<name> [--quick]`;
results in `ddl_lab/benchmarks/results/`."""
