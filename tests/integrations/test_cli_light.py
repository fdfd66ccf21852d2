"""The console commands answer `--help` fast, under their own names, without importing torch; errors are one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ddl_hf_cli

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
HELP_BOUND_S = 3.0  # the goal is 1.5 s on 2 cores; generous for a loaded CI machine


def _run(code: str, stdin=subprocess.DEVNULL) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=stdin
    )
    return done, time.perf_counter() - start


def _main(argv: list[str]) -> str:
    """Code that runs `ddl-hf` with `argv` and exits with its status."""
    return f"import sys, ddl_hf_cli; sys.exit(ddl_hf_cli.main({argv!r}))"


@pytest.mark.parametrize(
    ("entry", "argv", "prog"),
    [
        ("main", [], "ddl-hf"),
        ("main", ["convert"], "ddl-hf convert"),
        ("main", ["inspect"], "ddl-hf inspect"),
        ("convert_main", [], "convert-gpt2-to-delta-gpt"),
    ],
)
def test_help_is_fast_names_its_command_and_imports_no_torch(entry, argv, prog):
    code = (
        "import sys, ddl_hf_cli\n"
        "sys.argv[0] = 'ddl-hf'\n"
        f"try:\n    ddl_hf_cli.{entry}({[*argv, '--help']!r})\n"
        "except SystemExit as e:\n"
        "    heavy = sorted(m for m in ('torch', 'transformers', 'ddl_hf') if m in sys.modules)\n"
        "    print('HEAVY', heavy, 'EXIT', e.code)\n"
    )
    done, seconds = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {prog} "), done.stdout[:200]
    assert "HEAVY [] EXIT 0" in done.stdout
    assert seconds < HELP_BOUND_S, f"{prog} --help took {seconds:.2f} s"


def test_every_flag_has_help_text():
    for parser in (ddl_hf_cli.build_convert_parser(), *_subparsers(ddl_hf_cli.build_parser())):
        for action in parser._actions:
            assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help text"


def _subparsers(parser):
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            yield from action.choices.values()


def test_choice_mirrors_match_the_config_constants():
    from ddl_hf.configuration_delta_gpt import (
        DELTA_EMBED_EXPANDS,
        DELTA_GATES,
        DELTA_MODES,
        DELTA_STATE_READS,
        DELTA_VALUES,
        DeltaGPTConfig,
    )
    from ddl_hf.conversion.converting import DTYPES
    from ddl_hf.conversion.hub import DEFAULT_MAX_SHARD_SIZE

    assert ddl_hf_cli.DELTA_MODES == DELTA_MODES
    assert ddl_hf_cli.DELTA_GATES == DELTA_GATES
    assert ddl_hf_cli.DELTA_STATE_READS == DELTA_STATE_READS
    assert ddl_hf_cli.DELTA_EMBED_EXPANDS == DELTA_EMBED_EXPANDS
    assert ddl_hf_cli.DELTA_VALUES == DELTA_VALUES
    args = ddl_hf_cli.build_parser().parse_args(["convert", "--source", "s", "--output", "o"])
    assert args.conv_size == DeltaGPTConfig().delta_conv_size  # the CLI default is the config's
    assert tuple(DTYPES) == ddl_hf_cli.DTYPE_NAMES
    assert ddl_hf_cli.DEFAULT_MAX_SHARD_SIZE == DEFAULT_MAX_SHARD_SIZE


def _one_error_line(stderr: str) -> str:
    """Our part of stderr: one `error: ` line, last, and no traceback. Lines before it are tolerated: what another
    package logs at import depends on the machine (bitsandbytes warns on AVX512-BF16 CPUs); that the commands import
    none of the optional integrations is `test_failing_commands_import_no_optional_integration`'s to prove."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("error: ")]
    assert len(ours) == 1 and lines[-1] == ours[0], stderr
    assert "Traceback" not in stderr
    return ours[0]


#: Integrations that only some functions need; `import ddl_hf` and the commands import none of them until one runs.
OPTIONAL_INTEGRATIONS = ("peft", "bitsandbytes", "trl", "matplotlib", "datasets", "onnx", "onnxscript", "onnxruntime")
OPTIONAL_INTEGRATIONS += ("fla",)  # the DeltaNet kernels: registered when installed, imported on first use (not
# Triton: torch itself imports it when installed)


def _optional_modules_after(code: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `code` in a fresh interpreter, then list the optional integrations it imported (even when it failed)."""
    probe = (
        "import atexit, sys\n"
        f"optional = {OPTIONAL_INTEGRATIONS!r}\n"
        "atexit.register(lambda: print('OPTIONAL', *sorted(m for m in optional if m in sys.modules)))\n"
        f"{code}\n"
    )
    done, _ = _run(probe)
    line = next(line for line in done.stdout.splitlines() if line.startswith("OPTIONAL"))
    return done, line.split()[1:]


def test_import_ddl_hf_imports_no_optional_integration():
    """peft imports bitsandbytes (seconds; on AVX512-BF16 CPUs a warning at import): the models do not need either."""
    done, optional = _optional_modules_after("import ddl_hf\nddl_hf.DeltaGPTConfig(); ddl_hf.convert_gpt2")
    assert done.returncode == 0, done.stderr
    assert optional == []


def test_failing_commands_import_no_optional_integration(tmp_path):
    for argv in (
        ["inspect", "./does-not-exist", "--text", str(tmp_path / "missing.txt")],
        ["convert", "--quiet", "--source", "./does-not-exist", "--output", str(tmp_path / "out")],
        ["upgrade", "./does-not-exist", "--output", str(tmp_path / "up")],
    ):
        done, optional = _optional_modules_after(_main(argv))
        assert done.returncode == 1, (argv, done.stderr)
        assert optional == [], argv


@pytest.mark.parametrize("order", ["peft-first", "ddl_hf-first"])
def test_peft_default_targets_are_registered_whichever_is_imported_first(order):
    imports = ["import peft", "import ddl_hf"]
    code = "\n".join(imports if order == "peft-first" else imports[::-1]) + (
        "\nfrom peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as lora"
        "\nprint('LORA', lora['delta_gpt'], lora['delta_llama'])"
    )
    done, _ = _run(code)
    assert done.returncode == 0, done.stderr
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as lora

    from ddl_hf.peft_targets import delta_gpt_targets, delta_llama_targets

    expected = f"LORA {delta_gpt_targets(lora['gpt2'])} {delta_llama_targets(lora['llama'])}"
    assert expected in done.stdout.splitlines(), done.stdout


def _failure_line(argv: list[str]) -> str:
    """`ddl-hf` with `argv` in a fresh interpreter: it exits 1, and its one error line (returned)."""
    done, _ = _run(_main(argv))
    assert done.returncode == 1, (argv, done.stderr)
    return _one_error_line(done.stderr)


def test_inspect_missing_text_file_is_one_error_line(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    line = _failure_line(["inspect", str(model_dir), "--text", "missing.txt"])
    assert "missing.txt" in line and "--text" in line


def test_inspect_missing_model_directory_is_one_error_line(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world", encoding="utf-8")
    line = _failure_line(["inspect", "./does-not-exist", "--text", str(text)])
    assert "no such model directory: ./does-not-exist" in line


def test_inspect_non_delta_directory_is_one_error_line(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world", encoding="utf-8")
    assert "cannot inspect" in _failure_line(["inspect", str(tmp_path), "--text", str(text)])


def test_usage_errors_exit_2_with_an_error_line():
    done, _ = _run("import ddl_hf_cli; ddl_hf_cli.convert_main(['--output', 'x'])")
    assert done.returncode == 2
    assert "convert-gpt2-to-delta-gpt: error: the following arguments are required: --source" in done.stderr


def test_offline_hub_id_fails_in_seconds_and_names_the_fix(tmp_path, monkeypatch):
    """The network is unreachable here (and HF_HUB_OFFLINE=1 covers machines where it is not): no 30 s of retries."""
    import ddl_hf
    from ddl_hf.conversion import converting

    monkeypatch.setattr(converting, "HUB_PROBE_TIMEOUT_S", 2.0)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache" / "hub"))
    if converting.hub_reachable():
        monkeypatch.setattr(converting, "hub_reachable", lambda timeout=2.0: False)
    start = time.perf_counter()
    with pytest.raises(ddl_hf.ConversionError) as caught:
        ddl_hf.convert_gpt2("gpt2")
    seconds = time.perf_counter() - start
    assert seconds < 5.0, f"offline error took {seconds:.1f} s"
    message = str(caught.value)
    assert "unreachable" in message and "local GPT-2 directory" in message and "HF_HUB_OFFLINE" in message


def test_hub_offline_env_skips_the_probe(monkeypatch):
    from huggingface_hub import constants

    from ddl_hf.conversion import converting

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(converting.socket, "create_connection", lambda *a, **k: pytest.fail("probed the network"))
    assert converting.hub_reachable() is False
    assert converting.hub_kwargs("gpt2") == {"local_files_only": True}


def test_convert_missing_local_source_says_no_such_directory(tmp_path):
    line = _failure_line(["convert", "--quiet", "--source", "./does-not-exist", "--output", str(tmp_path / "out")])
    assert "No such directory: './does-not-exist'" in line and "Hub id" in line
    assert "repo id" not in line.lower()
    assert not (tmp_path / "out").exists()


def test_the_package_never_imports_the_command_line_module_back():
    """One direction: `ddl_hf_cli` calls into the package when a command runs; no module of the package imports
    `ddl_hf_cli` (which would make the two a circle)."""
    import ast

    importers = []
    for path in sorted((ROOT / "ddl_hf").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(name.split(".")[0] == "ddl_hf_cli" for name in names):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == []
