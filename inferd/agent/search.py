"""Search for the agent loop's ``web_search`` tool (chat's ``web_search_options``, the Responses
API's ``web_search`` tool): one backend interface, two backends, and the citations an answer
gets.

- ``SearchBackend``: ``search(query, k)`` -> up to ``k`` ``SearchHit``s (title, url, snippet,
  score: higher is better), best first.
- ``DirectoryIndex`` (``inferd serve --search-dir DIR``), local and offline: the ``.md``,
  ``.txt`` and ``.html`` files under DIR, cut into passages and indexed in an in-memory SQLite
  FTS5 table on first use; a query's candidates come in bm25 order, then, given an embedding
  function (``--search-embedding-model``), are reordered by cosine similarity to the query.
  Files over the size bound, binary or unreadable files, hidden ones and symbolic links are
  skipped. The index is built once: restart the server to see changed files.
- ``UrlSearch`` (``--search-url URL``): each query POSTed as ``{"query", "k"}``, the answer
  ``{"results": [{"title", "url", "snippet"}, ...]}``; the URL passes agent/url_policy.py
  (never a link-local or metadata address) and is reached only at the checked addresses.
- ``SearchTools``: the tool source (one per request) offering ``web_search``; it numbers the
  hits it shows the model across the request's searches and keeps them, so ``cite`` can map
  the answer's sentences back to the results: a sentence with a marker ``[n]`` cites result n,
  another cites the result it shares the most content words with (at least two, or all of a
  short sentence's). Offsets are Python string indices, ``text[start:end]``.

Imports only the base layer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from inferd.agent.tools import CallLimits, SpecTable, ToolCallError, ToolSource, ToolSpec
from inferd.agent.url_policy import McpUrlPolicy, OutboundUrlRefused, UrlPattern

log = logging.getLogger(__name__)

MiB = 1 << 20
SUFFIXES = frozenset({".md", ".markdown", ".txt", ".html", ".htm"})
DEFAULT_MAX_FILE_BYTES = 2 * MiB  # a larger file is skipped, not cut: its tail would be lost
DEFAULT_MAX_FILES = 20_000
PASSAGE_CHARS = 800  # what one index row holds, and one hit's snippet
MAX_QUERY_CHARS = 1000
MAX_QUERY_TERMS = 32
CANDIDATES = 4  # bm25 candidates per wanted hit, for the embedding rerank
MAX_ANSWER_BYTES = MiB  # a --search-url answer past this is refused unread
TOOL_NAME = "web_search"

# texts -> one vector each (the server's embedding model)
Embed = Callable[[Sequence[str]], Awaitable[list[list[float]]]]


@dataclass(frozen=True, slots=True)
class SearchHit:
    title: str
    url: str
    snippet: str
    score: float  # higher is better: -bm25, or the cosine similarity after a rerank


class SearchError(ToolCallError):
    """A search that failed; the message is the model's to read."""


class SearchBackend(ABC):
    @abstractmethod
    async def search(self, query: str, k: int) -> list[SearchHit]:
        """Up to ``k`` hits, best first; SearchError says why none could be had."""

    @abstractmethod
    def describe(self) -> str:
        """What the backend searches, for the startup line."""

    async def close(self) -> None:  # noqa: B027 (most backends hold nothing)
        """Release what the backend holds."""


# -- the local index --------------------------------------------------------------------------


@dataclass(slots=True)
class IndexStats:
    files: int = 0
    passages: int = 0
    too_large: int = 0
    unreadable: int = 0
    binary: int = 0


class DirectoryIndex(SearchBackend):
    def __init__(
        self,
        root: str | os.PathLike[str],
        embed: Embed | None = None,
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
    ) -> None:
        self.root = Path(root)
        self.embed = embed
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.stats = IndexStats()
        self._db: sqlite3.Connection | None = None
        self._db_lock = threading.Lock()  # one query at a time on the shared connection
        self._build_lock: asyncio.Lock | None = None

    def describe(self) -> str:
        order = "bm25, reranked by embeddings" if self.embed is not None else "bm25"
        return f"the files under {self.root} ({order})"

    async def search(self, query: str, k: int) -> list[SearchHit]:
        await self.ensure_built()
        wanted = k * CANDIDATES if self.embed is not None else k
        hits = await asyncio.to_thread(self._candidates, query, wanted)
        if self.embed is not None and len(hits) > 1:
            hits = await self._rerank(query, hits)
        return hits[:k]

    async def ensure_built(self) -> None:
        """Index the directory, once (on a worker thread: it reads every file)."""
        if self._build_lock is None:
            self._build_lock = asyncio.Lock()
        async with self._build_lock:
            if self._db is None:
                self._db = await asyncio.to_thread(self._build)
                s = self.stats
                log.info(
                    "search index of %s: %d file(s), %d passage(s); skipped %d over %d bytes, "
                    "%d unreadable, %d binary",
                    self.root,
                    s.files,
                    s.passages,
                    s.too_large,
                    self.max_file_bytes,
                    s.unreadable,
                    s.binary,
                )

    def _build(self) -> sqlite3.Connection:
        db = sqlite3.connect(":memory:", check_same_thread=False)
        db.execute(
            "CREATE VIRTUAL TABLE passages USING fts5("
            "title, body, url UNINDEXED, tokenize = 'porter unicode61')"
        )
        rows = []
        for path in self._files():
            document = self._read(path)
            if document is None:
                continue
            title, text = document
            self.stats.files += 1
            url = path.resolve().as_uri()
            rows += [(title, passage, url) for passage in passages(text)]
        db.executemany("INSERT INTO passages (title, body, url) VALUES (?, ?, ?)", rows)
        db.commit()
        self.stats.passages = len(rows)
        return db

    def _files(self) -> Iterator[Path]:
        """The candidate files, in a stable order, at most ``max_files``; hidden names and
        symbolic links left out (a link could lead out of the directory)."""
        found = 0
        for folder, dirs, names in os.walk(self.root, followlinks=False):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(names):
                path = Path(folder, name)
                if name.startswith(".") or path.suffix.lower() not in SUFFIXES:
                    continue
                if path.is_symlink() or not path.is_file():
                    continue
                if found == self.max_files:
                    log.warning("search index: stopped at %d files under %s", found, self.root)
                    return
                found += 1
                yield path

    def _read(self, path: Path) -> tuple[str, str] | None:
        """(title, text) of a file, or None when it is skipped (counted in ``stats``)."""
        try:
            with path.open("rb") as f:
                data = f.read(self.max_file_bytes + 1)
        except OSError:
            self.stats.unreadable += 1
            return None
        if len(data) > self.max_file_bytes:
            self.stats.too_large += 1
            return None
        try:
            if b"\0" in data:
                raise UnicodeDecodeError("utf-8", data, 0, 1, "a NUL byte")
            raw = data.decode("utf-8")
        except UnicodeDecodeError:
            self.stats.binary += 1
            return None
        if path.suffix.lower() in (".html", ".htm"):
            title, text = html_text(raw)
        else:
            title, text = _markdown_title(raw), raw
        return (title or path.stem), text

    def _candidates(self, query: str, limit: int) -> list[SearchHit]:
        expression = match_expression(query)
        if self._db is None or not expression:
            return []
        with self._db_lock:
            rows = self._db.execute(
                "SELECT url, title, body, bm25(passages, 2.0, 1.0) AS rank FROM passages "
                "WHERE passages MATCH ? ORDER BY rank LIMIT ?",
                (expression, limit * 4),  # room for several passages of one file
            ).fetchall()
        hits: list[SearchHit] = []
        seen: set[str] = set()
        for url, title, body, rank in rows:  # a file's best passage stands for it
            if url not in seen:
                seen.add(url)
                hits.append(SearchHit(title, url, body, -float(rank)))
        return hits[:limit]

    async def _rerank(self, query: str, hits: list[SearchHit]) -> list[SearchHit]:
        assert self.embed is not None
        try:
            vectors = await self.embed([query, *(f"{h.title}\n{h.snippet}" for h in hits)])
        except Exception as exc:  # the embedding model is unloaded, ...: bm25 order stands
            log.warning("search: the embedding rerank failed (%s); bm25 order kept", exc)
            return hits
        scored = [
            SearchHit(h.title, h.url, h.snippet, cosine(vectors[0], v))
            for h, v in zip(hits, vectors[1:], strict=True)
        ]
        return sorted(scored, key=lambda h: h.score, reverse=True)

    async def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def match_expression(query: str) -> str:
    """An FTS5 query for ``query``'s words, any of them (bm25 favours more): each word quoted,
    so nothing in a query is FTS5 syntax."""
    words = dict.fromkeys(w for w in re.findall(r"\w+", query.lower()) if len(w) > 1)
    return " OR ".join(f'"{w}"' for w in list(words)[:MAX_QUERY_TERMS])


def passages(text: str, size: int = PASSAGE_CHARS) -> list[str]:
    """``text`` cut into passages of at most ``size`` characters, on paragraph boundaries
    where it can be (a longer paragraph on whitespace)."""
    out: list[str] = []
    current = ""
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = " ".join(paragraph.split())
        while len(paragraph) > size:
            cut = paragraph.rfind(" ", 0, size)
            cut = cut if cut > 0 else size
            if current:
                out.append(current)
                current = ""
            out.append(paragraph[:cut])
            paragraph = paragraph[cut:].lstrip()
        if not paragraph:
            continue
        if current and len(current) + 1 + len(paragraph) > size:
            out.append(current)
            current = ""
        current = f"{current}\n{paragraph}" if current else paragraph
    if current:
        out.append(current)
    return out


def _markdown_title(text: str) -> str:
    for line in text.splitlines()[:50]:
        if line.startswith("# "):
            return line[2:].strip()
    return ""


class _HtmlText(HTMLParser):
    """The visible text of an HTML page and its <title> (or first <h1>)."""

    _SKIP = frozenset({"script", "style", "template", "noscript", "head"})
    _BLOCKS = frozenset({"p", "div", "br", "li", "h1", "h2", "h3", "h4", "section", "tr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title = ""
        self.h1 = ""
        self._stack: list[str] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self._stack.append(tag)
        if tag in self._BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._stack:
            while self._stack.pop() != tag:
                pass

    def handle_data(self, data: str) -> None:
        if "title" in self._stack:
            self.title += data
        elif not self._SKIP & set(self._stack):
            if "h1" in self._stack:
                self.h1 += data
            self.parts.append(data)


def html_text(raw: str) -> tuple[str, str]:
    """(title, text) of an HTML document."""
    parser = _HtmlText()
    parser.feed(raw)
    parser.close()
    title = " ".join((parser.title or parser.h1).split())
    return title, "".join(parser.parts)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


# -- a search service over HTTP ---------------------------------------------------------------


class UrlSearch(SearchBackend):
    def __init__(self, url: str, timeout_s: float = 20.0) -> None:
        try:
            UrlPattern.parse(url)
        except ValueError as exc:
            raise ValueError(f"--search-url: {exc}") from None
        self.url = url
        self.timeout_s = timeout_s
        self._client: Any = None

    def describe(self) -> str:
        return f"the search service at {self.url}"

    async def _connect(self) -> Any:
        """A client reaching the URL's host at the addresses checked now, and no others."""
        import httpx2

        from inferd.agent.pinned import pinned_client

        policy = McpUrlPolicy((UrlPattern.parse(self.url),), subject="--search-url")
        try:
            checked = await policy.check(self.url)
        except OutboundUrlRefused as exc:
            raise SearchError(f"the search service cannot be reached: {exc}") from None
        return pinned_client(checked.host, checked.addresses, {}, httpx2.Timeout(self.timeout_s))

    async def search(self, query: str, k: int) -> list[SearchHit]:
        if self._client is None:
            self._client = await self._connect()
        data = bytearray()
        async with self._client.stream("POST", self.url, json={"query": query, "k": k}) as response:
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > MAX_ANSWER_BYTES:
                    raise SearchError(f"the search service's answer is over {MAX_ANSWER_BYTES} B")
            if not 200 <= response.status_code < 300:
                raise SearchError(f"the search service answered HTTP {response.status_code}")
        return parse_hits(bytes(data), k)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def parse_hits(data: bytes, k: int) -> list[SearchHit]:
    """The hits of a search service's answer; SearchError when it is not the format."""
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise SearchError("the search service's answer is not JSON") from None
    results = value.get("results") if isinstance(value, dict) else None
    if not isinstance(results, list):
        raise SearchError('the search service\'s answer has no "results" list')
    hits = []
    for rank, item in enumerate(results[:k]):
        url = item.get("url") if isinstance(item, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise SearchError(f"the search service's result {rank} has no http(s) url")
        title, snippet = item.get("title"), item.get("snippet")
        score = item.get("score")
        hits.append(
            SearchHit(
                title[:300] if isinstance(title, str) and title else url[:300],
                url[:2048],
                snippet[:PASSAGE_CHARS] if isinstance(snippet, str) else "",
                float(score) if isinstance(score, int | float) else -float(rank),
            )
        )
    return hits


# -- the tool ---------------------------------------------------------------------------------


_DESCRIPTION = (
    "Search for documents about a topic. Returns numbered results (title, URL, text); cite a "
    "result you use by its number in brackets, as [1]."
)
_SCHEMA = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "what to search for"}},
    "required": ["query"],
    "additionalProperties": False,
}


@dataclass(slots=True)
class Search:
    query: str
    hits: list[SearchHit]
    first: int  # the number the model was shown for hits[0]


class SearchTools(ToolSource):
    """The ``web_search`` tool over a backend; one per request (it keeps what it showed)."""

    def __init__(self, backend: SearchBackend, k: int = 5) -> None:
        super().__init__(TOOL_NAME, CallLimits(30.0, max_concurrent=2, max_output_bytes=16384))
        self.backend = backend
        self.k = k
        self.searches: list[Search] = []
        # a search is read-only and the operator chose the backend: it runs without approval
        spec = SpecTable(TOOL_NAME, default="allow").spec(TOOL_NAME, _DESCRIPTION, _SCHEMA)
        self._specs = {spec.name: spec}

    @property
    def kind(self) -> str:
        return "search"

    @property
    def hits(self) -> list[SearchHit]:
        """Every hit shown, in the order they were numbered (hit n is ``hits[n - 1]``)."""
        return [h for s in self.searches for h in s.hits]

    async def start(self) -> None:
        pass

    async def _invoke(self, tool: ToolSpec, arguments: dict[str, Any]) -> tuple[str, bool]:
        query = arguments.get("query")
        if set(arguments) - {"query"} or not isinstance(query, str) or not query.strip():
            raise ToolCallError("web_search takes one argument: query, a non-empty string")
        query = query.strip()[:MAX_QUERY_CHARS]
        hits = await self.backend.search(query, self.k)
        search = Search(query, hits, len(self.hits) + 1)
        self.searches.append(search)
        if not hits:
            return f"No results for {query!r}.", False
        lines = [f"Results for {query!r} (cite a result by its number, as [1]):"]
        for number, hit in enumerate(hits, search.first):
            lines += ["", f"[{number}] {hit.title}", hit.url, hit.snippet]
        return "\n".join(lines), False

    async def close(self) -> None:
        pass  # the backend is the server's


# -- citations --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Citation:
    start: int
    end: int  # text[start:end] is the cited span
    url: str
    title: str


_MARKER = re.compile(r"\[(\d{1,3})\]")
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)", re.MULTILINE)
_STOP_WORDS = (
    "about after also been before being could does from have here into more most much only "
    "other over said same some such than that their them then there these they this those "
    "very were what when where which while will with would your"
)
_STOP = frozenset(_STOP_WORDS.split())


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", text.lower()) if len(w) > 3 and w not in _STOP}


@dataclass(slots=True)
class _HitWords:
    hit: SearchHit
    words: set[str] = field(default_factory=set)


def cite(text: str, hits: Sequence[SearchHit]) -> list[Citation]:
    """The answer's sentences that cite a result (see the module docstring), in order."""
    known = [_HitWords(h, _words(f"{h.title} {h.snippet}")) for h in hits]
    out: list[Citation] = []
    for match in _SENTENCE.finditer(text):
        sentence = match.group(0)
        start = match.start() + len(sentence) - len(sentence.lstrip())
        end = match.start() + len(sentence.rstrip())
        if start >= end:
            continue
        marked = [int(n) for n in _MARKER.findall(sentence) if 1 <= int(n) <= len(known)]
        if marked:
            chosen = [known[n - 1].hit for n in dict.fromkeys(marked)]
        else:
            best = _best(_words(sentence), known)
            chosen = [best] if best is not None else []
        out += [Citation(start, end, h.url, h.title) for h in chosen]
    return out


def _best(words: set[str], known: Sequence[_HitWords]) -> SearchHit | None:
    if not words:
        return None
    shared = [(len(words & k.words), -i, k.hit) for i, k in enumerate(known)]
    if not shared:
        return None
    count, _, hit = max(shared, key=lambda s: (s[0], s[1]))
    return hit if count >= min(2, len(words)) else None
