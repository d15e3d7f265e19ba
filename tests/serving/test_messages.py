"""A job's messages as the HTTP handlers read them: text deltas, then Done or Failed, matched by type (no model)."""

import asyncio
import json
from types import SimpleNamespace

from kvguard.control.decoding import FinishReason
from kvguard.serving import app
from kvguard.serving.engine import Job
from kvguard.serving.messages import Done, Failed, TextDelta
from kvguard.serving.metrics import Metrics
from kvguard.serving.protocol import GenerationRequest

SUMMARY = {"kv_bytes": 10, "kv_bytes_fp16": 40, "memory_saved": 0.75, "trigger_rate": 0.0, "max_level": 0,
           "actions": {}, "recomputed_positions": 0,
           "memory": {"hot_bytes": 10, "overlay_bytes": 0, "backing_ram_bytes": 0, "backing_disk_bytes": 0,
                      "kv_bytes": 10, "ram_bytes": 10, "fp16_bytes": 40, "memory_saved": 0.75}}


def _engine(log: list) -> SimpleNamespace:
    return SimpleNamespace(metrics=Metrics(2, 0.1, 8), model_name="tiny", log=log.append,
                           totals={"requests": 0, "generated_tokens": 0, "prompt_tokens": 0})


async def _streamed(messages, *, include_usage: bool = False) -> tuple[list[str], list[dict]]:
    loop = asyncio.get_running_loop()
    request = GenerationRequest(app.COMPLETIONS, [1, 2, 3], 8, stream=True, include_usage=include_usage)
    job = Job("job", request, 100.0, loop, asyncio.Queue())
    for message in messages:
        job.queue.put_nowait(message)
    log: list[dict] = []
    chunks = [chunk async for chunk in app._stream(_engine(log), job, app.COMPLETIONS)]
    return chunks, log


def test_a_stream_sends_each_delta_then_the_finish_and_logs_the_request():
    done = Done(FinishReason.STOP, 2, SUMMARY, first_token_at=101.0, finished_at=102.0)
    chunks, log = asyncio.run(_streamed([TextDelta("Hel"), TextDelta("lo"), done], include_usage=True))
    bodies = [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]
    assert [b["choices"][0]["text"] for b in bodies[:3]] == ["Hel", "lo", ""]
    assert bodies[2]["choices"][0]["finish_reason"] == "stop" and bodies[3]["usage"]["completion_tokens"] == 2
    assert chunks[-1] == "data: [DONE]\n\n"
    [record] = log
    assert record["status"] == "200" and record["ttft_s"] == 1.0 and record["finish_reason"] == "stop"


def test_a_failed_job_ends_the_stream_with_a_server_error():
    chunks, log = asyncio.run(_streamed([TextDelta("x"), Failed("RuntimeError: boom")]))
    assert json.loads(chunks[-1].removeprefix("data: "))["error"]["message"] == "RuntimeError: boom"
    assert log[0]["status"] == "500"


def test_a_job_cancelled_before_it_ran_answers_nothing():
    chunks, log = asyncio.run(_streamed([Done(FinishReason.CANCELLED, 0)]))
    assert chunks == [] and log[0]["status"] == "cancelled" and "ttft_s" not in log[0]
