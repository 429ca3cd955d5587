"""The frontend translators fed keel's events directly, for what a live run rarely shows: a
model attempt retried after some of its text went out, an attempt cut by a crash and run again
as a new item, a stream that joined mid-item. The UI message stream each makes is read back by
the `ai` package itself (its transport's parser and schema, then readUIMessageStream)."""

from __future__ import annotations

import json
from typing import Any

from channels.agui import AguiRun
from channels.aisdk import UiStream
from harness.events import (
    MessageCompleted,
    MessageCompletedData,
    MessageDelta,
    MessageDeltaData,
    TurnCompleted,
    TurnCompletedData,
)
from tests.jsclient import NodeScript, skip_without_node


def delta(item: str, text: str, offset: int) -> MessageDelta:
    return MessageDelta(session_id="ses_x", turn_id="turn_1", at=0.0, data=MessageDeltaData(item, text, offset))


def completed(item: str, text: str) -> MessageCompleted:
    return MessageCompleted(
        session_id="ses_x", turn_id="turn_1", at=0.0, id="1-1", seq=1, data=MessageCompletedData(item, text)
    )


END = TurnCompleted(session_id="ses_x", turn_id="turn_1", at=0.0, id="1-2", seq=2, data=TurnCompletedData("m1", "x"))


def ui_bytes(events: list[Any]) -> bytes:
    ui = UiStream("turn_1")
    return ui.opening() + b"".join(ui.feed(e) for e in events) + ui.closing(END)


def chunks(raw: bytes) -> list[dict[str, Any]]:
    lines = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def agui(events: list[Any]) -> list[dict[str, Any]]:
    run = AguiRun("ses_x", "run_1")
    raw = run.opening() + b"".join(run.feed(e) for e in events) + run.closing(END)
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ")]


def agui_texts(got: list[dict[str, Any]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in got:
        if e["type"] == "TEXT_MESSAGE_CONTENT":
            out[e["messageId"]] = out.get(e["messageId"], "") + e["delta"]
    return out


RETRIED = [delta("it_1", "Hello ", 0), delta("it_1", "wor", 6), delta("it_1", "Good", 0), delta("it_1", "bye.", 4)]
CUT = [delta("it_1", "Hello ", 0), delta("it_1", "wor", 6), delta("it_2", "Hello ", 0), delta("it_2", "world.", 6)]
CASES = {
    "retried": ([*RETRIED, completed("it_1", "Goodbye.")], "Goodbye."),
    "cut and run again": ([*CUT, completed("it_2", "Hello world.")], "Hello world."),
    "joined mid-item": (
        [delta("it_1", "lo wor", 3), delta("it_1", "ld.", 9), completed("it_1", "Hello world.")],
        "Hello world.",
    ),
    "kept text is not what streamed": ([delta("it_1", "Hel", 0), completed("it_1", "Howdy.")], "Howdy."),
    "plain": ([delta("it_1", "Hel", 0), delta("it_1", "lo.", 3), completed("it_1", "Hello.")], "Hello."),
}


@skip_without_node()
async def test_the_ai_package_reads_each_case_as_the_kept_text_once() -> None:
    for name, (events, kept) in CASES.items():
        run = await NodeScript.start("chat.mjs", "replay", "-", "-")
        try:
            run.say(json.dumps(ui_bytes(events).decode()))
            done = await run.until("done")
        finally:
            await run.close()
        (message,) = done["messages"]
        assert message["text"] == kept, (name, message["parts"])
        assert [p["type"] for p in message["parts"] if p["type"] == "text"] == ["text"], name
        assert done["warnings"] == [], name


def test_the_ui_stream_takes_back_a_step_only_when_what_went_out_is_not_kept() -> None:
    assert "reset-step" not in [c["type"] for c in chunks(ui_bytes(CASES["plain"][0]))]
    assert "reset-step" not in [c["type"] for c in chunks(ui_bytes(CASES["joined mid-item"][0]))]
    for name in ("retried", "cut and run again", "kept text is not what streamed"):
        assert [c["type"] for c in chunks(ui_bytes(CASES[name][0]))].count("reset-step") == 1, name


def test_agui_ends_a_text_that_was_not_kept_and_sends_the_kept_one_whole() -> None:
    for name, (events, kept) in CASES.items():
        got = agui(events)
        texts = agui_texts(got)
        assert list(texts.values())[-1] == kept, name
        starts = [e["messageId"] for e in got if e["type"] == "TEXT_MESSAGE_START"]
        ends = [e["messageId"] for e in got if e["type"] == "TEXT_MESSAGE_END"]
        assert sorted(starts) == sorted(ends) and len(set(starts)) == len(starts), name  # each opened once, closed
    assert agui_texts(agui(CASES["plain"][0])) == {"it_1": "Hello."}
    assert agui_texts(agui(CASES["joined mid-item"][0])) == {"it_1": "Hello world."}
