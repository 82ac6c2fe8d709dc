"""What `--scheme` can name: any kvquant scheme string, or a peer (transformers' own QuantizedCache).

A peer is named `hf-<backend>-int<bits>` (for example `hf-quanto-int4`, `hf-hqq-int2`): transformers'
`cache_utils.QuantizedCache(backend, config, nbits=bits, q_group_size=64, residual_length=128)`, which keeps
the last <=128 tokens unquantized and re-quantizes the whole cache each time that buffer fills.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass

import kvquant
from kvquant.scheme import Scheme, SchemeError

__all__ = ["PeerScheme", "EvalScheme", "PEER_BACKENDS", "parse_eval_scheme", "scheme_label", "schemes_help"]

PEER_BACKENDS = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
_PEER_RE = re.compile(r"^hf-(?P<backend>[a-z]+)-int(?P<bits>\d+)(-g(?P<group>\d+))?$")


@dataclass(frozen=True)
class PeerScheme:
    """transformers' QuantizedCache with one backend, bit width and group size (K and V alike)."""

    backend: str
    bits: int
    group_size: int = 64
    residual_length: int = 128

    def __post_init__(self) -> None:
        if self.backend not in PEER_BACKENDS:
            raise SchemeError(f"unknown peer backend {self.backend!r}; known: {', '.join(PEER_BACKENDS)}")
        allowed = (2, 4) if self.backend == "quanto" else (1, 2, 3, 4, 8)
        if self.bits not in allowed:
            raise SchemeError(
                f"{self.backend} cannot store int{self.bits} (quanto: int2/int4; hqq: 1-4, 8 bits)"
            )

    def __str__(self) -> str:
        g = "" if self.group_size == 64 else f"-g{self.group_size}"
        return f"hf-{self.backend}-int{self.bits}{g}"

    @property
    def package(self) -> str:
        return PEER_BACKENDS[self.backend][1]

    def check_available(self) -> str:
        """The installed backend's `package==version`; raises SchemeError naming the pip command if absent."""
        module, dist = PEER_BACKENDS[self.backend]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise SchemeError(
                f"peer scheme {self} needs {dist}: pip install {dist} torch=={_torch_version()} "
                "(pin torch so pip never replaces the CPU build)"
            )
        return f"{dist}=={importlib.metadata.version(dist)}"

    def make_cache(self, config):
        from transformers.cache_utils import QuantizedCache as HFQuantizedCache

        return HFQuantizedCache(
            self.backend,
            config,
            nbits=self.bits,
            q_group_size=self.group_size,
            residual_length=self.residual_length,
        )

    def bytes_per_token(self, config, dtype_bytes: int) -> float:
        """Steady-state formula: codes plus one scale and one shift (run dtype) per group of `group_size`."""
        shape = kvquant.memory.KVShape.from_config(config)
        values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
        return values * (self.bits / 8 + 2 * dtype_bytes / self.group_size)


EvalScheme = Scheme | PeerScheme


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def parse_eval_scheme(text: str | EvalScheme) -> EvalScheme:
    """A kvquant `Scheme` or a `PeerScheme`; unknown names raise SchemeError listing the known ones."""
    if isinstance(text, (Scheme, PeerScheme)):
        return text
    raw = text.strip().lower()
    if raw.startswith("hf-"):
        m = _PEER_RE.match(raw)
        if not m:
            raise SchemeError(
                f"bad peer scheme {text!r}: use hf-<backend>-int<bits>[-gN], backend one of "
                f"{', '.join(PEER_BACKENDS)} (for example hf-quanto-int4, hf-quanto-int2)"
            )
        return PeerScheme(m["backend"], int(m["bits"]), int(m["group"] or 64))
    return kvquant.parse_scheme(raw)


def scheme_label(scheme: EvalScheme) -> str:
    """The canonical string used in results. kvquant's unquantized scheme runs through the quantized-cache
    path and is labelled `kvquant:fp16...` so it never collides with the `fp16` reference."""
    s = str(scheme)
    if isinstance(scheme, Scheme) and scheme.is_fp16:
        return f"kvquant:{s}"
    return s


def schemes_help() -> str:
    lines = [kvquant.scheme_help(), "", "Peers (transformers' own QuantizedCache, cache mode only):"]
    for backend, (_, dist) in PEER_BACKENDS.items():
        ok = importlib.util.find_spec(backend if backend == "hqq" else "optimum") is not None
        state = "installed" if ok else f"not installed: pip install {dist}"
        lines.append(f"  hf-{backend}-int4, hf-{backend}-int2 [-gN]   group 64, residual 128 ({state})")
    lines.append("\nThe reference `fp16` (unquantized DynamicCache) is always run; it need not be named.")
    return "\n".join(lines)
