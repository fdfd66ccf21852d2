"""The lab: what measures DeltaGPT and DeltaLlama rather than ships with them (not part of the `ddl-hf` wheel).

    benchmarks/   speed and memory, each model side by side with its baseline:  python -m ddl_lab.benchmarks.<tool>
    studies/      does Deep Delta Learning help, and why (docs/studies.md):      python -m ddl_lab.studies.<study>
    checks/       correctness where CI cannot look (a GPU, the authors' code):  python -m ddl_lab.checks.<check>
    common.py     provenance, the results writer, timing with the A/A floor
    builders.py   the models they build: benchmark shapes, baseline / Delta pairs, tiny models

Run every tool from the repository root (`--help` lists its options; most have a `--quick`); each writes its results,
with the command that made them, beside it in `results/`.
"""
