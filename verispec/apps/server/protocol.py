"""OpenAI request models (pydantic), OpenAI-style error bodies, the checks a parsed body must pass, and
`parse_body` (a raw body to a validated request, or an APIError: the 4xx the server answers with).

Fields that would change a request's meaning are either honoured or refused with a 400 naming them;
only fields that change nothing (e.g. `user`) are ignored.
"""

from __future__ import annotations

import json
from typing import Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from verispec.core.grammar import Constraint
from verispec.names.drafters import DRAFTER_NAMES
from verispec.names.options import Bounds, SamplingParams, option_defaults, option_types, sampling_options

K_REQUEST_MAX = 32  # the largest num_draft_tokens a request may ask for
MAX_STOP_SEQUENCES = 32  # OpenAI takes 4; editors' plugins send a dozen or more (vLLM and llama.cpp take any)
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOOLS = 128
MAX_CHOICES = 16  # n
MAX_LOGIT_BIAS = 1024  # OpenAI takes 300 ids
MAX_JSON_DEPTH = 32  # a request body nested deeper than this is refused before validation


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _default(value, *defaults) -> bool:
    return value is None or any(value == d for d in defaults)


# field -> is this value one that changes nothing (so it may be accepted and ignored)?
UNSUPPORTED = {
    "functions": lambda v: _default(v, []),
    "function_call": lambda v: _default(v, "none"),
    "best_of": lambda v: _default(v, 1),
    "echo": lambda v: _default(v, False),
    "prompt_logprobs": lambda v: _default(v, 0),
}


def unsupported_field(data: dict) -> str | None:
    """The first field of `data` that asks for something this server does not do, else None."""
    return next((name for name, harmless in UNSUPPORTED.items() if name in data and not harmless(data[name])), None)


def check_json_shape(data, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why a parsed body is unacceptable (nested too deep, a string that is not valid Unicode), else None."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                return f"the body is nested deeper than {max_depth} levels"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, depth))
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return "the body contains a string that is not valid Unicode (a lone surrogate)"
    return None


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    return (f"invalid value for '{param}': {err.get('msg')}" if param else str(err.get("msg"))), param


def parse_body(raw: bytes, model_cls, unsupported=unsupported_field):
    """A validated request model from a raw body, or APIError(400) saying what is wrong with it (`unsupported`:
    the test naming a field the endpoint does not honour)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None
    except ValueError:  # bad JSON, bad UTF-8, an integer of thousands of digits
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    problem = check_json_shape(data)
    if problem:
        raise APIError(400, problem)
    field = unsupported(data)
    if field:
        raise APIError(400, f"'{field}' is not supported by this server", field, "unsupported_parameter")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(400, message, param) from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str | dict = "{}"


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if any(p.type != "text" for p in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(p.text or "" for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


def _option_fields() -> dict:
    """The library's sampling options as request fields: OpenAI's default and range where the API has the field,
    the server's limit where it sets one, else the library's (verispec.names.options)."""
    types = option_types()
    return {name: (types[name], Field(opt.api_default if opt.api_default is not None else default,
                                      description=opt.help,
                                      **(opt.api_bounds or opt.bounds or Bounds()).pydantic()))
            for (name, opt), default in zip(sampling_options().items(), option_defaults().values())}


SamplingOptions = create_model("SamplingOptions", __config__=ConfigDict(extra="ignore", strict=True),
                               **_option_fields())


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON valid under a schema."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({name, schema, strict})")
        return self


class SamplingFields(SamplingOptions):
    """Fields shared by both endpoints: the sampling options (SamplingOptions), the length, stops, streaming
    and verispec's speculation settings. Unknown fields that change nothing are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices: rows of one batch, choice i seeded seed + i")
    stream_options: StreamOptions | None = None
    # extensions (vLLM's names)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    num_draft_tokens: int | None = Field(None, ge=0, le=K_REQUEST_MAX)
    drafter: Literal[DRAFTER_NAMES + ("none",)] | None = None
    # structured output: OpenAI's response_format, or vLLM's guided_* (one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                                description="token id -> a value from -100 to 100 added to its logit")

    def constraint(self) -> tuple[Constraint | None, str | None]:
        """The structured output asked for and the field that asked (None, None: free text); ValueError: more than
        one asked for, or a malformed one."""
        fmt = self.response_format
        asked = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                         "guided_grammar") if getattr(self, name) is not None}
        if fmt is not None and fmt.type != "text":
            asked["response_format"] = fmt
        if len(asked) > 1:
            raise ValueError(f"one kind of structured output at a time: got {', '.join(asked)}")
        if not asked:
            return None, None
        (name, value), = asked.items()
        if name == "response_format":
            schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
            return (Constraint.json_object() if schema is None else Constraint.json_schema(schema)), name
        kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}[name]
        return getattr(Constraint, kind)(value), name

    def sampling(self) -> SamplingParams:
        """The request's sampling options as the library's SamplingParams (ValueError: a value it refuses)."""
        bias = {}
        for token, value in (self.logit_bias or {}).items():
            if not token.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            bias[int(token)] = value
        return SamplingParams(**{name: getattr(self, name) for name in sampling_options()}, logit_bias=bias)

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence must have 1 to {MAX_STOP_CHARS} characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids are >= 0")
        return v

    @model_validator(mode="after")
    def _min_within_max(self):
        limit = self.requested_max_tokens()
        if limit is not None:
            self.sampling().check_length(limit, "max_tokens")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        """None: no logprobs; n >= 0: the chosen token's logprob and the n most likely alternatives."""
        raise NotImplementedError


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _choice_names_a_tool(self):
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice asks for a call: give tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names '{choice.function.name}', which is not among the tools")
        if self.tools and len({t.function.name for t in self.tools}) < len(self.tools):
            raise ValueError("two tools have the same name")
        return self

    def tool_mode(self) -> str:
        """none (no tools offered), auto (the model may call), required (it must) or named (it must call the one
        tool_choice names)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def offered_tools(self) -> list[dict]:
        """The tools as the chat template renders them (OpenAI's dicts), none where no call may be made."""
        return [] if self.tool_mode() == "none" else [t.model_dump(exclude_none=True) for t in self.tools]

    def called_tools(self) -> list[dict]:
        """The tools a required call chooses among: all of them, or the one tool_choice names."""
        tools = self.offered_tools()
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in tools if t["function"]["name"] == self.tool_choice.function.name]
        return tools

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    suffix: str | None = Field(None, description="fill in the middle between the prompt and this suffix (a model "
                                                 "with fill-in-the-middle tokens)")
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt is supported")
            return v[0]
        return v

    def logprobs_count(self) -> int | None:
        return self.logprobs
