"""``doc_check``: a document checked against rules by a model, each section a child run.

Seed 001's scenario (LLM-based document testing), where a worker that died mid-document lost
the whole task. Here the Markdown document is split at its headings and each section is
checked by a child run of ``doc_check_section`` (key ``section:<n>``), so the sections are
checked in parallel, on any worker, each in a checkpointed step (``check``) whose model verdict
streams as ``delta`` events tagged with the section. The parent joins them
(``ctx.map``): while it waits it is parked and holds no worker slot. A section whose check
fails is retried as a run of its own; a parent replayed after a crash gets the same children
(one per key) and re-checks nothing that finished.

The model is asked to begin with ``VERDICT: PASS`` or ``VERDICT: FAIL`` and then list the
broken rules. A reply without such a line (the simulated model's, or a model that ignored the
format) counts as ``unclear``: it is reported, never guessed. The run returns a report with
every section's verdict and notes, the counts, and an overall verdict (``fail`` if any section
failed, ``pass`` if all passed, else ``unclear``).

Inputs are checked at the trigger: a document with no text or too many sections, or an empty
rule, is refused with 422 and nothing is stored.
"""

import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.llm import LLM, Message, Reply, complete
from moorline.types import JSONObject, JSONValue

MAX_DOCUMENT_CHARS = 200_000
MAX_SECTIONS = 50
MAX_RULES = 20

UNTITLED = "(untitled)"
"""The heading reported for text before the document's first heading."""

DEFAULT_RULES = (
    "The section says what it is for in its first sentence.",
    "There is no placeholder text (TODO, TBD, lorem ipsum, XXX).",
    "Commands, code and file names are in code blocks or inline code.",
)

SYSTEM_PROMPT = (
    "You check one section of a document against numbered rules. Begin your answer with a "
    "line 'VERDICT: PASS' if the section follows every rule, or 'VERDICT: FAIL' if it breaks "
    "any. Then write one line per broken rule: '- rule <n>: <why>'. Write nothing else."
)

_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_VERDICT = re.compile(r"^\W*VERDICT\W*(PASS|FAIL)\b", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Section:
    """A heading of the document and the text under it, up to the next heading."""

    heading: str
    text: str


def split_sections(document: str) -> list[Section]:
    """The document's sections, in order, split at Markdown ATX headings (``#`` … ``######``).

    Headings inside fenced code blocks do not count. Text before the first heading is a
    section headed :data:`UNTITLED` when it is not blank.
    """
    sections: list[Section] = []
    heading, lines, fenced = UNTITLED, list[str](), False

    def close() -> None:
        text = "\n".join(lines).strip()
        if heading != UNTITLED or text:
            sections.append(Section(heading=heading, text=text))

    for line in document.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        found = None if fenced else _HEADING.match(line)
        if found is None:
            lines.append(line)
            continue
        close()
        heading, lines = found.group(2), []
    close()
    return sections


def _check_document(document: str) -> str:
    count = len(split_sections(document))
    if count == 0:
        raise ValueError("the document has no text")
    if count > MAX_SECTIONS:
        raise ValueError(f"the document has {count} sections; at most {MAX_SECTIONS} are checked")
    return document


Document = Annotated[
    str, StringConstraints(max_length=MAX_DOCUMENT_CHARS), AfterValidator(_check_document)
]
"""A Markdown document: some text, at most :data:`MAX_SECTIONS` sections."""

Rule = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=500)]
Rules = Annotated[tuple[Rule, ...], Field(min_length=1, max_length=MAX_RULES)]


def parse_verdict(reply: str) -> str:
    """``pass`` or ``fail`` from the reply's ``VERDICT:`` line; ``unclear`` without one."""
    found = _VERDICT.search(reply)
    return "unclear" if found is None else found.group(1).lower()


def section_prompt(section: Section, rules: tuple[str, ...] | list[str]) -> str:
    """The rules, numbered, and the section to check against them."""
    numbered = "\n".join(f"{n}. {rule}" for n, rule in enumerate(rules, start=1))
    return f"Rules:\n{numbered}\n\nSection '{section.heading}':\n{section.text or '(empty)'}"


def overall_verdict(verdicts: list[str]) -> str:
    """``fail`` if any section failed, ``pass`` if all passed, else ``unclear``."""
    if "fail" in verdicts:
        return "fail"
    return "pass" if all(verdict == "pass" for verdict in verdicts) else "unclear"


def register(app: Moorline, llm: LLM) -> None:
    """Register ``doc_check`` on ``app``, asking ``llm``."""

    @app.workflow("doc_check_section", timeout=600, max_attempts=3)
    async def doc_check_section(
        ctx: Context, index: int, heading: str, text: str, rules: list[str]
    ) -> JSONObject:
        """Check one section against the rules; the model's reply, stored by step ``check``."""

        async def check(index: int, heading: str, text: str, rules: list[str]) -> JSONObject:
            prompt = section_prompt(Section(heading=heading, text=text), rules)
            messages = [Message.system(SYSTEM_PROMPT), Message.user(prompt)]
            tag: JSONObject = {"section": index, "heading": heading}
            reply = await complete(llm, messages, emit=ctx.emit, extra=tag)
            await ctx.emit("section_checked", {**tag, "verdict": parse_verdict(reply.text)})
            return reply.to_json()

        stored = await ctx.step("check", check, index, heading, text, rules)
        return stored if isinstance(stored, dict) else {}

    @app.workflow("doc_check", timeout=1800, max_children=MAX_SECTIONS)
    async def doc_check(
        ctx: Context, document: Document, rules: Rules = DEFAULT_RULES, title: str = "document"
    ) -> JSONObject:
        """Check every section of a Markdown document against the rules; return a report."""
        sections = split_sections(document)
        inputs: list[JSONObject] = [
            {"index": i, "heading": s.heading, "text": s.text, "rules": list(rules)}
            for i, s in enumerate(sections)
        ]
        stored = await ctx.map("doc_check_section", inputs, key="section")
        replies = [Reply.from_json(reply) for reply in stored]
        verdicts = [parse_verdict(reply.text) for reply in replies]
        report: list[JSONValue] = [
            {"heading": section.heading, "verdict": verdict, "notes": reply.text}
            for section, verdict, reply in zip(sections, verdicts, replies, strict=True)
        ]
        return {
            "title": title,
            "verdict": overall_verdict(verdicts),
            "passed": verdicts.count("pass"),
            "failed": verdicts.count("fail"),
            "unclear": verdicts.count("unclear"),
            "sections": report,
            "rules": list(rules),
            "model": replies[0].model,
            "simulated": replies[0].simulated,
        }
