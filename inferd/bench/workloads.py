"""The benchmark workloads of the design notes, as data."""

from __future__ import annotations

from dataclasses import dataclass

TOPICS = [
    "a lighthouse keeper",
    "a lost robot",
    "the first city on Mars",
    "a dragon who hates gold",
    "a violin maker",
    "a submarine crew",
    "an old library",
    "a mountain rescue team",
]

SYSTEM_FILLER = (
    "You are a meticulous assistant for a logistics company. Always answer with care, cite the "
    "relevant policy section, keep a courteous tone, and never invent shipment numbers. "
)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: int
    concurrency: int
    max_tokens: int
    system: str | None = None
    user_repeat: int = 1  # repeat the user text to make a long prompt
    # Plain-text prompts to /v1/completions instead of chat: for base models, which have no
    # chat template (Gemma 3 270M); the text is the messages' contents, one paragraph each.
    text: bool = False
    # The user messages, request i sending users[i % len]; empty: a story about a topic.
    users: tuple[str, ...] = ()

    def request(self, index: int) -> list[dict[str, str]] | str:
        """What one request sends: the messages, or (``text``) the prompt."""
        return self.prompt(index) if self.text else self.messages(index)

    def prompt(self, index: int) -> str:
        return "\n\n".join(m["content"] for m in self.messages(index))

    def messages(self, index: int) -> list[dict[str, str]]:
        topic = TOPICS[index % len(TOPICS)]
        user = f"Write a long story about {topic}. Story number {index}."
        if self.users:
            user = self.users[index % len(self.users)]
        elif self.user_repeat > 1:
            user = (f"Background notes on {topic}, part {index}. " * self.user_repeat) + user
        out = [{"role": "user", "content": user}]
        if self.system is not None:
            out.insert(0, {"role": "system", "content": self.system})
        return out


WORKLOADS = {
    "single": Workload("single stream, 128 tokens", requests=4, concurrency=1, max_tokens=128),
    "concurrent": Workload("16 concurrent streams", requests=32, concurrency=16, max_tokens=128),
    "concurrent64": Workload("64 concurrent streams", requests=128, concurrency=64, max_tokens=128),
    "long": Workload(
        "2000-token prompt", requests=2, concurrency=1, max_tokens=16, user_repeat=220
    ),
    "shared": Workload(
        "32 requests, shared 1000-token system prompt",
        requests=32,
        concurrency=8,
        max_tokens=16,
        system=SYSTEM_FILLER * 28,
    ),
}

# What a plain `inferd bench` runs: 64 streams only when asked (run one request at a time, the
# in-process peers would take many minutes over its 128 requests).
DEFAULT_WORKLOADS = ("single", "concurrent", "long", "shared")
