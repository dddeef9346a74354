"""The ``slipstream`` command: inspect, verify and convert checkpoints.

slipstream inspect CKPT_DIR            keys, dtypes, shapes, sizes
slipstream verify CKPT_DIR             read every byte and check every checksum
slipstream convert CKPT_DIR OUT.safetensors   consolidate tensors into one safetensors file
slipstream export CKPT_DIR OUT_DIR     the model's weights as a Hugging Face model directory
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


def _export(args) -> int:
    from .checkpoint.hf_export import DEFAULT_MAX_SHARD_SIZE, export_hf

    start = time.perf_counter()
    result = export_hf(
        args.checkpoint,
        args.output,
        prefix=args.prefix,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        config=args.config,
    )
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
    return 0


def _add_export(sub) -> None:
    cmd = sub.add_parser("export", help="write the model's weights as a Hugging Face directory")
    cmd.add_argument("checkpoint", help="a checkpoint directory (slipstream or DCP)")
    cmd.add_argument("output", help="the directory to write (created if needed)")
    cmd.add_argument(
        "--prefix", help="checkpoint key prefix of the model's weights, e.g. 'model.' (found)"
    )
    cmd.add_argument("--dtype", help="cast floating tensors: bf16, fp16 or fp32")
    cmd.add_argument("--max-shard-size", help="largest file, e.g. 500MB (default 5GB)")
    cmd.add_argument("--config", help="a config.json to copy beside the weights and check")
    cmd.set_defaults(fn=_export)


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
    _add_export(sub)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except SlipstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
