"""The `kvquant` lm-eval model's arguments, checked without heavy imports: what `--model_args` may name,
and the checks that both the command line (`kvquant.eval.lm_eval_cli`, before torch, transformers or
lm-eval's models are imported) and the model itself (`KVQuantLM.__init__`) run.

Below both: the command line imports the model to register it, the model imports these checks, and
neither imports the other for them.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "BACKENDS", "DTYPE_ALIASES", "HUB_ONLY_ARGS", "KNOWN_MODEL_ARGS", "batch_size_of", "check_device",
    "check_model_args", "scheme_display",
]

BACKENDS = ("auto", "triton", "torch")  # kvquant.backend.BACKENDS (torch-free copy; a test keeps them equal)
# --model_args dtype= spellings -> torch dtype name
DTYPE_ALIASES = {
    "auto": "float32",
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
HUB_ONLY_ARGS = ("revision", "peft", "delta", "parallelize", "tokenizer")
KVQUANT_ARGS = ("pretrained", "scheme", "chunk", "backend", "dtype", "device", "batch_size", "device_map")
# what HFLM.__init__ takes besides those (lm-eval 0.4.x; a test compares with its signature)
HFLM_ARGS = (
    "subfolder", "truncation", "logits_cache", "max_length", "softmax_dtype", "mixed_precision_dtype",
    "max_batch_size", "trust_remote_code", "use_fast_tokenizer", "add_bos_token", "prefix_token_id",
    "max_memory_per_gpu", "max_cpu_memory", "offload_folder", "tp_plan", "autogptq", "gptqmodel",
    "gguf_file", "think_end_token", "enable_thinking", "chat_template_args",
)
KNOWN_MODEL_ARGS = (*KVQUANT_ARGS, *HFLM_ARGS, *HUB_ONLY_ARGS)


def check_model_args(args: Mapping[str, object]) -> None:
    """Check the `kvquant` model's --model_args without heavy imports.

    Raises SchemeError (unknown scheme, with the known ones), FileNotFoundError / ValueError (model path),
    ValueError (chunk, backend, dtype, hub-only arguments), TypeError (a value of the wrong type), each
    naming the fix."""
    import difflib

    from kvquant.eval.config import check_calib_file, model_facts

    from kvquant.models import check_model_path
    from kvquant.scheme import parse_scheme

    unknown = [k for k in args if k not in KNOWN_MODEL_ARGS]
    if unknown:
        near = difflib.get_close_matches(unknown[0], KNOWN_MODEL_ARGS, n=1)
        hint = f"; did you mean {near[0]}=?" if near else ""
        raise ValueError(
            f"--model_args {unknown[0]}= is not an argument of the kvquant model{hint} (kvquant's: "
            f"{', '.join(KVQUANT_ARGS)}; and HFLM's, e.g. max_length, add_bos_token, trust_remote_code)"
        )
    scheme = args.get("scheme", "fp16")
    scheme = parse_scheme(scheme.replace(";", ",") if isinstance(scheme, str) else scheme)
    if scheme.calib is not None:
        check_calib_file(scheme.calib, str(scheme))
    chunk = args.get("chunk", 1)
    if not isinstance(chunk, int) or isinstance(chunk, bool):
        raise TypeError(f"chunk must be an int (tokens per forward), not {type(chunk).__name__} {chunk!r}")
    if chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive integer (tokens per forward)")
    backend = args.get("backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    dtype = args.get("dtype", "float32")
    if not _is_torch_dtype(dtype) and str(dtype) not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; known dtypes: float32, float16, bfloat16")
    batch_size_of(args.get("batch_size", 1))
    if args.get("device_map") is not None:
        from kvquant.models import parse_device_map

        parse_device_map(args["device_map"])
    if args.get("parallelize") not in (None, False):
        raise ValueError("--model_args parallelize= is HFLM's hub loader's split; the kvquant model takes "
                         "device_map=auto (or balanced, or a JSON file of module -> device)")
    for name in HUB_ONLY_ARGS:
        if args.get(name) not in (None, False, "main"):
            raise ValueError(f"--model_args {name}= is not supported by the kvquant model (no hub access)")
    pretrained = args.get("pretrained")
    try:
        check_model_path(None if pretrained is None else str(pretrained))
    except FileNotFoundError as e:  # the loader's advice names run.py's flag; here it is pretrained=
        raise FileNotFoundError(str(e).replace("leave --model out", "leave pretrained= out")) from None
    facts = model_facts(None if pretrained is None else str(pretrained))
    if facts.layers is not None:
        scheme.check_num_layers(facts.layers)
    if facts.positions is not None:
        scheme.check_positions(facts.positions)
        max_length = args.get("max_length")
        if isinstance(max_length, int) and max_length > facts.positions:
            raise ValueError(f"max_length={max_length} is beyond the model's {facts.positions} positions "
                             f"({facts.source})")


def batch_size_of(value: object) -> int:
    """lm-eval's batch size (--batch_size or batch_size=) as the kvquant model takes it: a positive integer.
    `auto` (HFLM's search by trial forwards without a cache) is refused."""
    if value is None:
        return 1
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"batch_size={value!r}: the kvquant model takes an integer batch size (requests per forward "
            "through one cache); HFLM's batch_size=auto search is not supported"
        )
    if value < 1:
        raise ValueError(f"batch_size={value} must be a positive integer")
    return value


def _is_torch_dtype(value: object) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


def check_device(device: str | None) -> None:
    """An accelerator that this torch cannot use is refused (imports torch, not transformers)."""
    if not device or device == "cpu":
        return
    import torch

    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: torch {torch.__version__} sees no CUDA device; use --device cpu"
        )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available here; use --device cpu")


def scheme_display(scheme) -> str:
    """A scheme (kvquant `Scheme`) as experiments/run.py's report shows it: a preset by its name (`kivi-2`),
    else its spec."""
    return scheme.name or str(scheme)
