"""The typed parts of one K or V spec (`kvquant.scheme.QuantSpec`), parsed once from its string:

    part         what it says                          objects
    family       what a stored value is                Dense() (fp16), UniformInt(bits, symmetric),
                                                       Codebook(bits, symmetric) (nuqN),
                                                       FP8(kind, unit_scale),
                                                       EngineFormat(name) (llama.cpp / ggml blocks),
                                                       VLLMCacheDtype(name), TurboSpec(bits, ...) (turboB)
    grain        which elements share a scale (and     PerToken(), PerHead(), ChannelGroups(channels=N),
                 zero); None: the spec has no scales   TokenGroups(tokens=N)
                 of its own (fp16, fp8 -tensor, engine
                 formats, TurboQuant)
    transforms   what changes K/V before the family's  Center(tokens), Rotate(seed), CalibRotate(),
                 codec encodes it, outermost first     Outliers(percent)

    int4-channel-g64-sym-center-rot7   family UniformInt(4, symmetric=True), grain TokenGroups(tokens=64),
                                       transforms (Center(64), Rotate(7))

Each part prints its own piece of the spec string (`option`) and checks a head_dim against itself
(`check_head_dim`); `QuantSpec` validates the combination. A grain's `extent(heads, head_dim)` is the block
(heads, tokens, channels) that shares one scale, what `kvquant.codecs.base.block_extent` hands every codec.
The codec of each family and transform type is registered by its module in `kvquant.codecs`
(`kvquant.codecs.base.register`). No torch here: CLIs validate schemes before the heavy imports.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "CalibRotate",
    "Center",
    "ChannelGroups",
    "Codebook",
    "Dense",
    "EngineFormat",
    "FP8",
    "Family",
    "Grain",
    "Granularity",
    "Outliers",
    "PerHead",
    "PerToken",
    "Rotate",
    "SchemeError",
    "TokenGroups",
    "Transform",
    "TurboSpec",
    "UniformInt",
    "VLLMCacheDtype",
]


class SchemeError(ValueError):
    """A scheme string or config that cannot be used; the message names the bad part and what is valid."""


class Granularity(str, enum.Enum):
    """Which elements of a (B, H_kv, T, D) tensor share one scale (and zero): the flat name of a grain."""

    TOKEN = "token"  # (B, H, T, D) -> scale (B, 1, T, 1)
    HEAD = "head"  # (B, H, T, D) -> scale (B, H, T, 1)
    GROUP = "group"  # (B, H, T, D) -> scale (B, H, T, D // N)
    CHANNEL = "channel"  # (B, H, T, D) -> scale (B, H, T // N, D)


DEFAULT_CENTER = 64  # tokens per stored key offset of `-center`
MAX_SEED = 2**31 - 1  # -rotS seeds a torch.Generator; 31 bits are portable (numpy, torch, every platform)
MAX_TOKENS = 1 << 24  # sink, window, token groups and -center: 16M tokens, beyond every model's positions
# Engine block formats (`kvquant.codecs.engine`), by canonical spec name: (nominal bits per value, values per
# block along head_dim). llama.cpp's names are its -ctk / -ctv cache types; MXFP4 / NVFP4 are ggml's blocks.
ENGINE_FORMATS: dict[str, tuple[int, int]] = {
    "llama.cpp:q8_0": (8, 32),
    "llama.cpp:q4_0": (4, 32),
    "llama.cpp:q4_1": (4, 32),
    "llama.cpp:q5_0": (5, 32),
    "llama.cpp:q5_1": (5, 32),
    "llama.cpp:iq4_nl": (4, 32),
    "mxfp4": (4, 32),
    "nvfp4": (4, 64),
    # vLLM's --kv-cache-dtype values (`kvquant.codecs.engine_vllm`): one scale per tensor or per (token, head)
    "vllm:fp8_e4m3": (8, 1),
    "vllm:fp8_e5m2": (8, 1),
    "vllm:int8_per_token_head": (8, 1),
    "vllm:fp8_per_token_head": (8, 1),
    "vllm:int4_per_token_head": (4, 2),  # two codes a byte after vLLM's Hadamard rotation (power-of-two D)
    # vLLM's TurboQuant presets, one spec per half (`kvquant.codecs.engine_vllm.TurboQuantCodec`): the scheme
    # item `vllm:turboquant_4bit_nc` expands to k=vllm:turboquant_4bit_nc.k,v=vllm:turboquant_4bit_nc.v
    "vllm:turboquant_k8v4.k": (8, 1),
    "vllm:turboquant_k8v4.v": (4, 2),
    "vllm:turboquant_4bit_nc.k": (4, 2),
    "vllm:turboquant_4bit_nc.v": (4, 2),
    "vllm:turboquant_k3v4_nc.k": (3, 8),
    "vllm:turboquant_k3v4_nc.v": (4, 2),
    "vllm:turboquant_3bit_nc.k": (3, 8),
    "vllm:turboquant_3bit_nc.v": (3, 8),
    # llama.cpp's attention rotation (`kvquant.codecs.engine`): the plain names rotate when head_dim % 64 == 0
    # (llama.cpp's default since April 2026), -norot never (LLAMA_ATTN_ROT_DISABLE=1), -rot always (refused
    # when head_dim is not a multiple of 64)
    **{
        f"llama.cpp:{t}-{r}": (b, 64 if r == "rot" else 32)
        for t, b in (("q8_0", 8), ("q4_0", 4), ("q4_1", 4), ("q5_0", 5), ("q5_1", 5), ("iq4_nl", 4))
        for r in ("norot", "rot")
    },
}


def rotation_block(head_dim: int) -> int:
    """Size of the Walsh-Hadamard blocks `-rot` applies over D: the largest power of two dividing head_dim
    (all of D for 64, 128, 256; 32 for 96: a block-diagonal rotation)."""
    return head_dim & -head_dim


def _check_packing(bits: int, head_dim: int) -> None:
    if head_dim * bits % 8:
        raise SchemeError(
            f"head_dim {head_dim} cannot be packed at {bits} bits (head_dim * bits must be a multiple of 8)"
        )


# ------------------------------------------------------------------------------------------------ grains


@dataclass(frozen=True)
class PerToken:
    """One scale per token over all KV heads (H_kv x D): x (2, 3, 5, 64) -> scale (2, 1, 5, 1)."""

    granularity: ClassVar[Granularity] = Granularity.TOKEN
    group_size: ClassVar[int | None] = None
    tokens: ClassVar[int] = 1  # tokens that must arrive before they can be quantized

    def extent(self, heads: int, head_dim: int) -> tuple[int, int, int]:
        """(heads, tokens, channels) of one block sharing a scale."""
        return heads, 1, head_dim

    def option(self) -> str:
        return ""

    def check_head_dim(self, head_dim: int) -> None:
        return None


@dataclass(frozen=True)
class PerHead:
    """One scale per (token, head) over D (`-head`): x (2, 3, 5, 64) -> scale (2, 3, 5, 1)."""

    granularity: ClassVar[Granularity] = Granularity.HEAD
    group_size: ClassVar[int | None] = None
    tokens: ClassVar[int] = 1

    def extent(self, heads: int, head_dim: int) -> tuple[int, int, int]:
        return 1, 1, head_dim

    def option(self) -> str:
        return "head"

    def check_head_dim(self, head_dim: int) -> None:
        return None


@dataclass(frozen=True)
class ChannelGroups:
    """One scale per `channels` consecutive channels of D within a (token, head) (`-gN`):
    x (2, 3, 5, 64), channels=32 -> scale (2, 3, 5, 2)."""

    channels: int
    granularity: ClassVar[Granularity] = Granularity.GROUP
    tokens: ClassVar[int] = 1

    @property
    def group_size(self) -> int:
        return self.channels

    def extent(self, heads: int, head_dim: int) -> tuple[int, int, int]:
        return 1, 1, self.channels

    def option(self) -> str:
        return f"g{self.channels}"

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.channels:
            raise SchemeError(
                f"group size {self.channels} does not divide head_dim {head_dim}; "
                f"pick a divisor of {head_dim} (for example -g{math.gcd(head_dim, 64)})"
            )


@dataclass(frozen=True)
class TokenGroups:
    """One scale per (head, channel) over `tokens` consecutive tokens (`-channel-gN`, KIVI's keys):
    x (2, 3, 64, 64), tokens=32 -> scale (2, 3, 2, 64)."""

    tokens: int
    granularity: ClassVar[Granularity] = Granularity.CHANNEL

    @property
    def group_size(self) -> int:
        return self.tokens

    def extent(self, heads: int, head_dim: int) -> tuple[int, int, int]:
        return 1, self.tokens, 1

    def option(self) -> str:
        return f"channel-g{self.tokens}"

    def check_head_dim(self, head_dim: int) -> None:
        return None


Grain = PerToken | PerHead | ChannelGroups | TokenGroups
GRAINS: dict[Granularity, type] = {g.granularity: g for g in (PerToken, PerHead, ChannelGroups, TokenGroups)}


def grain_of(granularity: Granularity, group_size: int | None) -> Grain:
    """The grain object of a flat (granularity, group_size) pair."""
    cls = GRAINS[granularity]
    return cls(group_size) if granularity in (Granularity.GROUP, Granularity.CHANNEL) else cls()


# ---------------------------------------------------------------------------------------------- families

# Families with a grammar of their own (the whole spec but -prerope), by the prefix their strings start with:
# `parse_spec` hands such a string to cls.parse(text) and `str(spec)` prints family.name().
SPEC_FAMILIES: dict[str, type] = {}


def _match_or_refuse(pattern: re.Pattern, text: str, usage: str) -> re.Match:
    """A family's own grammar: the match of `text`, or SchemeError saying how to write it."""
    m = pattern.match(text)
    if not m:
        raise SchemeError(usage)
    return m


def spec_family(prefix: str) -> Callable[[type], type]:
    """Class decorator: strings starting with `prefix` are specs of this family (`turbo`: TurboSpec). The
    class gives parse(text) (raising SchemeError with what is valid), name(), bits and
    check_head_dim(head_dim)."""

    def add(cls: type) -> type:
        known = (*SPEC_FAMILIES, *_BUILTIN_PREFIXES)
        taken = [p for p in known if p.startswith(prefix) or prefix.startswith(p)]
        if taken and SPEC_FAMILIES.get(prefix) is not cls:
            raise ValueError(f"spec prefix {prefix!r} overlaps {taken}: a spec string must name one family")
        SPEC_FAMILIES[prefix] = cls
        return cls

    return add


# what the built-in grammar reads (kvquant.scheme.parse_spec)
_BUILTIN_PREFIXES = ("fp16", "int", "nuq", "fp8", "llama.cpp:", "vllm:", "mxfp4", "nvfp4")



@dataclass(frozen=True)
class Dense:
    """`fp16`: K/V kept as they are, in the model's dtype."""

    bits: ClassVar[int] = 16
    symmetric: ClassVar[bool] = False

    def name(self) -> str:
        return "fp16"

    def check_head_dim(self, head_dim: int) -> None:
        return None


@dataclass(frozen=True)
class UniformInt:
    """`int8` / `int4` / `int2`: uniform levels, symmetric absmax (signed codes) or asymmetric min/max (a
    float zero point); the default is symmetric for int8, asymmetric below."""

    bits: int
    symmetric: bool = False

    def name(self) -> str:
        return f"int{self.bits}"

    def check_head_dim(self, head_dim: int) -> None:
        _check_packing(self.bits, head_dim)


@dataclass(frozen=True)
class Codebook:
    """`nuq4` / `nuq3` / `nuq2`: non-uniform levels, a codebook fitted offline per layer and K/V (calib=),
    over blocks normalized to [-1, 1] by their scale (and mid-range, asymmetric); the default symmetry as
    for int (asymmetric below 8 bits)."""

    bits: int
    symmetric: bool = False

    def name(self) -> str:
        return f"nuq{self.bits}"

    def check_head_dim(self, head_dim: int) -> None:
        _check_packing(self.bits, head_dim)


@dataclass(frozen=True)
class FP8:
    """`fp8-e4m3` / `fp8-e5m2`: torch's float8 codes, absmax-scaled per block of the grain, or (unit_scale,
    `-tensor`) one fixed unit scale with nothing stored."""

    kind: str
    unit_scale: bool = False
    bits: ClassVar[int] = 8
    symmetric: ClassVar[bool] = True  # absmax-scaled

    def name(self) -> str:
        return f"fp8-{self.kind}" + ("-tensor" if self.unit_scale else "")

    def check_head_dim(self, head_dim: int) -> None:
        return None


@dataclass(frozen=True)
class EngineFormat:
    """An engine's block format stored bit for bit as the engine lays it out (`kvquant.codecs.engine`):
    llama.cpp's cache types and ggml's MXFP4 / NVFP4 blocks (a key of `ENGINE_FORMATS`)."""

    format: str
    symmetric: ClassVar[bool] = False

    @property
    def bits(self) -> int:
        """The format's nominal bits per value."""
        return ENGINE_FORMATS[self.format][0]

    @property
    def block(self) -> int:
        """Values per block along head_dim."""
        return ENGINE_FORMATS[self.format][1]

    def name(self) -> str:
        return self.format

    def check_head_dim(self, head_dim: int) -> None:
        if self.format.endswith("-rot") and head_dim % 64:
            raise SchemeError(
                f"{self.format}: llama.cpp rotates Q/K/V only when head_dim is a multiple of 64 "
                f"(llama-kv-cache.cpp: n_embd_head_k % 64 == 0); head_dim {head_dim} is not (the plain "
                f"{self.format[:-4]} keeps llama.cpp's default, no rotation at this head_dim)"
            )
        if head_dim % self.block:
            raise SchemeError(
                f"{self.format} stores blocks of {self.block} values along head_dim (ggml asserts "
                f"k % {self.block} == 0): head_dim {head_dim} is not a multiple of {self.block}"
            )


@dataclass(frozen=True)
class VLLMCacheDtype(EngineFormat):
    """vLLM's `--kv-cache-dtype` formats (`vllm:...`, `kvquant.codecs.engine_vllm`), bit for bit."""

    def check_head_dim(self, head_dim: int) -> None:
        if self.format == "vllm:int4_per_token_head" and head_dim & (head_dim - 1):
            raise SchemeError(
                f"{self.format} rotates K and V with a Walsh-Hadamard transform (vLLM's "
                f"fast_hadamard_transform asserts a power-of-two dim): head_dim {head_dim} is not a power "
                "of two"
            )
        if not self.format.startswith("vllm:turboquant_"):
            return super().check_head_dim(head_dim)
        if self.format.endswith(".k") and self.bits < 8 and head_dim & (head_dim - 1):
            raise SchemeError(
                f"{self.format} rotates keys with a Sylvester Hadamard matrix (vLLM's "
                f"_build_hadamard): head_dim {head_dim} is not a power of two"
            )
        if self.format.startswith("vllm:turboquant_k8v4") and head_dim > 256:
            raise SchemeError(
                "turboquant_k8v4 requires FlashAttention-compatible head_size <= 256 (vLLM's "
                f"TurboQuantAttentionBackend.supports_combination): head_dim {head_dim}"
            )
        if head_dim % self.block:
            raise SchemeError(
                f"{self.format} packs {self.block} codes at a time along head_dim (vLLM's TurboQuant "
                f"store): head_dim {head_dim} is not a multiple of {self.block}"
            )
        return None


def engine_family(name: str) -> EngineFormat:
    """The family object of an engine format name (vLLM's or ggml's)."""
    return VLLMCacheDtype(name) if name.startswith("vllm:") else EngineFormat(name)


TURBO_ROTATIONS = ("dense", "hadamard")
TURBO_BLOCK = 16  # tokens per choice of outlier channels (one page of the default store)
_TURBO_RE = re.compile(
    r"^turbo(?P<bits>\d)(?:\.(?P<frac>25|5|75))?(?P<qjl>-qjl)?(?P<had>-had)?(?P<nc>-nc)?"
    r"(?:-seed(?P<seed>\d{1,10}))?(?:-block(?P<block>\d{1,8}))?$"
)


@spec_family("turbo")
@dataclass(frozen=True)
class TurboSpec:
    """TurboQuant (Zandieh et al., ICLR 2026; `kvquant.codecs.turbo`): per (token, head) vector, its norm
    (fp16) and a random rotation of its direction quantized coordinate by coordinate with Lloyd-Max levels
    of the rotated coordinate's distribution.

    bits: bits per coordinate of the regular channels, the QJL bit included (1..4).
    high: quarters of the D channels (0..3) that are outlier channels at bits + 1, each group its own
        TurboQuant instance (norm, rotation, levels): `turbo2.25` = D/4 channels at 3 bits, 3D/4 at 2.
    qjl: the MSE stage at bits - 1 and a 1-bit QJL sketch of the residual with its norm (TurboQuant_prod).
    rotation: "dense" (Haar orthogonal from a QR, the paper's) or "hadamard" (kvquant's -rot: H diag(s)).
    norm_correction: store norm / |decoded direction| so the decoded vector keeps the input's norm.
    seed: seeds the rotations and the QJL projection.
    block: tokens per choice of outlier channels (split specs: a D-bit mask per head every `block` tokens).
    """

    bits: int
    high: int = 0
    qjl: bool = False
    rotation: str = "dense"
    norm_correction: bool = False
    seed: int = 0
    block: int = TURBO_BLOCK
    symmetric: ClassVar[bool] = False

    def __post_init__(self) -> None:
        ints = (self.bits, self.high, self.seed, self.block)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in ints):
            raise SchemeError(f"turbo bits, high, seed and block must be integers, got {ints}")
        top = self.bits + (self.high > 0)
        if not (1 <= self.bits <= 4 and 0 <= self.high <= 3 and top <= 4):
            raise SchemeError(
                f"turbo{self.code_bits:g}: codes have 1..4 bits (outlier channels at bits + 1 <= 4), and "
                "0..3 quarters of the channels are outliers: turbo1 .. turbo4, turbo2.5, turbo3.5, turbo3.75"
            )
        if self.qjl and self.bits < 2:
            raise SchemeError("-qjl spends one of the bits on the QJL sketch: it needs turbo2 or more")
        if self.rotation not in TURBO_ROTATIONS:
            known = ", ".join(TURBO_ROTATIONS)
            raise SchemeError(f"unknown turbo rotation {self.rotation!r}; known: {known}")
        if not 0 <= self.seed <= MAX_SEED:
            raise SchemeError(f"turbo -seed{self.seed}: the seed must lie in 0..{MAX_SEED}")
        if not 1 <= self.block <= MAX_TOKENS:
            raise SchemeError(f"turbo -block{self.block}: 1..{MAX_TOKENS:,} tokens per outlier choice")
        if self.block != TURBO_BLOCK and not self.high:
            raise SchemeError("-blockN (how often outliers are chosen) is for split specs only (turbo2.5)")

    @property
    def code_bits(self) -> float:
        """Code bits per coordinate, averaged over D (norms and masks not counted): the spec's number."""
        return self.bits + self.high / 4

    @property
    def token_group(self) -> int:
        return self.block if self.high else 1

    def groups(self, head_dim: int) -> tuple[tuple[int, int], ...]:
        """(channels, code bits) of each TurboQuant instance: the outlier group first, the QJL bit
        excluded (the MSE stage's bits)."""
        mse = self.bits - self.qjl
        n_high = head_dim * self.high // 4
        if not n_high:
            return ((head_dim, mse),)
        return ((n_high, mse + 1), (head_dim - n_high, mse))

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 8 or head_dim < 8 or (self.high and head_dim % 32):
            raise SchemeError(
                f"turbo{self.code_bits:g} needs a head_dim that is a multiple of 8 (32 for an outlier split, "
                f"so each group packs whole bytes); got {head_dim}"
            )
        if self.rotation == "hadamard":
            bad = [n for n, _ in self.groups(head_dim) if n & (n - 1)]
            if bad:
                raise SchemeError(
                    f"turbo -had rotates each channel group with a Walsh-Hadamard transform, which needs a "
                    f"power of two; groups of {bad} channels are not: drop -had (dense rotation) or use "
                    "turbo2.5 / turbo3.5 (halves)"
                )

    @classmethod
    def parse(cls, text: str) -> TurboSpec:
        m = _match_or_refuse(
            _TURBO_RE, text, "write turbo<bits>[.25|.5|.75][-qjl][-had][-nc][-seedS][-blockN] "
            "(options in this order), e.g. turbo3, turbo3.5, turbo2.5-qjl, turbo3-had-nc",
        )
        frac = {None: 0, "25": 1, "5": 2, "75": 3}[m["frac"]]
        return cls(
            int(m["bits"]), frac, bool(m["qjl"]), "hadamard" if m["had"] else "dense", bool(m["nc"]),
            int(m["seed"] or 0), int(m["block"] or TURBO_BLOCK),
        )

    def name(self) -> str:
        return str(self)

    def __str__(self) -> str:
        parts = [f"turbo{self.code_bits:g}"]
        parts += [opt for on, opt in ((self.qjl, "qjl"), (self.rotation == "hadamard", "had"),
                                      (self.norm_correction, "nc")) if on]
        parts += [f"seed{self.seed}"] * (self.seed != 0)
        parts += [f"block{self.block}"] * (self.block != TURBO_BLOCK)
        return "-".join(parts)


_RBQ_RE = re.compile(
    r"^rbq(?P<bits>\d)-lf(?P<pairs>\d{1,4})b(?P<high>\d)(?:-(?P<grain>head|g\d{1,5}|channel-g\d{1,7}))?$"
)
RBQ_BITS = (8, 4, 2)


@spec_family("rbq")
@dataclass(frozen=True)
class RopeBlocks:
    """`rbqB-lfPbH[-head | -gN | -channel-gN]`: RoPE frequency blocks of the head dimension at different
    bits (Block-GTQ style; `kvquant.codecs.ropeblocks`): uniform asymmetric integer codes (int8: symmetric)
    at B bits, except the P lowest-frequency RoPE pairs at H bits. In the rotate-half layout (Llama, Gemma,
    Mistral, SmolLM2: channel c and c + D/2 share the frequency base^(-2c/D)), those are channels
    D/2 - P .. D/2 - 1 and D - P .. D - 1. Each block has its own scales with the grain (default per token
    and head, `-head`). Meant for keys, usually `-prerope` (the channels' frequencies are RoPE's; a rotation
    would mix them, so no -rot / -crot).

        rbq2-lf8b4-channel-g64-prerope   48 of 64 channels at 2 bits, the 16 lowest-frequency at 4: 2.5 code
                                         bits (+ 0.5 of channel-wise scales at FP16) = 3.0 bits
    """

    bits: int
    pairs: int
    high_bits: int
    grain: PerHead | ChannelGroups | TokenGroups = PerHead()
    symmetric: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.bits not in RBQ_BITS or self.high_bits not in RBQ_BITS:
            raise SchemeError(
                f"rbq bits are one of {RBQ_BITS} (int codes), got {self.bits} and {self.high_bits}"
            )
        if self.high_bits == self.bits:
            raise SchemeError(
                f"rbq{self.bits}-lf{self.pairs}b{self.high_bits}: both blocks at the same bits is "
                f"int{self.bits}; give the low-frequency block other bits"
            )
        if not isinstance(self.grain, (PerHead, ChannelGroups, TokenGroups)):
            raise SchemeError(f"rbq grain is -head, -gN or -channel-gN, not {self.grain!r}")

    @property
    def token_group(self) -> int:
        return self.grain.tokens

    def blocks(self, head_dim: int) -> tuple[list[int], list[int]]:
        """(channels at `bits`, channels at `high_bits`): the P lowest-frequency pairs in the rotate-half
        layout are the last P of each half."""
        half = head_dim // 2
        high = [*range(half - self.pairs, half), *range(head_dim - self.pairs, head_dim)]
        return [c for c in range(head_dim) if c not in set(high)], high

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 2 or not 0 < self.pairs < head_dim // 2:
            raise SchemeError(
                f"rbq -lf{self.pairs}: a head_dim of {head_dim} has {head_dim // 2} RoPE pairs; the "
                f"low-frequency block takes 1 to {head_dim // 2 - 1} of them"
            )
        for n, bits in ((head_dim - 2 * self.pairs, self.bits), (2 * self.pairs, self.high_bits)):
            if isinstance(self.grain, ChannelGroups) and n % self.grain.channels:
                raise SchemeError(
                    f"rbq -g{self.grain.channels}: a channel group must lie inside each block, but a block "
                    f"has {n} channels ({head_dim} split by -lf{self.pairs}); use -head or a divisor of both"
                )
            _check_packing(bits, n)

    @classmethod
    def parse(cls, text: str) -> RopeBlocks:
        m = _match_or_refuse(
            _RBQ_RE, text, "write rbq<bits>-lf<pairs>b<bits>[-head|-gN|-channel-gN], e.g. "
            "rbq2-lf8b4-channel-g64: P lowest-frequency RoPE pairs at the second number of bits, the rest at "
            "the first",
        )
        g = m["grain"] or "head"
        grain = PerHead() if g == "head" else (
            TokenGroups(int(g[len("channel-g"):])) if g.startswith("channel") else ChannelGroups(int(g[1:])))
        if isinstance(grain, (TokenGroups, ChannelGroups)) and not 1 <= grain.group_size <= MAX_TOKENS:
            raise SchemeError(f"rbq -{g}: a group of 1..{MAX_TOKENS:,}")
        return cls(int(m["bits"]), int(m["pairs"]), int(m["high"]), grain)

    def name(self) -> str:
        return str(self)

    def __str__(self) -> str:
        return f"rbq{self.bits}-lf{self.pairs}b{self.high_bits}-{self.grain.option()}"


Family = Dense | UniformInt | Codebook | FP8 | EngineFormat | VLLMCacheDtype | TurboSpec | RopeBlocks


def family_bits(family: Family) -> int:
    """The stored width of a family's codes: 16 (dense), its bits, the engine format's nominal bits, or a
    TurboQuant spec's code bits rounded up."""
    if isinstance(family, TurboSpec):
        return math.ceil(family.code_bits)
    return family.bits


# -------------------------------------------------------------------------------------------- transforms


@dataclass(frozen=True)
class Center:
    """`-center[N]`: subtract a per-(head, channel) offset, the mean of each `tokens` tokens, stored in the
    K/V dtype (`kvquant.codecs.transforms.CenterCodec`)."""

    tokens: int = DEFAULT_CENTER
    order: ClassVar[int] = 0  # the grammar's order, outermost first: center, rotation, outliers
    flat: ClassVar[str] = "center"

    def option(self) -> str:
        return "center" if self.tokens == DEFAULT_CENTER else f"center{self.tokens}"

    def check_head_dim(self, head_dim: int) -> None:
        return None


@dataclass(frozen=True)
class Rotate:
    """`-rot[S]`: orthonormal Walsh-Hadamard rotation over D with random signs from `seed`
    (`kvquant.codecs.transforms.RotationCodec`)."""

    seed: int = 0
    order: ClassVar[int] = 1
    flat: ClassVar[str] = "rotate"

    def option(self) -> str:
        return "rot" if self.seed == 0 else f"rot{self.seed}"

    def check_head_dim(self, head_dim: int) -> None:
        if rotation_block(head_dim) < 8:
            raise SchemeError(
                f"-rot needs a head_dim with a power-of-two factor of at least 8 (Walsh-Hadamard blocks); "
                f"head_dim {head_dim} has {rotation_block(head_dim)}"
            )


@dataclass(frozen=True)
class CalibRotate:
    """`-crot`: a calibrated orthogonal D x D rotation per layer and K/V from the calibration file
    (`kvquant.codecs.calibrot`), in place of -rot; starts from -rot's Hadamard (seed 0)."""

    seed: ClassVar[int] = 0  # the flat form's rotate=0
    order: ClassVar[int] = 1
    flat: ClassVar[str] = "rotate"

    def option(self) -> str:
        return "crot"

    def check_head_dim(self, head_dim: int) -> None:
        Rotate().check_head_dim(head_dim)


@dataclass(frozen=True)
class Outliers:
    """`-outP`: keep the top `percent`% magnitudes of each (token, head) vector exact (value + index)
    (`kvquant.codecs.transforms.OutlierCodec`)."""

    percent: float
    order: ClassVar[int] = 2
    flat: ClassVar[str] = "outliers"

    def option(self) -> str:
        return f"out{self.percent:g}"

    def count(self, head_dim: int) -> int:
        """Values kept exact per (token, head) vector: ceil(P% of D), at least 1."""
        return max(1, math.ceil(self.percent * head_dim / 100 - 1e-9))

    def check_head_dim(self, head_dim: int) -> None:
        return None


Transform = Center | Rotate | CalibRotate | Outliers
