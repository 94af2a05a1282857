"""The speculative-decoding workloads of `inferd bench --speculative`, as data.

Three kinds of text, from most to least to look up:

- ``copy``: the model repeats or lightly edits a ~250-token passage given in its prompt (a copy,
  a quote, an edit of given text: long runs of the prompt come back);
- ``summarize``: a ~500-token passage to summarize (the summary borrows phrases of the prompt);
- ``free``: a story about a topic (little to look up: speculation should cost nothing here).

Each is built for a number of concurrent streams; request ``i`` gets its own prompt (the
instructions and the order of the passage's sentences vary), so concurrent streams do not
share a whole prompt.
"""

from __future__ import annotations

from inferd.bench.workloads import Workload

LIGHTHOUSE = (
    "The lighthouse stood on a ledge of black rock at the end of the headland, and for a hundred "
    "and twelve years a keeper had climbed its spiral stairs every evening at dusk.",
    "He trimmed the wick, polished the great lens until it shone, and wound the clockwork that "
    "turned it, so that ships far out at sea could count the flashes and know which coast they "
    "were passing.",
    "In the mornings he wrote in the log: the direction and strength of the wind, the height of "
    "the swell, the colour of the sky, the names of the ships that had passed in the night, and "
    "anything else worth remembering, such as the winter the seals came ashore in their "
    "hundreds, or the night a schooner lost her mast and was towed into the harbour by the "
    "lifeboat.",
    "The log books filled a whole shelf in the keeper's cottage, bound in green cloth, the "
    "oldest so faded that the ink had turned the colour of weak tea.",
)
FERRY = (
    "Twice an hour a flat ferry crossed the river between the market town and the villages on "
    "the far bank, pulled along a steel cable by an engine that coughed every time it started.",
    "The ferryman had worked the crossing for thirty years and knew every passenger by name: "
    "the baker with her trays of bread, the schoolchildren with their satchels, the farmer who "
    "brought a goat to market every Saturday and never sold it.",
    "When the river flooded in spring the ferry stayed tied up for days, and the villagers "
    "walked eleven miles round by the old stone bridge, complaining all the way.",
    "The council had promised a new bridge for as long as anyone could remember, and every "
    "year the plans were drawn again, argued over in the town hall, and put back in a drawer.",
)

COPY_INSTRUCTIONS = (
    "Repeat the following text exactly, word for word:",
    'Copy the following text, replacing the word "keeper" with "warden" everywhere and '
    "changing nothing else:",
    "Copy the following text exactly, then add one sentence at the end about a storm:",
    'Copy the following text, replacing the word "ships" with "boats" everywhere and changing '
    "nothing else:",
)
SUMMARY_INSTRUCTIONS = (
    "Summarize the following text in three sentences:",
    "Write a short summary of the following text, keeping its names and numbers:",
)

KINDS = ("copy", "summarize", "free")
# Tokens each kind generates at most: a whole copy of the passage; a summary; a story's start
MAX_TOKENS = {"copy": 256, "summarize": 128, "free": 128}
SINGLE_STREAM_REQUESTS = 2  # one stream: requests in a row (a copy, then an edit)


def rotated(sentences: tuple[str, ...], by: int) -> str:
    """The passage with its sentences rotated ``by`` places (another prompt, same length)."""
    k = by % len(sentences)
    return " ".join(sentences[k:] + sentences[:k])


def copy_prompt(index: int) -> str:
    instruction = COPY_INSTRUCTIONS[index % len(COPY_INSTRUCTIONS)]
    return f"{instruction}\n\n{rotated(LIGHTHOUSE, index // len(COPY_INSTRUCTIONS))}"


def summary_prompt(index: int) -> str:
    instruction = SUMMARY_INSTRUCTIONS[index % len(SUMMARY_INSTRUCTIONS)]
    return f"{instruction}\n\n{rotated(LIGHTHOUSE + FERRY, index // len(SUMMARY_INSTRUCTIONS))}"


def spec_workload(kind: str, streams: int, max_tokens: int | None = None) -> Workload:
    """The ``kind`` workload at ``streams`` concurrent streams (one wave of requests; two in a
    row for one stream). ``max_tokens``: instead of the kind's own."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload {kind!r}: choose from {', '.join(KINDS)}")
    if streams < 1:
        raise ValueError("streams must be at least 1")
    requests = SINGLE_STREAM_REQUESTS if streams == 1 else streams
    users: tuple[str, ...] = ()  # free: the default story prompts
    if kind == "copy":
        users = tuple(copy_prompt(i) for i in range(requests))
    elif kind == "summarize":
        users = tuple(summary_prompt(i) for i in range(requests))
    label = "1 stream" if streams == 1 else f"{streams} streams"
    return Workload(
        f"{kind}, {label}",
        requests=requests,
        concurrency=streams,
        max_tokens=max_tokens or MAX_TOKENS[kind],
        users=users,
    )
