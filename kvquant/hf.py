"""kvquant through transformers' own routes: `model.generate()`, `pipeline(...)` and a `GenerationConfig`
select a `QuantizedCache` without a `cache=` argument.

transformers 5.x has no registry of cache implementations: `GenerationConfig.validate` accepts only the
names in `ALL_CACHE_IMPLEMENTATIONS` (`cache_implementation="kvquant"` fails there, loudly), and
`GenerationMixin._prepare_cache_for_generation` builds the cache from a fixed list (`cache_config` is read
only with `cache_implementation="quantized"`, for its quanto / HQQ / fp8 backends, and silently ignored
otherwise). That method is the one extension point, and `enable` uses it on the model instance, never on a
class:

    kvquant.enable(model, "int4-g64")         # attention "kvquant" + this model's generate() builds the cache
    model.generate(ids)                         # a QuantizedCache("int4-g64", model.config)
    model.generate(ids, cache_config={"scheme": "kivi-2"})          # another scheme for one call
    model.generate(ids, generation_config=GenerationConfig(cache_config={"scheme": "int8"}))
    model.generate(ids, cache_implementation="dynamic")             # opt out for one call
    pipeline("text-generation", model=model, tokenizer=tok)        # pipelines call model.generate()

`enable` writes the scheme into `model.generation_config.cache_config` ({"scheme": "int4-g64", ...}), so
`model.save_pretrained()` records it in generation_config.json and `kvquant.enable(model)` on the reloaded
model (no scheme) takes it from there. A call's `cache_config` that names a scheme is checked as the model's
is; one that names no scheme and no transformers backend is refused (transformers would ignore it).
Without `enable`, transformers never reads a `{"scheme": ...}` cache_config: it generates with a DynamicCache,
so enable first.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .scheme import Scheme, parse_scheme

__all__ = ["CACHE_CONFIG_KEYS", "CacheSettings", "disable", "enable", "enabled"]

logger = logging.getLogger(__name__)

CACHE_CONFIG_KEYS = ("scheme", "backend", "block_size", "capacity")  # what a kvquant cache_config may hold
_HOOK = "_prepare_cache_for_generation"  # GenerationMixin's method; enable() shadows it on the instance
_SETTINGS = "_kvquant_cache_settings"


@dataclass(frozen=True)
class CacheSettings:
    """What `generate()` builds: `QuantizedCache(scheme, model.config, backend=, block_size=, capacity=)`.

    capacity None sizes the codec pages for the call's whole generation (prompt + max_new_tokens)."""

    scheme: Scheme
    backend: str = "auto"
    block_size: int = 16
    capacity: int | None = None

    def __post_init__(self) -> None:
        from .backend import check_backend

        check_backend(self.backend)
        for name in ("block_size", "capacity"):
            value = getattr(self, name)
            if value is None and name == "capacity":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cache_config {name!r} must be a positive integer, got {value!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CacheSettings:
        """From a cache_config dict ({"scheme": "int4-g64", "backend": "torch", ...}); unknown keys are
        refused."""
        if not isinstance(config, Mapping):
            raise TypeError(f"cache_config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(CACHE_CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"cache_config has keys kvquant does not know: {unknown}; a kvquant cache_config holds "
                f"{list(CACHE_CONFIG_KEYS)} (transformers' own quantized-cache keys such as nbits or "
                "residual_length belong to cache_implementation='quantized' without a 'scheme')"
            )
        if "scheme" not in config:
            raise ValueError(
                f"cache_config {dict(config)!r} names no 'scheme'; give one, e.g. {{'scheme': 'int4-g64'}}"
            )
        kwargs = {k: v for k, v in config.items() if k != "scheme"}
        return cls(parse_scheme(config["scheme"]), **kwargs)

    def to_config(self) -> dict[str, Any]:
        """The JSON-able cache_config (defaults left out), as generation_config.json stores it."""
        out: dict[str, Any] = {"scheme": str(self.scheme)}
        for f in dataclasses.fields(self):
            if f.name != "scheme" and getattr(self, f.name) != f.default:
                out[f.name] = getattr(self, f.name)
        return out

    def make_cache(self, model, max_cache_length: int | None = None):
        """A QuantizedCache for `model` (checks head_dim, layer count, positions and calibration now)."""
        from .cache import QuantizedCache

        capacity = self.capacity or max(int(max_cache_length or 0) + 1, 16)
        return QuantizedCache(
            self.scheme, model.config, backend=self.backend, block_size=self.block_size, capacity=capacity
        )


def enable(model, scheme: Scheme | str | None = None, **cache_kwargs) -> CacheSettings | None:
    """Make `model` generate with a kvquant `QuantizedCache` whenever no `cache=` is passed.

    Sets the model's attention implementation to kvquant's, checks the scheme against the model now (head_dim,
    layers, positions, calibration file), records it in `model.generation_config.cache_config`, and shadows
    `_prepare_cache_for_generation` on this instance (not on its class) so that `generate()` and pipelines
    build the cache. `cache_kwargs`: backend ("auto" | "triton" | "torch"), block_size, capacity.

    scheme None: the scheme already in `model.generation_config.cache_config` (a saved
    generation_config.json); if there is none, generate() keeps transformers' DynamicCache unless a call's
    cache_config names a scheme. Returns the settings generate() uses by default (None when there is no
    default scheme). `disable(model)` undoes it."""
    _check_model(model)
    gen = model.generation_config
    if scheme is None:
        saved = gen.cache_config if isinstance(gen.cache_config, Mapping) else None
        settings = (
            CacheSettings.from_config({**saved, **cache_kwargs}) if saved and "scheme" in saved else None
        )
        if settings is None and cache_kwargs:
            raise ValueError(
                f"kvquant.enable: cache settings {sorted(cache_kwargs)} without a scheme; pass one, e.g. "
                "kvquant.enable(model, 'int4-g64', backend='torch')"
            )
    else:
        settings = CacheSettings.from_config({"scheme": scheme, **cache_kwargs})
    if settings is not None:
        settings.make_cache(model)  # refuse a scheme the model cannot hold now, not at the first generate()
    from . import ATTN_IMPLEMENTATION  # registers "kvquant" with transformers' attention and mask interfaces

    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if gen.cache_implementation is not None:
        logger.info(
            "kvquant.enable: generation_config.cache_implementation=%r cleared (kvquant builds the cache)",
            gen.cache_implementation,
        )
        gen.cache_implementation = None
    gen.cache_config = settings.to_config() if settings is not None else None
    setattr(model, _SETTINGS, settings)
    setattr(model, _HOOK, types.MethodType(_prepare_cache_for_generation, model))
    if settings is None:
        logger.info(
            "kvquant.enable: no default scheme; generate() builds a QuantizedCache when a call's "
            "cache_config names one"
        )
    return settings


def disable(model) -> None:
    """Undo `enable`: generate() builds transformers' caches again (the attention stays kvquant's, which is
    SDPA for them) and the generation config forgets the scheme."""
    if _HOOK in vars(model):
        delattr(model, _HOOK)
    if _SETTINGS in vars(model):
        delattr(model, _SETTINGS)
    cfg = model.generation_config.cache_config
    if isinstance(cfg, Mapping) and "scheme" in cfg:
        model.generation_config.cache_config = None


def enabled(model) -> bool:
    """Whether `enable(model, ...)` installed kvquant's generate() hook on this model."""
    return _HOOK in vars(model)


def _check_model(model) -> None:
    if not (hasattr(model, "generate") and hasattr(model, "generation_config") and hasattr(model, "config")):
        raise TypeError(
            f"kvquant.enable needs a transformers generative model (PreTrainedModel with generate()), "
            f"got {type(model).__name__}"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"kvquant.enable: {type(model).__name__} is an encoder-decoder model; kvquant caches the "
            "self-attention of decoder-only models"
        )


def settings_for_call(model, generation_config) -> CacheSettings | None:
    """The kvquant cache one generate() call should build, or None for transformers' own choice.

    A cache_config naming a scheme selects kvquant (with cache_implementation None or "quantized"); the
    model's enabled scheme applies when the call asks for no other cache. A cache_config with neither a scheme
    nor cache_implementation="quantized" would be ignored by transformers: refused here instead."""
    impl, cfg = generation_config.cache_implementation, generation_config.cache_config
    default: CacheSettings | None = getattr(model, _SETTINGS, None)
    model_cfg = model.generation_config.cache_config
    if isinstance(cfg, Mapping) and "scheme" in cfg:
        inherited = cfg == model_cfg  # the model's own default, carried into the call's config by generate()
        if impl not in (None, "quantized"):
            if inherited:
                return None  # the call chose another cache (cache_implementation="dynamic", "static", ...)
            raise ValueError(
                f"cache_config {dict(cfg)!r} names a kvquant scheme, but cache_implementation={impl!r} asks "
                "transformers for another cache; pass one of them"
            )
        base = default.to_config() if default is not None and not inherited else {}
        return CacheSettings.from_config({**base, **cfg})
    if impl is None:
        if cfg:  # transformers reads cache_config only with cache_implementation="quantized"
            raise ValueError(
                f"cache_config {dict(cfg) if isinstance(cfg, Mapping) else cfg!r} names no kvquant "
                "'scheme' and no cache_implementation uses it: transformers would ignore it. For kvquant "
                "pass cache_config={'scheme': 'int4-g64', ...}; for transformers' quantized cache add "
                "cache_implementation='quantized'"
            )
        return default
    return None  # cache_implementation names one of transformers' caches


def _prepare_cache_for_generation(
    self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
):
    """GenerationMixin._prepare_cache_for_generation on an enabled model: a QuantizedCache when the call's
    settings name a kvquant scheme and the caller passed no cache, else transformers' own."""
    settings = None
    if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
        settings = settings_for_call(self, generation_config)
    if settings is None:
        return type(self)._prepare_cache_for_generation(
            self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
    cache = settings.make_cache(self, max_cache_length)
    if generation_config.is_assistant:
        cache.activate_past_recording()
    model_kwargs["cache"] = cache
    return None
