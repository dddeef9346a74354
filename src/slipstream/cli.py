"""The ``slipstream`` command: inspect, verify, convert and export checkpoints.

slipstream inspect CKPT            keys, dtypes, shapes, sizes
slipstream verify CKPT             read every byte and check every checksum
slipstream convert CKPT OUT.safetensors   consolidate tensors into one safetensors file
slipstream export CKPT OUT_DIR     the model's weights as a Hugging Face model directory

CKPT is a local directory or a URL (s3://, gs://, az://). Exit statuses: 0 done (verify:
every byte checked against checksums); 1 the checkpoint failed (corrupt, missing,
unreadable, unsafe); 2 a usage error (bad arguments, an output path that cannot be
written, a missing optional package); 3 verify read everything, but the checkpoint has no
checksums (written by another tool, or its .slipstream.json removed): only its structure
and sizes were checked.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import __version__
from .checkpoint.load.contents import read_all, summarize, tensor_bytes, verify
from .errors import SlipstreamError
from .progress import Progress

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNVERIFIED = 3


class UsageError(Exception):
    """What the command was given cannot be used (exit status 2); the message names it."""


def _trust(args: argparse.Namespace) -> bool | list[str]:
    return True if args.trust_all else list(args.trust)


def _progress(label: str, args: argparse.Namespace) -> Progress:
    return Progress(label, tensor_bytes(args.checkpoint, trusted=_trust(args)))


def _inspect(args: argparse.Namespace) -> int:
    entries, checksummed = summarize(args.checkpoint, trusted=_trust(args))
    total = sum(e.nbytes for e in entries)
    width = max((len(e.key) for e in entries), default=3)
    for e in entries:
        if e.kind == "tensor":
            print(f"{e.key:<{width}}  {e.dtype:<9} {list(e.shape)!s:<20} chunks={e.chunks}")
        else:
            print(f"{e.key:<{width}}  value")
    print(
        f"{len(entries)} entries, {total / 2**20:.1f} MiB of tensors, "
        f"checksums: {'yes (slipstream index)' if checksummed else 'no (written by another tool)'}"
    )
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    with _progress("verify", args) as progress:
        report = verify(args.checkpoint, trusted=_trust(args), progress=progress.advance)
    seconds = time.perf_counter() - start
    read = (
        f"read {report.entries} entries, {report.tensor_bytes / 2**20:.1f} MiB of tensors from "
        f"{report.files} file(s) of {report.file_bytes / 2**20:.1f} MiB in {seconds:.2f} s"
    )
    if report.checksummed:
        print(
            f"verified {args.checkpoint}: {read}; {report.checksummed_blocks} checksummed "
            f"blocks and {report.checksummed_values} value(s) match: OK"
        )
        return EXIT_OK
    print(
        f"NOT verified {args.checkpoint}: {read}; it has no checksums (written by another "
        "tool, or its .slipstream.json removed): structure and sizes only (every file "
        "present and long enough, every record readable), the bytes themselves unchecked"
    )
    return EXIT_UNVERIFIED


def _convert(args: argparse.Namespace) -> int:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UsageError("convert needs safetensors: pip install 'slipstream[convert]'") from None
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise UsageError(f"the output directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK):
        raise UsageError(f"the output directory {out_dir} is not writable")
    start = time.perf_counter()
    with _progress("read", args) as progress:
        entries = read_all(args.checkpoint, trusted=_trust(args), progress=progress.advance)
    tensors = {k: v.contiguous() for k, v in entries.items() if hasattr(v, "dtype")}
    skipped = sorted(k for k in entries if k not in tensors)
    read_s = time.perf_counter() - start
    save_file(tensors, args.output)
    print(
        f"wrote {len(tensors)} tensors to {args.output} (read {read_s:.2f} s, "
        f"total {time.perf_counter() - start:.2f} s)"
    )
    if skipped:
        print(f"skipped {len(skipped)} non-tensor entries: {', '.join(skipped[:10])}")
    return EXIT_OK


def _checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory or URL (slipstream or DCP)")


def _trust_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="MODULE.NAME",
        help="a class or function the checkpoint's values may use beyond plain data "
        "(repeatable); only for checkpoints you trust",
    )
    parser.add_argument(
        "--trust-all",
        action="store_true",
        help="unpickle values without an allow-list, running any code they name "
        "(as dcp.load does); only for checkpoints you trust",
    )


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, help line, arguments and what it runs (an exit status)."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    _checkpoint_argument(parser)
    _trust_arguments(parser)


def _convert_arguments(parser: argparse.ArgumentParser) -> None:
    _checkpoint_argument(parser)
    parser.add_argument("output", help="the .safetensors file to write")
    _trust_arguments(parser)


def _export(args: argparse.Namespace) -> int:
    from .checkpoint.hf.export import DEFAULT_MAX_SHARD_SIZE, export_hf, parse_dtype, parse_size
    from .errors import CheckpointError

    try:
        max_shard_size = parse_size(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
        dtype = parse_dtype(args.dtype) if args.dtype else None
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    if args.config is not None and not os.path.isfile(args.config):
        raise UsageError(f"the config {args.config} does not exist")
    start = time.perf_counter()
    bars: list[Progress] = []

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(Progress("export", total))
        bars[0].advance(done - bars[0].done)

    try:
        result = export_hf(
            args.checkpoint,
            args.output,
            prefix=args.prefix,
            dtype=dtype,
            max_shard_size=max_shard_size,
            config=args.config,
            progress=progress,
        )
    finally:
        for bar in bars:
            bar.close()
    print(
        f"wrote {len(result.weight_map)} tensors ({result.total_size / 2**20:.1f} MiB) from "
        f"the prefix {result.prefix!r} to {result.output_description()} in "
        f"{time.perf_counter() - start:.2f} s"
    )
    if result.tied:
        print(f"tied weights written once: {', '.join(sorted(result.tied))}")
    if result.architecture is not None:
        print(f"names and shapes match {result.architecture}")
    elif args.config is not None:
        print("transformers is not installed: names not checked against the config")
    if result.skipped:
        print(f"left out {len(result.skipped)} other checkpoint entries (e.g. optimizer state)")
    return EXIT_OK


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    _checkpoint_argument(parser)
    parser.add_argument("output", help="the directory to write (created if needed)")
    parser.add_argument(
        "--prefix", help="checkpoint key prefix of the model's weights, e.g. 'model.' (found)"
    )
    parser.add_argument("--dtype", help="cast floating tensors: bf16, fp16 or fp32")
    parser.add_argument("--max-shard-size", help="largest file, e.g. 500MB (default 5GB)")
    parser.add_argument("--config", help="a config.json to copy beside the weights and check")


COMMANDS: list[Command] = [
    Command("inspect", "list a checkpoint's entries", _checkpoint_arguments, _inspect),
    Command(
        "verify",
        "read every byte of a checkpoint and check its checksums (exit 3: it has none)",
        _checkpoint_arguments,
        _verify,
    ),
    Command(
        "convert",
        "write a checkpoint's tensors to one .safetensors file",
        _convert_arguments,
        _convert,
    ),
    Command(
        "export",
        "write a checkpoint's model weights as a Hugging Face model directory",
        _export_arguments,
        _export,
    ),
]
"""The subcommands, in the order ``--help`` lists them; a new one is one more entry."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Inspect, verify, convert and export checkpoints (slipstream- or DCP-written).",
        epilog="exit status: 0 done, 1 the checkpoint failed, 2 usage error, "
        "3 verify found no checksums to check (structure and sizes only)",
    )
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        cmd = sub.add_parser(command.name, help=command.help, description=command.help)
        command.arguments(cmd)
        cmd.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; errors are one line on stderr and an exit status, never a traceback."""
    args = build_parser().parse_args(argv)
    where = f"slipstream {args.command}"
    try:
        status: int = args.run(args)
        return status
    except (UsageError, ValueError) as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (SlipstreamError, OSError) as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
