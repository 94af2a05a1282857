"""The skills of ``--skills-dir`` as tools of the agent loop: shown by name, loaded on demand.

The model sees each skill's name and description in the ``load_skill`` tool's description;
the instructions themselves (SKILL.md's body) and the skill's other files reach it only as the
result of a call to ``load_skill`` or ``read_skill_file``, so a conversation pays for the
skills it uses. The tools follow the skills folder as it changes (an upload, a delete, an
edit by hand): each listing reads it again. With no valid skill no tool is offered.

The tools only read the skills folder (bounded, as text; nothing is run), so they are
``allow`` unless the server denies its tools altogether (``--agent-permission deny``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from inferd.agent.skills import SkillError, SkillFile, SkillInfo, SkillStore
from inferd.agent.tools import (
    DEFAULT_MAX_OUTPUT_BYTES,
    CallLimits,
    Permission,
    SpecTable,
    ToolCallError,
    ToolSource,
    ToolSourceError,
    ToolSpec,
)

LOAD = "load_skill"
READ = "read_skill_file"


class SkillTools(ToolSource):
    def __init__(
        self,
        store: SkillStore,
        name: str = "skills",
        *,
        permission: Permission = "allow",
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> None:
        super().__init__(name, CallLimits(max_output_bytes=max_output_bytes))
        self.store = store
        self._table = SpecTable(name, default=permission)
        self._listed: tuple[tuple[str, str], ...] | None = None

    @property
    def kind(self) -> str:
        return "skills"

    async def start(self) -> None:
        try:
            await asyncio.to_thread(self.store.check_root)
        except SkillError as exc:
            raise ToolSourceError(str(exc)) from None
        self._refresh()

    async def close(self) -> None:
        pass

    def tools(self) -> list[ToolSpec]:
        self._refresh()
        return super().tools()

    def owns(self, name: str) -> bool:
        self._refresh()
        return super().owns(name)

    def spec_for(self, name: str) -> ToolSpec | None:
        self._refresh()
        return super().spec_for(name)

    def _refresh(self) -> None:
        """The specs again when the skills changed: their names are the schemas' ``enum``
        (the model can only name a skill that exists) and the listing is the description."""
        skills = self.store.listing()
        listed = tuple((s.name, s.description) for s in skills)
        if listed == self._listed:
            return
        self._listed = listed
        if not skills:
            self._specs = {}
            return
        names = [s.name for s in skills]
        load = self._table.spec(LOAD, _load_description(skills), _load_schema(names))
        read = self._table.spec(READ, _READ_DESCRIPTION, _read_schema(names))
        self._specs = {load.name: load, read.name: read}

    async def _invoke(self, tool: ToolSpec, arguments: dict[str, Any]) -> tuple[str, bool]:
        name = arguments.get("name")
        if not isinstance(name, str):
            raise ToolCallError(f"{tool.name} needs 'name', a skill's name")
        try:
            if tool.remote_name == LOAD:
                if set(arguments) - {"name"}:
                    raise ToolCallError(f"{LOAD} takes one argument: name")
                return await asyncio.to_thread(self._load, name), False
            path = arguments.get("path")
            if set(arguments) - {"name", "path"} or not isinstance(path, str):
                raise ToolCallError(f"{READ} takes name and path, both strings")
            return await asyncio.to_thread(self.store.read_file, name, path), False
        except SkillError as exc:
            raise ToolCallError(str(exc)) from None

    def _load(self, name: str) -> str:
        body = self.store.body(name)
        others = [f for f in self.store.files(name) if f.path != "SKILL.md"]
        return f"# Skill: {name}\n\n{body.rstrip()}\n{_file_list(others)}"


def _file_list(files: list[SkillFile]) -> str:
    if not files:
        return ""
    lines = "\n".join(f"- {f.path} ({f.size} bytes)" for f in files)
    return f"\nFiles of this skill (read one with {READ}):\n{lines}\n"


def _load_description(skills: list[SkillInfo]) -> str:
    listing = "\n".join(f"- {s.name}: {s.description}" for s in skills)
    return (
        "Load a skill: instructions for a kind of task, and the files that come with it. When "
        "the task at hand matches a skill below, load it first and follow its instructions.\n"
        f"Skills:\n{listing}"
    )


_READ_DESCRIPTION = "Read one of a loaded skill's files (as listed by load_skill) as text."


def _name_schema(names: list[str]) -> dict[str, Any]:
    return {"type": "string", "enum": names, "description": "the skill's name"}


def _load_schema(names: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": _name_schema(names)},
        "required": ["name"],
        "additionalProperties": False,
    }


def _read_schema(names: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": _name_schema(names),
            "path": {"type": "string", "maxLength": 255, "description": "the file's path"},
        },
        "required": ["name", "path"],
        "additionalProperties": False,
    }
