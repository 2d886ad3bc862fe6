"""The sampling options are declared once (verispec.names.options: SamplingParams) and derived everywhere else:
the command line's flags, the server's request fields, Pipeline.request's keywords, GenerationConfig, the bench's
reference runs and report."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verispec.names.options import (
    SamplingParams,
    option_defaults,
    sampling_from,
    sampling_options,
    to_llama_cpp,
    to_openai,
    to_transformers,
)

PACKAGE = Path(__file__).resolve().parents[2] / "verispec"
DECLARATION = "names/options.py"


def _names_in(path: Path, option: str) -> bool:
    """Whether a module names `option` in its code: an identifier, attribute, keyword, parameter, or a string
    that is the option's name or its command-line flag (comments and prose do not count)."""
    spellings = {option, "--" + option.replace("_", "-")}
    for node in ast.walk(ast.parse(path.read_text())):
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.arg if isinstance(node, (ast.keyword, ast.arg))
                else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
        if name in spellings:
            return True
    return False


def naming_modules(option: str) -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _names_in(p, option))


@pytest.mark.parametrize("option", list(sampling_options()))
def test_each_sampling_option_is_named_in_its_declaration_and_its_use_only(option):
    modules = naming_modules(option)
    assert DECLARATION in modules and len(modules) <= 2, f"{option} is named in {modules}"


def test_the_naming_check_sees_a_second_spelling_out(tmp_path):
    """The check's negative control: a front end that spells an option out again is caught."""
    spelled = tmp_path / "front.py"
    spelled.write_text('def f(args, p):\n    return {"top_p": args.top_p}, p.add_argument("--min-p")\n')
    prose = tmp_path / "prose.py"
    prose.write_text('"""temperature and top_p in a docstring"""\n# min_p in a comment\n')
    assert _names_in(spelled, "top_p") and _names_in(spelled, "min_p") and not _names_in(spelled, "seed")
    assert not _names_in(prose, "temperature") and not _names_in(prose, "top_p")


def test_every_option_reaches_every_front_end():
    from verispec.apps.server.protocol import ChatCompletionRequest
    from verispec.pipeline.pipeline import sampling_settings

    fields = ChatCompletionRequest.model_fields
    for name, opt in sampling_options().items():
        assert name in fields and fields[name].description == opt.help
        assert fields[name].default == (opt.api_default if opt.api_default is not None else option_defaults()[name])
    assert fields["temperature"].default == 1.0  # OpenAI's default, not the library's greedy
    params, _ = sampling_settings(presence_penalty=0.5, frequency_penalty=0.25, min_tokens=3, top_k=2)
    assert (params.presence_penalty, params.frequency_penalty, params.min_tokens, params.top_k) == (0.5, 0.25, 3, 2)
    with pytest.raises(TypeError, match="unknown sampling option: temprature"):
        sampling_settings(temprature=0.5)


def test_the_command_line_has_a_flag_per_option_with_its_default_and_help():
    from verispec.apps.cli import build_parser

    parser = build_parser()
    for command in ("generate", "chat", "bench"):
        sub = parser._subparsers._group_actions[0].choices[command]
        flags = {a.dest: a for a in sub._actions}
        for name, opt in sampling_options().items():
            assert flags[name].default == option_defaults()[name] and flags[name].help.startswith(opt.help[:20])
    args = parser.parse_args(["generate", "--prompt", "x", "--presence-penalty", "0.5", "--min-tokens", "4"])
    assert (args.presence_penalty, args.min_tokens) == (0.5, 4)


def test_values_out_of_range_are_refused_with_the_option_named():
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 2.0}, {"top_k": -1},
                {"repetition_penalty": 0.0}, {"presence_penalty": float("nan")}, {"min_tokens": -1}):
        (name,) = bad
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad)


def test_a_generation_config_maps_onto_the_options():
    from transformers import GenerationConfig

    assert sampling_from({}, GenerationConfig(do_sample=False, temperature=0.7, repetition_penalty=1.2)) == \
        SamplingParams(repetition_penalty=1.2)
    sampled = sampling_from({"top_k": 5}, GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=40))
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.7, 0.9, 5)  # keywords win
    assert sampling_from({}, GenerationConfig(do_sample=True, temperature=None)).temperature == 1.0


def test_other_engines_get_the_same_settings_or_a_refusal():
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, seed=3)
    assert to_transformers(sampled) == dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                                            repetition_penalty=1.1)
    assert to_transformers(SamplingParams()) == dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    assert to_llama_cpp(sampled) == dict(temp=0.7, top_p=0.9, top_k=20, min_p=0.05, repeat_penalty=1.1)
    assert to_llama_cpp(SamplingParams()) == dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    assert to_openai(SamplingParams(temperature=0.5, seed=7, presence_penalty=0.5)) == \
        dict(temperature=0.5, top_p=1.0, seed=7, presence_penalty=0.5)
    for refuse, params in ((to_openai, SamplingParams(top_k=3)), (to_transformers, SamplingParams(min_tokens=2)),
                           (to_llama_cpp, SamplingParams(frequency_penalty=0.5))):
        with pytest.raises(ValueError):
            refuse(params)


def test_a_report_describes_the_sampling_in_one_line():
    assert SamplingParams().describe() == "greedy"
    assert SamplingParams(temperature=0.7, top_p=0.9).describe() == "temperature=0.7 top_p=0.9"


def test_llama_servers_fields_mean_what_they_mean_there():
    from verispec.names.options import from_llama_server, openai_to_llama_server

    assert from_llama_server({}) == SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)  # its defaults
    # only the samplers listed run: llama.vim's chain samples at temperature 1 with no min-p
    assert from_llama_server({"top_k": 40, "top_p": 0.9, "temperature": 0.2}, ["top_k", "top_p"]) == SamplingParams(
        temperature=1.0, top_k=40, top_p=0.9)
    assert from_llama_server({"temperature": -1, "top_k": 0, "min_p": 0, "top_p": 1.0, "seed": 7}) == SamplingParams(
        seed=7)  # temperature <= 0 greedy; top_k and min_p <= 0 and top_p >= 1 off
    assert from_llama_server({"seed": -1}).seed is None and from_llama_server({"seed": 0xFFFFFFFF}).seed is None
    assert from_llama_server({"repeat_penalty": 1.3, "presence_penalty": 0.5}, ["penalties"]).repetition_penalty == 1.3
    assert from_llama_server({"repeat_penalty": 1.3}, ["top_k"]).repetition_penalty == 1.0
    with pytest.raises(ValueError, match="sampler 'mirostat' is not supported"):
        from_llama_server({}, ["top_k", "mirostat"])
    with pytest.raises(ValueError, match="top_p"):
        from_llama_server({"top_p": 0.0})
    sent = openai_to_llama_server({"temperature": 0.0, "top_p": 1.0, "stop": ["x"]})
    assert from_llama_server(sent) == SamplingParams()  # greedy, nothing of llama-server's defaults
    assert SamplingParams(seed=3).nth(2).seed == 5 and SamplingParams().nth(2).seed is None
