"""The test suite: a regular package, so its helpers import as `tests.builders`, `tests.rounding`, ... from the
repository root (pytest's one `pythonpath` entry; a subprocess gets it as PYTHONPATH), and a `tests` package that some
wheel installs into site-packages cannot stand in for them. The test files' folders have no `__init__.py`: pytest
imports each test file under its own name, and no test file imports another."""
