"""P's token-1 stream events (pdserve/server/first_events.py): what a continuing stream sends for token 1,
never what a request finished there flushes, and none where D's stream could begin otherwise."""

from __future__ import annotations

import json
from typing import Optional, Sequence

from pdserve.api.kv_transfer import RemoteDecodeRequest
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.engine.outputs import OutputProcessor, continuing_first_text
from pdserve.request import GenerationRequest, Request
from pdserve.server.chat_formatting import ChatFormat
from pdserve.server.first_events import first_events, wants_first_events
from pdserve.server.formatting import CompletionFormat
from pdserve.server.generation import GenerationResult

# A byte-level vocabulary: token 3 is the first byte of "é", token 4 its second.
VOCAB = {1: b"Hi there", 2: b"He", 3: "é".encode()[:1], 4: "é".encode()[1:], 5: b"!"}


class ByteTokenizer:
    eos_token_ids = (0,)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(VOCAB.get(i, b"") for i in ids).decode("utf-8", errors="replace")


TOKENIZER = ByteTokenizer()
PROMPT = (7, 8, 9)


def request(stop: tuple[str, ...] = (), decode_max_tokens: Optional[int] = 8, **sampling) -> GenerationRequest:
    params = RemoteDecodeRequest(do_remote_decode=True, decode_max_tokens=decode_max_tokens, want_first_events=True)
    return GenerationRequest("req-1", PROMPT, SamplingParams(max_tokens=1, stop=stop, **sampling), kv_params=params)


def result(token_id: int, reason: FinishReason = FinishReason.LENGTH, logprob: Optional[float] = None,
           top: tuple = ()) -> GenerationResult:
    answer = GenerationResult(num_prompt_tokens=len(PROMPT), token_ids=[token_id], finish_reason=reason)
    if logprob is not None:
        answer.logprobs.append(logprob)
        answer.top_logprobs.append(top)
    return answer


def completion_format(**fields) -> CompletionFormat:
    return CompletionFormat(response_id="cmpl-req-1", model="m", created=100, tokenizer=TOKENIZER,
                            with_logprobs=fields.pop("with_logprobs", False), **fields)


def events_of(text: Optional[str]) -> list[dict]:
    assert text is not None
    assert text.endswith("\n\n") and all(part.startswith("data: ") for part in text.strip().split("\n\n"))
    return [json.loads(part[len("data: "):]) for part in text.strip().split("\n\n")]


def build(fmt, req: GenerationRequest, res: GenerationResult, num_choices: int = 1,
          constrained: bool = False) -> Optional[str]:
    events, skipped = first_events(fmt, [req], [res], TOKENIZER, 4096, num_choices=num_choices,
                                   constrained=constrained)
    assert (events is None) != (skipped is None)
    return events


def skipped(fmt, req: GenerationRequest, res: GenerationResult, **kwargs) -> Optional[str]:
    return first_events(fmt, [req], [res], TOKENIZER, 4096, **{"num_choices": 1, "constrained": False, **kwargs})[1]


def test_the_text_is_what_a_continuing_stream_emits_with_a_stop_string_start_held_back():
    # Finished at token 1 the processor would flush "Hi there"; going on, "ere" may start "ere!".
    assert continuing_first_text(TOKENIZER, 1, ("ere!",)) == "Hi th"
    assert continuing_first_text(TOKENIZER, 1, ()) == "Hi there"
    assert continuing_first_text(TOKENIZER, 3, ()) == ""  # half a UTF-8 character: held back
    # The same as the engine's own output processor at token 1 of an unfinished request.
    engine_request = Request("r", list(PROMPT), SamplingParams(max_tokens=8, stop=("ere!",)), (0,), 0.0)
    engine_request.output_token_ids.append(1)
    output, _ = OutputProcessor(TOKENIZER).process(engine_request)
    assert output.new_text == "Hi th"


def test_completion_events_carry_token_1_text_and_logprobs_and_no_finish():
    fmt = completion_format(with_logprobs=True, num_top_logprobs=1)
    events = events_of(build(fmt, request(stop=("ere!",), logprobs=True, top_logprobs=1),
                             result(1, logprob=-0.5, top=((5, -1.25),))))
    assert len(events) == 1
    choice = events[0]["choices"][0]
    assert (events[0]["id"], events[0]["created"], events[0]["model"]) == ("cmpl-req-1", 100, "m")
    assert choice["text"] == "Hi th" and choice["finish_reason"] is None
    assert choice["logprobs"]["tokens"] == ["Hi there"] and choice["logprobs"]["token_logprobs"] == [-0.5]
    assert choice["logprobs"]["top_logprobs"] == [{"Hi there": -0.5, "!": -1.25}]


def test_chat_events_are_the_role_chunk_then_token_1():
    fmt = ChatFormat(response_id="chatcmpl-req-1", model="m", created=100, tokenizer=TOKENIZER, with_logprobs=False)
    events = events_of(build(fmt, request(), result(2)))
    assert [e["choices"][0]["delta"] for e in events] == [{"role": "assistant", "content": ""}, {"content": "He"}]
    assert {e["id"] for e in events} == {"chatcmpl-req-1"}


def test_none_where_d_could_begin_otherwise_and_p_names_why():
    fmt = completion_format
    assert skipped(fmt(), request(), result(3)) == "held_back"  # nothing to show yet
    assert skipped(fmt(), request(), result(1), num_choices=2) == "n_choices"
    assert skipped(fmt(), request(), result(1), constrained=True) == "grammar"
    assert skipped(fmt(echo=True, prompt_texts=("p",), prompts=(PROMPT,)), request(), result(1)) == "echo"
    assert skipped(fmt(), request(), result(1, FinishReason.STOP)) == "ends_at_one"  # EOS, stop token or string
    assert skipped(fmt(), request(decode_max_tokens=1), result(1)) == "ends_at_one"  # the client's max_tokens 1
    assert skipped(fmt(), request(prompt_logprobs=1), result(1)) == "echo"
    assert build(fmt(), request(), result(1)) is not None


def test_only_a_prefill_leg_that_asks_gets_events():
    assert wants_first_events(request())
    plain = RemoteDecodeRequest(do_remote_decode=True)  # vLLM's proxy: no such field, nothing changes
    assert not wants_first_events(GenerationRequest("r", PROMPT, SamplingParams(), kv_params=plain))
    assert not wants_first_events(GenerationRequest("r", PROMPT, SamplingParams()))
