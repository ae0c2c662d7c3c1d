"""The bench's priority measurement (bench/tools/priority.py): how it compares greedy runs, counts
what was evaluated twice, and builds its tables, on frames and log records made up here."""

from __future__ import annotations

from bench.inprocess.llama_native import NEAR_TIE_LOGPROB
from bench.tools.priority import Call, analyse, long_call, margin, parting, recomputed, section, short_call

CLEAR, TIE = 1.0, NEAR_TIE_LOGPROB / 2


def entry(token: str, margin: float = CLEAR) -> dict:
    top = [{"token": token, "logprob": -0.1, "bytes": list(token.encode())}]
    top.append({"token": "?", "logprob": -0.1 - margin, "bytes": [63]})
    return {"token": token, "logprob": -0.1, "bytes": list(token.encode()), "top_logprobs": top}


def answered(call: Call, tokens: list[dict], ttft_ms: float, preempted_after: int | None = None) -> Call:
    """``call`` as if the server had sent it ``tokens``, one a frame, the first ``ttft_ms`` after sending."""
    call.accepted = {"type": "accepted", "id": call.name, "request_id": f"r-{call.name}", "queue_position": 0}
    call.frames = [call.accepted]
    for index, token in enumerate(tokens):
        if index == preempted_after:
            call.frames.append({"type": "preempted", "id": call.name})
            call.frames.append({"type": "resumed", "id": call.name})
        call.frames.append(
            {"type": "token", "id": call.name, "index": index, "text": token["token"]} | {"logprobs": [token]}
        )
    call.end = {"type": "done", "id": call.name, "tokens_generated": len(tokens)}
    call.sent_ns, call.first_token_ns = 1_000_000_000, 1_000_000_000 + int(ttft_ms * 1e6)
    return call


def end_record(call: Call, ttft_ms: float, preemptions: int = 0, **prompt) -> dict:
    counts = {"prompt_tokens": 10, "prompt_tokens_reused": 0, "prompt_tokens_evaluated": 10} | prompt
    return {
        "event": "generation_done",
        "request_id": call.accepted["request_id"],
        "ttft_ms": ttft_ms,
        **counts,
        **({"preemptions": preemptions, "preempted_ms": 50.0} if preemptions else {}),
    }


def test_runs_that_part_are_told_apart_at_a_near_tie_or_elsewhere():
    same = [entry("a"), entry("b"), entry("c")]
    assert parting(same, [entry("a"), entry("b"), entry("c")]) is None
    assert parting(same, [entry("a"), entry("x", TIE), entry("c")]) == ("near_tie", 1)
    assert parting(same, [entry("a"), entry("x"), entry("c")]) == ("elsewhere", 1)
    assert parting(same, same[:2]) == ("elsewhere", 2)


def test_a_likelier_token_ignore_eos_ruled_out_is_no_alternative():
    read = entry("a", CLEAR)
    read["top_logprobs"].insert(0, {"token": "<eos>", "logprob": -0.01, "bytes": []})
    assert margin(read) == CLEAR
    read["top_logprobs"][1:] = []
    assert margin(read) is None


def test_only_prompt_tokens_beyond_the_prompt_count_as_recomputed():
    assert recomputed({"prompt_tokens": 10, "prompt_tokens_reused": 4, "prompt_tokens_evaluated": 6}) == 0
    assert recomputed({"prompt_tokens": 10, "prompt_tokens_reused": 4, "prompt_tokens_evaluated": 10}) == 4
    assert recomputed({"prompt_tokens": 10, "prompt_tokens_evaluated": 10, "prompt_tokens_wasted": 3}) == 3


def test_a_run_is_summed_up_against_its_unloaded_ttft():
    text = [entry("a"), entry("b"), entry("c"), entry("d")]
    parted = [entry("a"), entry("b"), entry("x"), entry("d")]
    reference = answered(long_call("alone-long-0", 0, 4, 10), text, 100)
    unloaded = [answered(short_call(f"u{n}", n, 0), [entry("a")], 100) for n in range(3)]
    queued = [answered(short_call(f"q{n}", n, None), [entry("a")], 400) for n in range(2)]
    queue_long = answered(long_call("queue0-long-0", 0, 4, None), text, 100)
    # Preempted after its first token, and parting from the run alone at the third.
    preempted = answered(long_call("priority0-long-0", 0, 4, 10), parted, 100, preempted_after=1)
    high = answered(short_call("h", 9, 0), [entry("a")], 120)
    control = answered(long_call("priority1-long-0", 0, 4, 10), text, 100)
    measured = {
        "references": [reference],
        "unloaded": unloaded,
        "queue": [{"longs": [queue_long], "queued": queued}],
        "priority": [{"lows": [preempted], "highs": [high]}],
        "control": {"lows": [control], "highs": []},
    }
    records = [end_record(call, 100) for call in [reference, *unloaded, queue_long, control]]
    records += [end_record(call, 400) for call in queued] + [end_record(high, 120)]
    records.append(end_record(preempted, 100, preemptions=1, prompt_tokens_reused=2))
    records.append({"event": "preempted", "request_id": "r-priority0-long-0", "by": "r-h"})

    result = analyse(measured, records, long_tokens=4)
    ttft = result["ttft"]
    assert ttft["unloaded"]["p50_ms"] == 100 and ttft["queue"]["p50_ratio"] == 4.0
    assert ttft["priority"]["n"] == 1 and ttft["priority"]["p99_ratio"] == 1.2
    texts = result["texts"]
    assert texts["preempted_vs_alone"] | {"partings": None} == {
        "partings": None,
        "n": 1,
        "equal": 0,
        "near_tie": 0,
        "elsewhere": 1,
        "parted_after_preemption": 1,
    }
    assert texts["preempted_vs_alone"]["partings"] == [
        {"name": "priority0-long-0", "kind": "elsewhere", "at": 2, "paused_at": 1}
    ]
    assert texts["control_vs_alone"]["equal"] == 1
    accounting = result["accounting"]
    assert accounting["preemptions"] == 1 and accounting["preempted_and_resumed_frames"] == [1, 1]
    # Two prompt tokens counted both as reused and as evaluated.
    assert accounting["prompt_tokens_recomputed"] == 2
    assert accounting["tokens_not_read_once"] == accounting["frame_index_gaps"] == 0

    result["meta"] = {
        "command": "python -m bench priority",
        "started_at": "2026-12-07",
        "machine": {"cores_available": 2},
        "load_average": [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]],
        "model": "smollm2",
        "workers": 4,
        "unloaded": 3,
        "rounds": 1,
        "long_tokens": 4,
        "highs_per_round": 1,
    }
    markdown = section(result)
    assert markdown.startswith("## Many users at once, and priority")
    queue_row = (
        "| requests 5 to 8, with 4 long generations running (default priority) | 2 | 400 | 400 | 4.00× | 4.00× |"
    )
    assert queue_row in markdown
