"""HF safetensors <-> megatron-core distributed checkpoints (`torch_dist`), streamed, on a CPU host.

    python -m grpo_pipeline.checkpoints.convert to-dist HF_DIR OUT
    python -m grpo_pipeline.checkpoints.convert to-hf DIST_DIR HF_CONFIG_DIR OUT

The converter's command line. checkpoints/megatron_layout.py is the layout (which tensors a config
implies, where each goes) and the conversions; checkpoints/hf_shards.py and checkpoints/dist_reader.py read
the files, checkpoints/dist_writer.py writes the dist checkpoint, checkpoints/staged_output.py owns OUT.

Its guarantees: OUT is checked before anything is read; the input is checked whole against its
config.json before a byte is written; bad input is one `error:` line on stderr and exit 2 with
nothing left behind (no OUT, no partial); a partial of the same OUT left by a killed conversion is
removed; a checkpoint's pickled `.metadata` never runs code. Exit 0 prints OUT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpo_pipeline.store.bounded_read import short
from grpo_pipeline.errors import EXIT_USER_ERROR, UserError

EXIT_INTERRUPTED = 130
MAX_ERROR_LINE = 2000  # characters: two paths near PATH_MAX's 4096 would be longer, but not usefully


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_pipeline.checkpoints.convert",
                                     description="Convert between HF safetensors and megatron-core torch_dist, streamed, on CPU.")
    commands = parser.add_subparsers(dest="command", required=True)
    to_dist = commands.add_parser("to-dist", help="HF directory -> dist checkpoint")
    to_dist.add_argument("model_dir", type=Path)
    to_dist.add_argument("out", type=Path)
    to_hf = commands.add_parser("to-hf", help="dist checkpoint -> HF directory (config and tokenizer from CONFIG_DIR)")
    to_hf.add_argument("dist_dir", type=Path)
    to_hf.add_argument("config_dir", type=Path)
    to_hf.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    from grpo_pipeline.checkpoints.megatron_layout import dist_to_hf, hf_to_dist  # torch, once the arguments parse

    try:
        # by hand OUT is new (the store gives hf_to_dist an empty directory of its own)
        out = hf_to_dist(args.model_dir, args.out, empty_dir_ok=False) if args.command == "to-dist" else dist_to_hf(
            args.dist_dir, args.config_dir, args.out)
    except UserError as exc:
        # one line, bounded: a name from a hostile file could be megabytes long
        print(f"error: {short(' '.join(str(exc).splitlines()), MAX_ERROR_LINE)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"error: interrupted; nothing was written to {args.out}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
