"""What `--scheme` can name, behind one protocol (`EvalScheme`): kvquant's own schemes and peers.

Every scheme the evaluation runs answers the same small protocol, so no caller switches on its type:

    label            the canonical string results are keyed by
    name             what tables and plots show (a preset's name such as `kivi-2`)
    modes            the evaluation modes it supports
    package          the pip distribution it needs beyond kvquant (None)
    check(shape)     refuse a model it cannot serve (a group size that does not divide head_dim)
    check_available  `package==version`, or SchemeError naming the pip command
    default_chunk    tokens per forward in cache mode unless --chunk is given (None: the run's; peers: 128)
    make_cache(config, mode)            the transformers Cache one document runs through
    bytes_per_token(shape, dtype_bytes) steady-state bytes per token at the storage dtype
    held_bytes(config, tokens, dtype_bytes)  bytes held after `tokens` tokens at the storage dtype

A peer is named `hf-<backend>-int<bits>[-gN]` (for example `hf-quanto-int4`, `hf-hqq-int2`): transformers'
`cache_utils.QuantizedCache(backend, config, nbits=bits, q_group_size=N, residual_length=128)`, which keeps
the last <=128 tokens unquantized and re-quantizes the whole cache each time that buffer fills.

Imports nothing heavy: torch and transformers are imported inside make_cache only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import kvquant
from kvquant.scheme import Scheme, SchemeError

__all__ = [
    "EvalScheme",
    "KVQuantScheme",
    "PeerScheme",
    "PEER_BACKENDS",
    "ALL_MODES",
    "parse_eval_scheme",
    "scheme_label",
    "schemes_help",
]

ALL_MODES = ("cache", "fake", "prefill")
PEER_BACKENDS = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
_PEER_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
_PEER_RE = re.compile(r"^hf-(?P<backend>[a-z]+)-int(?P<bits>\d+)(-g(?P<group>\d+))?$")


@runtime_checkable
class EvalScheme(Protocol):
    """The protocol every evaluated scheme implements (see the module docstring)."""

    @property
    def label(self) -> str: ...

    @property
    def name(self) -> str: ...

    modes: tuple[str, ...]
    package: str | None
    default_chunk: int | None  # tokens per forward in cache mode unless --chunk is given (None: the run's)

    def check(self, shape) -> None: ...

    def check_available(self) -> str: ...

    def make_cache(self, config, mode: str): ...

    def bytes_per_token(self, shape, dtype_bytes: int) -> float: ...

    def held_bytes(self, config, tokens: int, dtype_bytes: int) -> float: ...


@dataclass(frozen=True)
class KVQuantScheme:
    """A kvquant `Scheme` as the evaluation runs it: `QuantizedCache` (cache, prefill) or `FakeQuantCache`."""

    scheme: Scheme
    modes: tuple[str, ...] = ALL_MODES
    package: str | None = None
    default_chunk: int | None = None  # decode-exact: the chunk size changes only float rounding

    @property
    def label(self) -> str:
        """kvquant's unquantized scheme runs through the quantized-cache path and is labelled
        `kvquant:fp16...` so it never collides with the reference."""
        s = str(self.scheme)
        return f"kvquant:{s}" if self.scheme.is_fp16 else s

    @property
    def name(self) -> str:
        """What tables and plots show: the preset name, else the scheme; kvquant's unquantized scheme says
        what it is, beside a reference that may itself be named `fp16`: `fp16 (unquantized, kvquant cache)`,
        the reference's K/V held in kvquant's pages at the run dtype (counted at --kv-dtype, like every FP
        token), so its row measures the paged cache path, not FP16 rounding."""
        if self.scheme.name:
            return self.scheme.name
        return f"{self.scheme} (unquantized, kvquant cache)" if self.scheme.is_fp16 else self.label

    def __str__(self) -> str:
        return str(self.scheme)

    def check(self, shape) -> None:
        self.scheme.check_head_dim(shape.head_dim)

    def check_available(self) -> str:
        return f"kvquant=={_version('kvquant')}"

    def make_cache(self, config, mode: str):
        if mode == "fake":
            from .fakequant import FakeQuantCache  # torch and transformers: fake mode only

            return FakeQuantCache(self.scheme, config)
        return kvquant.QuantizedCache(self.scheme, config)

    def bytes_per_token(self, shape, dtype_bytes: int) -> float:
        return kvquant.memory.bytes_per_token(shape, self.scheme, dtype_bytes)

    def held_bytes(self, config, tokens: int, dtype_bytes: int) -> float:
        return float(kvquant.memory.cache_bytes(config, self.scheme, tokens, dtype=dtype_bytes))


@dataclass(frozen=True)
class PeerScheme:
    """transformers' QuantizedCache with one backend, bit width and group size (K and V alike); cache mode
    only (its first update returns the chunk unquantized, so fake and prefill modes would measure nothing)."""

    backend: str
    bits: int
    group_size: int = 64
    residual_length: int = 128
    modes: tuple[str, ...] = ("cache",)

    def __post_init__(self) -> None:
        if self.backend not in PEER_BACKENDS:
            raise SchemeError(f"unknown peer backend {self.backend!r}; known: {', '.join(PEER_BACKENDS)}")
        if self.bits not in _PEER_BITS[self.backend]:
            raise SchemeError(
                f"{self.backend} cannot store int{self.bits} (quanto: int2/int4; hqq: 1-4, 8 bits)"
            )

    def __str__(self) -> str:
        g = "" if self.group_size == 64 else f"-g{self.group_size}"
        return f"hf-{self.backend}-int{self.bits}{g}"

    @property
    def label(self) -> str:
        return str(self)

    @property
    def name(self) -> str:
        return str(self)

    @property
    def default_chunk(self) -> int:
        """Its residual length: each forward's chunk is returned unquantized and the whole cache requantized
        when the residual fills, so a chunk no longer than the residual is what decoding sees."""
        return self.residual_length

    @property
    def package(self) -> str:
        return PEER_BACKENDS[self.backend][1]

    def check(self, shape) -> None:
        if shape.head_dim % self.group_size and (2 * shape.num_kv_heads * shape.head_dim) % self.group_size:
            raise SchemeError(f"{self}: group {self.group_size} does not divide head_dim {shape.head_dim}")

    def check_available(self) -> str:
        """The installed backend's `package==version`; raises SchemeError naming the pip command if absent."""
        module, dist = PEER_BACKENDS[self.backend]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise SchemeError(
                f"peer scheme {self} needs {dist}: pip install {dist} torch=={_torch_version()} "
                "(pin torch so pip never replaces the CPU build)"
            )
        return f"{dist}=={_version(dist)}"

    def make_cache(self, config, mode: str = "cache"):
        if mode not in self.modes:
            raise ValueError("peer schemes run in cache mode only (their first update is never quantized)")
        from transformers.cache_utils import QuantizedCache as HFQuantizedCache

        kw = {}
        if self.backend == "hqq":
            kw["axis_key"] = kw["axis_value"] = 1  # hqq groups along the channels, as kvquant's -gN
        return HFQuantizedCache(
            self.backend,
            config,
            nbits=self.bits,
            q_group_size=self.group_size,
            residual_length=self.residual_length,
            **kw,
        )

    def bytes_per_token(self, shape, dtype_bytes: int) -> float:
        """Steady-state formula: codes plus one scale and one shift per group of `group_size` values."""
        shape = kvquant.memory.KVShape.from_config(shape)
        values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
        return values * (self.bits / 8 + 2 * dtype_bytes / self.group_size)

    def held_bytes(self, config, tokens: int, dtype_bytes: int) -> float:
        """At most residual_length tokens in FP, the rest quantized (the peer's steady state, no pages)."""
        shape = kvquant.memory.KVShape.from_config(config)
        fp = min(tokens, self.residual_length)
        per_fp = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes
        return fp * per_fp + (tokens - fp) * self.bytes_per_token(shape, dtype_bytes)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def parse_eval_scheme(text) -> EvalScheme:
    """A `KVQuantScheme` or a `PeerScheme`; unknown names raise SchemeError listing the known ones."""
    if isinstance(text, (KVQuantScheme, PeerScheme)):
        return text
    if isinstance(text, Scheme):
        return _kvquant_scheme(text)
    raw = text.strip().lower()  # peers only; kvquant's parser lowercases all but a calib= path itself
    if raw.startswith("hf-"):
        m = _PEER_RE.match(raw)
        if not m:
            raise SchemeError(
                f"bad peer scheme {text!r}: use hf-<backend>-int<bits>[-gN], backend one of "
                f"{', '.join(PEER_BACKENDS)} (for example hf-quanto-int4, hf-hqq-int8)"
            )
        return PeerScheme(m["backend"], int(m["bits"]), int(m["group"] or 64))
    return _kvquant_scheme(kvquant.parse_scheme(text))


def _kvquant_scheme(scheme: Scheme) -> KVQuantScheme:
    """salient=N/G runs in cache and prefill modes (fake mode has no cache to keep statistics in)."""
    if scheme.salient is not None:
        return KVQuantScheme(scheme, ("cache", "prefill"))
    return KVQuantScheme(scheme)


def scheme_label(scheme) -> str:
    """The canonical string results are keyed by (`EvalScheme.label`)."""
    return parse_eval_scheme(scheme).label


def schemes_help() -> str:
    lines = [kvquant.scheme_help(), "", "Peers (transformers' own QuantizedCache, cache mode only):"]
    for backend, (module, dist) in PEER_BACKENDS.items():
        ok = importlib.util.find_spec(module.split(".")[0]) is not None
        state = "installed" if ok else f"not installed: pip install {dist}"
        bits = "/".join(f"int{b}" for b in _PEER_BITS[backend])
        lines.append(f"  hf-{backend}-int4, hf-{backend}-int2 [-gN]   {bits}; group 64, residual 128 "
                     f"({state})")
    lines.append("\nThe unquantized reference is always run; it need not be named.")
    return "\n".join(lines)
