"""The README and docs/ say what the code does and cite what ships.

Every ```python block of README.md and docs/*.md runs as written (shell blocks are not run), each in a
fresh namespace, with the network cut. A block that loads the real model is marked slow (it still runs in
`make test`).
A block that fills a QuantizedCache must teach what the cache is for: the cache holds fewer bytes than the
same tokens unquantized, and the block prints what was saved.

Every results file they cite ships, every relative link reaches a file (and its #anchor a heading), and
docs/schemes.md is what docs/generate.py writes from the code's own help now."""

from __future__ import annotations

import functools
import importlib.util
import re
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]  # what a reader reads
GENERATED = ROOT / "docs" / "schemes.md"  # the code's own help, written by docs/generate.py
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of each ```python block."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))
ALL_BLOCKS = [
    (_rel(page), line, code) for page in PAGES for line, code in python_blocks(page.read_text("utf-8"))
]


def _param(page: str, line: int, code: str):
    slow = "load_model(" in code
    return pytest.param(page, line, code, id=f"{page}:{line}", marks=[pytest.mark.slow] if slow else [])


@pytest.fixture
def no_network(monkeypatch):
    def refuse(self, address, *args, **kwargs):
        if getattr(self, "family", None) == socket.AF_UNIX:
            return real(self, address)
        raise OSError(f"README example tried to reach the network: {address!r}")

    real = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: refuse(None, address))


def test_extraction_finds_python_and_skips_shell():
    text = "x\n```python\na = 1\n```\n```bash\nrm -rf /\n```\n```python\nb = 2\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n"), (8, "b = 2\n")]
    assert BLOCKS, "README.md has no ```python block: nothing would be checked"


def _fp_bytes(cache, config, dtype) -> int:
    """The bytes of the same tokens unquantized at `dtype` (K and V, every layer), from the config alone."""
    import torch

    from kvquant.quirks import attention_shape

    a = attention_shape(config)
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * cache.get_seq_length() * size


@pytest.mark.parametrize("page, line, code", [_param(*block) for block in ALL_BLOCKS])
def test_readme_python_block_runs(page, line, code, no_network, capsys):
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, f"{ROOT / page}:{line}", "exec"), namespace)  # noqa: S102 - the docs' own code
    printed = capsys.readouterr().out

    import kvquant

    caches = [v for v in namespace.values() if isinstance(v, kvquant.QuantizedCache)]
    models = [v for v in namespace.values() if hasattr(v, "config") and hasattr(v, "generate")]
    for cache in caches:
        assert cache.get_seq_length() > 0, "the example never fills its cache"
        if models:
            full = _fp_bytes(cache, models[0].config, models[0].dtype)
            assert cache.nbytes() < full, (
                f"{page}:{line}: the cache holds {cache.nbytes():,} B, as much as {full:,} B unquantized: "
                "the example quantizes nothing (make the prompt longer than sink + window)"
            )
        assert "saved" in printed, f"{page}:{line}: the example should print the bytes it saved"


_RESULT_FILE = re.compile(r"(?:benchmarks/results|calib)/[\w.-]+\.(?:md|csv|png|json|safetensors)")


def _cited(page: Path) -> set[str]:
    return set(_RESULT_FILE.findall(page.read_text(encoding="utf-8")))


def test_result_files_the_readme_cites_are_in_the_repository():
    """A measured figure cites its file; the file must ship (benchmarks/results/ is ignored by default, so a
    result added without `git add -f` would be cited and missing on a fresh checkout). README.md and every
    docs/*.md page, the generated one too (a `calib=` example in the code's help must name a shipped file)."""
    assert DOCS, "docs/ has no .md page"
    cited = {page: sorted(_cited(page)) for page in PAGES}
    assert len(cited[README]) >= 1, "the README's headline table cites no results file"
    assert sum(len(c) for c in cited.values()) >= 20, cited
    missing = [f"{_rel(page)}: {c}" for page, cs in cited.items() for c in cs if not (ROOT / c).is_file()]
    assert not missing, f"cited files that are not in the checkout: {missing}"
    tracked = _tracked_files()
    if tracked is not None:  # a result on disk but ignored here is missing from CI's fresh clone
        untracked = [f"{_rel(page)}: {c}" for page, cs in cited.items() for c in cs if c not in tracked]
        assert not untracked, f"cited files git does not track (add them with `git add -f`): {untracked}"


@functools.cache
def _tracked_files() -> set[str] | None:
    """Paths git tracks or has staged in this checkout (relative, '/'-separated); None outside a git checkout
    or without git."""
    if not (ROOT / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(out.stdout.decode().split("\0")) - {""}


def test_every_measured_table_in_results_md_names_its_file():
    """docs/results.md: each section that holds a measured table links a file under benchmarks/results/ or
    says that its run directory is not there."""
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", _FENCE.sub("", text), flags=re.M)[1:]
    assert len(sections) >= 6, [s.splitlines()[0] for s in sections]
    for section in sections:
        if "|---" in section:
            title = section.splitlines()[0]
            assert "](../benchmarks/results/" in section or "not in `benchmarks/results/`" in section, (
                f"docs/results.md section {title!r} has a table but links no file under benchmarks/results/"
            )


_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)  # code blocks: neither links nor headings
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def links(text: str) -> list[str]:
    """Targets of the markdown links and images of text, outside code blocks."""
    return [a or b for a, b in _LINK.findall(_FENCE.sub("", text))]


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of text: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading numbered (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for title in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", _FENCE.sub("", text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_link_helpers():
    text = "# A: `b` (c)\n[x](docs/y.md#a-b-c) ![p](i.png)\n```\n[no](z.md)\n# not a heading\n```\n"
    text += "## A: `b` (c)\n"
    assert links(text) == ["docs/y.md#a-b-c", "i.png"]
    assert anchors(text) == {"a-b-c", "a-b-c-1"}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_reach_a_file_and_a_heading(page):
    """Every relative link of README.md and docs/*.md points to a file of the checkout, and its #anchor (if
    any) to a heading of the page it names."""
    broken = []
    tracked = _tracked_files()  # None outside a git checkout
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            shown = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
            broken.append(f"{target} (no file {shown})")
        elif tracked is not None and file.is_relative_to(ROOT) and file.is_file() and (
            file.relative_to(ROOT).as_posix() not in tracked
        ):
            broken.append(f"{target} (git does not track {_rel(file)}: a fresh clone lacks it; `git add -f`)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading #{anchor} in {_rel(file)})")
    assert not broken, f"{_rel(page)} links to what is not there: {broken}"


def _generator():
    spec = importlib.util.spec_from_file_location("kvquant_docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_schemes_md_is_what_the_generator_writes_now():
    """The grammar page is generated from kvquant.scheme.scheme_help() and --list-schemes, never edited."""
    expected = _generator().render()
    assert "k=SPEC" in expected and "kivi-2" in expected, "the generator lost the grammar or the presets"
    committed = GENERATED.read_text(encoding="utf-8") if GENERATED.is_file() else ""
    assert committed == expected, (
        "docs/schemes.md is out of date with the code's scheme help: run `make docs` "
        "(or `.venv/bin/python docs/generate.py`) and commit the result"
    )
