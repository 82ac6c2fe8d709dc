"""Quantization schemes for the KV cache: typed configs, parsed once from short strings.

A scheme string is a comma-separated list of items:

    SPEC                  one spec for both K and V          int4-g64
    k=SPEC, v=SPEC        separate specs for K and V         k=int4-channel-g64,v=int4-g64
    sink=N                first N tokens kept unquantized    sink=4
    window=N              last N (or more) tokens unquantized window=128
    PRESET                a named scheme                      kivi-2
    layers=R:SPEC+R:K/V   per-layer specs over layer ranges   layers=0-3:int8+4-29:int4-g64
                          (R is A-B or A; the ranges tile layers 0..N-1; K/V gives K and V apart)
    calib=FILE            calibration file (codebooks) of     calib=calib/smollm2-nuq.safetensors
                          `experiments/calibrate.py`; for vllm:fp8, a file of vLLM k_scale / v_scale
                          (`experiments/export_scales.py`)    vllm:fp8,calib=DIR/kv_scales.safetensors
    budget=B              the per-layer allocation at B       budget=3.0,calib=FILE
                          average bits stored in calib=FILE by `experiments/allocate.py --write-calib`
                          (resolved on parsing into its layers= scheme)
    salient=N/G[:SPEC][:RULE]  of every G tokens leaving the    salient=2/64, salient=4/64:int8-head
                          window, the N the queries attended to most (per KV head) kept with SPEC (fp16
                          by default) beside the body's codes; RULE attn (default) or stride (a control)

Each item at most once, no empty items (a trailing or doubled comma is refused). Unquantized K/V is `fp16`
whatever the model's dtype (`bf16`, `fp32`, `none` are refused, not read as fp16). Sizes are bounded: seeds
0..2**31-1, sink/window/token groups up to 2**24 tokens, and `Scheme.check_positions` refuses a token group
longer than the model's positions.

SPEC is `fp16`, `int{8,4,2}` (uniform levels), `nuq{4,3,2}` (non-uniform levels: a per-layer codebook
fitted offline, needs calib=) or `fp8-e4m3` / `fp8-e5m2` (torch's float8 codes) followed by options, in this
order:

    (nothing)     token: one scale per token over all KV heads (H_kv x D)
    -head         one scale per (token, head) over D
    -gN           one scale per N consecutive channels of D within a (token, head)
    -channel-gN   one scale per (head, channel) over N consecutive tokens (KIVI's keys)
    -tensor       fp8 only: one fixed unit scale, nothing stored (vLLM's FP8 cache without calibrated
                  scales; values beyond the format's range saturate)
    -sym / -asym  symmetric absmax or asymmetric min/max (default: sym for int8, asym for int4/int2;
                  fp8 is always absmax-scaled and takes neither)
    -sfp16 / -sbf16 / -sfp32   dtype of stored scales and zeros (default: the K/V dtype)

then the research transforms (`kvquant.codecs.transforms`), after all of the above, in this order:

    -center[N]    subtract a per-(head, channel) offset, the mean of each N tokens (default 64), stored in
                  the K/V dtype (16/N bits per value at FP16): keys with large per-channel offsets
    -rot[S]       orthonormal Walsh-Hadamard rotation over D with random signs from seed S (default 0)
    -crot         (instead of -rot) a calibrated orthogonal D x D rotation per layer and K/V, learned to
                  preserve the attention output (`kvquant.codecs.calibrot`); needs calib=
    -outP         keep the top P% magnitudes of each (token, head) vector exact (FP16 value + index) and
                  quantize the rest over the tighter range (0 < P <= 25: -out1, -out0.5)
    -prerope      (keys only, last) stored before the rotary embedding; RoPE is re-applied on read
                  (Llama, Mistral, Qwen, Granite, OLMo-2: one RoPE; Gemma-3: each layer its layer type's,
                  local base 10,000 / global 1,000,000; `kvquant.rope.Rope.for_layers`)

`fp16-rot[S]` (rotation without quantization) is valid too: attention is unchanged up to rounding.

Engine formats, stored bit for bit as the engine lays them out (`kvquant.codecs.engine`), take no options
(only -prerope): `llama.cpp:q8_0`, `llama.cpp:q4_0`, `llama.cpp:q4_1`, `llama.cpp:q5_0`, `llama.cpp:q5_1`,
`llama.cpp:iq4_nl` (llama.cpp's -ctk / -ctv cache types; `llama.cpp:k=q8_0,v=q4_0` for -ctk q8_0 -ctv q4_0),
`mxfp4`, `nvfp4` (ggml's FP4 blocks); vLLM's `--kv-cache-dtype` values (`kvquant.codecs.engine_vllm`):
`vllm:fp8` (= `vllm:fp8_e4m3`), `vllm:fp8_e5m2` (per-tensor scale 1.0, saturating),
`vllm:int8_per_token_head`, `vllm:fp8_per_token_head` (one fp32 scale per token and head),
`vllm:int4_per_token_head` (Hadamard-rotated, 4-bit codes, an fp32 scale holding the zero point), and vLLM's
TurboQuant presets `vllm:turboquant_k8v4`, `vllm:turboquant_4bit_nc`, `vllm:turboquant_k3v4_nc`,
`vllm:turboquant_3bit_nc` (a whole scheme item or a layers= range spec: K and V are stored differently, as
the halves `vllm:turboquant_4bit_nc.k` / `.v`; vLLM's default boundary layers are the layers= form,
`kvquant.codecs.engine_vllm.vllm_cache_scheme`). llama.cpp's names rotate K/V with a Hadamard matrix when
head_dim % 64 == 0, as llama.cpp does by default; `llama.cpp:q4_0-norot` is LLAMA_ATTN_ROT_DISABLE=1,
`llama.cpp:q4_0-rot` requires the rotation.

TurboQuant (Zandieh et al., ICLR 2026; `kvquant.codecs.turbo`) is its own family, with its own options in this
order (only -prerope follows them):

    turboB        per (token, head): the norm (fp16) and a random rotation of the direction, each coordinate
                  coded with B-bit Lloyd-Max levels computed for a rotated unit vector's coordinate (B = 1..4)
    turboB.25/.5/.75   the paper's outlier split: that fraction of the D channels (the largest by energy,
                  chosen per head every 16 tokens, a D-bit mask) at B+1 bits, the rest at B, two independent
                  instances (norm, rotation, levels each): turbo2.25 is the paper's "2.5-bit" 32-of-128
                  split (2.25 code bits + two norms), turbo2.5 / turbo3.5 half the channels one bit higher
    -qjl          TurboQuant_prod: B-1 bits of MSE codes + a 1-bit QJL sketch of the residual (D signs of a
                  Gaussian projection) and its norm; decode returns the unbiased estimator's key
    -had          randomized Walsh-Hadamard rotation (kvquant's -rot) instead of the paper's dense Haar one
    -nc           norm correction: the stored norm makes the decoded vector keep the input's norm
    -seedS        seed of the rotations and the projection (default 0); -blockN: tokens per outlier choice

RoPE frequency blocks (Block-GTQ style; `kvquant.codecs.ropeblocks`) are a family too: `rbqB-lfPbH` stores
the P lowest-frequency RoPE pairs of the head dim (rotate-half layout: channels D/2-P..D/2-1 and D-P..D-1) as
intH and the other channels as intB, each block with its own scales, then `-head` (default), `-gN` or
`-channel-gN`, then only -prerope: `rbq2-lf8b4-channel-g64-prerope` (keys, 3.0 bits at D = 64).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field

from .spec_types import (
    DEFAULT_CENTER,
    ENGINE_FORMATS,
    FP8,
    MAX_SEED,
    MAX_TOKENS,
    SPEC_FAMILIES,
    TURBO_BLOCK,
    CalibRotate,
    Center,
    ChannelGroups,
    Codebook,
    Dense,
    EngineFormat,
    Family,
    Grain,
    Granularity,
    Outliers,
    PerHead,
    PerToken,
    Rotate,
    SchemeError,
    TokenGroups,
    Transform,
    TurboSpec,
    UniformInt,
    VLLMCacheDtype,
    engine_family,
    family_bits,
    grain_of,
    rotation_block,
)

__all__ = [
    # the typed parts of a spec (kvquant.spec_types), re-exported
    "CalibRotate",
    "Center",
    "ChannelGroups",
    "Codebook",
    "Dense",
    "EngineFormat",
    "FP8",
    "Outliers",
    "PerHead",
    "PerToken",
    "Rotate",
    "TokenGroups",
    "UniformInt",
    "VLLMCacheDtype",
    "ENGINE_FORMATS",
    "MAX_SEED",
    "MAX_TOKENS",
    "DEFAULT_CENTER",
    "TURBO_BLOCK",
    "rotation_block",
    "Granularity",
    "LayerSpecs",
    "QuantSpec",
    "Scheme",
    "SchemeError",
    "TurboSpec",
    "FP16",
    "PRESETS",
    "parse_spec",
    "parse_scheme",
    "require_scheme",
    "list_schemes",
    "scheme_help",
]


# Stored-scale dtypes by name: this module never imports torch (CLIs validate schemes before heavy imports);
# `kvquant.codecs.base.torch_dtype` maps a name to its torch dtype.
SCALE_DTYPES: tuple[str, ...] = ("fp16", "bf16", "fp32")
_TORCH_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}
BITS = (16, 8, 4, 3, 2)
CODEBOOK_BITS = (4, 3, 2)  # nuqN; 3 bits only for codebooks (packed 8 codes per 3 bytes)
CALIBRATE_COMMAND = (
    "python experiments/calibrate.py --model MODEL --scheme '{scheme}' --out calib/NAME.safetensors"
)
FP8_KINDS: tuple[str, ...] = ("e4m3", "e5m2")  # torch.float8_e4m3fn, torch.float8_e5m2
MAX_OUTLIER_PERCENT = 25.0
TURBOQUANT_PRESET_NAMES: tuple[str, ...] = (
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"
)
ENGINE_ALIASES: dict[str, str] = {"vllm:fp8": "vllm:fp8_e4m3"}  # vLLM's `fp8` is E4M3 on CUDA
# engine names kvquant knows but does not reproduce, with the reason (refused at parse time, listed as skipped
# by experiments/recommend.py)
ENGINE_REFUSED: dict[str, str] = {
    "vllm:nvfp4": "vLLM's NVFP4 follows FlashInfer's arithmetic, not reproduced here; kvquant's `nvfp4` is "
    "ggml's block of the same 4.5 bits (per-tensor scale 1.0)",
}
# Bounds that no real configuration reaches, so a typo (an extra digit, a pasted number) is refused at parse
# time instead of reserving gigabytes or overflowing a random generator later (MAX_SEED, MAX_TOKENS: in
# `kvquant.spec_types`):
MAX_CHANNELS = 1 << 16  # a -gN channel group must divide head_dim; no model's head_dim comes near 65536
MAX_LAYERS = 1 << 16  # layers= ranges
PAGE_SIZE = 16  # tokens per page of the default store (`KVStore(block_size=16)`): pages hold lcm(16, group)
# names that are not specs although they look like one: unquantized K/V is always written `fp16`
_NOT_SPECS = ("bf16", "fp32", "none", "int16", "float16", "bfloat16", "float32", "half")


def outlier_count(percent: float, head_dim: int) -> int:
    """Values kept exact per (token, head) vector by `-outP`: ceil(P% of D), at least 1."""
    return Outliers(percent).count(head_dim)


@dataclass(frozen=True)
class _FlatSpec:
    """The flat keyword form of a spec, checked and made canonical: what `QuantSpec(bits, ...)` takes (see
    its docstring). `QuantSpec` turns it into its typed parts."""

    bits: int
    granularity: Granularity = Granularity.TOKEN
    group_size: int | None = None
    symmetric: bool = False
    scale_dtype: str | None = None
    codebook: bool = False
    prerope: bool = False
    fp8: str | None = None
    center: int | None = None
    rotate: int | None = None
    outliers: float | None = None
    unit_scale: bool = False
    engine: str | None = None
    turbo: TurboSpec | None = None
    rotate_calib: bool = False

    def __post_init__(self) -> None:
        if self.engine is not None:
            self._check_engine()
            return
        if self.turbo is not None:
            self._check_turbo()
            return
        if self.bits not in BITS:
            raise SchemeError(f"bits={self.bits} is not supported; use one of {BITS}")
        if self.codebook and self.bits not in CODEBOOK_BITS:
            raise SchemeError(f"nuq{self.bits} is not supported; codebooks have {CODEBOOK_BITS} bits")
        if self.bits == 3 and not self.codebook:
            raise SchemeError("3 bits exist only as a codebook (nuq3); uniform specs are int8, int4 or int2")
        try:
            object.__setattr__(self, "granularity", Granularity(self.granularity))
        except ValueError:
            known = ", ".join(g.value for g in Granularity)
            raise SchemeError(f"unknown granularity {self.granularity!r}; known: {known}") from None
        self._check_research()
        if self.bits == 16:
            self._check_fp16()
            return
        if self.unit_scale:
            if self.fp8 is None:
                raise SchemeError(
                    "a fixed unit scale (-tensor) is for fp8 only, e.g. fp8-e4m3-tensor; "
                    "an integer cache needs appendable scales (token, head, gN, channel-gN)"
                )
            if self.scale_dtype is not None or self.granularity is not Granularity.TOKEN:
                raise SchemeError("fp8 -tensor stores no scale, so it takes no granularity or scale dtype")
        self._check_group()
        if self.scale_dtype is not None and not isinstance(self.scale_dtype, str):
            # a torch dtype given directly (torch.float16 prints as "torch.float16"); stored by name
            name = _TORCH_NAMES.get(str(self.scale_dtype))
            object.__setattr__(self, "scale_dtype", name or str(self.scale_dtype))
        if self.scale_dtype is not None and self.scale_dtype not in SCALE_DTYPES:
            raise SchemeError(
                f"scale_dtype {self.scale_dtype!r} is not supported; use one of {list(SCALE_DTYPES)} "
                "(by name)"
            )

    def _check_fp16(self) -> None:
        # anything else would print as `fp16` and parse back as a different spec
        if (
            self.group_size is not None
            or self.granularity is not Granularity.TOKEN
            or self.symmetric
            or self.scale_dtype is not None
            or self.codebook
        ):
            raise SchemeError(
                "fp16 takes no granularity, group size, symmetry or scale dtype (only -prerope)"
            )
        if self.fp8 is not None or self.center is not None or self.outliers is not None or self.unit_scale:
            raise SchemeError("fp16 takes no fp8 kind, -tensor, -center or -out (only -rot: fp16-rot)")

    def _check_group(self) -> None:
        needs_group = self.granularity in (Granularity.GROUP, Granularity.CHANNEL)
        if needs_group and (self.group_size is None or self.group_size < 1):
            what = "channels" if self.granularity is Granularity.GROUP else "tokens"
            raise SchemeError(
                f"{self.granularity.value} granularity needs a group size in {what} "
                f"(for example int{self.bits}-{'g64' if what == 'channels' else 'channel-g64'})"
            )
        if not needs_group and self.group_size is not None:
            raise SchemeError(f"{self.granularity.value} granularity takes no group size")
        if needs_group:
            channels = self.granularity is Granularity.GROUP
            limit = MAX_CHANNELS if channels else MAX_TOKENS
            if self.group_size > limit:
                why = (
                    "a channel group must divide head_dim, and no model's head_dim is that large"
                    if channels
                    else "a token group fills only after that many tokens, beyond every model's positions"
                )
                raise SchemeError(
                    f"group size {self.group_size} is above the maximum {limit:,} ({why}); "
                    f"use for example int{self.bits}-{'g64' if channels else 'channel-g64'}"
                )

    def _check_engine(self) -> None:
        """An engine format fixes everything but -prerope: its bits come from the format."""
        if self.engine not in ENGINE_FORMATS:
            raise SchemeError(f"unknown engine format {self.engine!r}; known: {', '.join(ENGINE_FORMATS)}")
        defaults = _FlatSpec(8)
        extra = [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ("bits", "engine", "prerope", "symmetric")
            and getattr(self, f.name) != getattr(defaults, f.name)
        ]
        if extra:
            raise SchemeError(
                f"{self.engine} is the engine's own format: it takes no {', '.join(extra)} (only -prerope)"
            )
        object.__setattr__(self, "bits", ENGINE_FORMATS[self.engine][0])
        object.__setattr__(self, "symmetric", False)  # one canonical value; the format decides

    def _check_turbo(self) -> None:
        """A TurboQuant spec fixes everything but -prerope (its options live in `TurboSpec`)."""
        if not isinstance(self.turbo, TurboSpec):
            raise SchemeError(f"turbo must be a TurboSpec (parse_spec('turbo3')), not {self.turbo!r}")
        fp16 = _FlatSpec(16)
        extra = [f.name for f in dataclasses.fields(self) if f.name not in ("bits", "turbo", "prerope")
                 and getattr(self, f.name) != getattr(fp16, f.name)]
        if extra:
            raise SchemeError(f"{self.turbo} takes no {', '.join(extra)} (only -prerope)")
        object.__setattr__(self, "bits", math.ceil(self.turbo.code_bits))

    def _check_research(self) -> None:
        """The fp8 kind and the research transforms (-center, -rot, -out)."""
        if self.fp8 is not None:
            if self.fp8 not in FP8_KINDS:
                raise SchemeError(
                    f"unknown fp8 kind {self.fp8!r}; known: " + ", ".join(f"fp8-{k}" for k in FP8_KINDS)
                )
            if self.bits != 8 or self.codebook:
                raise SchemeError(f"fp8 codes are 8 bits and uniform in exponent, got bits={self.bits}")
            object.__setattr__(self, "symmetric", True)  # absmax-scaled; one canonical value
        for name in ("center", "rotate"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < (name == "center")):
                what = "a positive number of tokens" if name == "center" else "a non-negative integer seed"
                raise SchemeError(f"{name}={n!r} must be {what}")
        if self.center is not None and self.center > MAX_TOKENS:
            raise SchemeError(
                f"-center{self.center}: at most {MAX_TOKENS:,} tokens per offset (an offset is stored only "
                "once its tokens have all arrived, beyond every model's positions); the default is -center "
                f"({DEFAULT_CENTER} tokens)"
            )
        if self.rotate_calib and (self.rotate != 0 or self.bits == 16):
            raise SchemeError(
                "-crot (a calibrated rotation) replaces -rot and needs a quantized spec: "
                "QuantSpec(bits, ..., rotate=0, rotate_calib=True), e.g. int2-g64-crot"
            )
        if self.rotate is not None and self.rotate > MAX_SEED:
            raise SchemeError(
                f"-rot{self.rotate}: the seed must lie in 0..{MAX_SEED} (2**31 - 1, what every random "
                "generator accepts), e.g. -rot7"
            )
        if self.outliers is not None:
            p = self.outliers
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= MAX_OUTLIER_PERCENT:
                raise SchemeError(
                    f"outliers={p!r} must be a percentage in (0, {MAX_OUTLIER_PERCENT:g}], "
                    "e.g. -out1 or -out0.5"
                )
            object.__setattr__(self, "outliers", float(p))

    def typed(self) -> tuple[Family, Grain | None, str | None, tuple[Transform, ...], bool]:
        """(family, grain, scale_dtype, transforms, prerope): the typed parts `QuantSpec` stores."""
        grain = grain_of(self.granularity, self.group_size)
        if self.engine is not None:
            family, grain = engine_family(self.engine), None
        elif self.turbo is not None:
            family, grain = self.turbo, None
        elif self.bits == 16:
            family, grain = Dense(), None
        elif self.fp8 is not None:
            family = FP8(self.fp8, self.unit_scale)
            grain = None if self.unit_scale else grain
        else:
            family = (Codebook if self.codebook else UniformInt)(self.bits, self.symmetric)
        transforms: list[Transform] = []
        if self.center is not None:
            transforms.append(Center(self.center))
        if self.rotate_calib:
            transforms.append(CalibRotate())
        elif self.rotate is not None:
            transforms.append(Rotate(self.rotate))
        if self.outliers is not None:
            transforms.append(Outliers(self.outliers))
        return family, grain, self.scale_dtype, tuple(transforms), self.prerope


_FLAT_FIELDS = tuple(f.name for f in dataclasses.fields(_FlatSpec))
_FAMILY_TYPES = (Dense, UniformInt, Codebook, FP8, EngineFormat, TurboSpec)  # what the grammar writes
_GRAIN_TYPES = (PerToken, PerHead, ChannelGroups, TokenGroups)
_TRANSFORM_TYPES = (Center, Rotate, CalibRotate, Outliers)
_UNSET: object = type("_Unset", (), {"__repr__": lambda self: "<unset>"})()  # a keyword not given


@dataclass(frozen=True, init=False)
class QuantSpec:
    """How one of K or V is stored, in typed parts (`kvquant.spec_types`):

    family: what a value is stored as (Dense, UniformInt, Codebook, FP8, EngineFormat / VLLMCacheDtype,
        TurboSpec).
    grain: which elements share a scale (PerToken, PerHead, ChannelGroups(channels=N),
        TokenGroups(tokens=N)); None where the family keeps no scales of the spec's choosing (fp16, fp8
        -tensor, engine formats, TurboQuant).
    scale_dtype: name of the dtype of stored scales and zeros ("fp16", "bf16", "fp32"); None stores them
        in the K/V dtype.
    transforms: applied before the family's codec, outermost first (Center, Rotate or CalibRotate,
        Outliers: the grammar's order).
    prerope: keys stored before the rotary embedding (the cache inverts the model's RoPE on the way in and
        re-applies it on read); keys only.

    Two ways to build one, both checked the same way:

        QuantSpec(family=UniformInt(4), grain=ChannelGroups(64))       typed
        QuantSpec(4, Granularity.GROUP, 64)                            the flat keywords, below

    The flat keywords are also read-only properties (`spec.bits`, `spec.group_size`, ...), and
    `dataclasses.replace(spec, rotate=None)` takes them too:
    bits: 16 (kept as is), 8, 4, 3 (codebooks only) or 2. granularity, group_size: the grain as a
    `Granularity` and its N (channels for GROUP, tokens for CHANNEL; None otherwise). symmetric: absmax with
    signed codes, or min/max with a float zero point. codebook: nuqN. fp8: "e4m3" or "e5m2" (bits 8,
    symmetric). unit_scale: fp8 -tensor. center: tokens per -center offset. rotate: -rot's seed (0 with
    rotate_calib, -crot). outliers: -out's percent. engine: an engine format name (a key of
    `ENGINE_FORMATS`; bits is then the format's). turbo: a `TurboSpec` (bits is its code bits rounded up).
    """

    family: Family
    grain: Grain | None
    scale_dtype: str | None
    transforms: tuple[Transform, ...]
    prerope: bool

    def __init__(
        self,
        bits: int = _UNSET,
        granularity: Granularity = _UNSET,
        group_size: int | None = _UNSET,
        symmetric: bool = _UNSET,
        scale_dtype: str | None = _UNSET,
        codebook: bool = _UNSET,
        prerope: bool = _UNSET,
        fp8: str | None = _UNSET,
        center: int | None = _UNSET,
        rotate: int | None = _UNSET,
        outliers: float | None = _UNSET,
        unit_scale: bool = _UNSET,
        engine: str | None = _UNSET,
        turbo: TurboSpec | None = _UNSET,
        rotate_calib: bool = _UNSET,
        *,
        family: Family | None = None,
        grain: Grain | None = _UNSET,
        transforms: tuple[Transform, ...] = _UNSET,
    ) -> None:
        given = {k: v for k, v in locals().items() if k in _FLAT_FIELDS and v is not _UNSET}
        if family is None:  # the flat form
            if grain is not _UNSET or transforms is not _UNSET:
                raise TypeError("QuantSpec takes grain= and transforms= with family= (the typed form)")
            if "bits" not in given:
                raise TypeError("QuantSpec needs bits (the flat form) or family= (the typed form)")
            self._set(*_FlatSpec(**given).typed())
            return
        # the typed form (dataclasses.replace passes the stored parts, and any flat keyword given to it)
        self._set(family, None if grain is _UNSET else grain, given.pop("scale_dtype", None),
                  () if transforms is _UNSET else tuple(transforms), bool(given.pop("prerope", False)))
        if not isinstance(family, _FAMILY_TYPES):  # a family from outside the grammar (a plug-in codec)
            if given:
                raise TypeError(
                    f"flat keywords {sorted(given)} apply to the grammar's families, not {family!r}"
                )
            self._check_plugin()
            return
        self._check_parts()
        flat = {name: getattr(self, name) for name in _FLAT_FIELDS}
        self._set(*_FlatSpec(**{**flat, **given}).typed())

    def _set(self, family, grain, scale_dtype, transforms, prerope) -> None:
        for name, value in zip(("family", "grain", "scale_dtype", "transforms", "prerope"),
                               (family, grain, scale_dtype, transforms, prerope), strict=True):
            object.__setattr__(self, name, value)

    def _check_parts(self) -> None:
        """Typed parts that the flat form could not say: a grain or transform of the wrong type, transforms
        out of the grammar's order or given twice, a grain where the family keeps no scales."""
        if self.grain is not None and not isinstance(self.grain, _GRAIN_TYPES):
            raise SchemeError(f"grain must be one of {', '.join(g.__name__ for g in _GRAIN_TYPES)}, "
                              f"not {self.grain!r}")
        bad = [t for t in self.transforms if not isinstance(t, _TRANSFORM_TYPES)]
        if bad:
            known = ", ".join(t.__name__ for t in _TRANSFORM_TYPES)
            raise SchemeError(f"transforms are {known}, not {bad[0]!r}")
        orders = [t.order for t in self.transforms]
        if orders != sorted(set(orders)):
            raise SchemeError(
                f"transforms {self.transforms} must come outermost first, each kind once: Center, then "
                "Rotate or CalibRotate, then Outliers (the grammar's -center, -rot, -out)"
            )
        keeps_scales = isinstance(self.family, (UniformInt, Codebook)) or (
            isinstance(self.family, FP8) and not self.family.unit_scale
        )
        if self.grain is None and keeps_scales:
            object.__setattr__(self, "grain", PerToken())  # the grammar's default
        elif self.grain is not None and not keeps_scales:
            raise SchemeError(f"{self.family.name()} keeps no scales of its own: it takes no grain")

    def _check_plugin(self) -> None:
        family = self.family
        if not (hasattr(family, "name") and hasattr(family, "check_head_dim")):
            raise SchemeError(
                f"a family needs name() and check_head_dim(head_dim), as kvquant.spec_types' do; {family!r} "
                "has not"
            )
        bits = getattr(family, "bits", None)
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
            raise SchemeError(f"a family needs its bits per value (1..16), {family!r} has {bits!r}")
        self._check_parts()

    # ---- the flat view (read-only; what the flat form takes)

    @property
    def bits(self) -> int:
        return family_bits(self.family)

    @property
    def symmetric(self) -> bool:
        return getattr(self.family, "symmetric", False)

    @property
    def granularity(self) -> Granularity:
        return self.grain.granularity if self.grain is not None else Granularity.TOKEN

    @property
    def group_size(self) -> int | None:
        return self.grain.group_size if self.grain is not None else None

    @property
    def codebook(self) -> bool:
        return isinstance(self.family, Codebook)

    @property
    def fp8(self) -> str | None:
        return self.family.kind if isinstance(self.family, FP8) else None

    @property
    def unit_scale(self) -> bool:
        return isinstance(self.family, FP8) and self.family.unit_scale

    @property
    def engine(self) -> str | None:
        return self.family.format if isinstance(self.family, EngineFormat) else None

    @property
    def turbo(self) -> TurboSpec | None:
        return self.family if isinstance(self.family, TurboSpec) else None

    def _transform(self, kind: str):
        return next((t for t in self.transforms if t.flat == kind), None)

    @property
    def center(self) -> int | None:
        t = self._transform("center")
        return None if t is None else t.tokens

    @property
    def rotate(self) -> int | None:
        t = self._transform("rotate")
        return None if t is None else t.seed

    @property
    def rotate_calib(self) -> bool:
        return isinstance(self._transform("rotate"), CalibRotate)

    @property
    def outliers(self) -> float | None:
        t = self._transform("outliers")
        return None if t is None else t.percent

    # ----

    @property
    def is_quantized(self) -> bool:
        return self.bits < 16

    @property
    def needs_calibration(self) -> bool:
        """Tables fitted offline (a calibration file): a codebook (nuqN) or a calibrated rotation (-crot)."""
        return isinstance(self.family, Codebook) or any(isinstance(t, CalibRotate) for t in self.transforms)

    @property
    def qmax(self) -> int:
        """Largest code: 2^b - 1 (asymmetric) or 2^(b-1) - 1 (symmetric, codes stored with offset 2^(b-1))."""
        return (1 << (self.bits - 1)) - 1 if self.symmetric else (1 << self.bits) - 1

    @property
    def tokens_per_group(self) -> int:
        """How many tokens must arrive before they can be quantized (a token group's N, else 1; with
        -centerM, the least common multiple with M; turbo split specs: their -blockN)."""
        n = self.grain.tokens if self.grain is not None else getattr(self.family, "token_group", 1)
        center = self._transform("center")
        return math.lcm(n, center.tokens) if center is not None else n

    def check_head_dim(self, head_dim: int) -> None:
        """Refuse a head_dim the grain, the family or a transform cannot serve, naming both numbers."""
        if self.grain is not None:
            self.grain.check_head_dim(head_dim)
        self.family.check_head_dim(head_dim)
        for t in self.transforms:
            t.check_head_dim(head_dim)

    def __str__(self) -> str:
        return format_spec(self)


FP16 = QuantSpec(16)


@dataclass(frozen=True)
class LayerSpecs:
    """The K and V specs of decoder layers first..last (inclusive) in a per-layer scheme."""

    first: int
    last: int
    key: QuantSpec
    value: QuantSpec

    def __post_init__(self) -> None:
        if not (isinstance(self.first, int) and isinstance(self.last, int) and 0 <= self.first <= self.last):
            raise SchemeError(f"layer range {self.first}-{self.last} must be A-B with 0 <= A <= B")
        if self.last >= MAX_LAYERS:
            raise SchemeError(
                f"layer range {self.first}-{self.last} goes beyond layer {MAX_LAYERS - 1:,} (no model has "
                "that many layers); the ranges cover the model's layers 0..N-1"
            )
        if self.value.prerope:
            raise SchemeError(f"-prerope applies to keys only (layers {self.first}-{self.last})")


SALIENT_RULES: tuple[str, ...] = ("attn", "stride")
MAX_SALIENT_GROUP = 1 << 12  # tokens per salient group: an index within it is stored in one or two bytes


@dataclass(frozen=True)
class Salient:
    """`salient=N/G[:SPEC][:RULE]`: of every G consecutive tokens that leave the window together, the N that
    the queries attended to most (per KV head) are stored with SPEC (default `fp16`: as they came, in the
    K/V dtype) beside the body's codes, and read instead of them (`kvquant.salient`, MiKV / ZipCache style).

    rule: "attn" (the mean attention share each token received from the queries that saw it unquantized:
        ZipCache's normalized attention) or "stride" (tokens 0, G/N, 2G/N, ... of each group: a control with
        the same bytes and no statistics). N must divide G (pages hold N / G salient rows per token); SPEC
        is per (token, head) (fp16, -head or -gN grains), never calibrated or pre-RoPE.
    """

    count: int
    group: int
    spec: QuantSpec = field(default_factory=lambda: FP16)
    rule: str = "attn"

    def __post_init__(self) -> None:
        n, g = self.count, self.group
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (n, g)) or not 0 < n < g:
            raise SchemeError(f"salient={n}/{g}: write N/G with 0 < N < G (N of every G tokens kept)")
        if g > MAX_SALIENT_GROUP or g % n:
            raise SchemeError(
                f"salient={n}/{g}: N must divide G and G be at most {MAX_SALIENT_GROUP} tokens (pages "
                f"hold G/N tokens per salient row); e.g. salient=2/64"
            )
        if self.rule not in SALIENT_RULES:
            raise SchemeError(f"salient rule {self.rule!r} is not one of {', '.join(SALIENT_RULES)}")
        spec = self.spec
        if not isinstance(spec, QuantSpec):
            raise SchemeError(f"salient= takes a QuantSpec, not {spec!r}")
        per_head = spec.grain is None or isinstance(spec.grain, (PerHead, ChannelGroups))
        if (spec.prerope or spec.needs_calibration or spec.tokens_per_group != 1 or not per_head
                or spec.turbo is not None or spec.engine is not None):
            raise SchemeError(
                f"salient=...:{spec}: salient tokens are chosen per head, one at a time, so their spec must "
                "store each (token, head) alone: fp16, or a -head / -gN spec without -center, -prerope, "
                "calibration, engine or turbo formats (e.g. salient=2/64:int8-head)"
            )

    @property
    def ratio(self) -> int:
        """Tokens per salient row: G / N."""
        return self.group // self.count

    def __str__(self) -> str:
        parts = [f"{self.count}/{self.group}"]
        if self.spec != FP16:
            parts.append(format_spec(self.spec))
        if self.rule != "attn":
            parts.append(self.rule)
        return ":".join(parts)


@dataclass(frozen=True)
class Scheme:
    """A K spec, a V spec, and how many first (sink) and last (window) tokens stay unquantized.

    layers: per-layer specs (`layers=0-3:int8+4-29:int4-g64`), ranges tiling layers 0..N-1 in order; then
        `key`/`value` are layer 0's and `for_layer(i)` gives layer i's uniform scheme (code that builds a
        layer must use it; for a uniform scheme it is the scheme itself).
    calib: path of a calibration file (`experiments/calibrate.py`) holding the codebooks of `nuqN` specs.
    salient: saliency-aware mixed precision (`Salient`, `salient=N/G`), or None.
    """

    key: QuantSpec
    value: QuantSpec
    sink: int = 0
    window: int = 0
    name: str | None = field(default=None, compare=False)  # the preset it came from, for display
    layers: tuple[LayerSpecs, ...] = ()
    calib: str | None = None
    salient: Salient | None = None

    def __post_init__(self) -> None:
        for what in ("sink", "window"):
            n = getattr(self, what)
            if not isinstance(n, int) or n < 0:
                raise SchemeError(f"{what}={n!r} must be a non-negative integer")
            if n > MAX_TOKENS:
                raise SchemeError(
                    f"{what}={n} is above the maximum {MAX_TOKENS:,} tokens (beyond every model's "
                    f"positions: {'nothing would be quantized' if what == 'window' else 'all would stay FP'})"
                )
        if self.calib is not None and (
            not isinstance(self.calib, str) or not self.calib or "," in self.calib
        ):
            raise SchemeError(f"calib={self.calib!r} must be a file path without commas")
        if self.layers:
            layers = tuple(self.layers)
            object.__setattr__(self, "layers", layers)
            expect = 0
            for r in layers:
                if r.first < expect:
                    raise SchemeError(
                        f"layer ranges overlap or are out of order at {r.first}-{r.last} (layers before "
                        f"{expect} are already given); write ranges in order, each layer once"
                    )
                if r.first > expect:
                    gap = f"layer {expect}" if r.first - 1 == expect else f"layers {expect}-{r.first - 1}"
                    raise SchemeError(
                        f"{gap} missing from layers=; the ranges must cover every layer from 0 on, in order"
                    )
                expect = r.last + 1
            if len(layers) == 1:
                raise SchemeError("layers= with one range is a uniform scheme: write the spec alone")
            object.__setattr__(self, "key", layers[0].key)
            object.__setattr__(self, "value", layers[0].value)
        if self.value.prerope:
            raise SchemeError("-prerope applies to keys only: write k=SPEC-prerope,v=SPEC")
        if self.salient is not None and not isinstance(self.salient, Salient):
            raise SchemeError(f"salient must be a Salient (salient=N/G), not {self.salient!r}")

    # ---- per layer

    @property
    def num_layers(self) -> int | None:
        """Layers a per-layer scheme covers (the model must have exactly these), None for a uniform one."""
        return self.layers[-1].last + 1 if self.layers else None

    def for_layer(self, index: int) -> Scheme:
        """Layer `index`'s scheme: uniform (no `layers`), with this scheme's sink, window and calib."""
        if not self.layers:
            return self
        for r in self.layers:
            if r.first <= index <= r.last:
                return dataclasses.replace(self, key=r.key, value=r.value, layers=(), name=None)
        raise SchemeError(
            f"layer {index} is not in this scheme's layers=, which covers layers 0-{self.num_layers - 1}"
        )

    def layer_specs(self) -> list[tuple[QuantSpec, QuantSpec]]:
        """(key, value) of every distinct range (one pair for a uniform scheme)."""
        return [(r.key, r.value) for r in self.layers] or [(self.key, self.value)]

    def specs(self) -> list[QuantSpec]:
        return [s for pair in self.layer_specs() for s in pair]

    @property
    def needs_calibration(self) -> bool:
        return any(s.needs_calibration for s in self.specs())

    @property
    def prerope(self) -> bool:
        return any(s.prerope for s in self.specs())

    def check_num_layers(self, num_layers: int) -> None:
        """Refuse a per-layer scheme written for another number of layers, naming both."""
        if self.layers and self.num_layers != num_layers:
            raise SchemeError(
                f"this scheme's layers= covers {self.num_layers} layers, but the model has {num_layers}; "
                f"write ranges covering 0-{num_layers - 1}"
            )

    def check_positions(self, max_positions: int, page_size: int = PAGE_SIZE) -> None:
        """Refuse a token group (`-channel-gN`, `-centerN`, and the page of lcm(page_size, group) tokens that
        stores it) longer than the model's positions: it could never fill, so nothing would be quantized,
        while every layer reserves pages of that many tokens (`int4-channel-g100003`: 1.6M-token pages)."""
        if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 1:
            raise TypeError(f"max_positions must be a positive int, not {max_positions!r}")
        for s in self.specs():
            group = s.tokens_per_group
            page = math.lcm(page_size, group)
            if page > max_positions:
                what = (f"-{s.grain.option()}" if isinstance(s.grain, TokenGroups) else "") + (
                    f"-center{s.center}" if s.center is not None else ""
                )
                raise SchemeError(
                    f"{s}: its token group ({what.lstrip('-')}: {group:,} tokens, stored in pages of "
                    f"lcm({page_size}, {group}) = {page:,} tokens) is longer than the model's "
                    f"{max_positions:,} positions, so it would never fill and nothing would be quantized; "
                    f"use a group whose lcm with {page_size} is at most {max_positions:,} tokens "
                    "(e.g. -channel-g64, -center64)"
                )

    @property
    def is_fp16(self) -> bool:
        return not any(s.is_quantized for s in self.specs())

    @property
    def tokens_per_flush(self) -> int:
        """Tokens move from the FP window to the quantized body in multiples of this (for a per-layer
        scheme, a multiple of every layer's: use `for_layer(i).tokens_per_flush` for layer i); with
        salient=N/G, a multiple of G (a group leaves the window whole)."""
        groups = [s.tokens_per_group for s in self.specs()]
        return math.lcm(*groups, self.salient.group if self.salient is not None else 1)

    def quantized_end(self, num_tokens: int) -> int:
        """Once num_tokens tokens have arrived, positions [min(sink, num_tokens), quantized_end) are in the
        quantized body; the rest (sink before, window after) are unquantized. The same for any chunking."""
        sink = min(self.sink, num_tokens)
        step = self.tokens_per_flush
        return sink + max(num_tokens - sink - self.window, 0) // step * step

    def check_head_dim(self, head_dim: int) -> None:
        for s in self.specs():
            s.check_head_dim(head_dim)

    def __str__(self) -> str:
        return format_scheme(self)


# ----------------------------------------------------------------------------------------------- parsing

_SPEC_RE = re.compile(
    r"^(?:(?P<family>int|nuq)(?P<bits>\d+)|(?P<fp>fp16)|fp8(?:-(?P<fp8>[a-z0-9]+))?)"
    r"(?P<opts>(-[a-z0-9.]+)*)$"
)
# research transforms, in the only order a spec may give them (after every other option)
_RESEARCH_ORDER = ("center", "rotation", "outliers")
_PREROPE = "-prerope"
_PRESET_DEFS: dict[str, tuple[str, str]] = {
    "kivi-4": (
        "k=int4-channel-g32,v=int4-g32,window=128",
        "KIVI 4-bit: K per channel, V per token group, 128 FP",
    ),
    "kivi-2": (
        "k=int2-channel-g32,v=int2-g32,window=128",
        "KIVI 2-bit: K per channel, V per token group, 128 FP",
    ),
}
EXAMPLES: dict[str, str] = {
    "fp16": "no quantization (the baseline)",
    "int8": "per token, symmetric absmax: round(x / max|x| * 127)",
    "int8-head": "per (token, head)",
    "int4-g128": "asymmetric, one scale and zero per 128 channels",
    "int4-g64": "asymmetric, one scale and zero per 64 channels",
    "int4-g32": "asymmetric, one scale and zero per 32 channels",
    "int2-g32": "asymmetric 2-bit, per 32 channels",
    "int4-g64-sym": "symmetric 4-bit, per 64 channels",
    "k=int4-channel-g64,v=int4-g64,sink=4,window=128": "K per channel (groups of 64 tokens), V per group",
    "k=int4-channel-g64-prerope,v=int4-g64": "K per channel, stored before RoPE (re-applied on read)",
    "k=fp16-prerope,v=fp16": "pre-RoPE storage alone (equals the model exactly)",
    "nuq4-g64,calib=calib/smollm2-nuq.safetensors": (
        "4-bit non-uniform levels per layer and K/V, per 64 channels"
    ),
    "k=nuq3-channel-g64-prerope,v=nuq3-g64,calib=calib/smollm2-nuq.safetensors": "KVQuant-style 3-bit",
    "nuq2-g32,calib=calib/smollm2-nuq.safetensors": "2-bit non-uniform levels, per 32 channels",
    "layers=0-1:int8+2-29:int4-g64": "per-layer specs: layers 0-1 int8, 2-29 int4-g64 (30-layer model)",
    "layers=0:int8/int4-g64+1-29:int4-channel-g64/int2-g32,window=128": "per-layer K/V specs (K/V)",
    "fp8-e4m3": "FP8 E4M3 (torch.float8_e4m3fn), one absmax scale per token over all heads",
    "fp8-e4m3-head": "FP8 E4M3, one scale per (token, head)",
    "fp8-e5m2-head": "FP8 E5M2 (torch.float8_e5m2), one scale per (token, head)",
    "fp8-e4m3-tensor": "FP8 E4M3, fixed unit scale, nothing stored (vLLM uncalibrated; saturates at 448)",
    "int4-g64-rot": "Walsh-Hadamard rotation over D (random signs, seed 0), then int4-g64; -rot7: seed 7",
    "k=int2-channel-g32-rot,v=int2-g32-rot,window=128": "KIVI-2 layout, K and V rotated",
    "int4-g64-out1": "top 1% magnitudes per (token, head) kept FP16 + uint8 index, the rest int4-g64",
    "k=int4-g64-center,v=int4-g64": "keys minus a per-channel offset (mean of each 64 tokens, FP16)",
    "int4-g64-center-rot-out1": "the three transforms: center, then rotate, then split outliers",
    "fp16-rot": "rotation alone, no quantization (attention unchanged up to rounding)",
    "llama.cpp:q8_0": "llama.cpp -ctk/-ctv q8_0: blocks of 32 along D, fp16 scale + int8 (8.5 bits)",
    "llama.cpp:q4_0": "llama.cpp q4_0: blocks of 32, fp16 scale + 4-bit codes (4.5 bits); q4_1/q5_0/q5_1",
    "llama.cpp:iq4_nl": "llama.cpp iq4_nl: blocks of 32, fp16 scale + 4-bit non-linear levels (4.5 bits)",
    "llama.cpp:k=q8_0,v=q4_0": "llama.cpp -ctk q8_0 -ctv q4_0 (prints as k=llama.cpp:q8_0,v=llama.cpp:q4_0)",
    "mxfp4": "OCP MXFP4 (ggml's block): 32 FP4 E2M1 values + one E8M0 scale (4.25 bits)",
    "nvfp4": "NVFP4 (ggml's block): 16 FP4 E2M1 values + one UE4M3 scale, per-tensor scale 1.0 (4.5 bits)",
    "vllm:fp8": "vLLM --kv-cache-dtype fp8 (= vllm:fp8_e4m3): E4M3, per-tensor scale 1.0, saturating",
    "vllm:fp8_e5m2": "vLLM fp8_e5m2: E5M2, per-tensor scale 1.0, saturating at 57344 (8 bits)",
    "vllm:int8_per_token_head": "vLLM int8_per_token_head: int8 (truncated) + fp32 scale per token and head",
    "vllm:fp8_per_token_head": "vLLM fp8_per_token_head: E4M3 + one fp32 scale per token and head",
    "vllm:int4_per_token_head": "vLLM int4_per_token_head: Hadamard-rotated 4-bit min/max codes, fp32 scale "
    "+ zero point per token and head",
    "layers=0:fp16+1-28:vllm:fp8+29:fp16": "vLLM fp8 with --kv-cache-dtype-skip-layers 0,29 (30 layers)",
    "llama.cpp:q4_0-norot": "llama.cpp q4_0 without its Hadamard rotation of K/V (LLAMA_ATTN_ROT_DISABLE=1)",
    "vllm:turboquant_4bit_nc": "vLLM TurboQuant: K Hadamard + 4-bit Lloyd-Max + norm (nc), V 4-bit min/max",
    "vllm:turboquant_k8v4": "vLLM TurboQuant k8v4: FP8 E4M3 keys (no scale), 4-bit min/max values",
    "layers=0-1:fp16+2-27:vllm:turboquant_3bit_nc+28-29:fp16": "vLLM turboquant_3bit_nc as served: "
    "two boundary layers at each end unquantized (30 layers)",
    "turbo3": "TurboQuant: fp16 norm + dense random rotation + 3-bit Lloyd-Max levels per coordinate",
    "turbo3.5": "TurboQuant 3.5: half the channels (outliers, per 16 tokens) at 4 bits, half at 3",
    "turbo2.5": "TurboQuant 2.5: half the channels at 3 bits, half at 2 (turbo2.25: a quarter at 3)",
    "k=turbo3-qjl,v=turbo3": "TurboQuant_prod keys: 2-bit codes + 1-bit QJL residual sketch (3 bits)",
    "turbo3-had-nc": "TurboQuant ablations: Walsh-Hadamard rotation, norm correction",
}


def _spec_error(text: str, why: str) -> SchemeError:
    err = SchemeError(
        f"bad quantization spec {text!r}: {why}. A spec is fp16, int8/int4/int2, nuq4/nuq3/nuq2 or "
        "fp8-e4m3/fp8-e5m2 (or turbo<bits>: TurboQuant, its own options) followed by "
        "[-head | -gN | -channel-gN | -tensor (fp8)] [-sym | -asym] "
        "[-sfp16 | -sbf16 | -sfp32], then in this order [-center[N]] [-rot[SEED]] [-outP] [-prerope (keys)]; "
        "examples: int8, int4-g64, int2-g32-sym, int4-channel-g64, fp8-e4m3-head, int4-g64-rot, fp16-rot"
    )
    err.unknown_name = why.startswith(_NOT_A_FAMILY)  # not a spec at all: a typo of a scheme name?
    return err


_NOT_A_FAMILY = "it does not start with"
_LONG_NUMBER = re.compile(r"\d{11,}")  # beyond every bound (the largest, a seed, has 10 digits)


def _option_kind(opt: str) -> str | None:
    if opt in ("head", "channel", "tensor") or re.fullmatch(r"g\d+", opt):
        return "granularity"
    if re.fullmatch(r"center\d*", opt):
        return "center"
    if re.fullmatch(r"rot\d*", opt) or opt == "crot":
        return "rotation"
    if re.fullmatch(r"out[0-9.]*", opt):
        return "outliers"
    if opt in ("sym", "asym"):
        return "symmetry"
    if opt.startswith("s") and opt[1:] in SCALE_DTYPES:
        return "scale dtype"
    return None


def parse_spec(text: str | QuantSpec) -> QuantSpec:
    """Parse one K or V spec such as `int4-g64` or `int4-channel-g64-sym` (a QuantSpec passes through)."""
    if isinstance(text, QuantSpec):
        return text
    if not isinstance(text, str):
        raise TypeError(
            f"parse_spec takes a spec string such as 'int4-g64' or a QuantSpec, not {type(text).__name__}"
        )
    text = text.strip().lower()
    if text.endswith(_PREROPE) and _PREROPE not in text[: -len(_PREROPE)]:
        return dataclasses.replace(parse_spec(text[: -len(_PREROPE)]), prerope=True)
    if _PREROPE in text:
        raise _spec_error(text, "-prerope comes last, once")
    engine = _parse_engine(text)
    if engine is not None:
        return engine
    if text.split("-")[0] in _NOT_SPECS:
        raise _spec_error(
            text,
            f"{text.split('-')[0]!r} is not a spec: unquantized K/V is written fp16 (kept in the model's own "
            "dtype, whatever it is; --kv-dtype sets the dtype bytes are counted at)",
        )
    if _LONG_NUMBER.search(text):
        raise _spec_error(text, "a number of 11 or more digits is beyond every bound (group sizes, seeds)")
    family = next((cls for prefix, cls in SPEC_FAMILIES.items() if text.startswith(prefix)), None)
    if family is not None:  # a family with its own options (turboB...: `TurboSpec.parse`)
        try:
            return QuantSpec(family=family.parse(text))
        except SchemeError as e:
            raise _spec_error(text, str(e)) from None
    m = _SPEC_RE.match(text)
    if not m:
        raise _spec_error(text, f"{_NOT_A_FAMILY} fp16, int<bits>, nuq<bits> or fp8-<kind>")
    bits, codebook = _parse_family(text, m)
    fp8 = m["fp8"]
    o = _parse_options(text, [o for o in m["opts"].split("-") if o], bits, fp8)
    if o["symmetric"] is None:
        o["symmetric"] = bits == 8
    if bits == 16:
        if o["rotate_calib"]:
            raise _spec_error(text, "fp16 takes no -crot (a calibrated rotation only helps a quantizer)")
        return QuantSpec(16, rotate=o["rotate"])
    return QuantSpec(bits, codebook=codebook, fp8=fp8, **o)


def _parse_engine(text: str) -> QuantSpec | None:
    """An engine's own format (`vllm:...`, `llama.cpp:...`, `mxfp4`, `nvfp4`), or None for any other text."""
    if text.startswith("vllm:"):
        text = ENGINE_ALIASES.get(text, text)
        if text.partition(":")[2] in TURBOQUANT_PRESET_NAMES:
            raise _spec_error(
                text, f"{text} stores keys and values differently: give it as the whole scheme ({text}, or "
                f"layers=A-B:{text}), or its halves k={text}.k,v={text}.v"
            )
        if text in ENGINE_REFUSED:
            raise _spec_error(text, f"{text} is not available: {ENGINE_REFUSED[text]}")
        if text not in ENGINE_FORMATS:
            known = ", ".join([*ENGINE_ALIASES, *(n for n in ENGINE_FORMATS if n.startswith("vllm:"))])
            why = f"unknown vLLM cache dtype {text.partition(':')[2]!r}; kvquant has {known}"
            raise _spec_error(text, why)
    if text not in ENGINE_FORMATS and not text.startswith("llama.cpp:"):
        return None
    if text not in ENGINE_FORMATS:
        types = ", ".join(n.partition(":")[2] for n in ENGINE_FORMATS if n.startswith("llama.cpp:"))
        raise _spec_error(
            text, f"unknown llama.cpp cache type {text.partition(':')[2]!r}; its quantized -ctk/-ctv "
            f"types are {types} (f16 is kvquant's fp16)"
        )
    return QuantSpec(ENGINE_FORMATS[text][0], engine=text)


def _parse_family(text: str, m: re.Match) -> tuple[int, bool]:
    """(bits, codebook) of a matched `fp16`, `fp8-<kind>`, `int<bits>` or `nuq<bits>`."""
    if m["fp"]:  # fp16 with options: fp16-rot
        return 16, False
    if m["family"] is None:  # fp8-<kind>
        fp8 = m["fp8"]
        if fp8 not in FP8_KINDS:
            known = " or ".join(f"fp8-{k}" for k in FP8_KINDS)
            why = f"unknown fp8 kind {fp8!r}; known: {known}" if fp8 else f"fp8 needs a kind: {known}"
            raise _spec_error(text, why)
        return 8, False
    bits = int(m["bits"])
    codebook = m["family"] == "nuq"
    if codebook and bits not in CODEBOOK_BITS:
        raise _spec_error(text, f"nuq{bits} is not supported (codebook bits must be 4, 3 or 2)")
    if not codebook and bits not in (8, 4, 2):
        raise _spec_error(text, f"int{bits} is not supported (bits must be 8, 4 or 2)")
    return bits, codebook


def _check_option_order(
    text: str, opt: str, kind: str | None, seen: dict[str, str], research: list[str]
) -> None:
    """One option of a kind at most; granularity, symmetry and scale dtype first, then -center, -rot, -out
    in that order (`research`: the research transforms given so far)."""
    if kind is not None and kind in seen:
        raise _spec_error(text, f"-{opt} conflicts with -{seen[kind]} (one {kind} option at most)")
    seen[kind] = opt
    if kind in _RESEARCH_ORDER:
        if research and _RESEARCH_ORDER.index(kind) < _RESEARCH_ORDER.index(_option_kind(research[-1])):
            why = f"-{opt} must come before -{research[-1]} (order: -center, -rot, -out)"
            raise _spec_error(text, why)
        research.append(opt)
    elif research:
        raise _spec_error(
            text,
            f"-{opt} must come before -{research[0]}: granularity, symmetry and scale dtype first, "
            "then -center, -rot, -out",
        )


def _parse_options(text: str, opts: list[str], bits: int, fp8: str | None) -> dict:
    """The flat QuantSpec keywords the options after the family give (symmetric None: not given)."""
    o = dict(granularity=Granularity.TOKEN, group_size=None, symmetric=None, scale_dtype=None, center=None,
             rotate=None, outliers=None, unit_scale=False, rotate_calib=False)
    seen: dict[str, str] = {}  # option kind -> the option given, to refuse a second one of a kind
    research: list[str] = []
    i = 0
    while i < len(opts):
        opt = opts[i]
        kind = _option_kind(opt)
        _check_option_order(text, opt, kind, seen, research)
        if bits == 16 and kind != "rotation":
            raise _spec_error(text, f"fp16 takes no -{opt} (only -rot, as in fp16-rot, and -prerope)")
        if fp8 is not None and kind == "symmetry":
            raise _spec_error(text, f"fp8 is always absmax-scaled; drop -{opt}")
        o["unit_scale"] = o["unit_scale"] or opt == "tensor"
        if fp8 is None and opt == "tensor":
            raise _spec_error(text, "-tensor (one fixed unit scale) is for fp8 only, e.g. fp8-e4m3-tensor")
        if kind == "center":
            o["center"] = int(opt[6:]) if opt[6:] else DEFAULT_CENTER
        elif kind == "rotation":
            o["rotate_calib"] = opt == "crot"  # the calibrated rotation (kvquant.codecs.calibrot)
            o["rotate"] = 0 if o["rotate_calib"] else int(opt[3:] or 0)
        elif kind == "outliers":
            if not re.fullmatch(r"out\d+(\.\d+)?", opt):
                raise _spec_error(text, f"-{opt}: -out needs a percentage, as in -out1 or -out0.5")
            o["outliers"] = float(opt[3:])
        elif opt == "tensor":
            pass  # unit_scale, above
        elif opt == "head":
            o["granularity"] = Granularity.HEAD
        elif opt == "channel":
            o["granularity"] = Granularity.CHANNEL
            if i + 1 >= len(opts) or not re.fullmatch(r"g\d+", opts[i + 1]):
                raise _spec_error(text, "-channel needs a token group after it, as in -channel-g64")
            o["group_size"] = int(opts[i + 1][1:])
            i += 1
        elif re.fullmatch(r"g\d+", opt):
            o["granularity"], o["group_size"] = Granularity.GROUP, int(opt[1:])
        elif opt in ("sym", "asym"):
            o["symmetric"] = opt == "sym"
        elif opt.startswith("s") and opt[1:] in SCALE_DTYPES:
            o["scale_dtype"] = opt[1:]
        else:
            raise _spec_error(text, f"unknown option -{opt}")
        i += 1
    if o["group_size"] == 0:
        raise _spec_error(text, "a group size must be at least 1")
    if o["center"] == 0:
        raise _spec_error(text, "-center needs at least 1 token per offset")
    if o["outliers"] is not None and not 0 < o["outliers"] <= MAX_OUTLIER_PERCENT:
        why = f"-out{o['outliers']:g} must keep a percentage in (0, {MAX_OUTLIER_PERCENT:g}]"
        raise _spec_error(text, why)
    return o


def format_spec(spec: QuantSpec) -> str:
    """The canonical string of a spec, each typed part printing its own piece in the grammar's order:
    family, grain, symmetry (when not the default), scale dtype, transforms, -prerope;
    parse_spec(format_spec(s)) == s."""
    parts = [spec.family.name()]
    if spec.grain is not None:
        parts.append(spec.grain.option())
    if isinstance(spec.family, (UniformInt, Codebook)) and spec.symmetric != (spec.bits == 8):
        parts.append("sym" if spec.symmetric else "asym")
    if spec.scale_dtype is not None:
        parts.append("s" + spec.scale_dtype)
    parts += [t.option() for t in spec.transforms]
    if spec.prerope:
        parts.append(_PREROPE[1:])
    return "-".join(p for p in parts if p)


def _tq_preset_of(key: QuantSpec, value: QuantSpec) -> str | None:
    """`vllm:turboquant_4bit_nc` when key and value are that preset's two halves (and nothing else)."""
    if key.engine is None or value.engine is None or key.prerope or value.prerope:
        return None
    name = key.engine.removesuffix(".k")
    ok = key.engine.endswith(".k") and value.engine == name + ".v"
    return name if ok and name.partition(":")[2] in TURBOQUANT_PRESET_NAMES else None


def _format_pair(key: QuantSpec, value: QuantSpec) -> str:
    if _tq_preset_of(key, value):
        return _tq_preset_of(key, value)
    return format_spec(key) if key == value else f"{format_spec(key)}/{format_spec(value)}"


def format_scheme(scheme: Scheme) -> str:
    """The canonical string of a scheme; parse_scheme(format_scheme(s)) == s."""
    if scheme.layers:
        ranges = [
            f"{r.first}{'' if r.first == r.last else f'-{r.last}'}:{_format_pair(r.key, r.value)}"
            for r in scheme.layers
        ]
        items = ["layers=" + "+".join(ranges)]
    elif scheme.key == scheme.value or _tq_preset_of(scheme.key, scheme.value):
        items = [_format_pair(scheme.key, scheme.value)]
    else:
        items = [f"k={format_spec(scheme.key)}", f"v={format_spec(scheme.value)}"]
    if scheme.sink:
        items.append(f"sink={scheme.sink}")
    if scheme.window:
        items.append(f"window={scheme.window}")
    if scheme.salient is not None:
        items.append(f"salient={scheme.salient}")
    if scheme.calib is not None:
        items.append(f"calib={scheme.calib}")
    return ",".join(items)


# a few of EXAMPLES and the presets: what a refusal lists (all of them: --list-schemes)
_SHORT_LIST = (
    "fp16", "int8", "int8-head", "int4-g64", "int2-g32", "int4-g64-rot", "fp8-e4m3",
    "k=int4-channel-g64,v=int4-g64,window=128", "nuq4-g64,calib=FILE", "kivi-4", "kivi-2",
)
_ITEMS = ("k=", "v=", "sink=", "window=", "layers=", "calib=", "salient=")


def did_you_mean(text: str) -> list[str]:
    """The preset or example scheme closest to a mistyped one (`kivi2` -> ['kivi-2']), or []."""
    raw = str(text).strip().lower().replace(" ", "")
    return difflib.get_close_matches(raw, [*_PRESET_DEFS, *EXAMPLES], n=1, cutoff=0.75)


def _scheme_error(text: str, why: str) -> SchemeError:
    near = did_you_mean(text)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    return SchemeError(
        f"bad scheme {text!r}: {why}.{hint}\nKnown schemes and presets: {', '.join(_SHORT_LIST)}, ...\n"
        "Grammar: SPEC | k=SPEC,v=SPEC | layers=A-B:SPEC[/VSPEC]+C-D:..., optionally with ,sink=N ,window=N "
        ",salient=N/G ,calib=FILE; every form, example and preset: `python experiments/run.py --list-schemes`"
    )


_RANGE_RE = re.compile(r"^(?P<first>\d{1,9})(-(?P<last>\d{1,9}))?$")


def _parse_layers(val: str) -> tuple[LayerSpecs, ...]:
    """`0-3:int8+4-29:int4-channel-g64/int4-g64` (`;` separates ranges too) -> LayerSpecs in order."""
    out = []
    for part in re.split(r"[+;]", val):
        rng, colon, specs = part.partition(":")
        m = _RANGE_RE.match(rng)
        if not colon or not m or not specs:
            raise SchemeError(
                f"bad layer range {part!r} in layers=: write A-B:SPEC or A:SPEC (K/V specs as KSPEC/VSPEC), "
                "ranges joined by +, e.g. layers=0-3:int8+4-29:int4-channel-g64/int4-g64"
            )
        first = int(m["first"])
        last = int(m["last"]) if m["last"] is not None else first
        k, slash, v = specs.partition("/")
        key = parse_spec(k)
        value = parse_spec(v) if slash else key
        out.append(LayerSpecs(first, last, key, value))
    return tuple(out)


_ENGINE_PAIR = re.compile(
    r"^\s*llama\.cpp:\s*k\s*=\s*([a-z0-9_-]+)\s*,\s*v\s*=\s*([a-z0-9_-]+)\s*(?=,|$)", re.IGNORECASE
)
_TQ_NAMES = "|".join(TURBOQUANT_PRESET_NAMES)
# vllm:turboquant_4bit_nc as a whole item -> k=...k,v=...v; as a layers= range spec -> ...k/...v
_TQ_ITEM = re.compile(rf"(?:^|(?<=,))\s*vllm:\s*({_TQ_NAMES})\s*(?=,|$)", re.IGNORECASE)
_TQ_RANGE = re.compile(rf"(?<=:)\s*vllm:\s*({_TQ_NAMES})\s*(?=[+;,]|$)", re.IGNORECASE)


def require_scheme(scheme: object, who: str) -> Scheme:
    """`scheme` itself when it is a parsed Scheme; else a TypeError naming `who` (a function past the entry
    points, which parse the user's text once) and the fix."""
    if not isinstance(scheme, Scheme):
        raise TypeError(
            f"{who} takes a parsed Scheme (kvquant.parse_scheme), not {type(scheme).__name__} {scheme!r}"
        )
    return scheme


def parse_scheme(text: str | Scheme) -> Scheme:
    """Parse a scheme string (or pass a Scheme through). Raises SchemeError naming the bad part."""
    if isinstance(text, Scheme):
        return text
    if not isinstance(text, str):
        raise TypeError(
            f"parse_scheme takes a scheme string such as 'int4-g64' or a Scheme, not {type(text).__name__} "
            f"({text!r})"
        )
    if not text.strip():
        raise _scheme_error(text, "it is empty")
    text = _expand_engine_items(text)
    raw = text.strip().lower().replace(" ", "")
    if raw in _PRESET_DEFS:
        return dataclasses.replace(parse_scheme(_PRESET_DEFS[raw][0]), name=raw)
    items = _parse_items(text, raw)
    if items.budget is not None:  # the allocation stored in the calibration file (kvquant.calibration)
        return _budget_scheme(text, items)
    return _build_scheme(text, items)


def _expand_engine_items(text: str) -> str:
    """Rewrite the engine shorthands into the grammar's own items: `llama.cpp:k=q8_0,v=q4_0` (as -ctk, -ctv)
    -> k=llama.cpp:q8_0,v=llama.cpp:q4_0; a vLLM TurboQuant preset as a whole item -> its k= and v= halves,
    as a layers= range spec -> its KSPEC/VSPEC halves."""
    text = _ENGINE_PAIR.sub(r"k=llama.cpp:\1,v=llama.cpp:\2", text)
    text = _TQ_ITEM.sub(lambda m: f"k=vllm:{m[1].lower()}.k,v=vllm:{m[1].lower()}.v", text)
    return _TQ_RANGE.sub(lambda m: f"vllm:{m[1].lower()}.k/vllm:{m[1].lower()}.v", text)


@dataclass
class _Items:
    """The items of one scheme string, each parsed on its own (None: not given); `_build_scheme` checks how
    they combine."""

    both: QuantSpec | None = None  # a bare SPEC, for K and V
    key: QuantSpec | None = None
    value: QuantSpec | None = None
    layers: tuple[LayerSpecs, ...] | None = None
    calib: str | None = None
    budget: float | None = None
    salient: Salient | None = None
    ints: dict[str, int] = field(default_factory=dict)  # sink=, window=


def _parse_items(text: str, raw: str) -> _Items:
    """Parse each comma-separated item of `text` (`raw`: lower case, no spaces) into `_Items`, refusing an
    empty item and an item given twice; an item's own error is re-raised as a scheme error."""
    items = _Items()
    given: dict[str, str] = {}  # item name (k for key=) -> the item, to refuse a second one
    # items split on the original text too: a calib= path keeps its case and its inner spaces
    originals = text.strip().split(",")
    for n, (item, original) in enumerate(zip(raw.split(","), originals, strict=True)):
        name, eq, _ = item.partition("=")
        if not item:
            raise _empty_item_error(text, n, len(originals))
        canon = {"key": "k", "value": "v"}.get(name, name) if eq else "spec"
        if canon in given and canon != "spec":
            raise _scheme_error(
                text, f"{canon}= is given twice ({given[canon]!r} and {item!r}); give each item once"
            )
        given[canon] = item
        try:
            _parse_item(text, items, item, original)
        except SchemeError as e:
            if str(e).startswith("bad scheme"):
                raise
            if getattr(e, "unknown_name", False) and did_you_mean(text):
                raise _scheme_error(text, f"{item!r} is neither a spec nor a preset") from None
            raise _scheme_error(text, str(e)) from None
    return items


def _empty_item_error(text: str, n: int, count: int) -> SchemeError:
    """Item `n` (0-based) of `count` is empty: name the comma that made it."""
    where = "a trailing comma" if n == count - 1 else ("a leading comma" if n == 0 else "two commas in a row")
    return _scheme_error(text, f"item {n + 1} is empty ({where}); remove the extra comma")


def _parse_item(text: str, items: _Items, item: str, original: str) -> None:
    """Parse one item (`item` lower case without spaces, `original` as written) into `items`."""
    name, eq, val = item.partition("=")
    if not eq:
        if items.both is not None:
            raise _scheme_error(
                text, f"two specs {items.both} and {item!r}; use k=...,v=... for different K and V"
            )
        items.both = parse_spec(item) if item not in _PRESET_DEFS else None
        if items.both is None:
            raise _scheme_error(text, f"preset {item!r} cannot be combined with other items")
    elif name in ("k", "key"):
        items.key = parse_spec(val)
    elif name in ("v", "value"):
        items.value = parse_spec(val)
    elif name in ("sink", "window"):
        items.ints[name] = _parse_tokens(text, name, val)
    elif name == "layers":
        items.layers = _parse_layers(val)
    elif name == "budget":
        items.budget = _parse_budget(text, val)
    elif name == "salient":
        items.salient = _parse_salient(val)
    elif name == "calib":
        items.calib = _parse_calib(text, original)
    else:
        raise _unknown_item_error(text, name)


def _parse_tokens(text: str, name: str, val: str) -> int:
    """The token count of `sink=N` or `window=N`: a non-negative integer of at most 10 digits."""
    if not re.fullmatch(r"\d{1,10}", val):  # \d: what int() reads (str.isdigit also takes '²')
        why = "too large" if re.fullmatch(r"\d+", val) else "not a non-negative integer"
        raise _scheme_error(text, f"{name}={val!r} is {why} (tokens, e.g. {name}=128)")
    return int(val)


def _parse_budget(text: str, val: str) -> float:
    """The average bits of `budget=B`, in (0, 16]."""
    if not re.fullmatch(r"\d{1,2}(\.\d{1,6})?", val) or not 0 < float(val) <= 16:
        why = f"budget={val!r} must be average bits in (0, 16], e.g. budget=3.0"
        raise _scheme_error(text, why)
    return float(val)


_SALIENT_RE = re.compile(r"^(?P<n>\d{1,4})/(?P<g>\d{1,5})(?P<rest>(:[^:]+)*)$")


def _parse_salient(val: str) -> Salient:
    """`N/G[:SPEC][:RULE]` of `salient=` (`Salient`); a part after N/G is a rule name or a spec."""
    m = _SALIENT_RE.match(val)
    if not m:
        raise SchemeError(
            f"salient={val!r}: write salient=N/G[:SPEC][:RULE], e.g. salient=2/64, salient=4/64:int8-head, "
            f"salient=2/64:stride (rules: {', '.join(SALIENT_RULES)})"
        )
    spec, rule = FP16, "attn"
    parts = [p for p in m["rest"].split(":") if p]
    for i, part in enumerate(parts):
        if part in SALIENT_RULES and i == len(parts) - 1:
            rule = part
        elif i == 0 and part not in SALIENT_RULES:
            spec = parse_spec(part)
        else:
            raise SchemeError(f"salient={val!r}: after N/G give at most a spec, then a rule "
                              f"({', '.join(SALIENT_RULES)})")
    return Salient(int(m["n"]), int(m["g"]), spec, rule)


def _parse_calib(text: str, original: str) -> str:
    """The path of `calib=FILE`, taken from the item as written (its case and inner spaces kept)."""
    calib = original.partition("=")[2].strip()
    if not calib:
        raise _scheme_error(text, "calib= needs a file path (written by experiments/calibrate.py)")
    return calib


def _unknown_item_error(text: str, name: str) -> SchemeError:
    """`name=` is no item of the grammar: list the valid ones and the closest."""
    valid = ["k", "v", "sink", "window", "layers", "calib", "budget", "salient"]
    near = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {near[0]}=?" if near else ""
    return _scheme_error(
        text,
        f"unknown item {name!r} (valid: k=, v=, sink=, window=, layers=, calib=, budget=, salient=){hint}",
    )


def _budget_scheme(text: str, items: _Items) -> Scheme:
    """`budget=B,calib=FILE`: no spec beside it, and the allocation read from the calibration file."""
    if items.both is not None or items.key is not None or items.value is not None or items.layers is not None:
        raise _scheme_error(text, "budget= stands for the specs: give no spec, k=, v= or layers= with it")
    if items.salient is not None:
        raise _scheme_error(text, "budget= is the stored allocation as measured (without salient=); give "
                                  "its layers= scheme with salient= instead")
    if items.calib is None:
        raise _scheme_error(
            text, "budget= is resolved through a calibration file: add calib=FILE (written by "
            "experiments/allocate.py --budget-bits B --calib FILE --write-calib)"
        )
    return _resolve_budget(items.budget, items.calib, items.ints.get("sink"), items.ints.get("window"))


def _build_scheme(text: str, items: _Items) -> Scheme:
    """The Scheme of the parsed items: exactly one of a spec, k= with v=, or layers=, and a calib= file
    when a spec is fitted offline."""
    key, value, both, layers = items.key, items.value, items.both, items.layers
    if layers is not None:
        if both is not None or key is not None or value is not None:
            raise _scheme_error(text, "give either a spec (or k= and v=) or layers=, not both")
        key, value = layers[0].key, layers[0].value
    elif both is not None and (key is not None or value is not None):
        raise _scheme_error(text, "give either one spec for both or k= and v=, not both")
    elif both is None and (key is None or value is None):
        raise _scheme_error(text, "k= needs a matching v= (and the other way round)")
    if both is not None:
        key = value = both
    try:
        scheme = Scheme(
            key, value, items.ints.get("sink", 0), items.ints.get("window", 0), layers=layers or (),
            calib=items.calib, salient=items.salient,
        )
    except SchemeError as e:
        raise _scheme_error(text, str(e)) from None
    if scheme.needs_calibration and scheme.calib is None:
        raise _scheme_error(
            text,
            "nuqN specs (codebooks) and -crot (calibrated rotations) are fitted offline; run `"
            + CALIBRATE_COMMAND.format(scheme=str(scheme))
            + "` and add ,calib=calib/NAME.safetensors to the scheme",
        )
    return scheme


def list_schemes() -> list[str]:
    """Example scheme strings and preset names (any string following the grammar is valid too)."""
    return list(EXAMPLES) + list(_PRESET_DEFS)


def scheme_help() -> str:
    """A printable table of the grammar, the examples and the presets."""
    lines = [__doc__.strip(), "", "Examples:"]
    lines += [f"  {name:<50} {what}" for name, what in EXAMPLES.items()]
    lines += ["", "Presets:"]
    lines += [f"  {name:<10} = {expansion:<40} {what}" for name, (expansion, what) in _PRESET_DEFS.items()]
    return "\n".join(lines)


PRESETS: dict[str, Scheme] = {name: parse_scheme(name) for name in _PRESET_DEFS}


def _resolve_budget(budget: float, calib: str, sink: int | None, window: int | None) -> Scheme:
    """`budget=B,calib=FILE`: the per-layer scheme `experiments/allocate.py --write-calib` stored in FILE's
    JSON for B average bits (with its sink and window; a sink= / window= given beside budget= must match
    them), with calib=FILE. Reads the JSON side only (no torch)."""
    from .calibfile import CalibrationError, stored_allocation

    text, js = stored_allocation(budget, calib)
    scheme = parse_scheme(f"{text},calib={calib}")  # stored without calib=: this file is it
    for name, want in (("sink", sink), ("window", window)):
        if want is not None and want != getattr(scheme, name):
            raise CalibrationError(
                f"budget={budget:g} in {js} was allocated with {name}={getattr(scheme, name)}, not "
                f"{name}={want}; drop {name}= or allocate again with --{name} {want} --write-calib"
            )
    return scheme
