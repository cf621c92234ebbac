"""Tool calls in OpenAI's shape on top of structured outputs.

`tool_choice`:
  "none"                   the tools are not offered; the answer is text.
  "auto" (the default)     the answer is text: SmolLM2's chat template has no tool syntax (no `tools` variable, no
                           tool-call markup), so there is no call format the model was taught to emit and no parser
                           to recognise one; "auto" is plain chat, and the tools are not shown to the model.
  "required"               the answer is constrained to a non-empty JSON array of calls, each {"name": one of the
                           tools, "arguments": that tool's `parameters` schema} (one call when
                           parallel_tool_calls is false); answered as `tool_calls`.
  {"type": "function", "function": {"name": N}}
                           the answer is constrained to N's `parameters` schema: its arguments; answered as one
                           tool call to N.
For "required" and a named tool the model is told what to call in a system message peagle adds (each function's
name, description and schema), since the template cannot say it.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from peagle.engine.grammar import Constraint

# A function without `parameters` takes none: an empty object.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(ValueError):
    """A malformed `tools` or `tool_choice`; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request answers with tools: `named` is the one function called (its arguments are the output),
    else the output is an array of {"name", "arguments"} calls."""
    functions: tuple[Function, ...]
    named: Function | None
    constraint: Constraint

    def system_message(self) -> str:
        """What the model is told when its template cannot render tools."""
        if self.named is not None:
            f = self.named
            return (f"Call the function `{f.name}`" + (f" ({f.description})" if f.description else "") +
                    ". Reply with only its arguments as JSON matching this schema: " + json.dumps(f.parameters))
        listing = "\n".join(f"- {f.name}: {f.description or 'no description'}; arguments schema: "
                            f"{json.dumps(f.parameters)}" for f in self.functions)
        return ("You can call these functions:\n" + listing + "\nReply with only a JSON array of calls, each "
                "{\"name\": <function name>, \"arguments\": <its arguments>}.")

    def calls(self, text: str) -> list[dict] | None:
        """OpenAI's `tool_calls` for a finished answer, or None if it is not a complete call (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.named is not None:
            return [tool_call(self.named.name, json.dumps(value))]
        return [tool_call(c["name"], json.dumps(c["arguments"])) for c in value]


def tool_call(name: str, arguments: str, index: int | None = None) -> dict:
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name,
                                                                                    "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def parse_functions(tools: list) -> tuple[Function, ...]:
    out = []
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"{param}: only {{\"type\": \"function\", \"function\": {{...}}}} tools are supported",
                            param)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"{param}.function.name: each tool needs a function with a name", f"{param}.function")
        params = fn.get("parameters", NO_PARAMETERS)
        if not isinstance(params, dict):
            raise ToolError(f"{param}.function.parameters: must be a JSON schema object",
                            f"{param}.function.parameters")
        out.append(Function(fn["name"], str(fn.get("description") or ""), params))
    names = [f.name for f in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError(f"tools: the function name {dup!r} appears twice", "tools")
    return tuple(out)


def plan(tools: list | None, tool_choice, parallel_tool_calls: bool = True) -> ToolPlan | None:
    """The constrained tool call a request asks for, or None when the answer is text ("none", "auto", no tools)."""
    functions = parse_functions(tools or [])
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if not functions:
        raise ToolError("tool_choice: there are no tools to choose from; send `tools` or drop tool_choice",
                        "tool_choice")
    if tool_choice == "required":
        calls = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                            "properties": {"name": {"const": f.name}, "arguments": f.parameters}}
                           for f in functions]}
        schema = {"type": "array", "minItems": 1, "items": calls}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(functions, None, Constraint.json_schema(schema, "tools"))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        named = next((f for f in functions if f.name == name), None)
        if named is None:
            raise ToolError(f"tool_choice.function.name: {name!r} is not one of the tools "
                            f"({', '.join(f.name for f in functions)})", "tool_choice.function.name")
        return ToolPlan(functions, named, Constraint.json_schema(named.parameters, f"tools.{functions.index(named)}"
                                                                 ".function.parameters"))
    raise ToolError("tool_choice: must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                    "\"function\": {\"name\": ...}}", "tool_choice")



def with_tool_message(messages: list[dict], tool_plan: ToolPlan) -> list[dict]:
    """The conversation with the tool instruction in its system message (added first when there is none)."""
    note = tool_plan.system_message()
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


class ToolCallStream:
    """One streamed choice's tool-call deltas in OpenAI's shape. A named call streams its arguments as they are
    generated (the first delta carries the call's id and name); "required" answers are an array whose calls are
    known only once it is complete, so each call is sent whole when the answer ends."""

    def __init__(self, tool_plan: ToolPlan):
        self.plan, self.text, self.started = tool_plan, "", False

    def delta(self, text: str, finished: bool) -> list[dict] | None:
        self.text += text
        if self.plan.named is not None:
            if not self.started:
                self.started = True
                return [tool_call(self.plan.named.name, text, index=0)]
            return [{"index": 0, "function": {"arguments": text}}] if text else None
        if not finished:
            return None
        calls = self.plan.calls(self.text)
        return [{"index": i, **c} for i, c in enumerate(calls)] if calls else None


def finish_reason(reason: str | None, calls: list[dict] | None) -> str | None:
    """OpenAI's finish reason of an answer with tool calls: "tool_calls" when it ended on its own."""
    return "tool_calls" if reason == "stop" and calls else reason
