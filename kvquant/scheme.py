"""Quantization schemes for the KV cache: typed configs, parsed once from short strings.

A scheme string is a comma-separated list of items:

    SPEC                  one spec for both K and V          int4-g64
    k=SPEC, v=SPEC        separate specs for K and V         k=int4-channel-g64,v=int4-g64
    sink=N                first N tokens kept unquantized    sink=4
    window=N              last N (or more) tokens unquantized window=128
    PRESET                a named scheme                      kivi-2

SPEC is `fp16` or `int{8,4,2}` followed by options, in this order:

    (nothing)     token: one scale per token over all KV heads (H_kv x D)
    -head         one scale per (token, head) over D
    -gN           one scale per N consecutive channels of D within a (token, head)
    -channel-gN   one scale per (head, channel) over N consecutive tokens (KIVI's keys)
    -sym / -asym  symmetric absmax or asymmetric min/max (default: sym for int8, asym for int4/int2)
    -sfp16 / -sbf16 / -sfp32   dtype of stored scales and zeros (default: the K/V dtype)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass, field

__all__ = [
    "Granularity",
    "QuantSpec",
    "Scheme",
    "SchemeError",
    "FP16",
    "PRESETS",
    "parse_spec",
    "parse_scheme",
    "list_schemes",
    "scheme_help",
]


class SchemeError(ValueError):
    """A scheme string or config that cannot be used; the message names the bad part and what is valid."""


class Granularity(str, enum.Enum):
    """Which elements of a (B, H_kv, T, D) tensor share one scale (and zero)."""

    TOKEN = "token"  # (B, H, T, D) -> scale (B, 1, T, 1)
    HEAD = "head"  # (B, H, T, D) -> scale (B, H, T, 1)
    GROUP = "group"  # (B, H, T, D) -> scale (B, H, T, D // N)
    CHANNEL = "channel"  # (B, H, T, D) -> scale (B, H, T // N, D)


# Stored-scale dtypes by name: this module never imports torch (CLIs validate schemes before heavy imports);
# `kvquant.codec.torch_dtype` maps a name to its torch dtype.
SCALE_DTYPES: tuple[str, ...] = ("fp16", "bf16", "fp32")
_TORCH_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}
BITS = (16, 8, 4, 2)


@dataclass(frozen=True)
class QuantSpec:
    """How one of K or V is quantized.

    bits: 16 (kept as is), 8, 4 or 2.
    granularity: see `Granularity`.
    group_size: channels per group (GROUP) or tokens per group (CHANNEL); None otherwise.
    symmetric: absmax with signed codes, or min/max with a float zero point.
    scale_dtype: name of the dtype of stored scales and zeros ("fp16", "bf16", "fp32"); None stores them
        in the K/V dtype.
    """

    bits: int
    granularity: Granularity = Granularity.TOKEN
    group_size: int | None = None
    symmetric: bool = False
    scale_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise SchemeError(f"bits={self.bits} is not supported; use one of {BITS}")
        try:
            object.__setattr__(self, "granularity", Granularity(self.granularity))
        except ValueError:
            known = ", ".join(g.value for g in Granularity)
            raise SchemeError(f"unknown granularity {self.granularity!r}; known: {known}") from None
        if self.bits == 16:
            # anything else would print as `fp16` and parse back as a different spec
            if (
                self.group_size is not None
                or self.granularity is not Granularity.TOKEN
                or self.symmetric
                or self.scale_dtype is not None
            ):
                raise SchemeError("fp16 takes no granularity, group size, symmetry or scale dtype")
            return
        needs_group = self.granularity in (Granularity.GROUP, Granularity.CHANNEL)
        if needs_group and (self.group_size is None or self.group_size < 1):
            what = "channels" if self.granularity is Granularity.GROUP else "tokens"
            raise SchemeError(
                f"{self.granularity.value} granularity needs a group size in {what} "
                f"(for example int{self.bits}-{'g64' if what == 'channels' else 'channel-g64'})"
            )
        if not needs_group and self.group_size is not None:
            raise SchemeError(f"{self.granularity.value} granularity takes no group size")
        if self.scale_dtype is not None and not isinstance(self.scale_dtype, str):
            # a torch dtype given directly (torch.float16 prints as "torch.float16"); stored by name
            name = _TORCH_NAMES.get(str(self.scale_dtype))
            object.__setattr__(self, "scale_dtype", name or str(self.scale_dtype))
        if self.scale_dtype is not None and self.scale_dtype not in SCALE_DTYPES:
            raise SchemeError(
                f"scale_dtype {self.scale_dtype!r} is not supported; use one of {list(SCALE_DTYPES)} "
                "(by name)"
            )

    @property
    def is_quantized(self) -> bool:
        return self.bits < 16

    @property
    def qmax(self) -> int:
        """Largest code: 2^b - 1 (asymmetric) or 2^(b-1) - 1 (symmetric, codes stored with offset 2^(b-1))."""
        return (1 << (self.bits - 1)) - 1 if self.symmetric else (1 << self.bits) - 1

    @property
    def tokens_per_group(self) -> int:
        """How many tokens must arrive before they can be quantized (N for CHANNEL, else 1)."""
        return self.group_size if self.granularity is Granularity.CHANNEL else 1

    def check_head_dim(self, head_dim: int) -> None:
        """Refuse a group size that does not divide head_dim, naming both numbers."""
        if self.granularity is Granularity.GROUP and head_dim % self.group_size:
            raise SchemeError(
                f"group size {self.group_size} does not divide head_dim {head_dim}; "
                f"pick a divisor of {head_dim} (for example -g{math.gcd(head_dim, 64)})"
            )
        if self.is_quantized and head_dim % (8 // self.bits):
            raise SchemeError(f"head_dim {head_dim} cannot be packed at {self.bits} bits")

    def __str__(self) -> str:
        return format_spec(self)


FP16 = QuantSpec(16)


@dataclass(frozen=True)
class Scheme:
    """A K spec, a V spec, and how many first (sink) and last (window) tokens stay unquantized."""

    key: QuantSpec
    value: QuantSpec
    sink: int = 0
    window: int = 0
    name: str | None = field(default=None, compare=False)  # the preset it came from, for display

    def __post_init__(self) -> None:
        for what in ("sink", "window"):
            n = getattr(self, what)
            if not isinstance(n, int) or n < 0:
                raise SchemeError(f"{what}={n!r} must be a non-negative integer")

    @property
    def is_fp16(self) -> bool:
        return not (self.key.is_quantized or self.value.is_quantized)

    @property
    def tokens_per_flush(self) -> int:
        """Tokens move from the FP window to the quantized body in multiples of this."""
        return math.lcm(self.key.tokens_per_group, self.value.tokens_per_group)

    def quantized_end(self, num_tokens: int) -> int:
        """Once num_tokens tokens have arrived, positions [min(sink, num_tokens), quantized_end) are in the
        quantized body; the rest (sink before, window after) are unquantized. The same for any chunking."""
        sink = min(self.sink, num_tokens)
        step = self.tokens_per_flush
        return sink + max(num_tokens - sink - self.window, 0) // step * step

    def check_head_dim(self, head_dim: int) -> None:
        self.key.check_head_dim(head_dim)
        self.value.check_head_dim(head_dim)

    def __str__(self) -> str:
        return format_scheme(self)


# ----------------------------------------------------------------------------------------------- parsing

_SPEC_RE = re.compile(r"^int(?P<bits>\d+)(?P<opts>(-[a-z0-9]+)*)$")
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
}


def _spec_error(text: str, why: str) -> SchemeError:
    return SchemeError(
        f"bad quantization spec {text!r}: {why}. A spec is fp16 or int8/int4/int2 followed by "
        "[-head | -gN | -channel-gN] [-sym | -asym] [-sfp16 | -sbf16 | -sfp32]; examples: "
        "int8, int8-head, int4-g64, int2-g32-sym, int4-channel-g64"
    )


def _option_kind(opt: str) -> str | None:
    if opt in ("head", "channel") or re.fullmatch(r"g\d+", opt):
        return "granularity"
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
    if text in ("fp16", "bf16", "fp32", "none", "int16"):
        return FP16
    m = _SPEC_RE.match(text)
    if not m:
        raise _spec_error(text, "it does not start with fp16 or int<bits>")
    bits = int(m["bits"])
    if bits not in (8, 4, 2):
        raise _spec_error(text, f"int{bits} is not supported (bits must be 8, 4 or 2)")
    opts = [o for o in m["opts"].split("-") if o]
    granularity, group_size, symmetric, scale_dtype = Granularity.TOKEN, None, None, None
    seen: dict[str, str] = {}  # option kind -> the option given, to refuse a second one of a kind
    i = 0
    while i < len(opts):
        opt = opts[i]
        kind = _option_kind(opt)
        if kind is not None and kind in seen:
            raise _spec_error(text, f"-{opt} conflicts with -{seen[kind]} (one {kind} option at most)")
        seen[kind] = opt
        if opt == "head":
            granularity = Granularity.HEAD
        elif opt == "channel":
            granularity = Granularity.CHANNEL
            if i + 1 >= len(opts) or not re.fullmatch(r"g\d+", opts[i + 1]):
                raise _spec_error(text, "-channel needs a token group after it, as in -channel-g64")
            group_size = int(opts[i + 1][1:])
            i += 1
        elif re.fullmatch(r"g\d+", opt):
            granularity, group_size = Granularity.GROUP, int(opt[1:])
        elif opt in ("sym", "asym"):
            symmetric = opt == "sym"
        elif opt.startswith("s") and opt[1:] in SCALE_DTYPES:
            scale_dtype = opt[1:]
        else:
            raise _spec_error(text, f"unknown option -{opt}")
        i += 1
    if symmetric is None:
        symmetric = bits == 8
    if group_size == 0:
        raise _spec_error(text, "a group size must be at least 1")
    return QuantSpec(bits, granularity, group_size, symmetric, scale_dtype)


def format_spec(spec: QuantSpec) -> str:
    """The canonical string of a spec; parse_spec(format_spec(s)) == s."""
    if not spec.is_quantized:
        return "fp16"
    parts = [f"int{spec.bits}"]
    if spec.granularity is Granularity.HEAD:
        parts.append("head")
    elif spec.granularity is Granularity.GROUP:
        parts.append(f"g{spec.group_size}")
    elif spec.granularity is Granularity.CHANNEL:
        parts.append(f"channel-g{spec.group_size}")
    if spec.symmetric != (spec.bits == 8):
        parts.append("sym" if spec.symmetric else "asym")
    if spec.scale_dtype is not None:
        parts.append("s" + spec.scale_dtype)
    return "-".join(parts)


def format_scheme(scheme: Scheme) -> str:
    """The canonical string of a scheme; parse_scheme(format_scheme(s)) == s."""
    if scheme.key == scheme.value:
        items = [format_spec(scheme.key)]
    else:
        items = [f"k={format_spec(scheme.key)}", f"v={format_spec(scheme.value)}"]
    if scheme.sink:
        items.append(f"sink={scheme.sink}")
    if scheme.window:
        items.append(f"window={scheme.window}")
    return ",".join(items)


def _scheme_error(text: str, why: str) -> SchemeError:
    return SchemeError(
        f"bad scheme {text!r}: {why}.\nKnown schemes and presets: {', '.join(list_schemes())}.\n"
        "Grammar: SPEC | k=SPEC,v=SPEC, optionally with ,sink=N and ,window=N "
        "(see `python experiments/run.py --list-schemes`)"
    )


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
    raw = text.strip().lower().replace(" ", "")
    if raw in _PRESET_DEFS:
        return dataclasses.replace(parse_scheme(_PRESET_DEFS[raw][0]), name=raw)
    both = key = value = None
    ints: dict[str, int] = {}
    for item in raw.split(","):
        name, eq, val = item.partition("=")
        try:
            if not eq:
                if both is not None:
                    raise _scheme_error(
                        text, f"two specs {both} and {item!r}; use k=...,v=... for different K and V"
                    )
                both = parse_spec(item) if item not in _PRESET_DEFS else None
                if both is None:
                    raise _scheme_error(text, f"preset {item!r} cannot be combined with other items")
            elif name in ("k", "key"):
                key = parse_spec(val)
            elif name in ("v", "value"):
                value = parse_spec(val)
            elif name in ("sink", "window"):
                if not val.isdigit():
                    raise _scheme_error(text, f"{name}={val!r} is not a non-negative integer")
                ints[name] = int(val)
            else:
                raise _scheme_error(text, f"unknown item {name!r} (valid: k=, v=, sink=, window=)")
        except SchemeError as e:
            if str(e).startswith("bad scheme"):
                raise
            raise _scheme_error(text, str(e)) from None
    if both is not None and (key is not None or value is not None):
        raise _scheme_error(text, "give either one spec for both or k= and v=, not both")
    if both is None and (key is None or value is None):
        raise _scheme_error(text, "k= needs a matching v= (and the other way round)")
    if both is not None:
        key = value = both
    return Scheme(key, value, ints.get("sink", 0), ints.get("window", 0))


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
