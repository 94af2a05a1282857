"""Skills (agent/skills.py, agent/skill_tools.py): the store's checks of an upload, which
refuse before anything is written; a folder laid out by hand; the tools the agent loop offers,
following the folder as it changes. On a real temporary folder; routes and the model's use
of the tools are tested live in tests/server/test_skills_live.py."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import zipfile
from pathlib import Path

import pytest

from inferd.agent.config import AgentConfig, AgentConfigError, agent_config
from inferd.agent.skill_tools import SkillTools
from inferd.agent.skills import (
    SkillError,
    SkillExists,
    SkillLimits,
    SkillNotFound,
    SkillStore,
    entries_from_zip,
)
from inferd.server.agent_runtime import AgentRuntime

LIMITS = SkillLimits(max_files=4, max_file_bytes=2000, max_total_bytes=2500, max_depth=2)


def skill_md(name: str = "pdf-tools", description: str = "Split and merge PDF files.") -> bytes:
    return f"---\nname: {name}\ndescription: {description}\n---\n# PDFs\nUse qpdf.\n".encode()


def zipped(*entries: tuple[str, bytes], symlink: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, content in entries:
            archive.writestr(path, content)
        if symlink is not None:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, "/etc/passwd")
    return buffer.getvalue()


@pytest.fixture
def store(tmp_path: Path) -> SkillStore:
    root = tmp_path / "skills"
    root.mkdir()
    return SkillStore(root, LIMITS)


def test_an_upload_becomes_a_skill_with_its_files(store: SkillStore) -> None:
    info = store.create([("SKILL.md", skill_md()), ("ref/notes.txt", b"page ranges: 1-3")])
    assert (info.name, info.description) == ("pdf-tools", "Split and merge PDF files.")
    assert [s.name for s in store.listing()] == ["pdf-tools"]
    assert store.body("pdf-tools") == "# PDFs\nUse qpdf.\n"
    assert [(f.path, f.size) for f in store.files("pdf-tools")] == [
        ("SKILL.md", len(skill_md())),
        ("ref/notes.txt", 16),
    ]
    assert store.read_file("pdf-tools", "ref/notes.txt") == "page ranges: 1-3"
    assert sorted(os.listdir(store.root)) == ["pdf-tools"]  # no staging folder left


def test_a_zip_of_the_folder_is_unpacked_without_its_top_folder(store: SkillStore) -> None:
    folder = [("pdf-tools/", b""), ("pdf-tools/SKILL.md", skill_md()), ("pdf-tools/a.txt", b"A")]
    data = zipped(*folder)
    store.create(entries_from_zip(data, LIMITS))
    assert [f.path for f in store.files("pdf-tools")] == ["SKILL.md", "a.txt"]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([("SKILL.md", skill_md()), ("../escape.txt", b"x")], "'.' or '..' part"),
        ([("SKILL.md", skill_md()), ("ref/../../x", b"x")], "'.' or '..' part"),
        ([("SKILL.md", skill_md()), ("/etc/cron.d/x", b"x")], "is absolute"),
        ([("SKILL.md", skill_md()), ("C:/x.txt", b"x")], "is absolute"),
        ([("SKILL.md", skill_md()), ("ref\\x.txt", b"x")], "backslash"),
        ([("SKILL.md", skill_md()), ("a\x00b", b"x")], "control character"),
        ([("SKILL.md", skill_md()), ("a/b/c/d.txt", b"x")], "folders deep"),
        ([("SKILL.md", skill_md()), ("é" * 200, b"x")], "over 255 bytes"),
        ([("SKILL.md", skill_md()), ("\udcff.txt", b"x")], "not valid Unicode"),
        ([("SKILL.md", skill_md()), ("big.bin", b"x" * 2001)], "over 2000 bytes"),
        ([("SKILL.md", skill_md())] + [(f"{i}.txt", b"x") for i in range(4)], "at most 4 files"),
        (
            [("SKILL.md", skill_md()), ("a", b"x" * 900), ("b", b"x" * 900), ("c", b"x" * 900)],
            "at most 2500",
        ),
        ([("SKILL.md", skill_md()), ("a.txt", b"1"), ("a.txt", b"2")], "given twice"),
        ([("SKILL.md", skill_md()), ("a", b"1"), ("a/b", b"2")], "both a file and a folder"),
        ([("notes.txt", b"no skill here")], "no SKILL.md"),
        ([("SKILL.md", b"# no front matter\n")], "must start with a '---' line"),
        ([("SKILL.md", b"---\nname: x\n")], "no closing '---'"),
        ([("SKILL.md", b"---\nname: [unclosed\n---\n")], "not valid YAML"),
        ([("SKILL.md", b"---\n- a list\n---\n")], "must be a mapping"),
        ([("SKILL.md", skill_md(name="Bad_Name"))], "'name' must be 1-64"),
        ([("SKILL.md", skill_md(name="-dash"))], "'name' must be 1-64"),
        ([("SKILL.md", skill_md(name="a" * 65))], "'name' must be 1-64"),
        ([("SKILL.md", b"---\nname: ok\n---\nbody")], "'description' must be"),
        ([("SKILL.md", b"---\nname: ok\ndescription: [1, 2]\n---\n")], "'description' must be"),
        ([("SKILL.md", skill_md(description="x" * 1025))], "at most 1024 characters"),
        ([("SKILL.md", b"\xff\xfe---")], "not UTF-8"),
        ([], "no files"),
    ],
)
def test_an_upload_the_checks_refuse_writes_nothing(
    store: SkillStore, entries: list[tuple[str, bytes]], message: str
) -> None:
    with pytest.raises(SkillError, match=message) as refused:
        store.create(entries)
    assert not isinstance(refused.value, SkillExists | SkillNotFound)
    assert os.listdir(store.root) == []


def test_a_zip_with_a_symlink_a_traversal_or_too_much_inside_is_refused(store: SkillStore) -> None:
    with pytest.raises(SkillError, match="is a symlink"):
        entries_from_zip(zipped(("SKILL.md", skill_md()), symlink="link"), LIMITS)
    traversal = entries_from_zip(zipped(("SKILL.md", skill_md()), ("../../x", b"x")), LIMITS)
    with pytest.raises(SkillError, match=r"'\.\.' part"):
        store.create(traversal)
    with pytest.raises(SkillError, match="not a readable zip"):
        entries_from_zip(b"PK\x03\x04 truncated", LIMITS)
    # compressed small, over the bound unpacked: refused, nothing unpacked past the bound
    bomb = zipped(("SKILL.md", skill_md()), ("big", b"y" * 50_000))
    with pytest.raises(SkillError, match="over 2000 bytes"):
        entries_from_zip(bomb, LIMITS)
    assert os.listdir(store.root) == []


def test_a_taken_name_is_refused_as_existing(store: SkillStore) -> None:
    store.create([("SKILL.md", skill_md())])
    with pytest.raises(SkillExists, match="'pdf-tools' exists"):
        store.create([("SKILL.md", skill_md(description="Another one."))])
    (store.root / "by-hand").write_text("a file, not a skill")
    with pytest.raises(SkillExists):
        store.create([("SKILL.md", skill_md(name="by-hand"))])
    assert store.info("pdf-tools").description == "Split and merge PDF files."
    assert sorted(os.listdir(store.root)) == ["by-hand", "pdf-tools"]


def test_delete_removes_the_skill_and_unknown_names_are_not_found(store: SkillStore) -> None:
    store.create([("SKILL.md", skill_md())])
    store.delete("pdf-tools")
    assert store.listing() == [] and os.listdir(store.root) == []
    for name in ("pdf-tools", "../etc", "x" * 300):
        with pytest.raises(SkillNotFound):
            store.delete(name)
        with pytest.raises(SkillNotFound):
            store.info(name)


def test_folders_laid_out_by_hand_that_break_the_rules_are_skipped(
    store: SkillStore, tmp_path: Path
) -> None:
    def folder(name: str, content: bytes) -> Path:
        (store.root / name).mkdir()
        (store.root / name / "SKILL.md").write_bytes(content)
        return store.root / name

    good = folder("good", skill_md(name="good"))
    folder("wrong-name", skill_md(name="other"))
    folder("no-front", b"just text")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "SKILL.md").write_bytes(skill_md(name="linked"))
    (outside / "secret.txt").write_text("secret")
    (store.root / "linked").symlink_to(outside)  # a symlinked skill folder is not followed
    (good / "secret.txt").symlink_to(outside / "secret.txt")
    (good / "sub").symlink_to(outside)
    (good / "blob.bin").write_bytes(b"\x00\xff\xfe")
    assert [s.name for s in store.listing()] == ["good"]
    assert [f.path for f in store.files("good")] == ["SKILL.md", "blob.bin"]  # no links
    with pytest.raises(SkillError, match="passes a symlink"):
        store.read_file("good", "secret.txt")
    with pytest.raises(SkillError, match="passes a symlink"):
        store.read_file("good", "sub/secret.txt")
    with pytest.raises(SkillError, match="not UTF-8"):
        store.read_file("good", "blob.bin")
    with pytest.raises(SkillError, match="has no file"):
        store.read_file("good", "missing.txt")
    with pytest.raises(SkillNotFound):
        store.read_file("linked", "secret.txt")


def test_a_large_file_is_read_cut_to_the_bound(store: SkillStore) -> None:
    store.create([("SKILL.md", skill_md())])
    (store.root / "pdf-tools" / "long.txt").write_text("z" * 3000)  # added by hand
    text = store.read_file("pdf-tools", "long.txt")
    assert text.startswith("z" * 2000) and text.endswith("[file cut at 2000 bytes]")


def test_an_edit_by_hand_is_seen_on_the_next_listing(store: SkillStore) -> None:
    store.create([("SKILL.md", skill_md())])
    assert store.info("pdf-tools").description == "Split and merge PDF files."
    (store.root / "pdf-tools" / "SKILL.md").write_bytes(skill_md(description="Now OCR too."))
    assert [s.description for s in store.listing()] == ["Now OCR too."]


# -- the tools ---------------------------------------------------------------------------------


def test_the_tools_follow_the_skills_and_load_one_on_demand(store: SkillStore) -> None:
    tools = SkillTools(store)

    async def run() -> None:
        await tools.start()
        assert tools.tools() == []  # no skill: nothing offered
        store.create([("SKILL.md", skill_md()), ("ref/notes.txt", b"use -split")])
        load, read = tools.tools()
        assert (load.name, read.name, load.permission) == ("load_skill", "read_skill_file", "allow")
        assert "- pdf-tools: Split and merge PDF files." in load.description
        assert "Use qpdf" not in load.description  # the body only when loaded
        assert load.input_schema["properties"]["name"]["enum"] == ["pdf-tools"]
        loaded = await tools.call("load_skill", {"name": "pdf-tools"})
        assert not loaded.is_error
        assert "# PDFs\nUse qpdf." in loaded.content
        assert "- ref/notes.txt (10 bytes)" in loaded.content
        file = await tools.call("read_skill_file", {"name": "pdf-tools", "path": "ref/notes.txt"})
        assert (file.content, file.is_error) == ("use -split", False)
        escape = await tools.call("read_skill_file", {"name": "pdf-tools", "path": "../../x"})
        assert escape.is_error and "'..' part" in escape.content
        missing = await tools.call("load_skill", {"name": "nope"})
        assert missing.is_error and "no skill named 'nope'" in missing.content
        store.delete("pdf-tools")
        assert tools.tools() == [] and not tools.owns("load_skill")

    asyncio.run(run())


def test_the_skills_dir_flag_checks_its_folder_and_the_runtime_offers_the_tools(
    tmp_path: Path,
) -> None:
    with pytest.raises(AgentConfigError, match=r"--skills-dir .*: not a directory"):
        agent_config(
            mcp_config=None, dispatch_url=None, max_tool_rounds=2, permission="ask",
            mcp_allow_urls=[], skills_dir=str(tmp_path / "missing"),
        )  # fmt: skip
    assert not AgentConfig().has_sources and AgentConfig(skills_dir=str(tmp_path)).has_sources
    SkillStore(tmp_path).create([("SKILL.md", skill_md())])

    async def offered(permission: str) -> list[str]:
        config = agent_config(
            mcp_config=None, dispatch_url=None, max_tool_rounds=2, permission=permission,
            mcp_allow_urls=[], skills_dir=str(tmp_path),
        )  # fmt: skip
        runtime = AgentRuntime(config)
        try:
            server = await runtime.server_tools(None)
            return [] if server is None else [t.name for t in server.specs]
        finally:
            await runtime.close()

    # the schemas compile as the loop's grammar; the tools only read, so `ask` does not hold
    # them, and `deny` (every server tool refused) does
    assert asyncio.run(offered("ask")) == ["load_skill", "read_skill_file"]
    assert asyncio.run(offered("deny")) == []
