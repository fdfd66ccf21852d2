"""`ddl-hf convert` (also the console command `convert-gpt2-to-delta-gpt`) and `ddl-hf upgrade`: arguments in, report
or one error out.

GPT-2 sources become DeltaGPT, Llama / Mistral / Qwen2 / Qwen3 sources DeltaLlama: `convert_checkpoint` picks the
family from the source's config. The only place in the conversion package that prints; the flags are defined in
`ddl_hf_cli` (no torch import).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from ..configuration_delta_gpt import DELTA_EMBED_EXPANDS, DELTA_GATES, DELTA_STATE_READS, DELTA_VALUES
from .converting import looks_like_path
from .errors import ConversionError
from .families import ResolvedSource, resolve_source, source_model_type
from .hub import convert_checkpoint, push_converted_to_hub
from .upgrade import upgrade_checkpoint


def run_cli(args: argparse.Namespace) -> int:
    """Run `convert` from parsed arguments; print the report, or one clear error line. Returns the exit code.

    `kill PID` is handled like Ctrl-C (`convert_checkpoint` turns SIGTERM into KeyboardInterrupt while it writes).
    """
    try:
        source = resolve_source(args.source)  # the one read of the source's config in this run
        command = recorded_command(args, source)
    except ConversionError as error:  # the source's config cannot be read, or is of no family that converts
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.push_to_hub and not args.base_model and os.path.exists(args.source):
        print(
            f"note: {args.source} is a local path, so the model card has no base_model; pass --base-model HUB_ID "
            "to link the Hub repository to the model it was converted from.",
            file=sys.stderr,
        )
    try:
        report = convert_checkpoint(
            source,
            args.output,
            delta_mode=args.delta_mode,
            value_channels=args.value_channels,
            beta_init=args.beta_init,
            delta_gate=args.gate,
            delta_state_read=args.state_read,
            delta_embed_expand=args.embed_expand,
            delta_conv_size=args.conv_size,
            delta_value=args.value,
            delta_value_scale=args.value_scale,
            delta_shared_read=args.shared_read,
            delta_erase=not args.no_erase,
            dtype=args.dtype,
            force=args.force,
            max_shard_size=args.max_shard_size,
            base_model=args.base_model,
            progress=not args.quiet,
            command=command,
            hub_repo_id=args.push_to_hub,
        )
    except (ConversionError, KeyboardInterrupt, OSError) as error:
        return write_failed(error, "the conversion of " + args.source, args.output)
    print(report)
    files = sorted(p.name for p in Path(args.output).iterdir())
    print(f"Wrote {args.output}: {', '.join(files)}")
    if args.push_to_hub:
        try:
            url = push_converted_to_hub(args.output, args.push_to_hub, private=args.private or None)
        except Exception as error:  # network, auth, permissions: the local output is complete either way
            print(
                f"error: upload to {args.push_to_hub} failed: {error}. {args.output} is complete; retry with "
                f"`hf upload {args.push_to_hub} {args.output}` after `hf auth login`.",
                file=sys.stderr,
            )
            return 1
        print(f"Uploaded to {url}")
    return 0


def run_upgrade_cli(args: argparse.Namespace) -> int:
    """Run `upgrade` from parsed arguments; print what was written, or one clear error line. Returns the exit code."""
    try:
        report = upgrade_checkpoint(args.source, args.output, force=args.force)
    except (ConversionError, KeyboardInterrupt, OSError) as error:
        return write_failed(error, "the upgrade of " + args.source, args.output)
    print(report)
    return 0


def write_failed(error: BaseException, what: str, output: str) -> int:
    """One error line for a conversion or upgrade that stopped before its atomic write (nothing is left at `output`);
    returns the exit code (130 for an interrupt, as the shell's)."""
    if isinstance(error, ConversionError):
        print(f"error: {error}", file=sys.stderr)
    elif isinstance(error, KeyboardInterrupt):
        print(f"error: interrupted; nothing was written to {output}.", file=sys.stderr)
        return 130
    elif error.errno == errno.ENOSPC:
        print(
            f"error: disk full while writing {what} ({error}). Nothing was written to {output}; free space on that "
            "filesystem or choose another --output.",
            file=sys.stderr,
        )
    else:
        print(f"error: cannot write {output}: {error}. Nothing was written.", file=sys.stderr)
    return 1


def recorded_command(args: argparse.Namespace, source: ResolvedSource | None = None) -> str:
    """The command the model card shows: `convert-gpt2-to-delta-gpt` for a GPT-2 source, `ddl-hf convert` for a
    Llama-family one, with the flags that differ from their defaults and no machine paths.

    `source` is the run's resolved source (read here from `args.source` if not given: the same reader as the
    conversion, so the same errors, and a family that does not convert is refused before any output).
    """
    family = source_model_type((source or resolve_source(args.source)).config)
    program = "convert-gpt2-to-delta-gpt" if family == "gpt2" else "ddl-hf convert"
    source_shown = f"path/to/{family}" if looks_like_path(args.source) else args.source  # no machine paths
    return (
        f"{program} --source {source_shown} --output OUT --delta-mode {args.delta_mode} "
        f"--value-channels {args.value_channels} --beta-init {args.beta_init:g} --dtype {args.dtype}"
        + (f" --gate {args.gate}" if args.gate != DELTA_GATES[0] else "")
        + "".join(
            f" --{flag} {value}"
            for flag, value, default in (
                ("state-read", args.state_read, DELTA_STATE_READS[0]),
                ("embed-expand", args.embed_expand, DELTA_EMBED_EXPANDS[0]),
                ("conv-size", args.conv_size, 4),
                ("value", args.value, DELTA_VALUES[0]),
                ("value-scale", f"{args.value_scale:g}", "4"),
            )
            if value != default
        )
        + (" --shared-read" if args.shared_read else "")
        + (" --no-erase" if args.no_erase else "")
    )


__all__ = ["recorded_command", "run_cli", "run_upgrade_cli"]
