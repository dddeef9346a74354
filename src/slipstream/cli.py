"""The ``slipstream`` command: inspect, verify and convert checkpoints.

slipstream inspect CKPT_DIR            keys, dtypes, shapes, sizes
slipstream verify CKPT_DIR             read every byte and check every checksum
slipstream convert CKPT_DIR OUT.safetensors   consolidate tensors into one safetensors file
"""

from __future__ import annotations

import argparse
import sys
import time

from .checkpoint.inspect import read_all, summarize
from .errors import SlipstreamError


def _inspect(args) -> int:
    entries, checksummed = summarize(args.checkpoint)
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
    return 0


def _verify(args) -> int:
    start = time.perf_counter()
    entries = read_all(args.checkpoint)
    seconds = time.perf_counter() - start
    print(f"verified {len(entries)} entries of {args.checkpoint} in {seconds:.2f} s: OK")
    return 0


def _convert(args) -> int:
    try:
        from safetensors.torch import save_file
    except ImportError:
        print("convert needs safetensors: pip install 'slipstream[convert]'", file=sys.stderr)
        return 2
    start = time.perf_counter()
    entries = read_all(args.checkpoint)
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
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_text in (
        ("inspect", _inspect, "list a checkpoint's entries"),
        ("verify", _verify, "read every byte of a checkpoint and check its checksums"),
        ("convert", _convert, "write a checkpoint's tensors to one .safetensors file"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("checkpoint", help="a checkpoint directory (slipstream or DCP)")
        if name == "convert":
            cmd.add_argument("output", help="the .safetensors file to write")
        cmd.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except SlipstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
