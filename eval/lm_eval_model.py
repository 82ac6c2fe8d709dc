"""lm-eval model `kvquant`: HFLM whose requests really read a quantized KV cache.

Stock HFLM scores a request in one prefill forward, which never reads a cache, so a KV scheme would not
change a single number. Here every request goes through a fresh `kvquant.QuantizedCache`:

    loglikelihood          context[:-1] is fed in chunks of `chunk` tokens, each attending to the quantized
                           cache of the ones before; the continuation (with the last context token) is then
                           scored in chunks against that cache
    loglikelihood_rolling  each lm-eval window is scored the same way (chunk after chunk through the cache)
    generate_until         the context is prefilled in chunks, then `model.generate(..., cache=cache)` decodes

With `batch_size=N` (lm-eval's --batch_size), loglikelihood requests whose cached prefixes have the same
length run N at a time through one cache of N rows: distinct prefixes are filled together (one row each;
requests sharing a prefix share its pages), and the continuations are right-padded, which no real token
ever attends to (attention is causal and decode-exact), with the same chunk boundaries as batch 1.
With every GEMM row-invariant that is batch 1's arithmetic bit for bit (tested); with the CPU's GEMM it is
not: MKL rounds a row by how many rows its product has (1, 2-15, 16+ on an AVX-512 Xeon), so a 1-token
scoring forward of B rows rounds unlike batch 1's single row (~1e-6 in K/V), and a quantized cache can turn
that into a different code at a rounding boundary (measured: one of 16 MMLU questions moved by 0.2-0.47
nats at int4-g64 on SmolLM2-135M). For bit-exact numbers keep batch size 1 (docs/scale.md).
Generation runs one request at a time. The model is loaded with kvquant's offline loader (a local folder,
a .gguf, or the embedded default when `pretrained` is left out); nothing reaches the hub. `device_map=`
(auto | balanced | a JSON file) splits it across devices (`kvquant.models.parse_device_map`).

Data parallel: under `torchrun` or `accelerate launch` (WORLD_SIZE > 1) each process binds its own device
(`cuda:LOCAL_RANK`, or the CPU with gloo), scores its share of the requests, and lm-eval gathers them:

    torchrun --standalone --nproc-per-node 2 -m kvquant.eval.lm_eval_cli --model kvquant ...

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
from kvquant.models import input_device
from kvquant.scheme import Scheme, parse_scheme

from .lm_eval_args import DTYPE_ALIASES, batch_size_of, check_device, check_model_args, scheme_display

__all__ = ["KVQuantLM", "DEFAULT_CHUNK", "choice_agreement", "scheme_display"]

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
        batch_size: loglikelihood requests per forward (an integer; see the module's docstring).
        device_map: "auto", "balanced" or a JSON file of module -> device: the model split across devices
            (not with data-parallel ranks).
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
        device_map: str | dict | None = None,
        **kwargs,
    ) -> None:
        # check the cheap arguments before loading anything (the same checks as kvquant-lm-eval's)
        check_model_args(
            dict(kwargs, scheme=scheme, chunk=chunk, backend=backend, dtype=dtype, pretrained=pretrained,
                 batch_size=batch_size, device_map=device_map)
        )
        check_device(device)
        self.scheme = parse_scheme(scheme.replace(";", ",") if isinstance(scheme, str) else scheme)
        self.kv_backend, self.chunk = backend, chunk
        accelerator = _data_parallel(device)
        if accelerator is not None:
            if device_map is not None:
                raise ValueError(
                    f"device_map={device_map} with {accelerator.num_processes} data-parallel processes: each "
                    "process binds one device; split the model (one process) or run ranks, not both"
                )
            device = str(accelerator.device)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = kvquant.load_model(
            pretrained, dtype=_dtype(dtype), device=device, device_map=device_map
        )
        self.model_path = str(pretrained) if pretrained is not None else "default"
        hflm_logger = logging.getLogger("lm_eval.models.huggingface")
        quiet = _DropPrefix("`pretrained` model kwarg is not of type", "Passed an already-initialized model")
        hflm_logger.addFilter(quiet)  # HFLM warns about the model object we hand it on purpose
        try:
            super().__init__(
                pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size_of(batch_size),
                **kwargs,
            )
        finally:
            hflm_logger.removeFilter(quiet)
        self._device = input_device(model)  # a model split by a device map takes its ids on its first device
        if accelerator is not None:  # HFLM sets up no ranks for a model object: lm-eval's DP hooks, here
            self.accelerator = accelerator
            self._rank, self._world_size = accelerator.process_index, accelerator.num_processes
        self._prefix: tuple[tuple, QuantizedCache] | None = None  # the last prefix filled, and its cache
        if isinstance(self.batch_size_per_gpu, int) and self.batch_size_per_gpu > 1:
            logger.warning(
                "batch_size=%d: scores equal batch 1's up to the GEMM's rounding by row count, which a "
                "quantized cache can turn into a different code (a request may move by a fraction of a nat); "
                "use batch size 1 for bit-exact numbers (docs/scale.md)", self.batch_size_per_gpu,
            )
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
    def _feed(self, cache: QuantizedCache, rows: Sequence[Sequence[int]]) -> None:
        """Fill the cache with rows of equal length (B, n), in chunks of `chunk` tokens, each chunk reading
        the cache of the ones before; no logits are kept (only each chunk's last, which HF computes)."""
        if not rows or not rows[0]:
            return
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)  # (B, n)
        for i in range(0, ids.shape[1], self.chunk):
            self.model(ids[:, i : i + self.chunk], cache=cache, use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def _score(
        self, cache: QuantizedCache, rows: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]
    ) -> list[tuple[float, bool]]:
        """Feed rows (right-padded to the longest) through the cache in chunks and score each row's target
        tokens: (sum of log-probs, whether every target is the argmax) per row. A row's padding comes after
        its real tokens, so none of them attends to it (causal, decode-exact): it changes no number."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], device=self.device)  # (B, n)
        want = torch.tensor([list(t) + [0] * (width - len(t)) for t in targets])  # (B, n)
        picked, greedy = [], []
        for i in range(0, width, self.chunk):
            logits = self.model(ids[:, i : i + self.chunk], cache=cache, use_cache=True).logits  # (B, t, V)
            logprobs = F.log_softmax(logits.to(self.softmax_dtype or torch.float32), dim=-1)
            t = want[:, i : i + self.chunk].to(logprobs.device)  # (B, t)
            picked.append(logprobs.gather(-1, t[..., None])[..., 0])
            greedy.append(logprobs.argmax(-1) == t)
        lp, ok = torch.cat(picked, dim=1), torch.cat(greedy, dim=1)  # (B, n)
        return [(float(lp[b, : len(r)].sum()), bool(ok[b, : len(r)].all())) for b, r in enumerate(rows)]

    # ---- lm-eval's hooks

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, whether the continuation is greedy) per request, in order.

        As stock HFLM: the input is (context + continuation)[-(max_length + 1):][:-1]. Its first
        n - len(continuation) tokens (the prefix) fill the cache; the rest are scored against it. With batch
        size 1, requests that share a prefix (the choices of one multiple-choice question) reuse a copy of
        its cache; with batch size N, up to N requests whose prefixes have the same length run together."""
        prepared = []
        for _key, context_enc, continuation_enc in requests:
            if not continuation_enc:
                raise ValueError("empty continuation: nothing to score")
            inp = (context_enc + continuation_enc)[-(self.max_length + 1) :][:-1]
            n_cont = min(len(continuation_enc), len(inp))
            prefix = tuple(inp[: len(inp) - n_cont])
            prepared.append((prefix, inp[len(inp) - n_cont :], continuation_enc[-n_cont:]))
        size = self.batch_size_per_gpu if isinstance(self.batch_size_per_gpu, int) else 1
        results: list[tuple[float, bool] | None] = [None] * len(prepared)
        bar = tqdm(total=len(prepared), disable=disable_tqdm or self.rank != 0, desc="kvquant loglikelihood")
        for group in _batches([p[0] for p in prepared], max(size, 1)):
            rows = [prepared[i] for i in group]
            for i, answer in zip(group, self._score_group(rows), strict=True):
                results[i] = answer
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
            bar.update(len(group))
        bar.close()
        return results

    def _score_group(
        self, rows: list[tuple[tuple[int, ...], list[int], list[int]]]
    ) -> list[tuple[float, bool]]:
        """Requests whose prefixes have one length, in one cache: the distinct prefixes fill one row each,
        then each request's row is selected (pages shared by reference count, copied on write)."""
        distinct = list(dict.fromkeys(r[0] for r in rows))
        if len(rows) == 1 or len(distinct) == 1:
            key = ("prefix", distinct[0])
            if self._prefix is None or self._prefix[0] != key:  # as batch 1: one fill per distinct prefix
                filled = self.new_cache()
                self._feed(filled, [distinct[0]])
                self._prefix = (key, filled)
            cache = copy.deepcopy(self._prefix[1])  # scoring appends to the cache; keep the prefix's
            if len(rows) > 1:
                cache.batch_repeat_interleave(len(rows))
        else:
            cache = self.new_cache()
            self._feed(cache, distinct)  # (U, p)
            where = {p: i for i, p in enumerate(distinct)}
            cache.batch_select_indices(torch.tensor([where[r[0]] for r in rows]))
        return self._score(cache, [r[1] for r in rows], [r[2] for r in rows])

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """Prefill context[:, :-1] through a fresh cache in chunks, then generate with it."""
        if context.shape[0] != 1:
            raise ValueError("kvquant generates one request at a time (batch size 1)")
        cache = self.new_cache()
        self._feed(cache, [context[0, :-1].tolist()])
        return super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """HFLM's generation, one request at a time whatever the batch size (its batches are left-padded)."""
        size = self.batch_size_per_gpu
        self.batch_size_per_gpu = 1
        try:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        finally:
            self.batch_size_per_gpu = size

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


def _batches(prefixes: Sequence[tuple[int, ...]], size: int) -> list[list[int]]:
    """Indices of requests in groups of at most `size` whose prefixes have one length. Batch size 1 keeps
    lm-eval's order; larger batches sort by (prefix length, prefix) so that equal prefixes sit together."""
    if size == 1:
        return [[i] for i in range(len(prefixes))]
    order = sorted(range(len(prefixes)), key=lambda i: (len(prefixes[i]), prefixes[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < size and len(prefixes[groups[-1][0]]) == len(prefixes[i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _data_parallel(device: str | None):
    """An accelerate `Accelerator` when this process is one of several ranks (torchrun / accelerate launch:
    WORLD_SIZE > 1), else None. Ranks without CUDA (or asked for the CPU) use gloo on the CPU."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from datetime import timedelta

    from accelerate import Accelerator, InitProcessGroupKwargs

    cpu = (device or "").startswith("cpu") or not torch.cuda.is_available()
    # as HFLM: a long timeout, since ranks wait for each other at lm-eval's gathers
    accelerator = Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(weeks=52))])
    if accelerator.num_processes <= 1:
        raise RuntimeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but accelerate set up one process; launch with "
            "torchrun --nproc-per-node N or accelerate launch --num_processes N"
        )
    return accelerator


if __name__ == "__main__":  # a __main__ copy would register a second class; the command is lm_eval_cli
    sys.exit("kvquant.eval.lm_eval_model is the lm-eval model, not a command: run kvquant-lm-eval or "
             "python -m kvquant.eval.lm_eval_cli (torchrun / accelerate launch too)")
register_model("kvquant")(KVQuantLM)


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
