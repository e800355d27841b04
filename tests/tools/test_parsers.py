"""Reading tool calls out of generated text: forced formats and the native formats of chat templates."""

from __future__ import annotations

import json

from pdserve.tools.parsers import (
    HermesToolParser,
    MistralToolParser,
    held_back_length,
    parse_named,
    parse_required,
    parser_for_template,
)


def test_required_answers_become_calls_with_json_arguments_and_fresh_ids():
    calls = parse_required('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_required('[{"name": "a", "argu') == []  # cut short by max_tokens: no half call


def test_named_answers_are_the_arguments_themselves():
    (call,) = parse_named("f", '{"q": "x"}')
    assert (call.name, call.arguments) == ("f", '{"q": "x"}')


def test_hermes_blocks_split_into_content_and_calls_and_malformed_ones_stay_text():
    parser = HermesToolParser()
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Sure." and [c.name for c in calls] == ["f", "g"]
    assert parser.parse("no calls") == ("no calls", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parser.parse(broken) == (broken, [])


def test_mistral_calls_follow_their_marker():
    content, calls = MistralToolParser().parse('[TOOL_CALLS][{"name": "f", "arguments": {"a": 2}}]')
    assert content == "" and json.loads(calls[0].arguments) == {"a": 2}


def test_the_parser_follows_what_the_template_writes_and_markers_are_held_back_while_streaming():
    assert isinstance(parser_for_template("...<tool_call>..."), HermesToolParser)
    assert isinstance(parser_for_template("...[TOOL_CALLS]..."), MistralToolParser)
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
    assert held_back_length("Hello <tool_", "<tool_call>") == 6
    assert held_back_length("Hello", "<tool_call>") == 0
