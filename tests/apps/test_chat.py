"""ChatBot on tiny models (multi-turn identity, streaming, cache reuse) and the REPL in a pseudo-terminal."""

from __future__ import annotations

import sys

import pexpect
import pytest
from tiny import save_tiny_pair

from verispec.apps.chat import ChatBot
from verispec.assembly.build import load
from verispec.catalog import cache_root, installed
from verispec.pipeline.text import encode_messages


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("chat"))


def _pipe(pair_dirs):
    target, draft = pair_dirs
    return load(target, draft, drafter="model", k=3, device="cpu", dtype="fp32", backend="hf")


def _bot(pair_dirs, **kwargs) -> ChatBot:
    return ChatBot(_pipe(pair_dirs), max_new_tokens=40, **kwargs)


def _fresh_reply(pair_dirs, messages) -> str:
    """What a brand-new engine (empty caches) answers to the fully rendered history."""
    pipe = _pipe(pair_dirs)
    ids = encode_messages(pipe.tokenizer, messages)
    result = pipe.engine.generate(ids, max_new_tokens=40)
    return pipe.tokenizer.decode(result.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_second_turn_equals_fresh_generation_over_history(pair_dirs):
    bot = _bot(pair_dirs, system_prompt="You are terse.")
    bot.generate_response("Hello there")
    second = bot.generate_response("Tell me more, ünïcode 🙂")
    messages = bot.messages()[:-1]  # system, user1, assistant1, user2
    assert second == _fresh_reply(pair_dirs, messages)
    assert len(bot.history) == 4 and bot.history[-1]["content"] == second


def test_streamed_pieces_equal_final_text(pair_dirs):
    bot = _bot(pair_dirs)
    for message in ("first", "ça va? 你好"):
        pieces = list(bot.stream_response(message))
        assert "".join(pieces) == bot.history[-1]["content"]
        assert bot.last_turn.stats.new_tokens > 0


def test_later_turns_reuse_the_cached_prefix(pair_dirs):
    bot = _bot(pair_dirs)
    target = bot.pipeline.engine.target
    fed = []  # per target pass: the prompt tokens it fed (a round's pass feeds the unseen prompt, then the k drafts
    # whose logits it keeps along with the prompt's last: k + 1 kept)
    forward = target.forward_rows

    def recording(slots, feeds, last_only=False, logits_for=None):
        kept = 1 if last_only else feeds[0].numel() if logits_for is None else logits_for[0]
        fed.append(feeds[0].numel() - kept + 1)
        return forward(slots, feeds, last_only, logits_for)

    target.forward_rows = recording
    prompt1 = bot.prompt_ids("one")
    bot.generate_response("one")
    fed.clear()
    prompt2 = bot.prompt_ids("two")
    assert prompt2[: len(prompt1)] == prompt1
    bot.generate_response("two")
    # the first turn's prompt was not encoded again: only the reply as re-rendered and the new turn (fed in the
    # second turn's first round, with its drafts)
    assert fed[0] <= len(prompt2) - len(prompt1)


def test_interrupted_answer_keeps_partial_reply_and_consistency(pair_dirs):
    bot = _bot(pair_dirs)
    stream = bot.stream_response("go")
    next(stream)
    stream.close()
    assert bot.last_turn.interrupted and bot.history[-1]["role"] == "assistant"
    reply = bot.generate_response("again")
    assert reply == _fresh_reply(pair_dirs, bot.messages()[:-1])


def test_stats_reset_and_speedup(pair_dirs):
    bot = _bot(pair_dirs, measure_plain=True)
    bot.generate_response("a")
    bot.generate_response("b")
    total = bot.total_stats()
    assert total.new_tokens == sum(t.stats.new_tokens for t in bot.turns)
    assert total.drafted == sum(t.stats.drafted for t in bot.turns) > 0
    assert all(t.speedup is not None and t.speedup > 0 for t in bot.turns)
    assert "acceptance" in bot.last_turn.line()
    bot.reset()
    assert bot.history == [] and bot.turns == []
    with pytest.raises(ValueError, match="empty"):
        bot.generate_response("   ")


def _spawn(args: list[str], timeout: int = 120) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "verispec.apps.cli", "chat", *args], encoding="utf-8", timeout=timeout,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(__import__("pathlib").Path.home()),
                               "VERISPEC_HOME": cache_root().as_posix()})
    child.setwinsize(40, 200)
    return child


def test_repl_two_turns_stats_reset_exit(pair_dirs):
    target, draft = pair_dirs
    child = _spawn(["--target", target, "--draft", draft, "--dtype", "fp32", "--max-new-tokens", "20"])
    child.expect("verispec chat: target")
    child.expect(">>> ")
    child.sendline("hello")
    child.expect(r"\[\d+ tokens \| [\d.]+ tok/s \| acceptance")
    child.expect(">>> ")
    child.sendline("second \\")
    child.expect(r"\.\.\. ")
    child.sendline("line")
    child.expect(r"\[\d+ tokens")
    child.expect(">>> ")
    child.sendline("/stats")
    child.expect(r"\[2 turns, \d+ tokens")
    child.sendline("/reset")
    child.expect(r"\[conversation reset\]")
    child.sendline("/stats")
    child.expect(r"\[0 turns")
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_repl_piped_stdin_one_answer_per_line(pair_dirs):
    import subprocess

    target, draft = pair_dirs
    proc = subprocess.run(
        [sys.executable, "-m", "verispec.apps.cli", "chat", "--target", target, "--draft", draft, "--dtype", "fp32",
         "--max-new-tokens", "8"],
        input="one\ntwo\n", capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0
    assert proc.stderr.count("acceptance") == 2 and ">>>" not in proc.stdout


@pytest.mark.integration
def test_repl_ctrl_c_stops_answer_and_continues():
    """A real model (SmolLM2-135M) in a pseudo-terminal: Ctrl-C mid-answer, then another turn."""
    if installed("smollm2-135m-instruct") is None:
        pytest.fail("smollm2-135m-instruct not installed; run `make setup`")
    m = "smollm2-135m-instruct"
    child = _spawn(["--target", m, "--draft", m, "--backend", "hf", "--max-new-tokens", "400"], timeout=300)
    child.expect(">>> ")
    child.sendline("Write a very long story about a dragon who learns to code.")
    child.expect(r"\w+ \w+ \w+")  # the answer is streaming
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect(r"interrupted\]")
    child.expect(">>> ")
    child.sendline("What is the capital of France? One word.")
    child.expect("Paris")
    child.expect(r"acceptance [\d.]+%")
    child.expect(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
