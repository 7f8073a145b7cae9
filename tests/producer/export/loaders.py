"""What each training tool's loader demands of a dataset line, restated from its own source.

Each check below follows the named file line by line (the commit read is given), so a test can
hold genqueue's export to the tool's rules without installing the tool (torch and all).
SpecForge's validator is pure Python and is copied whole: tests/producer/export/specforge_validation.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

# --- LLaMA-Factory (hiyouga/LLaMA-Factory @ ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30) ---------
# data/README.md "Sharegpt Format" and src/llamafactory/data/parser.py defaults: columns
# messages=conversations, system, tools; tags from/value, human/gpt/observation/function_call.
LF_ODD = ("human", "observation")  # converter.py SharegptDatasetConverter: odd_tags
LF_EVEN = ("gpt", "function_call")  # even_tags
# template.py register_template: thought_words default ("<think>\n", "\n</think>\n\n")
LF_THOUGHT = ("<think>\n", "\n</think>\n\n")
# template.py register_template: tool_call_words default ("<tool_call>", "</tool_call>")
LF_TOOL_CALL = ("<tool_call>", "</tool_call>")


def llamafactory_sharegpt(row: dict[str, Any]) -> list[str]:
    """The problems LLaMA-Factory would find with ROW (empty: it trains on it). Follows
    converter.py SharegptDatasetConverter.__call__ (lines 135-190), formatter.py
    FunctionFormatter.apply (lines 96-140) and ToolFormatter.apply (json.loads of `tools`)."""
    problems: list[str] = []
    messages = row.get("conversations")
    if not isinstance(messages, list):
        return ["no conversations list"]
    system = row.get("system", "")
    if not isinstance(system, str):
        problems.append("system is not a string")
    if messages and messages[0].get("from") == "system":  # the system tag may lead the list
        messages = messages[1:]
    for turn_idx, message in enumerate(messages):
        if set(message) != {"from", "value"} or not isinstance(message["value"], str):
            problems.append(f"turn {turn_idx} is not {{from, value}} with a string value")
            continue
        if message["from"] not in (LF_ODD, LF_EVEN)[turn_idx % 2]:
            problems.append(f"turn {turn_idx}: role {message['from']!r} out of place ('Invalid role tag')")
        if message["from"] == "function_call":
            problems += _lf_function(turn_idx, message["value"])
    if len(messages) % 2 != 0:
        problems.append("odd number of turns ('Invalid message count')")
    tools = row.get("tools")
    if tools is not None:
        try:
            parsed = json.loads(tools)
            if not isinstance(parsed, list):
                problems.append("tools is not a JSON list")
        except (TypeError, json.JSONDecodeError):
            problems.append("tools is not a JSON string ('Invalid JSON format in tool description')")
    return problems


def _lf_function(turn_idx: int, content: str) -> list[str]:
    block = re.search(rf"{re.escape(LF_TOOL_CALL[0])}(.*?){re.escape(LF_TOOL_CALL[1])}", content, re.DOTALL)
    if block is not None:
        json_part = block.group(1)
    else:
        thought = re.search(rf"{re.escape(LF_THOUGHT[0])}(.*?){re.escape(LF_THOUGHT[1])}", content, re.DOTALL)
        json_part = content.replace(thought.group(0), "") if thought else content
    try:
        calls = json.loads(json_part)
    except json.JSONDecodeError:
        return [f"turn {turn_idx}: function_call is not JSON ('Invalid JSON format in function message')"]
    calls = calls if isinstance(calls, list) else [calls]
    # _parse_functions: FunctionCall(tc["name"], json.dumps(tc["arguments"]))
    if not all(isinstance(tc, dict) and "name" in tc and "arguments" in tc for tc in calls):
        return [f"turn {turn_idx}: a call without name or arguments"]
    return []


def llamafactory_thought(value: str) -> tuple[str | None, str]:
    """(the thought, the answer) as ReasoningTemplate splits a gpt value (remove_thought's
    regex, template.py line 106); the thought is None when the value has no closed block."""
    m = re.search(f"{re.escape(LF_THOUGHT[0])}(.*?){re.escape(LF_THOUGHT[1])}", value, re.DOTALL)
    if m is None:
        return None, value
    return m.group(1), value.replace(m.group(0), "", 1)


def llamafactory_trained_turns(row: dict[str, Any], *, mask_history: bool) -> list[int]:
    """The indexes in ROW's `conversations` of the assistant turns LLaMA-Factory computes a loss
    on. processor/supervised.py SupervisedDatasetProcessor._encode_data_example (lines 68-92):
    every (prompt, response) pair's response is a target, unless `mask_history` (a data
    argument of the training config, hparams/data_args.py line 54: "mask the history and train
    on the last turn only"), which labels every pair but the last IGNORE_INDEX. The pairs are
    the even (gpt/function_call) turns after an optional leading system turn."""
    conv = row["conversations"]
    lead = 1 if conv and conv[0].get("from") == "system" else 0
    answers = [i for i in range(lead, len(conv)) if (i - lead) % 2 == 1]
    return answers[-1:] if mask_history else answers


# --- EAGLE-3 (SafeAILab/EAGLE @ cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b) -----------------
def eagle3(rows: list[dict[str, Any]]) -> list[str]:
    """The problems eagle/traineagle3/main.py build_dataset_rank.preprocess_function would hit
    (lines 66-92): it iterates `examples['id']`, maps `from` through {"human": "user", "gpt":
    "assistant"} (a KeyError for any other role), skips a first turn that is not human, then
    asserts strict user/assistant alternation."""
    problems: list[str] = []
    roles = {"human": "user", "gpt": "assistant"}
    for i, row in enumerate(rows):
        if "id" not in row:
            problems.append(f"row {i}: no id")
        source = row.get("conversations") or []
        if not source:
            continue
        if roles.get(source[0].get("from")) != "user":
            source = source[1:]
        for j, sentence in enumerate(source):
            role = roles.get(sentence.get("from"))
            if role is None:
                problems.append(f"row {i}: role {sentence.get('from')!r} (KeyError)")
            elif role != ("user", "assistant")[j % 2]:
                problems.append(f"row {i}: turn {j} breaks the alternation (AssertionError)")
            if not isinstance(sentence.get("value"), str):
                problems.append(f"row {i}: turn {j} value is not a string")
    return problems


def llamafactory_read(row: dict[str, Any], entry: dict[str, Any] | None = None) -> tuple[str, str, int]:
    """(system, tools, turns) as LLaMA-Factory's SharegptDatasetConverter reads ROW under the
    dataset_info.json ENTRY (None: no entry, the DatasetAttr defaults). converter.py lines
    147-156: a leading turn whose role tag is `system_tag` (default "system") is the system
    prompt, else the `system` column if one is named (default: none); line 222: tools come
    from the `tools` column only if one is named (default: none)."""
    columns = (entry or {}).get("columns", {})
    tags = (entry or {}).get("tags", {})
    messages = row[columns.get("messages", "conversations")]
    role, content, system_tag = tags.get("role_tag", "from"), tags.get("content_tag", "value"), tags.get(
        "system_tag", "system")
    if system_tag and messages and messages[0][role] == system_tag:
        system, messages = messages[0][content], messages[1:]
    else:
        system = row[columns["system"]] if columns.get("system") else ""
    tools = row[columns["tools"]] if columns.get("tools") else ""
    return system or "", tools or "", len(messages)


# --- SpecForge (sgl-project/SpecForge @ a6b6b0230009d15ec2a97a57384e6f53f0f96946) ------------
SPECFORGE_DEFAULT_SYSTEM = "<the chat template's system_prompt>"


def specforge_read(row: dict[str, Any]) -> tuple[str, list[Any]]:
    """(system, tools) as SpecForge's build_eagle3_dataset reads a row: tools from the `tools`
    column, a JSON string or a list (specforge/data/preprocessing.py lines 261-284); the system
    prompt only from a first message whose role (from `role`, else `from`) is "system",
    otherwise the chat template's own default is inserted (specforge/data/parse.py
    _normalize_message and GeneralParser.parse, lines 202-212)."""
    conv = row["conversations"]
    first = conv[0] if conv else {}
    role = first.get("role", first.get("from", ""))
    system = (first.get("content") or first.get("value") or "") if role == "system" else SPECFORGE_DEFAULT_SYSTEM
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    return system, tools if isinstance(tools, list) else []


# --- speculators (vllm-project/speculators @ c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b) -------
def speculators_read(row: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """(roles, tools) as speculators' preprocessing reads a row: _normalize_conversation
    (src/speculators/data_generation/preprocessing.py lines 71-119) maps from/role through
    human|user -> user, gpt|assistant -> assistant, system, tool, and any other role to
    assistant; tools from the `tools` column, a JSON string or a list (_parse_conv_tools)."""
    roles = []
    for turn in row["conversations"]:
        role = turn.get("from", turn.get("role", ""))
        if role in ("human", "user"):
            roles.append("user")
        elif role in ("gpt", "assistant"):
            roles.append("assistant")
        elif role in ("system", "tool"):
            roles.append(role)
        else:
            roles.append("assistant")
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    return roles, tools if isinstance(tools, list) else []


def every_assistant_turn(row: dict[str, Any]) -> list[int]:
    """The turns SpecForge and speculators compute a loss on: every assistant turn, found by
    role: SpecForge's specforge/data/preprocessing.py preprocess_conversations and speculators'
    src/speculators/data_generation/preprocessing.py (_detect_assistant_pattern,
    _create_loss_mask_from_offsets) set the loss mask to 1 on every assistant span of the
    rendered template. Neither reads a per-turn field, so a row holding the input's own
    history answers trains on them too."""
    roles = [t.get("role", t.get("from")) for t in row["conversations"]]
    return [i for i, r in enumerate(roles) if r in ("assistant", "gpt", "function_call")]
