"""What one evaluation run is (`RunConfig`), and the checks that need neither torch nor a model.

Imports nothing heavy: `experiments/run.py` builds and checks a config here, so a usage error, an unknown
scheme, a missing model folder or corpus is reported in well under a second, before torch, transformers,
datasets or wandb are imported. `kvquant.eval.runner.run` repeats these checks for callers of the API.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

from kvquant import quirks

if TYPE_CHECKING:
    from kvquant.scheme import Scheme

    from .schemes import EvalScheme

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_DOCS",
    "DEFAULT_MAX_LENGTH",
    "DTYPE_NAMES",
    "EXIT_USAGE",
    "KV_DTYPES",
    "MODES",
    "MODE_CHOICES",
    "WANDB_MODES",
    "ParsedSchemes",
    "Progress",
    "RunConfig",
    "RunError",
    "RunInterrupted",
    "RunIncomplete",
    "Shard",
    "parse_shard",
    "TASKS",
    "RETRIEVAL_TASKS",
    "DEFAULT_LENGTHS",
    "DEFAULT_DEPTHS",
    "DEFAULT_TRIALS",
    "check_inputs",
    "validate",
    "script_parser",
    "parse_lengths",
    "parse_depths",
]

DEFAULT_MAX_LENGTH = 8192
DEFAULT_CHUNK = 1024
DEFAULT_DOCS = 2
# --task: ppl (perplexity drift by position) or a retrieval task (kvquant.eval.retrieval)
RETRIEVAL_TASKS = ("passkey", "needle")
TASKS = ("ppl", *RETRIEVAL_TASKS)
DEFAULT_LENGTHS = (1024, 2048, 4096)  # retrieval prompt lengths, tokens
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the key sits in the filler: 0 first, 1 last
DEFAULT_TRIALS = 3  # keys (and filler offsets) per grid cell
ANSWER_ROOM = 16  # positions a retrieval prompt leaves the model for its answer's tokens
MIN_RETRIEVAL_LENGTH = 128  # the prompt's instruction, key and question take ~60 tokens
MODES = ("cache", "fake", "prefill")  # kvquant.eval.measure.MODES; a test keeps the two equal
MODE_CHOICES = (*MODES, "both", "all")  # both: cache and fake; all: the three
WANDB_MODES = ("online", "offline", "disabled")
# accepted spellings -> the torch dtype's name
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
# --kv-dtype: the dtype a deployment stores K/V (and scales) in; bytes and savings are reported at it
KV_DTYPES = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
             "fp32": "float32", "float32": "float32"}
KV_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_DEVICE_RE = re.compile(r"^(cpu|mps|(cuda|xpu)(:\d+)?)$")


class RunError(ValueError):
    """Bad input, found before any long work. The message names the problem and the fix."""


@dataclass(frozen=True)
class Progress:
    """How many of a run's points (scheme x mode x document x bucket, the reference included) are measured.

    `failed`: points that belong to a scheme that failed in that mode; they will not be measured."""

    measured: int
    total: int
    failed: int = 0

    @property
    def complete(self) -> bool:
        return self.measured + self.failed >= self.total

    def __str__(self) -> str:
        return f"{self.measured} of {self.total} points"


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run, after everything measured so far was written (results, summary, report, plots)."""

    def __init__(self, run_dir: Path, progress: Progress):
        super().__init__(
            f"interrupted: {progress} measured and written to {run_dir}; rerun the same command to resume"
        )
        self.run_dir, self.progress = run_dir, progress


class RunIncomplete(Exception):
    """A run that wrote its report with points missing, not by an interruption: `--merge` before every shard
    finished, or a torchrun rank that stopped early. The report and summary are written (marked partial)."""

    def __init__(self, run_dir: Path, progress: Progress, why: str):
        super().__init__(
            f"{why}: {progress} measured in {run_dir}; the report is marked partial. Rerun the missing "
            "shards, or the same command without --shard/--merge (any number of processes), to measure "
            "the rest"
        )
        self.run_dir, self.progress = run_dir, progress


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0-based), of a job array (`--shard I/N`) or a torchrun rank of a world."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not (_is_int(self.index) and _is_int(self.count)):
            raise TypeError(f"Shard({self.index!r}, {self.count!r}): index and count are ints")
        if self.count < 1 or not 0 <= self.index < self.count:
            raise RunError(f"--shard {self.index}/{self.count}: use I/N with 0 <= I < N (N >= 1), e.g. 0/4")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def tag(self) -> str:
        """How its results file and lock are named: shard-I-of-N."""
        return f"shard-{self.index}-of-{self.count}"

    def part(self, items: list) -> list:
        """This shard's contiguous part of `items` (sizes differ by at most one): deterministic, so
        independent processes given the same list divide it without talking to each other."""
        n = len(items)
        return items[self.index * n // self.count : (self.index + 1) * n // self.count]


def parse_shard(text: str) -> Shard:
    """`I/N` -> Shard(I, N); the error names the form."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not m:
        raise RunError(f"--shard {text!r}: use I/N, shard I (0-based) of N, e.g. --shard 0/4 ... --shard 3/4")
    return Shard(int(m[1]), int(m[2]))


EXIT_USAGE = 2  # as argparse: bad arguments or inputs, found before any long work


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage is one --help away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser of an experiments/ script: its docstring as the help text, as written, and one-line usage
    errors that exit with EXIT_USAGE."""
    return _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_SEED = 2**32 - 1  # random.Random takes any int, but torch.manual_seed and numpy stop at 64 / 32 bits


def check_seed(seed: int, flag: str = "--seed") -> None:
    """A seed every generator the run seeds accepts (torch, numpy, random): 0 .. 2**32 - 1."""
    if not _is_int(seed):
        raise TypeError(f"{flag} must be an int, not {type(seed).__name__} {seed!r}")
    if not 0 <= seed <= MAX_SEED:
        raise RunError(f"{flag} {seed} must lie in 0..{MAX_SEED} (2**32 - 1, what torch and numpy seed with)")


def _positive(name: str, value: int | None, minimum: int, why: str) -> None:
    if value is None:
        return
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r}")
    if value < minimum:
        raise RunError(f"{name} {value} must be at least {minimum} ({why})")


_Config = TypeVar("_Config")


@dataclass(frozen=True)
class ParsedSchemes:
    """A config's schemes parsed once, by validation (`validate`, `kvquant.eval.serve.check_config`), beside
    the `schemes` they were parsed from: a config whose `schemes` change (`dataclasses.replace`) drops
    them."""

    source: tuple  # the config's `schemes` as given (strings or scheme objects)
    schemes: tuple  # what they parse to: EvalSchemes (RunConfig, de-duplicated) or Schemes (ServeConfig)

    @staticmethod
    def attach(config: _Config, schemes) -> _Config:
        """A copy of the frozen `config` holding `schemes`, parsed from its `schemes`. A copy, not
        `dataclasses.replace`: nothing is re-derived (RunConfig's `chunk_given` stays as it was)."""
        new = copy.copy(config)
        object.__setattr__(new, "parsed_schemes", ParsedSchemes(tuple(config.schemes), tuple(schemes)))
        return new

    @staticmethod
    def kept(config) -> ParsedSchemes | None:
        """`config.parsed_schemes` while they are still those of `config.schemes`, else None (__post_init__
        of both configs: a copy whose schemes were replaced is not validated)."""
        held = config.parsed_schemes
        if held is None:
            return None
        if not isinstance(held, ParsedSchemes):
            raise TypeError(
                f"parsed_schemes is set by validation (a ParsedSchemes), not {type(held).__name__}; leave it "
                "out and validate the config"
            )
        return held if held.source == tuple(config.schemes) else None


@dataclass(frozen=True)
class RunConfig:
    """One evaluation: which schemes, on what model and text, how long and in which mode.

    Values that make no sense raise RunError here (never silently replaced by a default); whether the
    schemes parse and the paths exist is `validate`'s job, which returns a copy holding the parsed schemes
    (`parsed`): code past validation takes those, never the strings."""

    schemes: tuple[str | Scheme | EvalScheme, ...]  # as given: 'int4-g64', a Scheme, an EvalScheme
    model: str | None = None  # None: the embedded default
    corpus: str = "wikipedia"
    mode: str = "cache"  # cache | fake | both
    max_length: int = DEFAULT_MAX_LENGTH
    chunk: int | None = None  # None: DEFAULT_CHUNK, and each scheme's own default (peers: 128), see chunk_for
    docs: int | None = None
    tokens: int | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    out: str | None = None
    force: bool = False
    wandb: str = "disabled"
    kv_dtype: str = "fp16"  # storage dtype of the reported bytes (not the compute dtype)
    prefill: int | None = None  # prefill mode's prompt length P (default: half of max_length)
    reference_cache: bool = True  # reuse the reference pass's hidden states across runs
    noise_floor: bool = False  # measure cache mode twice (second time with shifted chunks): drift_noise
    task: str = "ppl"  # ppl | passkey | needle
    lengths: tuple[int, ...] | None = None  # retrieval: prompt lengths (None: DEFAULT_LENGTHS)
    depths: tuple[float, ...] | None = None  # retrieval: key depths in [0, 1] (None: DEFAULT_DEPTHS)
    trials: int | None = None  # retrieval: keys per (length, depth) (None: DEFAULT_TRIALS)
    shard: Shard | None = None  # --shard I/N: this job-array task's part of the points; no report
    merge: bool = False  # --merge: measure nothing; summary, report and plots from every shard's results
    device_map: str | None = None  # --device-map auto|balanced|FILE: the model split across devices
    extra: dict = field(default_factory=dict, compare=False)
    # set by `validate` (ParsedSchemes.attach), never by hand; read it as `parsed`
    parsed_schemes: ParsedSchemes | None = field(default=None, compare=False, repr=False)
    chunk_given: bool = field(init=False, default=True)  # False: --chunk was left to its default

    def __post_init__(self) -> None:
        if not isinstance(self.schemes, (tuple, list)):  # a lone string would be read letter by letter
            raise TypeError(
                f"schemes must be a tuple of scheme strings such as ('int4-g64',), not "
                f"{type(self.schemes).__name__} {self.schemes!r}"
            )
        object.__setattr__(self, "schemes", tuple(self.schemes))
        object.__setattr__(self, "parsed_schemes", ParsedSchemes.kept(self))
        object.__setattr__(self, "chunk_given", self.chunk is not None)
        if self.chunk is None:
            object.__setattr__(self, "chunk", DEFAULT_CHUNK)
        self._check_task()
        self._check_sharding()
        if self.mode not in MODE_CHOICES:
            raise RunError(f"unknown mode {self.mode!r}; known: {', '.join(MODE_CHOICES)}")
        if self.dtype not in DTYPE_NAMES:
            raise RunError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_NAMES)}")
        if self.kv_dtype not in KV_DTYPES:
            raise RunError(f"unknown --kv-dtype {self.kv_dtype!r}; known: fp16, bf16, fp32")
        if self.prefill is not None:
            _positive("--prefill", self.prefill, 1, "prompt tokens processed in one FP forward")
            if self.prefill >= self.max_length:
                raise RunError(f"--prefill {self.prefill} must be below --max-length {self.max_length} "
                               "(the continuation is what prefill mode scores)")
        if self.wandb not in WANDB_MODES:
            raise RunError(f"unknown W&B mode {self.wandb!r}; known: {', '.join(WANDB_MODES)}")
        if not _DEVICE_RE.match(str(self.device)):
            raise RunError(f"unknown device {self.device!r}; use cpu, cuda, cuda:N or mps")
        if self.device_map is not None:
            _check_device_map(self.device_map)
        _positive("--max-length", self.max_length, 2, "a document of L tokens gives L - 1 predictions")
        _positive("--chunk", self.chunk, 1, "tokens per forward")
        if self.noise_floor and self.chunk < 2:
            raise RunError("--noise-floor needs --chunk >= 2 (token-by-token decoding has one realization: "
                           "the noise floor compares two chunkings)")
        _positive("--docs", self.docs, 1, "documents to evaluate")
        _positive("--tokens", self.tokens, 1, "the token budget")
        if not _is_int(self.seed):
            raise TypeError(f"--seed must be an int, not {type(self.seed).__name__} {self.seed!r}")
        check_seed(self.seed)
        if self.prefill is not None and "prefill" not in self.modes:
            raise RunError(
                f"--prefill {self.prefill} applies to prefill mode only, and --mode {self.mode} measures "
                f"{', '.join(self.modes)}; add --mode prefill (or all), or drop --prefill"
            )
        if self.docs is not None and self.tokens is not None:
            raise RunError("give --docs or --tokens, not both")

    def _check_sharding(self) -> None:
        if self.shard is not None and not isinstance(self.shard, Shard):
            raise TypeError(f"shard must be a Shard (parse_shard('0/2')), not {type(self.shard).__name__}")
        if self.shard is None and not self.merge:
            return
        flag = "--merge" if self.merge else f"--shard {self.shard}"
        if self.shard is not None and self.merge:
            raise RunError("--merge writes the report from every shard: run it once, without --shard")
        if self.force:
            raise RunError(
                f"{flag} with --force: a shard would delete the other shards' results; start over once with "
                "--force in one process (or a new --out), then run the shards"
            )

    def _check_task(self) -> None:
        if self.task not in TASKS:
            raise RunError(f"unknown task {self.task!r}; known: {', '.join(TASKS)}")
        grid = {"--lengths": self.lengths, "--depths": self.depths, "--trials": self.trials}
        if self.task == "ppl":
            given = [k for k, v in grid.items() if v is not None]
            if given:
                raise RunError(f"{', '.join(given)} apply to --task passkey|needle, not ppl")
            return
        if self.noise_floor:
            raise RunError("--noise-floor applies to --task ppl")
        if self.lengths is not None:
            object.__setattr__(self, "lengths", tuple(self.lengths))
            if not self.lengths:
                raise RunError("--lengths names no length")
            for n in self.lengths:
                _positive("--lengths", n, MIN_RETRIEVAL_LENGTH, "the prompt's scaffold is ~60 tokens")
        if self.depths is not None:
            object.__setattr__(self, "depths", tuple(float(d) for d in self.depths))
            if not self.depths:
                raise RunError("--depths names no depth")
            bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
            if bad:
                raise RunError(f"--depths {bad[0]:g} must lie in [0, 1] (0: the key first, 1: last)")
        _positive("--trials", self.trials, 1, "keys per grid cell")

    @property
    def parsed(self) -> tuple[EvalScheme, ...]:
        """The schemes parsed by `validate` (kvquant's and peers, de-duplicated in order): what every function
        past validation takes. A config not validated raises RunError."""
        if self.parsed_schemes is None:
            raise RunError(
                "this RunConfig holds no parsed schemes: validate it first "
                "(config = kvquant.eval.config.validate(config); runner.run does)"
            )
        return self.parsed_schemes.schemes

    @property
    def is_retrieval(self) -> bool:
        return self.task in RETRIEVAL_TASKS

    @property
    def grid_lengths(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.lengths or DEFAULT_LENGTHS)))

    @property
    def grid_depths(self) -> tuple[float, ...]:
        return tuple(sorted(set(self.depths or DEFAULT_DEPTHS)))

    @property
    def grid_trials(self) -> int:
        return self.trials or DEFAULT_TRIALS

    def chunk_for(self, scheme) -> int:
        """Tokens per forward for one scheme in cache mode: --chunk when given, else the scheme's own default
        (a peer's is its residual length, 128, so its numbers are decode-like), else DEFAULT_CHUNK."""
        own = getattr(scheme, "default_chunk", None)
        return self.chunk if self.chunk_given or own is None else own

    @property
    def modes(self) -> tuple[str, ...]:
        """Measured modes; with noise_floor, cache mode's second realization `cache-shift` too."""
        base = {"both": ("cache", "fake"), "all": MODES}.get(self.mode, (self.mode,))
        return (*base, "cache-shift") if self.noise_floor and "cache" in base else base

    @property
    def prefill_length(self) -> int:
        return self.prefill if self.prefill is not None else max(self.max_length // 2, 1)

    @property
    def kv_dtype_name(self) -> str:
        return KV_DTYPES[self.kv_dtype]

    @property
    def dtype_name(self) -> str:
        """The torch dtype's name: float32, float16 or bfloat16."""
        return DTYPE_NAMES[self.dtype]


def _check_device_map(spec: str) -> None:
    """--device-map: a strategy or a readable JSON file of module -> device (kvquant.models.parse_device_map,
    which imports nothing heavy)."""
    from kvquant.models import parse_device_map

    try:
        parse_device_map(spec)
    except (OSError, ValueError, TypeError) as e:
        raise RunError(f"--device-map: {e}") from None


def validate(config: RunConfig, *, check_model: bool = True) -> RunConfig:
    """Parse the schemes and check the model, corpus and run directory, without torch; the copy of `config`
    holding the parsed schemes (`config.parsed`: EvalSchemes, de-duplicated in order). Raises RunError.

    A config validated before is checked again without parsing a string again (its parsed schemes are
    re-checked). check_model=False when the caller hands `run` a model object instead of a path."""
    held = config.parsed_schemes
    schemes = resolve_schemes(held.schemes if held is not None else config.schemes)
    if check_model:
        check_model_path(config.model)
        check_fits(config, schemes, model_facts(config.model))
    check_quantizes(config, schemes)
    check_corpus(config.corpus)
    check_out(config.out, config.force)
    return ParsedSchemes.attach(config, schemes)


def check_inputs(config: RunConfig, *, check_model: bool = True) -> list[EvalScheme]:
    """`validate(config).parsed` as a list: the parsed schemes (kvquant's and peers), de-duplicated in order.
    Raises RunError."""
    return list(validate(config, check_model=check_model).parsed)


def check_fits(config: RunConfig, schemes, facts: ModelFacts) -> None:
    """What the model's config file says, before its weights are loaded: --max-length (or the retrieval
    lengths) within its positions, per-layer schemes covering its layers, token groups it can fill, and
    head_dim the schemes can cut (group sizes, engine formats' blocks)."""
    from kvquant.scheme import SchemeError

    longest = max(config.grid_lengths) if config.is_retrieval else config.max_length
    flag = "--lengths" if config.is_retrieval else "--max-length"
    if facts.positions is not None and longest > facts.positions:
        raise RunError(
            f"{flag} {longest} is beyond the model's {facts.positions} positions ({facts.source}); "
            f"use at most {flag} {facts.positions}"
        )
    for s in schemes:
        scheme = getattr(s, "scheme", None)
        if scheme is None:
            continue  # a peer: checked when its cache is built
        try:
            if facts.layers is not None:
                scheme.check_num_layers(facts.layers)
            if facts.positions is not None:
                scheme.check_positions(facts.positions)
            if facts.head_dim is not None:  # engine formats' block rules (ggml: k % 32 == 0), group sizes
                scheme.check_head_dim(facts.head_dim)
        except SchemeError as e:
            raise RunError(f"scheme {scheme}: {e} ({facts.source})") from None


def quantizes_nothing(scheme, length: int, flag: str = "--max-length") -> str | None:
    """Why a kvquant `Scheme` quantizes no token of a `length`-token sequence (its sink and window hold every
    token, or its token group never fills), or None when it quantizes some."""
    if scheme.is_fp16:
        return None
    layers = [scheme.for_layer(r.first) for r in scheme.layers] or [scheme]
    if not all(la.is_fp16 or la.quantized_end(length) <= min(la.sink, length) for la in layers):
        return None
    group = scheme.tokens_per_flush
    after = f" (and whole groups of {group} tokens must fit after them)" if group > 1 else ""
    return (f"scheme {scheme} quantizes nothing at {flag} {length}: sink={scheme.sink} and "
            f"window={scheme.window} keep every token unquantized{after}")


def check_quantizes(config: RunConfig, schemes) -> None:
    """Refuse a kvquant scheme that would quantize nothing at this length (its sink and window hold every
    token, or its token group never fills): it would report the bits of a scheme never applied."""
    length = max(config.grid_lengths) if config.is_retrieval else config.max_length
    flag = "--lengths" if config.is_retrieval else "--max-length"
    for s in schemes:
        scheme = getattr(s, "scheme", None)
        reason = None if scheme is None else quantizes_nothing(scheme, length, flag)
        if reason is not None:
            raise RunError(f"{reason}, so it would report the bits of a scheme never applied; lower "
                           f"window/sink, use a smaller group, or raise {flag}")


@dataclass(frozen=True)
class ModelFacts:
    """What a model's config file says (None: unknown), read without loading weights or torch."""

    positions: int | None = None
    layers: int | None = None
    source: str = "unknown"
    # the shape of the KV cache (engine formats' rules: kvquant.eval.recommend); None where unknown
    head_dim: int | None = None
    kv_heads: int | None = None
    sliding_window: int | None = None  # set when some layers attend only to a window (hybrid models)
    sliding_layers: tuple[int, ...] | None = None  # which ones, where the config says (layer_types)


def model_facts(model: str | None) -> ModelFacts:
    """max_position_embeddings and num_hidden_layers of a model folder's config.json, or a GGUF's
    `<arch>.context_length` / `<arch>.block_count` (the header only); ModelFacts() where unknown."""
    from kvquant.models import check_model_path as resolve

    try:
        src = resolve(model)
    except (FileNotFoundError, ValueError):
        return ModelFacts()
    folder = Path(src.folder)
    try:
        if src.gguf is not None and (folder / src.gguf).is_file():
            return _gguf_facts(folder / src.gguf)
        if (folder / "config.json").is_file():
            import json

            cfg = json.loads((folder / "config.json").read_text())
            if not isinstance(cfg, dict):
                return ModelFacts()
            return ModelFacts(
                quirks.max_positions(cfg),
                quirks.attention_shape(cfg).num_layers,
                f"from {folder / 'config.json'}",
                **_shape_facts(cfg),
            )
    except (OSError, ValueError, AttributeError):  # unreadable: the loader says why, later
        return ModelFacts()
    return ModelFacts()


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes


def _shape_facts(cfg: dict) -> dict:
    """head_dim, kv_heads and sliding layers of a config.json (`kvquant.quirks`); sliding_layers None where
    the file does not say which layers slide (a window but no `layer_types`)."""
    shape = quirks.attention_shape(cfg)
    windows = quirks.layer_windows(cfg)
    if windows is None:
        window, sliding = quirks.sliding_window(cfg), None
    else:
        sliding = tuple(i for i, w in enumerate(windows) if w is not None)
        window = windows[sliding[0]] if sliding else None
    return {"head_dim": shape.head_dim, "kv_heads": shape.num_kv_heads, "sliding_window": window,
            "sliding_layers": sliding}


def _gguf_facts(path: Path) -> ModelFacts:
    """Read GGUF key/values until the architecture's context length, block count and attention shape are
    known and its block of `<arch>.` keys has ended (its sliding window may come after the shape)."""
    import struct

    def read(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF header")
        return struct.unpack(fmt, data)[0]

    def string(f) -> bytes:
        return f.read(read(f, "<Q"))

    def value(f, kind):
        if kind == 8:
            return string(f)
        if kind == 9:  # array: skip it
            item, n = read(f, "<I"), read(f, "<Q")
            if item == 8:
                for _ in range(n):
                    f.seek(read(f, "<Q"), 1)
            else:
                f.seek(_GGUF_SIZES[item] * n, 1)
            return None
        fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}[kind]
        return read(f, fmt)

    found: dict[str, object] = {}
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            return ModelFacts()
        read(f, "<I")  # version
        read(f, "<Q")  # tensors
        known = False  # the architecture's length, depth and attention shape read: stop after its block
        for _ in range(read(f, "<Q")):
            key = string(f).decode("utf-8", "replace")
            arch = found.get("general.architecture")
            if known and not key.startswith(f"{arch.decode()}."):  # (the tokenizer's arrays follow)
                break
            found[key] = value(f, read(f, "<I"))
            if isinstance(arch, bytes) and not known:
                arch = arch.decode()
                pos, layers = found.get(f"{arch}.context_length"), found.get(f"{arch}.block_count")
                shape = (f"{arch}.attention.head_count_kv", f"{arch}.attention.key_length")
                known = pos is not None and layers is not None and all(k in found for k in shape)
    arch = found.get("general.architecture")
    if not isinstance(arch, bytes):
        return ModelFacts()
    arch = arch.decode()
    pos, layers = found.get(f"{arch}.context_length"), found.get(f"{arch}.block_count")
    if pos is None or layers is None:
        return ModelFacts()
    att = f"{arch}.attention."
    heads, width = found.get(att + "head_count"), found.get(f"{arch}.embedding_length")
    head_dim = found.get(att + "key_length")
    if head_dim is None and _is_int(heads) and _is_int(width) and heads:
        head_dim = width // heads
    kv = found.get(att + "head_count_kv", heads)
    window = found.get(att + "sliding_window")
    window = int(window) if _is_int(window) and window > 0 else None
    return ModelFacts(
        int(pos), int(layers), f"from {path.name}",
        head_dim=int(head_dim) if _is_int(head_dim) else None,
        kv_heads=int(kv) if _is_int(kv) else None,
        sliding_window=window,
        sliding_layers=_gguf_sliding_layers(arch, int(layers), window) if window else None,
    )


def _gguf_sliding_layers(arch: str, layers: int, window: int) -> tuple[int, ...] | None:
    """Which layers of a GGUF model slide: a GGUF header gives the window, not the pattern, and transformers'
    GGUF loader builds the model's config class (`<arch>_text`, else `<arch>`: Gemma-3's 5 sliding : 1 full)
    with its default `layer_types`, so that class's defaults are the model kvquant runs. None when
    transformers has no config class for the architecture (this imports transformers, and so torch)."""
    from transformers import CONFIG_MAPPING

    for model_type in (f"{arch}_text", arch):
        if model_type in CONFIG_MAPPING:
            cfg = CONFIG_MAPPING[model_type](num_hidden_layers=layers, sliding_window=window).to_dict()
            windows = quirks.layer_windows(cfg)
            return None if windows is None else tuple(i for i, w in enumerate(windows) if w is not None)
    return None


def resolve_schemes(names) -> list:
    """Parse and de-duplicate; unknown names raise RunError listing the known ones."""
    from kvquant.scheme import Scheme, SchemeError

    from .schemes import KVQuantScheme, PeerScheme, parse_eval_scheme

    out, seen = [], set()
    for n in names:
        if not isinstance(n, (str, Scheme, KVQuantScheme, PeerScheme)):
            raise TypeError(
                f"a scheme must be a string such as 'int4-g64' or a Scheme, not {type(n).__name__} {n!r}"
            )
        try:
            s = parse_eval_scheme(n)
            s.check_available()
        except SchemeError as e:
            raise RunError(str(e)) from None
        calib = getattr(getattr(s, "scheme", None), "calib", None)
        if calib is not None:
            check_calib_file(calib, str(s))
        if s.label not in seen:
            seen.add(s.label)
            out.append(s)
    if not out:
        raise RunError("name at least one scheme (--scheme int4-g64); see --list-schemes")
    return out


def check_model_path(model: str | None) -> None:
    from kvquant.models import check_model_path as check

    try:
        check(model)
    except (FileNotFoundError, ValueError) as e:
        raise RunError(str(e)) from None


def check_corpus(corpus: str) -> None:
    from .data import CORPORA, CorpusError
    from .data import check_corpus as check

    try:
        check(corpus)
    except CorpusError as e:
        near = difflib.get_close_matches(str(corpus), CORPORA, n=1)
        raise RunError(str(e) + (f"; did you mean {near[0]!r}?" if near else "")) from None


def _parse_list(flag: str, text: str, convert) -> tuple:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise RunError(f"{flag} names no value (e.g. {flag} 512,1k,2k)")
    try:
        return tuple(convert(t) for t in items)
    except ValueError:
        raise RunError(f"{flag}: cannot read {text!r} (comma-separated, e.g. {flag} 512,1k,2k)") from None


def _length(t: str) -> int:
    t = t.lower()
    return int(t[:-1]) * 1024 if t.endswith("k") else int(t)


def parse_lengths(text: str) -> tuple[int, ...]:
    """`512,1k,2k` -> (512, 1024, 2048)."""
    return _parse_list("--lengths", text, _length)


def parse_depths(text: str) -> tuple[float, ...]:
    """`0,0.5,1` -> (0.0, 0.5, 1.0)."""
    return _parse_list("--depths", text, float)


CALIB_FORMAT = "kvquant-calibration/1"  # kvquant.calibration.FORMAT (a test keeps the two equal)


def check_calib_file(path: str, scheme: str = "") -> None:
    """A scheme's calib= file, checked without torch before any model work: NAME.safetensors with a readable
    header whose tensors all lie in the file (not truncated, not a pickle renamed), and NAME.json beside it,
    a kvquant calibration's metadata (a JSON object of the right format); or a file of vLLM k_scale /
    v_scale tensors only (`experiments/export_scales.py`, `recommend.py --export`), which needs no JSON.
    Raises RunError naming the fix."""
    import json
    import struct

    from kvquant.calibfile import is_kv_scale_names

    what = f"scheme {scheme}: calib={path}" if scheme else f"calib={path}"
    fix = (
        "write it with `python experiments/calibrate.py --scheme 'SCHEME' --out NAME.safetensors` "
        "(SCHEME without calib=)"
    )
    p = Path(path).expanduser()
    if p.is_dir():
        raise RunError(f"{what} is a directory; name the .safetensors file experiments/calibrate.py wrote")
    st = p.with_suffix(".safetensors") if p.suffix == ".json" else (
        p if p.suffix == ".safetensors" else p.with_name(p.name + ".safetensors")
    )
    js = st.with_suffix(".json")
    if not st.is_file():
        raise RunError(f"{what}: {st} does not exist{' (a directory)' if st.is_dir() else ''}; {fix}")
    size = st.stat().st_size
    try:
        with st.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{size} bytes, shorter than a safetensors header")
            n = struct.unpack("<Q", head)[0]
            if not 2 <= n <= 100_000_000:
                raise ValueError("its first 8 bytes are no safetensors header length (a pickle?)")
            if n > size - 8:
                raise ValueError(f"truncated: its header needs {n + 8:,} bytes, the file has {size:,}")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: its tensors end at byte {8 + n + end:,}, the file has {size:,}")
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise RunError(f"{what}: {st} is not a readable safetensors file ({e}); {fix}") from None
    if is_kv_scale_names(header):  # vLLM's k_scale / v_scale: kvquant.export reads them, no JSON beside
        return
    if not js.is_file():
        raise RunError(f"{what}: {js} does not exist{' (a directory)' if js.is_dir() else ''}; {fix}")
    try:
        meta = json.loads(js.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise RunError(f"{what}: {js} is not JSON ({e}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("format") != CALIB_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise RunError(f"{what}: {js} is not a kvquant calibration file (format {got!r}, want "
                       f"{CALIB_FORMAT!r}); {fix}")


NAME_MAX = 255  # bytes per path component on every common file system


def check_out(out: str | None, force: bool) -> None:
    """--out must be new, empty, or a kvquant run directory (resumed, or replaced with --force), and a place
    where a folder can be created (a name each file system takes, below a writable folder)."""
    if out is None:
        return
    path = Path(out)
    long = [part for part in path.parts if len(part.encode()) > NAME_MAX]
    if long:
        raise RunError(
            f"--out: the name {long[0][:40]}... is {len(long[0].encode())} bytes, above the file system's "
            f"{NAME_MAX}; choose a shorter --out"
        )
    if not path.exists():
        _check_creatable(path)
    if path.exists() and not path.is_dir():
        raise RunError(f"--out {out} is a file; name a folder for the run directory")
    if path.is_dir() and not force and not (path / "config.json").is_file():
        from .results import foreign_files  # no torch

        # only what kvquant writes (a lock file, a shard's results while torchrun's rank 0 claims the folder)
        # is a run directory in the making
        if foreign_files(path):
            raise RunError(
                f"{out} exists and is not a kvquant run directory; pass --force or choose another --out"
            )


def _check_creatable(path: Path) -> None:
    """Create (and remove) a probe folder in the nearest existing parent of `path`: refuses /proc/x, a
    read-only mount or a file in the way with the reason, before any work."""
    import os
    import tempfile

    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise RunError(f"--out {path}: {parent} is a file, not a folder; choose another --out")
    try:
        tempfile.TemporaryDirectory(dir=parent, prefix=".kvquant-probe-").cleanup()
    except OSError as e:
        raise RunError(
            f"--out {path}: cannot create a folder in {parent} ({os.strerror(e.errno) if e.errno else e}); "
            "choose a writable --out"
        ) from None
