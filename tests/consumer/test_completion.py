from genqueue.consumer.client import classify_status
from genqueue.common.errors import PermanentError, TransientError
from genqueue.consumer.completion import CUT_IN_ANSWER, CUT_IN_THINKING, FINISHED, parse_completion, split_inline


def resp(message: dict, finish: str = "stop", usage: dict | None = None) -> dict:
    return {"model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage or {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}


def test_reasoning_field_current_name():
    t = parse_completion(resp({"role": "assistant", "content": "4", "reasoning": "2+2"}))
    assert (t.content, t.reasoning, t.reasoning_form, t.outcome) == ("4", "2+2", "field", FINISHED)


def test_reasoning_content_older_name_is_not_lost():
    t = parse_completion(resp({"role": "assistant", "content": "4", "reasoning_content": "2+2"}))
    assert t.reasoning == "2+2" and t.reasoning_form == "field"


def test_inline_think_split():
    t = parse_completion(resp({"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"}))
    assert (t.content, t.reasoning, t.reasoning_form) == ("answer", "hmm", "inline")


def test_inline_unclosed_means_cut_in_thinking():
    t = parse_completion(resp({"role": "assistant", "content": "<think>still thinking"}, finish="length"))
    assert t.content == "" and t.reasoning == "still thinking" and t.outcome == CUT_IN_THINKING


def test_cut_in_answer_and_field_cut_in_thinking():
    assert parse_completion(resp({"content": "half an answ", "reasoning": "r"}, "length")).outcome == CUT_IN_ANSWER
    assert parse_completion(resp({"content": None, "reasoning": "r"}, "length")).outcome == CUT_IN_THINKING


def test_no_thinking_at_all():
    t = parse_completion(resp({"content": "plain", "reasoning": None}))
    assert t.reasoning is None and t.reasoning_form == "none" and t.content == "plain"


def test_closing_tag_only():
    assert split_inline("thought</think>answer") == ("answer", "thought", True)
    assert split_inline("no tags here") == ("no tags here", None, True)


def test_reasoning_tokens_from_details():
    t = parse_completion(resp({"content": "x"}, usage={"prompt_tokens": 1, "completion_tokens": 9,
                                                      "completion_tokens_details": {"reasoning_tokens": 7}}))
    assert t.usage == {"prompt_tokens": 1, "completion_tokens": 9, "reasoning_tokens": 7}


def test_status_classes():
    for s in (400, 404, 413, 422):
        assert classify_status(s) is PermanentError
    for s in (408, 429, 500, 502, 503, 504):
        assert classify_status(s) is TransientError


def test_template_opened_thinking_cut_by_the_budget():
    body = resp({"content": "still thinking, no tags", "reasoning": None}, "length")
    assert parse_completion(body).outcome == CUT_IN_ANSWER  # without the probe's knowledge
    t = parse_completion(body, think_opened=True)
    assert t.outcome == CUT_IN_THINKING and t.reasoning == "still thinking, no tags" and t.content == ""


def test_thinking_with_no_answer_is_not_finished():
    from genqueue.consumer.completion import NO_ANSWER

    t = parse_completion(resp({"content": None, "reasoning": "the whole reply"}, "stop"))
    assert t.outcome == NO_ANSWER
