"""wiki-search: answer trivia questions by searching and reading a small wiki with tools.

After verifiers' ``wiki_search`` environment: a tool environment (``max_turns`` 10) whose
model calls three tools, then answers in a message without a tool call:

- ``search_pages(query)``: BM25 over every page's title and text; the best pages (at most
  ``top_k``, only pages sharing a word with the query), one ``page_id (Title)`` a line;
- ``view_sections(page_id)``: the page's sections, one ``section_id (Title)`` a line;
  section ids are ``page_id:section_slug`` (``vorlia:geography``);
- ``read_section(section_id)``: that section's text.

An unknown page or section, or an empty query, is an error the model reads as
``Error: ...`` (counted by the tool environment, never the rollout's end).

Data, in order of precedence:

- ``corpus_path`` + ``questions_path`` (always together): JSONL files of pages (``id``,
  ``title``, ``content``: markdown whose ``#`` headings start sections; text before the
  first heading is the section ``intro``) and of questions (``question``, ``answer``,
  optionally ``info``);
- the hub datasets ``willcb/rare-wiki-pages`` and ``willcb/wiki-trivia-questions-v4`` (split
  ``train``) when reachable (``source="auto"``, the default, or ``"hub"``);
- otherwise (``source="generated"``, or ``auto`` offline) a generated wiki, deterministic
  for its ``corpus_seed``: 48 invented pages (16 countries, 16 creatures, 16 people), three
  one-sentence sections each, and 144 template questions ("What is the capital of
  Vorlia?") whose one-word answer is in exactly one section. It is small and regular on
  purpose, with short tool outputs, so that a byte-level tiny model can learn the path
  search_pages(name) -> view_sections(id) -> read_section(id) -> answer (SFT on the
  demonstrations, then RL: measured in docs/environments.md). Each generated question's
  ``info`` holds that path (``query``, ``page_id``, ``section_id``), which
  ``demonstration(example)`` turns into an SFT conversation with real tool outputs.

Questions are split into train and a held-out eval set by a seeded shuffle (``seed``;
``num_eval_examples=-1`` holds out a fifth, at least one).

The BM25 index (``bm25s``, the `wiki-search` extra) is cached on disk under ``<cache root>/<sha256 of the corpus>``:
the root is ``cache_dir`` when given, else ``$PRIME_RL_CACHE/wiki_search``, else
``~/.cache/prime-rl/wiki_search``. A changed corpus gets a new key and its own index; a
cache that cannot be read back is removed and rebuilt; a new index is written to a
temporary folder and renamed into place once complete, so readers never see half of one.

Reward ``correct_answer`` (the final answer is the last assistant message, when it makes
no tool call; running out of turns scores 0):

- default: the answer and the reference are normalized (lowercase, punctuation and the
  articles a/an/the dropped, whitespace collapsed); 1 when the reference's words appear
  together, as whole words, in an answer at most ``MAX_EXTRA_WORDS`` words longer than the
  reference ("Tarn", "The capital is Tarn." are right for "Tarn"; "Tarnish" is not, and
  neither is a long list of guesses);
- ``judge="ENDPOINT_ID"``: an LLM judge, an endpoint of ``endpoints_path`` (any
  OpenAI-compatible server), asked verifiers' yes/no question with the question, the
  reference and the answer; a reply starting with "yes" scores 1, "no" 0. A judge that
  fails, times out (``judge_timeout_s``, the whole request) or says neither scores 0 and
  is counted in the metric ``judge_errors``; it never stalls a rollout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import shutil
import sys
import unicodedata
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

import httpx
from prime_rl.envs import DatasetUnavailable, Example, Messages, Rubric, State, StatefulToolEnv
from prime_rl.envs import data as env_data
from prime_rl.extras import import_extra
from pydantic import Field, model_validator

from orchestrator.envs.common import CountOrAll, EvalCountOrAll, TrainCountArgs, held_out_split

if TYPE_CHECKING:
    import bm25s

ENV = "wiki-search"
CORPUS_HUB_ID = "willcb/rare-wiki-pages"
QUESTIONS_HUB_ID = "willcb/wiki-trivia-questions-v4"
SYSTEM_PROMPT = "Answer the question using the wiki tools. Reply with the answer only."
MAX_EXTRA_WORDS = 10
INDEX_VERSION = 1  # part of the cache key: bump when the tokenization or file layout changes
INDEX_META = "meta.json"  # written last inside an index folder: the folder is complete


# --------------------------------------------------------------------------- pages


@dataclass(frozen=True)
class Section:
    id: str
    """``page_id:slug``."""
    title: str
    text: str


@dataclass(frozen=True)
class Page:
    id: str
    title: str
    content: str
    sections: tuple[Section, ...]


_HEADING = re.compile(r"^#{1,6}\s+(.*\S)\s*$")


def slug(text: str) -> str:
    """``Early life`` -> ``early_life``: lowercase letters and digits joined by ``_``."""
    return re.sub(r"[^0-9a-z]+", "_", text.lower()).strip("_") or "section"


def split_sections(page_id: str, content: str) -> tuple[Section, ...]:
    """Sections of a markdown page: every ``#`` heading starts one (up to the next heading
    of any level); text before the first heading is the section ``intro``. Slugs repeated
    within the page get ``_2``, ``_3``..."""
    parts: list[tuple[str, list[str]]] = [("Introduction", [])]
    for line in content.splitlines():
        heading = _HEADING.match(line)
        if heading:
            parts.append((heading.group(1), []))
        else:
            parts[-1][1].append(line)
    sections, seen = [], set()
    for index, (title, lines) in enumerate(parts):
        text = "\n".join(lines).strip()
        if index == 0 and not text:
            continue  # no lead text
        base = "intro" if index == 0 else slug(title)
        name, n = base, 1
        while name in seen:
            n += 1
            name = f"{base}_{n}"
        seen.add(name)
        sections.append(Section(f"{page_id}:{name}", title, text))
    return tuple(sections)


def pages_from_rows(rows: list[Any], where: str) -> list[Page]:
    """Corpus rows (``id``, ``title``, ``content`` strings, ids unique) -> pages."""
    pages, seen = [], set()
    for i, row in enumerate(rows):
        fields = [row.get(k) for k in ("id", "title", "content")] if isinstance(row, dict) else [None]
        if not all(isinstance(f, str) for f in fields) or not str(fields[0]).strip():
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{ENV}: {where} row {i} needs string `id` (not empty), `title` and `content`; it has {keys}")
        page_id, title, content = (str(f) for f in fields)
        if page_id in seen:
            raise ValueError(f"{ENV}: {where} row {i}: page id {page_id!r} is used twice")
        seen.add(page_id)
        pages.append(Page(page_id, title, content, split_sections(page_id, content)))
    if not pages:
        raise ValueError(f"{ENV}: {where} has no pages")
    return pages


def questions_from_rows(rows: list[Any], where: str) -> list[dict[str, Any]]:
    """Question rows (``question`` and ``answer``, not empty; ``info`` optional) -> dataset rows."""
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not str(row.get("question") or "").strip() or not str(row.get("answer") or "").strip():
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{ENV}: {where} row {i} needs a non-empty `question` and `answer`; it has {keys}")
        info = row.get("info") if isinstance(row.get("info"), dict) else {}
        out.append({"question": str(row["question"]), "answer": str(row["answer"]).strip(), "info": dict(info)})
    return out


# --------------------------------------------------------------------------- search index


def corpus_key(pages: list[Page]) -> str:
    """sha256 of the corpus contents (and the index format): the cache folder's name."""
    digest = hashlib.sha256(f"{ENV} index v{INDEX_VERSION}\n".encode())
    for page in pages:
        digest.update(json.dumps([page.id, page.title, page.content]).encode() + b"\n")
    return digest.hexdigest()


def cache_root(cache_dir: str | Path | None) -> Path:
    """Where index folders live: ``cache_dir``, else ``$PRIME_RL_CACHE/wiki_search``, else
    ``~/.cache/prime-rl/wiki_search``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("PRIME_RL_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "prime-rl") / "wiki_search"


def _bm25s() -> Any:
    """The ``bm25s`` module (the `wiki-search` extra), or the one-line error naming it."""
    return import_extra("bm25s", ENV)


def _tokenize(texts: list[str]) -> Any:
    return _bm25s().tokenize(texts, stopwords="en", show_progress=False)


def _build_index(pages: list[Page]) -> bm25s.BM25:
    retriever = _bm25s().BM25()
    retriever.index(_tokenize([f"{p.title}\n{p.content}" for p in pages]), show_progress=False)
    return retriever


def _warn(message: str) -> None:
    print(f"[{ENV}] {message}", file=sys.stderr, flush=True)


def _discard(folder: Path) -> None:
    """Move a folder out of the way (one rename, so no reader sees it half-deleted), then delete it."""
    doomed = folder.with_name(f".{folder.name}.discard-{uuid.uuid4().hex[:8]}")
    try:
        folder.rename(doomed)
    except OSError:
        doomed = folder
    shutil.rmtree(doomed, ignore_errors=True)


def _read_index(folder: Path, key: str, num_docs: int) -> bm25s.BM25 | None:
    """The cached index, or None when there is none; an unreadable or partial one is
    discarded (and rebuilt by the caller)."""
    if not folder.exists():
        return None
    bm25s = _bm25s()
    try:
        meta = json.loads((folder / INDEX_META).read_text())
        expected = {"key": key, "num_docs": num_docs, "version": INDEX_VERSION}
        if meta != expected:
            raise ValueError(f"{INDEX_META} is {meta}, expected {expected}")
        retriever = bm25s.BM25.load(str(folder), show_progress=False)
        if retriever.scores.get("num_docs") != num_docs:
            raise ValueError(f"it indexes {retriever.scores.get('num_docs')} pages, expected {num_docs}")
        return retriever
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, a rebuilt index fixes it
        _warn(f"index cache {folder} is unreadable ({type(e).__name__}: {e}); rebuilding it")
        _discard(folder)
        return None


def _write_index(retriever: bm25s.BM25, folder: Path, key: str, num_docs: int) -> None:
    """Save into a temporary folder, mark it complete, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        retriever.save(str(tmp), show_progress=False)
        meta = {"key": key, "num_docs": num_docs, "version": INDEX_VERSION}
        (tmp / INDEX_META).write_text(json.dumps(meta))
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / INDEX_META).is_file():  # not another process's finished index
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_index(pages: list[Page], root: Path | None) -> tuple[bm25s.BM25, bool]:
    """(retriever, built): the cached index of this corpus under ``root``, or a new one
    (saved there for next time; ``root`` None: memory only). A cache that cannot be written
    is a warning, not an error: the index works without it."""
    if root is None:
        return _build_index(pages), True
    key = corpus_key(pages)
    folder = root / key
    cached = _read_index(folder, key, len(pages))
    if cached is not None:
        return cached, False
    retriever = _build_index(pages)
    try:
        _write_index(retriever, folder, key, len(pages))
    except OSError as e:
        _warn(f"cannot cache the search index in {folder} ({e}); using it from memory")
    return retriever, True


class WikiError(ValueError):
    """A tool's answer to a bad request: the model reads ``Error: <message>``."""


class Wiki:
    """The pages, their sections and the search index: the tools' hidden argument."""

    def __init__(self, pages: list[Page], root: Path | None, top_k: int = 3):
        self.pages = {p.id: p for p in pages}
        self.order = [p.id for p in pages]  # index position -> page id
        self.sections = {s.id: s for p in pages for s in p.sections}
        self.top_k = top_k
        self.index, self.index_built = open_index(pages, root)

    def search(self, query: str) -> list[Page]:
        """The best ``top_k`` pages that share at least one word with the query, best first."""
        results, scores = self.index.retrieve(_tokenize([query]), k=min(self.top_k, len(self.order)), show_progress=False)
        return [self.pages[self.order[int(i)]] for i, s in zip(results[0], scores[0]) if s > 0]


# --------------------------------------------------------------------------- tools
# Their docstrings are the tool descriptions the model reads: short on purpose (a tiny
# byte-level model reads every character of the schemas at every turn).


def search_pages(query: str, wiki: Wiki) -> str:
    """Search the wiki; lists the best pages as `page_id (Title)` lines.

    Args:
        query: words to look for, e.g. a name.
    """
    if not query.strip():
        raise WikiError("the query is empty; give words to search for")
    found = wiki.search(query)
    if not found:
        return f"No pages match {query!r}."
    return "\n".join(f"{p.id} ({p.title})" for p in found)


def view_sections(page_id: str, wiki: Wiki) -> str:
    """List a page's sections as `section_id (Title)` lines.

    Args:
        page_id: a page id from search_pages.
    """
    page = wiki.pages.get(page_id.strip())
    if page is None:
        raise WikiError(f"no page {page_id!r}; search_pages lists page ids")
    if not page.sections:
        return f"Page {page.id!r} is empty."
    return "\n".join(f"{s.id} ({s.title})" for s in page.sections)


def read_section(section_id: str, wiki: Wiki) -> str:
    """Read a section.

    Args:
        section_id: a section id from view_sections.
    """
    section_id = section_id.strip()
    page_id, colon, _ = section_id.rpartition(":")
    if not colon or not page_id:
        raise WikiError(f"section id {section_id!r} is not page_id:section; view_sections lists them")
    if page_id not in wiki.pages:
        raise WikiError(f"no page {page_id!r}; search_pages lists page ids")
    section = wiki.sections.get(section_id)
    if section is None:
        raise WikiError(f"no section {section_id!r}; view_sections({page_id!r}) lists them")
    return section.text or "(This section is empty.)"


TOOLS = (search_pages, view_sections, read_section)


# --------------------------------------------------------------------------- generated wiki
# Invented names (no real place or person), short and distinct: no name is a word of
# another page, so searching a name finds exactly its page. Facts come from pools; the
# invented ones (capitals, languages, birthplaces) are drawn without repeats.

COUNTRIES = ["Vorlia", "Brenmark", "Ostavia", "Kelmar", "Durnia", "Zafira", "Quorland", "Elbaria", "Mirosa", "Tavland",
             "Fennory", "Galdor", "Ilvania", "Norvel", "Pellia", "Rundel", "Solvane", "Ummera", "Xandor", "Yestra"]
CREATURES = ["Brelm", "Snarf", "Glimmox", "Tuskin", "Wubble", "Zorp", "Quillet", "Murkel", "Fizzet", "Grottle",
             "Hoblet", "Jibbit", "Klonk", "Plumble", "Skarn", "Vexil", "Drubb", "Nimbet", "Ooglet", "Rivvet"]
PEOPLE = ["Ida Voss", "Tomas Brek", "Lena Marr", "Oskar Feld", "Mira Tull", "Anouk Ress", "Bram Olle", "Cato Wren",
          "Dara Quist", "Edda Sorn", "Finn Hale", "Greta Pim", "Hugo Lark", "Ines Dorr", "Jory Blom", "Kaia Renn",
          "Luca Mott", "Nora Velt", "Otto Kray", "Pia Lund"]
CAPITALS = ["Tarn", "Oslen", "Brix", "Dunmere", "Elsk", "Fobb", "Gerrin", "Istra", "Jask", "Kovel",
            "Lunt", "Nesk", "Orrin", "Pask", "Quell", "Ruvo", "Setta", "Torv", "Uskel", "Varn"]
LANGUAGES = ["Ossic", "Brennish", "Taltic", "Marvic", "Duric", "Elvan", "Faric", "Gotlish", "Hessic", "Ilmic",
             "Jorric", "Keshi", "Lumic", "Norric", "Pellish", "Sarric", "Tovic", "Uldric", "Vessan", "Wendic"]
TOWNS = ["Amsk", "Birro", "Colm", "Dessa", "Efton", "Garro", "Hesk", "Ilby", "Jutt", "Kemble",
         "Lorr", "Mabb", "Nuxley", "Ossby", "Prell", "Ruddle", "Sabble", "Tolk", "Uxley", "Wenn"]
COLORS = ["red", "blue", "green", "gray", "brown", "black", "white", "golden", "silver", "orange", "purple", "yellow"]
HABITATS = ["swamps", "caves", "deserts", "forests", "hills", "lakes", "marshes", "meadows", "mountains", "jungles"]
FOODS = ["berries", "fish", "moss", "seeds", "beetles", "roots", "mushrooms", "worms", "leaves", "nuts", "snails"]
JOBS = ["painter", "sailor", "baker", "poet", "doctor", "farmer", "teacher", "builder", "singer", "potter", "dancer"]
INSTRUMENTS = ["harp", "drum", "flute", "lute", "horn", "fiddle", "bell", "banjo", "cello", "organ", "zither"]
PAGES_PER_KIND = 16

# (section title, sentence, question) per kind, one fact each: {e} the entity, {x} the answer
KINDS: dict[str, list[tuple[str, str, str]]] = {
    "country": [
        ("Overview", "{e} is a small country. Its people speak {x}.", "What language do the people of {e} speak?"),
        ("History", "{e} was founded in the year {x}.", "In what year was {e} founded?"),
        ("Geography", "The capital of {e} is {x}.", "What is the capital of {e}?"),
    ],
    "creature": [
        ("Overview", "The {e} is a creature with {x} fur.", "What color is the fur of the {e}?"),
        ("Habitat", "The {e} lives in the {x}.", "Where does the {e} live?"),
        ("Diet", "The {e} eats {x}.", "What does the {e} eat?"),
    ],
    "person": [
        ("Overview", "{e} is a famous {x}.", "What is the job of {e}?"),
        ("Early life", "{e} was born in {x}.", "Where was {e} born?"),
        ("Work", "{e} is best known for playing the {x}.", "What instrument does {e} play?"),
    ],
}


def _facts(kind: str, rng: random.Random) -> tuple[list[str], list[list[str]]]:
    """(entity names, their three facts each) of one kind, drawn with ``rng``."""
    n = PAGES_PER_KIND
    if kind == "country":
        names, langs, caps = rng.sample(COUNTRIES, n), rng.sample(LANGUAGES, n), rng.sample(CAPITALS, n)
        return names, [[lang, str(rng.randint(200, 1900)), cap] for lang, cap in zip(langs, caps)]
    if kind == "creature":
        names = rng.sample(CREATURES, n)
        return names, [[rng.choice(COLORS), rng.choice(HABITATS), rng.choice(FOODS)] for _ in names]
    names, towns = rng.sample(PEOPLE, n), rng.sample(TOWNS, n)
    return names, [[rng.choice(JOBS), town, rng.choice(INSTRUMENTS)] for town in towns]


@lru_cache(maxsize=4)
def generated_wiki(corpus_seed: int = 0) -> tuple[tuple[dict[str, str], ...], tuple[dict[str, Any], ...]]:
    """(page rows, question rows) of the generated wiki: 48 pages, 144 questions; the same
    for the same seed. Each question's ``info`` holds its path (query, page_id, section_id)."""
    rng = random.Random(f"{ENV}/corpus/{corpus_seed}")
    pages, questions = [], []
    for kind, templates in KINDS.items():
        names, facts = _facts(kind, rng)
        for name, values in zip(names, facts):
            page_id = slug(name)
            body = [f"## {title}\n{sentence.format(e=name, x=x)}" for (title, sentence, _), x in zip(templates, values)]
            pages.append({"id": page_id, "title": name, "content": "\n".join(body)})
            for (title, _, question), x in zip(templates, values):
                info = {"query": name, "page_id": page_id, "section_id": f"{page_id}:{slug(title)}"}
                questions.append({"question": question.format(e=name), "answer": x, "info": info})
    return tuple(pages), tuple(questions)


# --------------------------------------------------------------------------- data


def _local_rows(path: str | Path, name: str, expected: str) -> list[Any]:
    if not Path(path).is_file():
        raise DatasetUnavailable(f"{ENV}: {name} {str(path)!r} does not exist (expected a JSONL file of {expected} rows)")
    try:
        return env_data.read_file(Path(path))
    except DatasetUnavailable as e:
        raise DatasetUnavailable(f"{ENV}: {name}: {e}") from e


def _hub_rows() -> tuple[list[Any], list[Any]]:
    """(corpus rows, question rows) from the hub, or DatasetUnavailable saying what to pass."""
    for hub_id in (CORPUS_HUB_ID, QUESTIONS_HUB_ID):
        reason = env_data.hub_unreachable(hub_id)
        if reason is not None:
            raise DatasetUnavailable(
                f"{ENV}: dataset {hub_id} is unreachable ({reason}); pass source='generated', "
                "or corpus_path and questions_path (JSONL files)"
            )
    try:
        return env_data.read_hub(CORPUS_HUB_ID, None, "train"), env_data.read_hub(QUESTIONS_HUB_ID, None, "train")
    except DatasetUnavailable as e:
        raise DatasetUnavailable(f"{ENV}: {e}; pass source='generated', or corpus_path and questions_path") from e


def load_data(
    source: str, corpus_path: str | None, questions_path: str | None, corpus_seed: int
) -> tuple[list[Page], list[dict[str, Any]], str]:
    """(pages, question rows, origin) from the files, the hub or the generator (module docstring)."""
    if corpus_path is not None:
        pages_rows = _local_rows(corpus_path, "corpus_path", "id/title/content")
        question_rows = _local_rows(str(questions_path), "questions_path", "question/answer")
        return pages_from_rows(pages_rows, f"corpus_path {corpus_path!r}"), questions_from_rows(
            question_rows, f"questions_path {questions_path!r}"
        ), "local files"
    if source in ("auto", "hub"):
        try:
            corpus, questions = _hub_rows()
            return pages_from_rows(corpus, CORPUS_HUB_ID), questions_from_rows(questions, QUESTIONS_HUB_ID), "hub"
        except DatasetUnavailable as e:
            if source == "hub":
                raise
            origin = f"generated offline ({e})"
    else:
        origin = "generated"
    corpus, questions = generated_wiki(corpus_seed)
    rows = [{**q, "info": {**q["info"], "corpus_seed": corpus_seed}} for q in questions]
    return pages_from_rows(list(corpus), "the generated wiki"), rows, origin


# --------------------------------------------------------------------------- rewards


def final_answer(completion: Messages) -> str | None:
    """Content of the last assistant message, None when it makes a tool call (the episode
    ran out of turns) or there is none."""
    replies = [m for m in completion if m.get("role") == "assistant"]
    if not replies or replies[-1].get("tool_calls"):
        return None
    return str(replies[-1].get("content") or "")


def normalize_words(text: str) -> list[str]:
    """Lowercase words without punctuation or the articles a/an/the (SQuAD's normalization)."""
    text = "".join(" " if unicodedata.category(c).startswith("P") else c for c in text.lower())
    return [w for w in text.split() if w not in ("a", "an", "the")]


def answer_matches(predicted: str | None, reference: str) -> bool:
    """The reference's words appear together, as whole words, in a short answer (at most
    ``MAX_EXTRA_WORDS`` more words than the reference, so a list of guesses does not pass)."""
    ref, got = normalize_words(reference), normalize_words(predicted or "")
    if not ref or not got or len(got) > len(ref) + MAX_EXTRA_WORDS:
        return False
    return f" {' '.join(ref)} " in f" {' '.join(got)} "


JUDGE_PROMPT = """Given a ground truth answer and a response, determine if the response is correct.

Question:
```
{question}
```

Ground truth answer:
```
{answer}
```

Response:
```
{response}
```

Respond either "yes" or "no" only."""


@dataclass(frozen=True)
class Judge:
    """An OpenAI-compatible chat endpoint asked yes/no about each answer."""

    endpoint_id: str
    url: str
    model: str
    api_key: str | None
    timeout_s: float

    async def verdict(self, question: str, reference: str, response: str) -> bool:
        """True for yes, False for no; raises on anything else (HTTP error, odd reply)."""
        prompt = JUDGE_PROMPT.format(question=question, answer=reference, response=response)
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s)) as client:
            reply = await client.post(f"{self.url.rstrip('/')}/chat/completions", json=body, headers=headers)
            reply.raise_for_status()
            text = str(reply.json()["choices"][0]["message"]["content"] or "")
        words = normalize_words(text.rsplit("</think>", 1)[-1])  # a reasoning judge's verdict follows its thoughts
        if words and words[0] in ("yes", "no"):
            return words[0] == "yes"
        raise ValueError(f"the judge answered {text[:100]!r}, not yes or no")


def load_judge(judge: str, endpoints_path: str | Path, timeout_s: float) -> Judge:
    from prime_rl.endpoints import load_endpoints

    try:
        endpoints = load_endpoints(Path(endpoints_path))
    except ValueError as e:  # ConfigError: missing file, bad TOML
        raise ValueError(f"{ENV}: judge {judge!r}: {e}") from e
    if judge not in endpoints:
        raise ValueError(f"{ENV}: judge {judge!r} is not an endpoint of {str(endpoints_path)!r} (it has {sorted(endpoints)})")
    endpoint = endpoints[judge]
    api_key = os.environ.get(endpoint.key) if endpoint.key else None
    return Judge(judge, endpoint.url, endpoint.model, api_key, timeout_s)


def correct_answer(completion, answer) -> float:
    """1 when the final answer matches the reference (``answer_matches``)."""
    return float(answer_matches(final_answer(completion), answer))


def judged_answer(judge: Judge):
    """The judge's verdict on the final answer as a reward function; failures score 0 and
    are counted in ``state["judge_errors"]`` (the traceback-free reason is shown once)."""
    warned: list[bool] = []

    async def correct_answer(completion, answer, info, state) -> float:  # the metric keeps its name
        response = final_answer(completion)
        if not response or not response.strip():
            return 0.0  # no answer: nothing to judge
        question = str((info or {}).get("question") or "")
        try:
            return float(await asyncio.wait_for(judge.verdict(question, answer, response), judge.timeout_s))
        except Exception as e:  # noqa: BLE001 - a failing judge scores 0, counted, never stops the run
            state["judge_errors"] = state.get("judge_errors", 0) + 1
            if not warned:
                warned.append(True)
                _warn(f"judge {judge.endpoint_id!r} failed ({type(e).__name__}: {e}); such answers score 0, "
                      "counted in judge_errors (shown once)")
            return 0.0

    return correct_answer


def judge_errors(state) -> float:
    """1 when the judge failed on this rollout's answer (error, timeout, neither yes nor no)."""
    return float(state.get("judge_errors", 0))


def make_rubric(judge: Judge | None) -> Rubric:
    """``correct_answer`` by normalized match, or by the LLM judge plus the ``judge_errors`` metric."""
    if judge is None:
        return Rubric(funcs=[correct_answer])
    rubric = Rubric(funcs=[judged_answer(judge)])
    rubric.add_metric(judge_errors)
    return rubric


# --------------------------------------------------------------------------- environment


class WikiSearchEnv(StatefulToolEnv):
    """The three wiki tools, with the wiki injected as their hidden ``wiki`` argument."""

    runs_programs = False  # its episodes only exchange messages and search an index in memory

    def __init__(self, wiki: Wiki, origin: str = "", **kwargs: Any):
        super().__init__(error_formatter=_tool_error, **kwargs)
        self.wiki = wiki
        self.data_origin = origin
        """Where the data came from (files, hub, generated and why): for logs and tests."""
        for tool in TOOLS:
            self.add_tool(tool, args_to_skip=("wiki",))

    def update_tool_args(self, tool_name: str, tool_args: dict[str, Any], messages: Messages, state: State) -> dict[str, Any]:
        return {**tool_args, "wiki": self.wiki}


def _tool_error(e: Exception) -> str:
    """The wiki's own errors read plainly; anything else (a bug) keeps its type name."""
    return f"Error: {e}" if isinstance(e, WikiError) else f"Error: {type(e).__name__}: {e}"


class WikiSearchArgs(TrainCountArgs):
    """wiki-search's arguments: verifiers' wiki_search, plus the data, the index and the judge."""

    env: ClassVar[str] = ENV
    num_train_examples: CountOrAll = -1
    """Train questions; -1: all but the held-out ones."""
    num_eval_examples: EvalCountOrAll = -1
    """Held-out questions; -1: a fifth."""
    max_turns: int = Field(10, ge=1)
    """Model turns, tool calls included."""
    system_prompt: str = SYSTEM_PROMPT
    """The instruction."""
    seed: int = 0
    """Seeds the train/eval split."""
    corpus_seed: int = 0
    """Picks the generated wiki."""
    source: Literal["auto", "hub", "local", "generated"] = "auto"
    """`auto` (the files when given, else the hub when it answers, else generated), `hub`, `local` (the files) or `generated`."""
    corpus_path: str | None = None
    """A JSONL file of pages (`id`, `title`, `content`), with `questions_path`."""
    questions_path: str | None = None
    """A JSONL file of questions (`question`, `answer`) about `corpus_path`'s pages."""
    cache_dir: str | None = None
    """Root of the search index cache (default `$PRIME_RL_CACHE/wiki_search`, else `~/.cache/prime-rl/wiki_search`)."""
    top_k: int = Field(3, ge=1)
    """Most pages `search_pages` lists."""
    judge: str | None = None
    """An endpoint id of `endpoints_path`: an LLM judges the answers instead of the normalized match."""
    judge_timeout_s: float = Field(30.0, gt=0)
    """Longest a judge's whole request may take, in seconds (then the answer scores 0)."""
    endpoints_path: str = "configs/endpoints.toml"
    """The endpoints file that names `judge`."""
    num_examples: CountOrAll | None = None
    """Another name for `num_train_examples`."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.corpus_path is None) != (self.questions_path is None):
            raise ValueError("corpus_path and questions_path go together (questions about that corpus); give both or neither")
        if self.corpus_path is not None and self.source not in ("auto", "local"):
            raise ValueError(f"corpus_path and questions_path are local files, but source is {self.source!r}; "
                             "use 'local' or 'auto'")
        if self.corpus_path is None and self.source == "local":
            raise ValueError("source='local' needs corpus_path and questions_path (JSONL files)")
        return self


def load_environment(**args: Any) -> WikiSearchEnv:
    """wiki-search with ``args`` (``WikiSearchArgs``)."""
    a = WikiSearchArgs.parse(args)
    _bm25s()  # the search index needs it: say so before the data is read
    judged = load_judge(a.judge, a.endpoints_path, a.judge_timeout_s) if a.judge is not None else None

    pages, questions, origin = load_data(a.source, a.corpus_path, a.questions_path, a.corpus_seed)
    train, evals = held_out_split(questions, a.num_eval_examples, a.seed, ENV, "questions", share=5)
    if a.train_count != -1:
        train = train[: a.train_count]
    for row in (*train, *evals):
        row["info"] = {**row["info"], "question": row["question"]}
        row["task"] = ENV
    return WikiSearchEnv(
        Wiki(pages, cache_root(a.cache_dir), a.top_k),
        origin,
        dataset=train,
        eval_dataset=evals or None,
        system_prompt=a.system_prompt,
        rubric=make_rubric(judged),
        max_turns=a.max_turns,
    )


# --------------------------------------------------------------------------- demonstrations


@lru_cache(maxsize=4)
def _generated_memory_wiki(corpus_seed: int) -> Wiki:
    """The generated wiki with an in-memory index (demonstrations without an env at hand)."""
    return Wiki(pages_from_rows(list(generated_wiki(corpus_seed)[0]), "the generated wiki"), None)


def demonstration(example: Example, env: WikiSearchEnv | None = None) -> Messages | None:
    """The whole tool-using episode for SFT: the prompt, then search_pages(query),
    view_sections(page_id), read_section(section_id) (assistant tool calls ``call_0``..
    ``call_2``, each followed by its real tool output) and the bare reference answer.

    Needs the path in ``info`` (``query``, ``page_id``, ``section_id``: generated questions
    have it); the wiki is ``env``'s, else the generated one of ``info["corpus_seed"]`` (a
    question from files or the hub without ``env`` is a ValueError). None
    when the path is missing or does not lead to the answer (the search does not list the
    page, or the section does not hold the answer)."""
    info = example.info
    if not all(isinstance(info.get(k), str) for k in ("query", "page_id", "section_id")):
        return None
    if env is None and not isinstance(info.get("corpus_seed"), int):
        raise ValueError(f"{ENV}: demonstration(example) without env= needs a generated question (info has no corpus_seed)")
    wiki = env.wiki if env is not None else _generated_memory_wiki(info["corpus_seed"])
    steps = [(search_pages, "query", info["query"]), (view_sections, "page_id", info["page_id"]),
             (read_section, "section_id", info["section_id"])]
    messages: Messages = [dict(m) for m in example.prompt]
    outputs = []
    for i, (tool, arg, value) in enumerate(steps):
        try:
            outputs.append(tool(value, wiki))
        except WikiError:
            return None
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": tool.__name__, "arguments": json.dumps({arg: value})}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": outputs[-1]})
    searched, sections, text = outputs
    leads_there = f"{info['page_id']} (" in searched and f"{info['section_id']} (" in sections
    if not leads_there or not _holds(text, example.answer):
        return None
    messages.append({"role": "assistant", "content": example.answer})
    return messages


def _holds(text: str, answer: str) -> bool:
    """The section's text contains the answer as whole words (normalized)."""
    if not normalize_words(answer):
        return False
    return f" {' '.join(normalize_words(answer))} " in f" {' '.join(normalize_words(text))} "
