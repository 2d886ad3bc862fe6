"""The sampling options, declared once: `SamplingParams` is their declaration (name, type, default, range, help,
and what each is called by the APIs verispec speaks to), and everything else derives from it: the command line's
flags, the server's request fields (with OpenAI's defaults where the API has them), `Pipeline.request`'s
keywords, a GenerationConfig's reading, the reference runs of the bench and its report. The processing that
gives these options their meaning is verispec.core.sampling. Also declared here: the per-front-end defaults of
max_new_tokens.

Torch-free: building the command line's parser loads no torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, get_type_hints

# max_new_tokens where a caller asks for none, per front end
MAX_NEW_TOKENS = 256  # the library (Pipeline, Request) and `verispec generate` / `chat`
BENCH_MAX_NEW_TOKENS = 128  # `verispec bench`: every prompt of a set, each configuration, in one run
SERVER_MAX_TOKENS = 512  # `verispec serve`: OpenAI's API has no default for max_tokens; the server's own

INT64 = 1 << 63
LOGIT_BIAS_MAX = 100.0  # OpenAI's range for a logit_bias value
INFILL_TOP_K_MAX = 256  # the infill sampler reads a row's candidates on the host: top_k bounds them


@dataclass(frozen=True)
class Bounds:
    """A closed or open interval (None: unbounded on that side), finite numbers only."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, value: float) -> bool:
        return ((isinstance(value, int) or math.isfinite(value)) and (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def text(self, integer: bool = False) -> str:
        """The interval in words, for an integer option or a real one."""
        parts = [f"{op} {bound:g}" for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                 if bound is not None]
        return ("an integer" if integer else "a finite number") + (f" {' and '.join(parts)}" if parts else "")

    def pydantic(self) -> dict[str, float]:
        """The bounds as pydantic Field constraints."""
        return {name: value for name, value in vars(self).items() if value is not None}


@dataclass(frozen=True)
class Option:
    """How one sampling option is checked, shown and spoken of elsewhere. `bounds`: the values the library takes
    (None: any, as for a seed). `api_default` / `api_bounds`: the server's field where it differs (OpenAI's
    default and range, or the server's own limit). `openai`: a field of OpenAI's API (else an extension
    named as vLLM names it, which the server accepts and `to_openai` refuses to send). `transformers` / `llama_cpp`: the name of the
    same setting in transformers' generate and llama-cpp-python's generate (None: they have none). `llama_server`:
    its field in llama-server's own API (/completion, /infill), with llama-server's default `llama_server_default`
    where it differs from the library's, and `sampler`, the llama.cpp sampler that applies it as that API's
    `samplers` names it."""

    help: str
    bounds: Bounds | None = Bounds()
    api_default: Any = None
    api_bounds: Bounds | None = None
    openai: bool = False
    transformers: str | None = None
    llama_cpp: str | None = None
    llama_server: str | None = None
    llama_server_default: Any = None
    sampler: str | None = None


def option(default: Any, help: str, **how: Any) -> Any:
    return field(default=default, metadata={"option": Option(help, **how)})


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the target's logits (and the draft's, by the same processing).
    Temperature 0 is greedy decoding; every filter and penalty at its default is off."""

    temperature: float = option(0.0, "sampling temperature; 0 = greedy", bounds=Bounds(ge=0), api_default=1.0,
                                api_bounds=Bounds(ge=0, le=2), openai=True, transformers="temperature",
                                llama_cpp="temp", llama_server="temperature", llama_server_default=0.8,
                                sampler="temperature")
    top_k: int = option(0, "sample among the K likeliest tokens; 0 = all", bounds=Bounds(ge=0),
                        transformers="top_k", llama_cpp="top_k", llama_server="top_k", llama_server_default=40,
                        sampler="top_k")
    top_p: float = option(1.0, "sample among the likeliest tokens whose probabilities sum to P; 1 = all",
                          bounds=Bounds(gt=0, le=1), openai=True, transformers="top_p", llama_cpp="top_p",
                          llama_server="top_p", llama_server_default=0.95, sampler="top_p")
    min_p: float = option(0.0, "drop tokens less likely than MIN_P times the likeliest one; 0 = none",
                          bounds=Bounds(ge=0, le=1), transformers="min_p", llama_cpp="min_p", llama_server="min_p",
                          llama_server_default=0.05, sampler="min_p")
    repetition_penalty: float = option(1.0, "penalise tokens already in the prompt or output (CTRL's penalty; > 1 "
                                            "penalises); 1 = none", bounds=Bounds(gt=0),
                                       api_bounds=Bounds(gt=0, le=10), transformers="repetition_penalty",
                                       llama_cpp="repeat_penalty", llama_server="repeat_penalty",
                                       sampler="penalties")
    seed: int | None = option(None, "random seed for sampling (default: a fresh one each run)", bounds=None,
                              api_bounds=Bounds(ge=-INT64, lt=INT64), openai=True, llama_server="seed",
                              llama_server_default=-1)
    presence_penalty: float = option(0.0, "subtract this from the logit of every token already generated "
                                          "(OpenAI's penalty; the prompt's tokens are not counted); 0 = none",
                                     api_bounds=Bounds(ge=-2, le=2), openai=True, llama_server="presence_penalty",
                                     sampler="penalties")
    frequency_penalty: float = option(0.0, "subtract this times its count from the logit of every token already "
                                           "generated (OpenAI's penalty); 0 = none",
                                      api_bounds=Bounds(ge=-2, le=2), openai=True,
                                      llama_server="frequency_penalty", sampler="penalties")
    min_tokens: int = option(0, "generate at least this many tokens: EOS and the stop token ids cannot end "
                                "generation before", bounds=Bounds(ge=0))
    infill_sampler: bool = option(False, "llama.cpp's infill sampler after the filters, for code completion: end where "
                                 "the end of text is likely enough, merge tokens that prefix one another, keep only "
                                 f"likely ones (needs top_k 1-{INFILL_TOP_K_MAX}; no effect when greedy)",
                                  bounds=None, sampler="infill")
    stop_ids: tuple[int, ...] = ()  # the ids min_tokens masks (the engine adds its EOS and stop ids): not an option
    # OpenAI's logit_bias: (id, value) pairs, each value (-100 to 100) added to its id's logit before any other
    # processing, on the target's p and the draft's q alike; a mapping id -> value is taken too: not an option
    logit_bias: tuple[tuple[int, float], ...] = ()
    # what the infill sampler reads of the vocabulary (verispec.core.infill.TokenPieces), set when a request
    # resolves against a model: not an option
    vocabulary: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, f in _fields().items():
            value, bounds = getattr(self, name), f.metadata["option"].bounds
            if bounds is not None and not bounds.holds(value):
                raise ValueError(f"{name} must be {bounds.text(isinstance(f.default, int))}, got {value}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        pairs = tuple(sorted((int(token), float(value)) for token, value in bias))
        if any(token < 0 or not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX for token, value in pairs):
            raise ValueError(f"logit_bias maps token ids >= 0 to values from {-LOGIT_BIAS_MAX} to {LOGIT_BIAS_MAX}")
        object.__setattr__(self, "logit_bias", pairs)
        if self.infill_sampler and not 1 <= self.top_k <= INFILL_TOP_K_MAX:
            raise ValueError(f"the infill sampler needs top_k between 1 and {INFILL_TOP_K_MAX}, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def counted(self) -> bool:
        """Whether processing needs the generated tokens' counts (presence or frequency penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def delays_stops(self) -> bool:
        """Whether the stop ids are masked in some first positions (min_tokens)."""
        return self.min_tokens > 0

    def masks_stops(self, position: int) -> bool:
        """Whether rows from generated position `position` on may still have their stop ids masked."""
        return position < self.min_tokens and bool(self.stop_ids)

    def unmasked_from(self, position: int) -> int:
        """The first generated position, from `position` on, where no stop id is masked."""
        return max(position, self.min_tokens)

    def masking(self, stop_ids: frozenset[int]) -> SamplingParams:
        """These params with min_tokens masking `stop_ids` too (themselves when min_tokens is 0)."""
        if not self.min_tokens:
            return self
        return replace(self, stop_ids=tuple(sorted(stop_ids | set(self.stop_ids))))

    def check_length(self, max_new_tokens: int, name: str = "max_new_tokens") -> None:
        """ValueError when min_tokens asks for more tokens than `max_new_tokens` allows."""
        if self.min_tokens > max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) is larger than {name} ({max_new_tokens})")

    def nth(self, i: int) -> SamplingParams:
        """These params for the i-th of several samples of one request (from 0): a given seed is seed + i, so that
        each draws on its own and the whole request reproduces."""
        return self if self.seed is None or not i else replace(self, seed=self.seed + i)

    @property
    def seeded_draws(self) -> bool:
        """Whether the draws are seeded (sampled with a seed): the same request must draw the same tokens."""
        return self.seed is not None and not self.greedy

    @property
    def infilling(self) -> bool:
        """Whether the infill sampler transforms the distribution (asked for, and not greedy)."""
        return self.infill_sampler and not self.greedy

    def with_vocabulary(self, vocabulary: Any) -> SamplingParams:
        """These params reading `vocabulary` (the model's token pieces) where the infill sampler needs them."""
        return replace(self, vocabulary=vocabulary) if self.infilling else self

    def without_penalties(self) -> SamplingParams:
        """These params without the penalties and min_tokens (temperature, the filters and the seed kept)."""
        return replace(self, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0)

    def changed(self) -> dict[str, Any]:
        """The options set away from their defaults."""
        return {name: getattr(self, name) for name, f in _fields().items() if getattr(self, name) != f.default}

    def describe(self) -> str:
        """One line for a report: 'greedy', or the options that differ from their defaults."""
        changed = self.changed()
        if self.greedy:
            changed.pop("temperature", None)
            return " ".join(["greedy", *(f"{name}={value}" for name, value in changed.items())])
        return " ".join(f"{name}={value}" for name, value in changed.items())


@functools.cache
def _fields() -> dict[str, Any]:
    """The option fields of SamplingParams by name (not stop_ids), read once: every construction checks them."""
    return {f.name: f for f in fields(SamplingParams) if "option" in f.metadata}


def sampling_options() -> dict[str, Option]:
    """Each sampling option's declaration, by name, in declaration order."""
    return {name: f.metadata["option"] for name, f in _fields().items()}


def option_defaults() -> dict[str, Any]:
    """Each sampling option's default (the library's)."""
    return {name: f.default for name, f in _fields().items()}


def option_types() -> dict[str, Any]:
    """Each sampling option's type (float, int, int | None)."""
    hints = get_type_hints(SamplingParams)
    return {name: hints[name] for name in _fields()}


def sampling_from(settings: Mapping[str, Any], generation_config=None) -> SamplingParams:
    """SamplingParams from a transformers GenerationConfig (do_sample false or unset: greedy; otherwise its
    temperature, filters and repetition penalty) overlaid with `settings`' values that are not None, which win.
    An unknown name is a TypeError, a value out of range a ValueError."""
    unknown = sorted(set(settings) - set(_fields()) - {"logit_bias"})
    if unknown:
        raise TypeError(f"unknown sampling option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} (known: "
                        f"{', '.join(_fields())})")
    values: dict[str, Any] = {}
    config = generation_config
    if config is not None:
        sampled = bool(getattr(config, "do_sample", False))
        for name, opt in sampling_options().items():
            value = None if opt.transformers is None else getattr(config, opt.transformers, None)
            if name == "temperature":
                values[name] = (1.0 if value is None else value) if sampled else 0.0
            elif value is not None and (sampled or name == "repetition_penalty"):
                values[name] = value
    values.update({name: value for name, value in settings.items() if value is not None})
    return SamplingParams(**values)


def _unsupported(params: SamplingParams, names: set[str], engine: str) -> None:
    refused = sorted(set(params.changed()) - names - {"seed"})
    if refused:
        raise ValueError(f"{', '.join(refused)}: {engine} has no such setting")


def to_transformers(params: SamplingParams) -> dict[str, Any]:
    """transformers' generate keywords for these params (greedy: do_sample off); ValueError for an option it
    lacks. A seed is not a generate keyword (transformers samples from torch's global RNG)."""
    opts = sampling_options()
    _unsupported(params, {name for name, opt in opts.items() if opt.transformers}, "transformers' generate")
    if params.greedy:
        kwargs: dict[str, Any] = {opt.transformers: None for name, opt in opts.items()
                                  if opt.transformers and name not in ("repetition_penalty", "min_p")}
        kwargs["do_sample"] = False
    else:
        kwargs = {"do_sample": True}
        kwargs.update({opt.transformers: getattr(params, name) or None for name, opt in opts.items()
                       if opt.transformers and name != "repetition_penalty"})
        kwargs[opts["temperature"].transformers] = params.temperature
    if params.penalised:
        kwargs[opts["repetition_penalty"].transformers] = params.repetition_penalty
    return kwargs


def to_llama_cpp(params: SamplingParams) -> dict[str, Any]:
    """llama-cpp-python's generate keywords for these params (greedy: temperature 0 and top-k 1); ValueError
    for an option it lacks."""
    opts = sampling_options()
    _unsupported(params, {name for name, opt in opts.items() if opt.llama_cpp}, "llama-cpp-python's generate")
    chosen = replace(params, top_k=1, top_p=1.0, min_p=0.0) if params.greedy else params
    return {opt.llama_cpp: getattr(chosen, name) for name, opt in opts.items() if opt.llama_cpp}


# llama-server's sampler chain when a request names none, and the samplers of that chain verispec does not have,
# which are off at their settings' defaults (a request that sets those settings is refused by the server)
LLAMA_SERVER_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
LLAMA_SERVER_OFF_SAMPLERS = frozenset({"dry", "top_n_sigma", "typ_p", "xtc"})
LLAMA_SERVER_RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama-server's seeds for "a fresh one"


def llama_server_fields() -> dict[str, tuple[str, Any]]:
    """llama-server's sampling fields: its name -> (the option's name, llama-server's default for it)."""
    defaults = option_defaults()
    return {opt.llama_server: (name, defaults[name] if opt.llama_server_default is None else opt.llama_server_default)
            for name, opt in sampling_options().items() if opt.llama_server}


def from_llama_server(values: Mapping[str, Any], samplers: Sequence[str] = LLAMA_SERVER_SAMPLERS) -> SamplingParams:
    """SamplingParams for a request to llama-server's own API: `values` by llama-server's field names (its
    defaults for those left out, see llama_server_fields). llama.cpp runs only the samplers listed in `samplers` (the
    infill sampler where it is listed), so an option whose sampler is not listed is off (without the temperature
    sampler, llama.cpp samples the distribution as it is: a temperature of 1); a temperature <= 0 is greedy; a
    top_k or min_p <= 0 and a top_p >= 1 are off, as in llama.cpp; seed -1 is a fresh one. ValueError: a value the
    library refuses, a sampler verispec has not (those of LLAMA_SERVER_OFF_SAMPLERS are off at their defaults and
    may be listed)."""
    opts = sampling_options()
    known = {opt.sampler for opt in opts.values() if opt.sampler} | LLAMA_SERVER_OFF_SAMPLERS
    unknown = [s for s in samplers if s not in known]
    if unknown:
        raise ValueError(f"the sampler '{unknown[0]}' is not supported (supported: {', '.join(sorted(known))})")
    out: dict[str, Any] = {name: opt.sampler in samplers for name, opt in opts.items()
                           if opt.sampler and not opt.llama_server}  # a sampler that is an option of its own
    for field_name, (name, default) in llama_server_fields().items():
        value = values.get(field_name, default)
        sampler = opts[name].sampler
        if sampler is not None and sampler not in samplers:  # off: the library's default, but a temperature of 1
            if name == "temperature":
                out[name] = 1.0
            continue
        if name == "temperature":
            value = max(0.0, value)
        elif name in ("top_k", "min_p") and value <= 0 or name == "top_p" and value >= 1:
            continue
        elif name == "seed" and value in LLAMA_SERVER_RANDOM_SEEDS:
            continue
        out[name] = value
    return SamplingParams(**out)


def openai_to_llama_server(fields: Mapping[str, Any]) -> dict[str, Any]:
    """llama-server's sampling fields for an OpenAI request's (to_openai's, by the options' names; other fields such
    as stop pass as they are): every option llama-server has, those not given at the library's default (off), so
    that llama-server's own defaults (top_k 40, min_p 0.05) do not apply."""
    defaults, opts = option_defaults(), sampling_options()
    out = {key: value for key, value in fields.items() if key not in opts}
    for name, opt in opts.items():
        if opt.llama_server:
            value = fields.get(name, defaults[name])
            out[opt.llama_server] = LLAMA_SERVER_RANDOM_SEEDS[0] if name == "seed" and value is None else value
    return out


def to_openai(params: SamplingParams) -> dict[str, Any]:
    """An OpenAI request's sampling fields for these params: temperature and top_p always (the API's defaults
    differ from the library's), the other OpenAI fields where set; ValueError naming the options set that
    OpenAI's API lacks."""
    opts = sampling_options()
    changed = params.changed()
    refused = sorted(name for name in changed if not opts[name].openai)
    if refused:
        raise ValueError(f"not OpenAI request fields, so not sent to an endpoint: {', '.join(refused)}")
    return {name: getattr(params, name) for name, opt in opts.items()
            if opt.openai and (name in changed or opt.api_default is not None or name == "top_p")}
