"""lm-eval model `kvquant`: HFLM whose requests really read a quantized KV cache.

Stock HFLM scores a request in one prefill forward, which never reads a cache, so a KV scheme would not
change a single number. Here every request goes through a fresh `kvquant.QuantizedCache`:

    loglikelihood          context[:-1] is fed in chunks of `chunk` tokens, each attending to the quantized
                           cache of the ones before; the continuation (with the last context token) is then
                           scored in chunks against that cache
    loglikelihood_rolling  each lm-eval window is scored the same way (chunk after chunk through the cache)
    generate_until         the context is prefilled in chunks, then `model.generate(..., cache=cache)` decodes

Requests run one at a time (batch size 1): correctness first. The model is loaded with kvquant's offline
loader (a local folder, a .gguf, or the embedded default when `pretrained` is left out); nothing reaches
the hub.

    kvquant-lm-eval --model kvquant --model_args pretrained=PATH,scheme=int4-g64,chunk=256 \
        --include_path eval/tasks --tasks kvquant_mmlu --limit 20

A scheme with commas (`k=int4-channel-g64,v=int4-g64`) is written with `;` inside --model_args, whose items
lm-eval splits on commas: `scheme=k=int4-channel-g64;v=int4-g64`.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

import kvquant
from kvquant.cache import QuantizedCache
from kvquant.scheme import Scheme, parse_scheme

from .lm_eval_cli import DTYPE_ALIASES, check_device, check_model_args

__all__ = ["KVQuantLM", "DEFAULT_CHUNK", "choice_agreement", "cli", "scheme_display", "wandb_defaults"]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK = 1024  # as experiments/run.py (kvquant.eval.runner.DEFAULT_CHUNK)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = DTYPE_ALIASES.get(str(name))
    if key is None:
        raise ValueError(f"unknown dtype {name!r}; known dtypes: {', '.join(DTYPES)}")
    return DTYPES[key]


class _DropPrefix(logging.Filter):
    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


class KVQuantLM(HFLM):
    """HFLM over a model loaded by `kvquant.load_model`, scoring and generating through a QuantizedCache.

    Args (all reachable from --model_args):
        pretrained: a local HF model folder or .gguf file; None for the embedded default model.
        scheme: a kvquant scheme string (`fp16`, `int4-g64`, `kivi-2`, ...; `;` for `,`).
        chunk: tokens per forward when feeding text through the cache.
        backend: "auto", "triton" or "torch" (the cache's kernel dispatch).
        dtype: model dtype (float32 by default: the CPU reference).
        Everything else goes to HFLM (max_length, add_bos_token, ...).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        scheme: str | Scheme = "fp16",
        chunk: int = DEFAULT_CHUNK,
        backend: str = "auto",
        dtype: str | torch.dtype = "float32",
        device: str | None = None,
        batch_size: int | str | None = 1,
        **kwargs,
    ) -> None:
        # check the cheap arguments before loading anything (the same checks as kvquant-lm-eval's)
        check_model_args(
            dict(kwargs, scheme=scheme, chunk=chunk, backend=backend, dtype=dtype, pretrained=pretrained)
        )
        check_device(device)
        self.scheme = parse_scheme(scheme.replace(";", ",") if isinstance(scheme, str) else scheme)
        self.kv_backend, self.chunk = backend, chunk
        if batch_size not in (None, 1, "1"):
            logger.warning("kvquant scores requests one at a time; batch_size=%s is ignored", batch_size)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = kvquant.load_model(pretrained, dtype=_dtype(dtype), device=device)
        self.model_path = str(pretrained) if pretrained is not None else "default"
        hflm_logger = logging.getLogger("lm_eval.models.huggingface")
        quiet = _DropPrefix("`pretrained` model kwarg is not of type", "Passed an already-initialized model")
        hflm_logger.addFilter(quiet)  # HFLM warns about the model object we hand it on purpose
        try:
            super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1, **kwargs)
        finally:
            hflm_logger.removeFilter(quiet)
        self.new_cache()  # fails now, naming both numbers, if the scheme's group does not fit head_dim
        self._tag_wandb_run()

    def wandb_config(self) -> dict:
        """What a W&B run of this model says at its top level: `scheme` as experiments/run.py's report names
        it (a preset by its name), the canonical spec, chunk and backend."""
        return {
            "scheme": scheme_display(self.scheme),
            "scheme_spec": str(self.scheme),
            "kv_chunk": self.chunk,
            "kv_backend": self.kv_backend,
            "task": "lm-eval",
        }

    def _tag_wandb_run(self) -> None:
        """lm-eval's WandbLogger starts its run before the model is built: put the scheme at the run config's
        top level (lm-eval nests model_args in a string under cli_configs), so W&B can group by it."""
        wandb = sys.modules.get("wandb")  # never import wandb here: only a run lm-eval started matters
        run = getattr(wandb, "run", None) if wandb is not None else None
        if run is not None:
            run.config.update(self.wandb_config(), allow_val_change=True)

    # ---- the cache

    def new_cache(self) -> QuantizedCache:
        return QuantizedCache(self.scheme, self.model.config, backend=self.kv_backend)

    @torch.no_grad()
    def _feed(self, cache: QuantizedCache, tokens: Sequence[int], keep_logits: bool) -> list[torch.Tensor]:
        """Run tokens through the model in chunks, each chunk reading the cache of the ones before.

        Returns the logits of every chunk, each (1, t, V), when keep_logits; else nothing."""
        out = []
        for i in range(0, len(tokens), self.chunk):
            ids = torch.tensor([tokens[i : i + self.chunk]], dtype=torch.long, device=self.device)
            keep = 0 if keep_logits else 1  # a filling chunk needs no (t, V) logits, only its K/V
            logits = self.model(ids, cache=cache, use_cache=True, logits_to_keep=keep).logits
            if keep_logits:
                out.append(logits)
        return out

    # ---- lm-eval's hooks

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, whether the continuation is greedy) per request, in order.

        As stock HFLM: the input is (context + continuation)[-(max_length + 1):][:-1]. Its first
        n - len(continuation) tokens fill the cache; the rest are scored against it. Requests that share
        that prefix (the choices of one multiple-choice question) reuse a copy of its cache."""
        results = []
        last: tuple[tuple[int, ...], QuantizedCache] | None = None
        for key, context_enc, continuation_enc in tqdm(
            requests, disable=disable_tqdm or self.rank != 0, desc="kvquant loglikelihood"
        ):
            if not continuation_enc:
                raise ValueError("empty continuation: nothing to score")
            inp = (context_enc + continuation_enc)[-(self.max_length + 1) :][:-1]
            n_cont = min(len(continuation_enc), len(inp))
            prefix, scored = tuple(inp[: len(inp) - n_cont]), inp[len(inp) - n_cont :]
            if last is None or last[0] != prefix:
                cache = self.new_cache()
                self._feed(cache, prefix, keep_logits=False)
                last = (prefix, cache)
            cache = copy.deepcopy(last[1])  # scoring appends to the cache; keep the prefix's for the next
            logits = torch.cat(self._feed(cache, scored, keep_logits=True), dim=1)[0]  # (n_cont, V)
            logprobs = F.log_softmax(logits.to(self.softmax_dtype or torch.float32), dim=-1)
            target = torch.tensor(continuation_enc[-n_cont:], device=logprobs.device)
            answer = (
                float(logprobs.gather(-1, target[:, None]).sum()),
                bool((logprobs.argmax(-1) == target).all()),
            )
            results.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """Prefill context[:, :-1] through a fresh cache in chunks, then generate with it."""
        if context.shape[0] != 1:
            raise ValueError("kvquant generates one request at a time (batch size 1)")
        cache = self.new_cache()
        self._feed(cache, context[0, :-1].tolist(), keep_logits=False)
        return super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)

    def get_model_info(self) -> dict:
        """Model facts for lm-eval's results, without HFLM's hub look-up of a model sha."""
        return {
            "model_num_parameters": self.model.num_parameters(),
            "model_dtype": str(self.model.dtype),
            "model_path": self.model_path,
            "kv_scheme": str(self.scheme),
            "kv_chunk": self.chunk,
            "kv_backend": self.kv_backend,
        }


if __name__ != "__main__":  # `python -m` runs a __main__ copy; the registered class is the importable one
    register_model("kvquant")(KVQuantLM)


def scheme_display(scheme: Scheme) -> str:
    """A scheme as experiments/run.py's report shows it: a preset by its name (`kivi-2`), else its spec."""
    return scheme.name or str(scheme)


def wandb_defaults(argv: Sequence[str]) -> dict[str, str]:
    """W&B environment defaults for an lm-eval run with `--wandb_args`: the group `lm-eval <tasks>` (every
    scheme run on the same tasks lands in one group) and the run named by its scheme; `group=` / `name=` in
    --wandb_args, or WANDB_RUN_GROUP / WANDB_NAME already set, win. Empty without --wandb_args."""
    args = list(argv)
    if "--wandb_args" not in args and not any(a.startswith("--wandb_args=") for a in args):
        return {}

    def value(flag: str) -> str | None:
        for i, a in enumerate(args):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    out = {"WANDB_RUN_GROUP": f"lm-eval {value('--tasks') or 'tasks'}"}
    model_args = value("--model_args") or ""
    scheme = next((kv.split("=", 1)[1] for kv in model_args.split(",") if kv.startswith("scheme=")), "fp16")
    try:
        out["WANDB_NAME"] = scheme_display(parse_scheme(scheme.replace(";", ",")))
    except ValueError:
        pass  # the argument check reports a bad scheme in one line; no name here
    return out


def choice_agreement(samples_a: list[dict], samples_b: list[dict]) -> float:
    """Fraction of multiple-choice docs where two runs pick the same choice.

    Takes lm-eval's logged samples of one task from two runs (`simple_evaluate(..., log_samples=True)`
    -> results["samples"][task]), for example fp16 against int2-g32: a 135M model is near chance on MMLU,
    so agreement with FP16, not accuracy, says what the quantized cache changed."""

    def picks(samples: list[dict]) -> dict[int, int]:
        return {s["doc_id"]: max(range(len(s["resps"])), key=lambda i: s["resps"][i][0][0]) for s in samples}

    a, b = picks(samples_a), picks(samples_b)
    common = a.keys() & b.keys()
    if not common:
        raise ValueError("the two runs share no doc_id; log samples of the same task and limit")
    return sum(a[d] == b[d] for d in common) / len(common)


def cli(argv: Sequence[str] | None = None) -> None:
    """`kvquant-lm-eval`: lm-eval's CLI with the `kvquant` model registered (lm-eval finds no plug-ins);
    see `kvquant.eval.lm_eval_cli`, which checks the arguments before the heavy imports."""
    from .lm_eval_cli import cli as checked_cli

    for var, default in wandb_defaults(sys.argv[1:] if argv is None else argv).items():
        os.environ.setdefault(var, default)  # read by the wandb.init lm-eval's WandbLogger calls
    checked_cli(argv)


if __name__ == "__main__":
    from kvquant.eval.lm_eval_model import cli as registered_cli

    registered_cli()
