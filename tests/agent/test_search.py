"""Web search's backends (agent/search.py): the local index over a real temporary directory
(SQLite FTS5, bm25, an embedding rerank), a search service on a real loopback HTTP server, the
``web_search`` tool's numbering, and the citations an answer gets."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from inferd.agent.search import (
    DirectoryIndex,
    SearchError,
    SearchHit,
    SearchTools,
    UrlSearch,
    cite,
    match_expression,
    passages,
)

LAVA = "# Lava fields\n\nThe volcano volcano volcano erupted; lava flows covered the slopes.\n"
ASH = (
    "<html><head><title>Ash clouds</title><script>volcano()</script></head><body>"
    "<h1>Ash</h1><p>After the volcano woke, an ash cloud spread over the town for many days, "
    "and the airport closed while crews cleared the runways of grey dust.</p></body></html>"
)


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    (tmp_path / "lava.md").write_text(LAVA)
    (tmp_path / "ash.html").write_text(ASH)
    (tmp_path / "notes.txt").write_text("Shopping: bread, milk, apples.\n")
    return tmp_path


def search(index: DirectoryIndex, query: str, k: int = 5) -> list[SearchHit]:
    async def main() -> list[SearchHit]:
        try:
            return await index.search(query, k)
        finally:
            await index.close()

    return asyncio.run(main())


def names(hits: Sequence[SearchHit]) -> list[str]:
    return [h.url.rsplit("/", 1)[1] for h in hits]


def test_bm25_ranks_the_files_that_match_and_reads_titles_and_urls(docs: Path) -> None:
    hits = search(DirectoryIndex(docs), "volcano")
    assert names(hits) == ["lava.md", "ash.html"]  # three mentions beat one; notes has none
    assert [h.title for h in hits] == ["Lava fields", "Ash clouds"]
    assert hits[0].url == (docs / "lava.md").resolve().as_uri()
    assert hits[0].score > hits[1].score
    assert "volcano()" not in hits[1].snippet  # the page's script is not its text
    assert hits[1].snippet.startswith("Ash")
    assert search(DirectoryIndex(docs), "volcano", k=1) == hits[:1]


def test_an_embedding_function_reorders_the_candidates_by_cosine(docs: Path) -> None:
    query = "volcano"

    async def embed(texts: Sequence[str]) -> list[list[float]]:
        # the query and the ash page point one way, the lava page the other
        return [
            [float(t == query or "ash" in t.lower()), float("lava" in t.lower())] for t in texts
        ]

    plain = search(DirectoryIndex(docs), query)
    reranked = search(DirectoryIndex(docs, embed), query)
    assert names(plain) == ["lava.md", "ash.html"]
    assert names(reranked) == ["ash.html", "lava.md"]
    assert [h.score for h in reranked] == [1.0, 0.0]  # the cosine similarities


def test_a_failing_embedding_function_leaves_bm25_order(docs: Path) -> None:
    async def embed(texts: Sequence[str]) -> list[list[float]]:
        raise RuntimeError("the embedding model is unloaded")

    assert names(search(DirectoryIndex(docs, embed), "volcano")) == ["lava.md", "ash.html"]


def test_files_over_the_size_bound_binary_hidden_and_linked_ones_are_skipped(
    tmp_path: Path,
) -> None:
    (tmp_path / "small.md").write_text("geyser " * 10)
    (tmp_path / "big.md").write_text("geyser " * 200)  # 1400 bytes
    (tmp_path / "nul.txt").write_bytes(b"geyser\0\0\x01binary")
    (tmp_path / "latin1.txt").write_bytes("geyser caf\xe9".encode("latin-1"))
    (tmp_path / "image.png").write_bytes(b"geyser")  # not a document type
    (tmp_path / ".hidden.md").write_text("geyser")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "notes.md").write_text("geyser")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.md"
    outside.write_text("geyser secret")
    (tmp_path / "link.md").symlink_to(outside)
    index = DirectoryIndex(tmp_path, max_file_bytes=1000)
    assert names(search(index, "geyser")) == ["small.md"]
    stats = index.stats
    assert (stats.files, stats.too_large, stats.binary) == (1, 1, 2)


def test_a_file_that_cannot_be_read_is_counted_and_skipped(tmp_path: Path) -> None:
    index = DirectoryIndex(tmp_path)
    assert index._read(tmp_path / "removed-while-indexing.md") is None
    assert index.stats.unreadable == 1


def test_a_query_is_words_never_fts5_syntax(docs: Path) -> None:
    assert match_expression('volcano" OR lava* NEAR( -x AND "') == (
        '"volcano" OR "or" OR "lava" OR "near" OR "and"'
    )
    assert names(search(DirectoryIndex(docs), 'volcano" NEAR( *')) == ["lava.md", "ash.html"]
    assert search(DirectoryIndex(docs), "?! *") == []
    assert search(DirectoryIndex(docs), "zeppelin") == []


def test_long_text_is_cut_into_bounded_passages_on_paragraphs() -> None:
    text = "alpha beta\n\n" + "word " * 400 + "\n\nomega"
    cut = passages(text, size=100)
    assert all(len(p) <= 100 for p in cut)
    assert cut[0] == "alpha beta" and cut[-1].endswith("omega")
    assert " ".join(cut).split() == text.split()


def test_the_tool_numbers_hits_across_searches_and_keeps_them(docs: Path) -> None:
    async def main() -> tuple[Any, Any, Any]:
        tools = SearchTools(DirectoryIndex(docs), k=1)
        first = await tools.call("web_search", {"query": "volcano"})
        second = await tools.call("web_search", {"query": "bread"})
        bad = await tools.call("web_search", {"query": "x", "page": 2})
        return tools, first, (second, bad)

    tools, first, (second, bad) = asyncio.run(main())
    assert [t.permission for t in tools.tools()] == ["allow"]
    assert first.content.splitlines()[:3] == [
        "Results for 'volcano' (cite a result by its number, as [1]):",
        "",
        "[1] Lava fields",
    ]
    assert "[2] notes" in second.content  # numbered after the first search's hit
    assert names(tools.hits) == ["lava.md", "notes.txt"]
    assert bad.is_error and "one argument: query" in bad.content


HITS = [
    SearchHit("Lava fields", "file:///lava.md", "The volcano erupted; lava flows", 1.0),
    SearchHit("Ash clouds", "file:///ash.html", "an ash cloud spread over the town", 0.5),
]


def test_citations_follow_markers_else_shared_words() -> None:
    text = "Lava flows covered the slopes. The town saw ash [2]. Unrelated closing words!"
    found = cite(text, HITS)
    assert [(text[c.start : c.end], c.url) for c in found] == [
        ("Lava flows covered the slopes.", "file:///lava.md"),
        ("The town saw ash [2].", "file:///ash.html"),
    ]
    assert found[0].title == "Lava fields"
    assert cite("Nothing matches [7].", HITS) == []  # a marker past the hits cites nothing


class Service(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answers = {
            "/ok": {
                "results": [
                    {"title": "Kīlauea", "url": "https://example.org/k", "snippet": "lava"},
                    {"url": "https://example.org/untitled", "score": 0.25},
                    {"title": "third", "url": "https://example.org/3"},
                ]
            },
            "/bad-url": {"results": [{"title": "x", "url": "javascript:alert(1)"}]},
            "/shape": {"hits": []},
        }
        data = json.dumps(answers[self.path] | {"echo": body}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def url_search(url: str, k: int = 2) -> list[SearchHit]:
    async def main() -> list[SearchHit]:
        backend = UrlSearch(url)
        try:
            return await backend.search("volcano", k)
        finally:
            await backend.close()

    return asyncio.run(main())


def test_a_search_service_answers_hits_as_json(service: str) -> None:
    hits = url_search(f"{service}/ok")
    assert hits == [
        SearchHit("Kīlauea", "https://example.org/k", "lava", -0.0),
        SearchHit("https://example.org/untitled", "https://example.org/untitled", "", 0.25),
    ]


@pytest.mark.parametrize(
    ("path", "message"),
    [("/bad-url", r"has no http\(s\) url"), ("/shape", 'no "results" list')],
)
def test_a_search_service_answer_out_of_shape_is_an_error(
    service: str, path: str, message: str
) -> None:
    with pytest.raises(SearchError, match=message):
        url_search(f"{service}{path}")


def test_a_search_url_at_a_metadata_address_is_refused() -> None:
    with pytest.raises(SearchError, match="cloud metadata address"):
        url_search("http://169.254.169.254/search")
    with pytest.raises(ValueError, match="--search-url"):
        UrlSearch("ftp://example.org/")
