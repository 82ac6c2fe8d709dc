"""Which KV-cache format to deploy in a serving engine, measured offline, and the command that deploys it.

    python experiments/recommend.py --engine llama.cpp --quick      # default model, a 1,024-token smoke run
    python experiments/recommend.py --engine vllm                   # default model, its full 8,192 positions
    python experiments/recommend.py --engine vllm --model path/to/model --gpu h100
    python experiments/recommend.py --engine vllm --quick --passkey          # + a passkey exact-match column
    python experiments/recommend.py --engine vllm --export calib/kv-scales   # + calibrated FP8 scales scored
    python experiments/recommend.py --engine vllm --out runs/rec --shard 0/4  # ... 3/4, then --merge
    torchrun --nproc-per-node 4 experiments/recommend.py --engine vllm --device cuda --out runs/rec

Every KV format the engine offers for this model (refused ones listed with the engine's reason), its
skip-layer variants and kvquant's recipes at comparable bits, in prefill and cache mode, through the run
harness (two resumable run directories with report.md and plots); then a ranked table, the deploy command and
what kvquant's better recipe would gain. Rerunning the same command resumes. The sweep shards as every run of
the harness does (torchrun ranks, or --shard I/N then --merge: docs/scale.md). See docs/engines.md.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from kvquant.eval.config import (
    EXIT_USAGE,
    RunError,
    RunIncomplete,
    RunInterrupted,
    parse_shard,
    script_parser,
)

EXIT_INTERRUPTED = 130


def build_parser():
    from kvquant.eval.recommend import DEFAULT_TOLERANCE, ENGINES, GPUS

    p = script_parser(__doc__)
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--model", default=None, help="local HF model folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--corpus", default=None, help="default: wikipedia, shakespeare beyond 16k tokens")
    p.add_argument("--max-length", type=int, default=None, help="tokens per document (default: the model's)")
    p.add_argument("--docs", type=int, default=None)
    p.add_argument("--chunk", type=int, default=None, help="tokens per forward in cache mode")
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="capacity is counted on this GPU")
    p.add_argument("--weights-gb", type=float, default=0.0, help="weights held beside the KV cache (GB)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="drift bound (0.01 = 1%%)")
    p.add_argument("--out", default=None, help="default runs/recommend/<engine>-<model>-<length>")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 document of 1,024 tokens, chunk 256")
    p.add_argument("--force", action="store_true", help="replace existing run directories")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--passkey", action="store_true",
                   help="also a passkey grid in prefill mode: an exact-match column (not a criterion)")
    p.add_argument("--passkey-length", type=int, default=None, metavar="N",
                   help="the passkey prompt's tokens (default: --max-length, the longest context measured)")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="vLLM: write calibrated FP8 k_scale / v_scale to DIR (kv_scales.safetensors, "
                        "kv_cache_scheme.json) and score them as the row 'fp8 (calibrated)'")
    part = p.add_mutually_exclusive_group()
    part.add_argument("--shard", default=None, metavar="I/N",
                      help="a job-array task: measure shard I of N of every run of the sweep (no ranking)")
    part.add_argument("--merge", action="store_true",
                      help="measure nothing: rank from every shard's results in --out")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvquant.eval.recommend import recommend, report_text

    try:
        if (args.shard is not None or args.merge) and args.out is None:
            raise RunError("--shard/--merge need --out: every shard and the merge name one shared folder")
        rec = recommend(
            args.engine, args.model, corpus=args.corpus, max_length=args.max_length, docs=args.docs,
            chunk=args.chunk, out=args.out, gpu=args.gpu, weights_gb=args.weights_gb,
            tolerance=args.tolerance, quick=args.quick, force=args.force, device=args.device,
            dtype=args.dtype, passkey=args.passkey or args.passkey_length is not None, merge=args.merge,
            export=args.export, passkey_length=args.passkey_length,
            shard=parse_shard(args.shard) if args.shard is not None else None,
        )
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RunIncomplete as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (RunInterrupted, KeyboardInterrupt) as e:
        print(e or "interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    if rec.part_only:
        print("this process's part of the sweep is measured in " + ", ".join(map(str, rec.run_dirs.values()))
              + "; when every shard is done, run the same command with --merge instead of --shard")
        return 0
    print(report_text(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
