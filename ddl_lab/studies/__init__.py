"""The research studies: does Deep Delta Learning help, and why (docs/studies.md has each one's command, results and
commit). Run from the repository root as `python -m ddl_lab.studies.<name> [--quick]`; results in
`ddl_lab/studies/results/`."""
