"""verispec's llama.cpp kernels (native/llama.cpp-kernels.patch): what a process reports about them, the exact
(batch-invariant) mode's rules, and, on the real GGUFs, that a token's logits do not depend on the pass it is in:
a pass over n tokens gives bitwise the logits of n one-token passes, and several sequences decoded in one context
(prompts and drafts side by side, rolled back, in any order) each get bitwise what they get alone. With exact
kernels for every weight type, and by default for Q4_K/Q6_K weights (the multi-column kernels, attention on its
one-row kernel, each sequence's cells in the order of its positions). llama.cpp reads its kernel switches once per
process, so the passes run in child processes."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import verispec.backends.llamacpp as llamacpp
from verispec.assembly.resolve import check_exact_kernels
from verispec.assembly.specs import TargetSpec
from verispec.catalog import DEFAULT_TARGET
from verispec.names.errors import ModelError, SpecError

# the child processes run on every CPU, whatever share the test's worker has: one-token attention splits a long
# context across threads (the switches these tests check), which needs two threads or more
pytestmark = pytest.mark.usefixtures("every_cpu")

VERISPEC_BUILD = ("CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | VERISPEC_BUILD = 0123abcd | "
                  "VERISPEC_MULTICOL = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
AVX2_BUILD = ("CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1 | VERISPEC_BUILD = 0123abcd | VERISPEC_MULTICOL = AVX2 | "
              "LLAMAFILE = 1 | REPACK = 1 | ")
SSE_BUILD = "CPU : SSE3 = 1 | VERISPEC_BUILD = 0123abcd | LLAMAFILE = 1 | "
STOCK_BUILD = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | "


class _FakeLlamaCpp:
    def __init__(self, info: str) -> None:
        self.info = info

    def llama_print_system_info(self) -> bytes:
        return self.info.encode()


@pytest.fixture
def system_info(monkeypatch):
    """Set the features list llama.cpp reports, and start from a process that has opened no model and has
    no exact-kernel switch."""

    def use(info: str) -> None:
        monkeypatch.setattr(llamacpp, "import_llama_cpp", lambda: _FakeLlamaCpp(info))

    monkeypatch.setattr(llamacpp, "_opened", False)
    for name in (llamacpp.ENV_EXACT, llamacpp.ENV_SPLIT_KV, llamacpp.ENV_FA_TILED, llamacpp.ENV_KV_INTERLEAVE):
        monkeypatch.delenv(name, raising=False)
    return use


def test_kernels_read_from_the_features_list(system_info):
    system_info(VERISPEC_BUILD)
    assert llamacpp.kernels() == llamacpp.Kernels("0123abcd", multicol="AVX512-VNNI", amx=False, exact=0)
    system_info(VERISPEC_BUILD.replace("VERISPEC_MULTICOL = 1", "VERISPEC_MULTICOL = AVX512_VNNI"))
    assert llamacpp.kernels() == llamacpp.Kernels("0123abcd", multicol="AVX512-VNNI", amx=False, exact=0)
    system_info(AVX2_BUILD)
    assert llamacpp.kernels() == llamacpp.Kernels("0123abcd", multicol="AVX2", amx=False, exact=0)
    system_info(SSE_BUILD)
    assert llamacpp.kernels() == llamacpp.Kernels("0123abcd", multicol=None, amx=False, exact=0)
    system_info(STOCK_BUILD)
    assert llamacpp.kernels() == llamacpp.Kernels(None, multicol=None, amx=True, exact=0, split_kv=True,
                                                  tiled_fa=True, interleave=False)


def test_each_kernel_state_says_why_in_one_line(system_info):
    system_info(VERISPEC_BUILD)
    assert "multi-column kernels (AVX512-VNNI)" in llamacpp.kernels().describe()
    system_info(AVX2_BUILD)
    assert "multi-column kernels (AVX2)" in llamacpp.kernels().describe()
    system_info(SSE_BUILD)
    assert "multi-column kernels do not run" in llamacpp.kernels().describe()
    system_info(STOCK_BUILD)
    line = llamacpp.kernels().describe(["Q4_K"])
    assert "make install-llamacpp" in line and "AMX" in line and "not batch-invariant" in line
    for line in (llamacpp.Kernels("k", "AVX2", False, 512).describe(), llamacpp.Kernels(None, None, False, 0).describe()):
        assert line.startswith("llama.cpp: ") and "\n" not in line
    assert "exact kernels for every weight type" in llamacpp.Kernels("k", "AVX2", False, 512).describe()


def test_batch_invariance_said_per_weight_types():
    """Q4_K/Q6_K weights are batch-invariant on the multi-column kernels; other types only with exact kernels;
    any switch that makes attention depend on its pass, AMX or a CPU without the kernels says why not."""
    default = llamacpp.Kernels("k", multicol="AVX2", amx=False, exact=0)
    assert default.variance({"Q4_K", "Q6_K"}) is None
    assert default.describe({"Q4_K", "Q6_K"}).endswith("; batch-invariant")
    assert "Q4_1" in default.variance({"Q4_K", "Q4_1"}) and "--exact-kernels" in default.variance({"Q4_1"})
    assert "not repacked" in default.variance({"Q4_K (not repacked)"})
    assert llamacpp.Kernels("k", "AVX2", False, 512).variance({"Q4_1", "Q8_0"}) is None
    for kernels, why in ((llamacpp.Kernels("k", "AVX2", False, 0, split_kv=True), "attention"),
                         (llamacpp.Kernels("k", "AVX2", False, 0, tiled_fa=True), "attention"),
                         (llamacpp.Kernels("k", "AVX2", False, 0, interleave=False), "attention"),
                         (llamacpp.Kernels("k", "AVX2", True, 0), "AMX"),
                         (llamacpp.Kernels("k", None, False, 0), "AVX2, FMA and F16C"),
                         (llamacpp.Kernels(None, None, False, 0), "stock")):
        assert why in kernels.variance({"Q4_K"}), kernels


def test_attention_switches_batch_invariant_unless_asked(system_info, monkeypatch):
    system_info(VERISPEC_BUILD)
    for name in (llamacpp.ENV_SPLIT_KV, llamacpp.ENV_FA_TILED, llamacpp.ENV_KV_INTERLEAVE):
        monkeypatch.delenv(name, raising=False)
    kernels = llamacpp.kernels()
    assert not kernels.split_kv and not kernels.tiled_fa and kernels.interleave
    monkeypatch.setenv(llamacpp.ENV_SPLIT_KV, "1")
    monkeypatch.setenv(llamacpp.ENV_FA_TILED, "1")
    monkeypatch.setenv(llamacpp.ENV_KV_INTERLEAVE, "0")
    kernels = llamacpp.kernels()
    assert kernels.split_kv and kernels.tiled_fa and not kernels.interleave
    system_info(STOCK_BUILD)  # stock llama.cpp always splits and tiles
    for name in (llamacpp.ENV_SPLIT_KV, llamacpp.ENV_FA_TILED, llamacpp.ENV_KV_INTERLEAVE):
        monkeypatch.delenv(name)
    assert llamacpp.kernels().split_kv and llamacpp.kernels().tiled_fa


def test_exact_kernels_switch_the_process_before_any_model_opens(system_info):
    system_info(VERISPEC_BUILD)
    llamacpp.use_exact_kernels()
    assert os.environ[llamacpp.ENV_EXACT] == str(llamacpp.EXACT_WIDTH)
    assert llamacpp.kernels().exact == llamacpp.EXACT_WIDTH
    llamacpp._opened = True
    llamacpp.use_exact_kernels()  # already on: a second model asking for them is fine


def test_exact_kernels_refused_once_a_model_is_open(system_info):
    system_info(VERISPEC_BUILD)
    llamacpp._opened = True
    with pytest.raises(ModelError, match="before the first llama.cpp model"):
        llamacpp.use_exact_kernels()
    assert llamacpp.ENV_EXACT not in os.environ


def test_exact_kernels_need_verispecs_build(system_info):
    system_info(STOCK_BUILD)
    with pytest.raises(ModelError, match="make install-llamacpp"):
        llamacpp.use_exact_kernels()


PATCH = os.path.join(os.path.dirname(__file__), "..", "..", "native", "llama.cpp-kernels.patch")
AMX_PROBE = os.path.join(os.path.dirname(__file__), "..", "..", "native", "amx_probe.c")
# llama.cpp's ggml_tile_config_init as the patch leaves it, around the line that precedes its ldtilecfg; the
# configuration read back with sttilecfg must be the one filled in
TILE_CONFIG_TEST = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
struct tile_config_t { uint8_t palette_id = 0; uint8_t start_row = 0; uint8_t reserved_0[14] = {0};
                       uint16_t colsb[16] = {0}; uint8_t rows[16] = {0}; };
__attribute__((noinline)) void init(void) {
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    for (int i = 0; i < 8; i++) { tc.rows[i] = 16; tc.colsb[i] = 64; }
    BEFORE_LOAD
    _tile_loadconfig(&tc);
}
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;
    init();
    alignas(64) tile_config_t back = {};
    _tile_storeconfig(&back);
    asm volatile("" : : "r"(&back) : "memory");  // the same compiler blind spot, for the store
    _tile_release();
    for (int i = 0; i < 8; i++) if (back.rows[i] != 16 || back.colsb[i] != 64) { puts("dropped"); return 1; }
    puts("kept");
    return 0;
}
"""


def _line_before_tile_loadconfig() -> str:
    """The line the patch puts before llama.cpp's `_tile_loadconfig(&tc);` (the new side of its hunk)."""
    with open(PATCH) as f:
        text = f.read()
    hunk = text[text.index("diff --git a/ggml/src/ggml-cpu/amx/mmq.cpp"):]
    new_side = [line[1:] for line in hunk.splitlines()[4:] if line[:1] in (" ", "+")]
    at = next(i for i, line in enumerate(new_side) if line.strip() == "_tile_loadconfig(&tc);")
    return new_side[at - 1].strip()


def test_the_amx_tile_configuration_survives_the_compiler(tmp_path):
    """The AMX build's tile configuration: GCC 12 at -O3 does not see that _tile_loadconfig reads the
    configuration and drops the stores that fill it in (llama.cpp then dies at its first wide pass). The patch
    puts a compiler barrier before the load; compiled around it here, the configuration loaded is the one filled
    in. Runs where g++ builds AMX code and the CPU runs AMX tiles (native/amx_probe.c)."""
    barrier = _line_before_tile_loadconfig()
    assert barrier.startswith("asm volatile") and '"memory"' in barrier
    if shutil.which("cc") is None or shutil.which("g++") is None:
        pytest.skip("no C and C++ compilers")
    probe = tmp_path / "probe"
    if subprocess.run(["cc", "-O1", "-mamx-tile", "-mamx-int8", AMX_PROBE, "-o", str(probe)],
                      capture_output=True).returncode != 0:
        pytest.skip("the compiler cannot build AMX code")
    if subprocess.run([str(probe)], capture_output=True).returncode != 0:
        pytest.skip("this CPU, kernel or VM does not run AMX tiles")

    def run_with(line: str) -> str:
        source, binary = tmp_path / "tiles.cpp", tmp_path / "tiles"
        source.write_text(TILE_CONFIG_TEST.replace("BEFORE_LOAD", line))
        built = subprocess.run(["g++", "-O3", "-mamx-tile", "-mamx-int8", str(source), "-o", str(binary)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            pytest.skip(f"g++ cannot build the AMX test: {built.stderr.strip().splitlines()[-1]}")
        return subprocess.run([str(binary)], capture_output=True, text=True).stdout.strip()

    assert run_with(barrier) == "kept"  # without it, GCC 12 prints "dropped"


def test_exact_kernels_are_llama_cpps_and_cover_every_pass():
    hf = TargetSpec("m", backend="hf", exact_kernels=True)
    with pytest.raises(SpecError) as err:
        check_exact_kernels(hf, 4)
    assert err.value.field == "target.exact_kernels" and ("target.backend", "llamacpp") in err.value.fixes
    llama = TargetSpec("m", backend="llamacpp", exact_kernels=True)
    for k in (0, llamacpp.EXACT_WIDTH - 1, "auto", None):
        check_exact_kernels(llama, k)
    with pytest.raises(SpecError, match=f"at most {llamacpp.EXACT_WIDTH - 1}") as err:
        check_exact_kernels(llama, llamacpp.EXACT_WIDTH)
    assert err.value.field == "k"
    check_exact_kernels(TargetSpec("m", backend="hf"), 99)  # not asked for: nothing to check
    with pytest.raises(SpecError, match="True or False"):
        TargetSpec("m", exact_kernels="yes")


# -- on the real GGUFs ---------------------------------------------------------------------------------

# Prefill `context` tokens, then for each width n (2..16 unless given): a pass over n tokens, and n one-token
# passes from the same cache; report per width whether the logits are bitwise equal and how far apart they are,
# and a hash of the widest width's one-token logits (to compare processes that run other kernels).
_PASSES = textwrap.dedent("""
    import hashlib, json, sys, torch
    from verispec.backends.base import Sequence
    from verispec.backends.llamacpp import LlamaCppModel, kernels, use_exact_kernels
    from verispec.backends.loading import resolve_gguf
    name, context, exact = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "exact"
    widths = [int(n) for n in sys.argv[4].split(",")] if len(sys.argv) > 4 else range(2, 17)
    if exact:
        use_exact_kernels()
    model = Sequence(LlamaCppModel(resolve_gguf(name), n_ctx=1024))
    model.forward(torch.arange(1000, 1000 + context) % model.vocab_size, last_only=True)
    tokens = torch.tensor([(2000 + 37 * i) % model.vocab_size for i in range(max(widths))])
    out = {"kernels": kernels().describe(model.model.weight_types), "multicol": kernels().multicol, "widths": {}}
    model.rollback(context)  # token i's one-token pass sees the context and tokens[:i], whatever the width
    single = torch.cat([model.forward(tokens[i : i + 1]) for i in range(max(widths))])
    for n in widths:
        model.rollback(context)
        batch = model.forward(tokens[:n])
        out["widths"][n] = [torch.equal(batch, single[:n]), (batch - single[:n]).abs().max().item()]
    out["single"] = hashlib.sha256(single.float().numpy().tobytes()).hexdigest()
    print(json.dumps(out))
""")

# Three sequences (prompts of 70, 5 and 130 tokens) decoded alone, one token a pass; then together in one
# 4-slot context: the three prompts in one pass (in slots 2, 0, 1), then 12 rounds in which each feeds its next
# token and 0-5 junk drafts that are rolled back. Report per sequence whether every position's logits are bitwise
# those it got alone.
_BATCHED = textwrap.dedent("""
    import json, random, sys, torch
    from verispec.backends.base import Sequence
    from verispec.backends.llamacpp import LlamaCppModel, kernels, use_exact_kernels
    from verispec.backends.loading import resolve_gguf
    name, exact = sys.argv[1], sys.argv[2] == "exact"
    if exact:
        use_exact_kernels()
    solo = LlamaCppModel(resolve_gguf(name), n_ctx=1024)
    rng = random.Random(0)
    vocab = min(solo.vocab_size, 20000)
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in (70, 5, 130)]
    nexts = [[rng.randrange(100, vocab) for _ in range(12)] for _ in prompts]
    alone = []
    for p, c in zip(prompts, nexts):
        seq = Sequence(solo)
        seq.reset()
        alone.append(torch.cat([seq.forward(torch.tensor(p), last_only=True)]
                               + [seq.forward(torch.tensor([t])) for t in c]))
    multi = solo.with_slots(4)
    slots = [2, 0, 1]
    got = [[row] for row in multi.forward_rows(slots, [torch.tensor(p) for p in prompts], last_only=True)]
    for j in range(12):
        feeds = [torch.tensor([c[j]] + [rng.randrange(100, vocab) for _ in range(rng.randrange(6))]) for c in nexts]
        for b, row in enumerate(multi.forward_rows(slots, feeds)):
            got[b].append(row[:1])
            multi.rollback(slots[b], multi.lengths[slots[b]] - feeds[b].numel() + 1)
    same = [torch.equal(torch.cat(g), a) for g, a in zip(got, alone)]
    print(json.dumps({"kernels": kernels().describe(solo.weight_types), "same": same,
                      "invariant": solo.batch_invariant}))
""")


def _child(script: str, *args: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VERISPEC_GGML_", "VERISPEC_KV_"))}
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         env={**base, **env, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _passes(name: str, context: int, mode: str, *widths: int, **env: str) -> dict:
    from verispec.catalog import installed

    if installed(name) is None:
        pytest.fail(f"{name} is not installed; run `make setup`")
    return _child(_PASSES, name, str(context), mode, *([",".join(map(str, widths))] if widths else []), **env)


def _batched(name: str, mode: str, **env: str) -> dict:
    from verispec.catalog import installed

    if installed(name) is None:
        pytest.fail(f"{name} is not installed; run `make setup`")
    return _child(_BATCHED, name, mode, **env)


@pytest.mark.integration
@pytest.mark.parametrize("name, mode, env", [(DEFAULT_TARGET, "default", {}),
                                             (DEFAULT_TARGET, "default", {llamacpp.ENV_MULTICOL_ISA: "avx2"}),
                                             ("smollm2-135m-instruct", "exact", {})])
def test_sequences_batched_in_one_context_get_bitwise_their_logits_alone(name, mode, env):
    """The 1.5B's Q4_K/Q6_K weights by default (each variant of the kernels), SmolLM2's Q4_1 weights with exact
    kernels: every position of every sequence equals its solo one-token pass, whatever the rows beside it, the
    slot it is in and the junk drafts its batch mates rolled back; the process says the model is batch-invariant."""
    result = _batched(name, mode, **env)
    if mode == "default" and "multi-column" not in result["kernels"]:
        pytest.skip(f"no multi-column kernels here: {result['kernels']}")
    assert result["same"] == [True, True, True] and result["invariant"], result


@pytest.mark.integration
@pytest.mark.parametrize("env", [{llamacpp.ENV_FA_TILED: "1"}, {llamacpp.ENV_KV_INTERLEAVE: "0"}])
def test_batched_logits_differ_without_the_attention_switches(env):
    """The negative control: with flash attention's tiled kernel (the 205-row prompt pass takes it) or with
    llama.cpp's own cell placement (a sequence's new cells land in the holes its mates' rollbacks left, before
    its older ones), some sequence's logits differ from its solo ones, and the process says why."""
    result = _batched(DEFAULT_TARGET, "default", **env)
    assert not all(result["same"]) and not result["invariant"], result
    assert "not batch-invariant" in result["kernels"]


@pytest.mark.integration
@pytest.mark.parametrize("name", [DEFAULT_TARGET, "smollm2-135m-instruct"])
def test_exact_kernels_make_a_pass_over_n_tokens_equal_n_one_token_passes(name):
    """300 cached tokens: one-token flash attention would split the context across threads (from 512 cells)
    and sum it in another order than a wider pass. The 1.5B's Q4_K/Q6_K weights run verispec's multi-column
    kernels (or one-column ones), SmolLM2's Q4_1 weights one-column kernels, so both paths are covered."""
    result = _passes(name, 300, "exact")
    assert "exact kernels for every weight type" in result["kernels"] and "; batch-invariant" in result["kernels"]
    assert all(same for same, _ in result["widths"].values()), result["widths"]


@functools.cache
def _stock_passes() -> dict:
    return _passes(DEFAULT_TARGET, 300, "default", 5, 16, **{llamacpp.ENV_MULTICOL: "0"})


@pytest.mark.integration
@pytest.mark.parametrize("isa", ["best", "avx2"])
def test_default_kernels_compute_each_token_as_the_stock_one_token_pass(isa):
    """The default on Q4_K/Q6_K weights, in each variant of the multi-column kernels (the best this CPU runs, and
    the AVX2 one, which AVX512 machines run when asked): every column of a pass over 2..16 tokens, and of one over
    80 (a prompt chunk's sweeps over the weights: 64 columns, then 16), is bitwise what the one-token pass gives
    (the same integer sums and float steps); and a one-token pass on them is bitwise llama.cpp's own (the kernels
    on one-token passes only, against none, both prefilling the context alike)."""
    env = {llamacpp.ENV_MULTICOL_ISA: "avx2"} if isa == "avx2" else {}
    result = _passes(DEFAULT_TARGET, 300, "default", *range(2, 17), 80, **env)
    if not result["multicol"]:
        pytest.skip(f"no multi-column kernels here: {result['kernels']}")
    assert isa != "avx2" or result["multicol"] == "AVX2", result["kernels"]
    assert all(same for same, _ in result["widths"].values()), result["widths"]
    one_token = _passes(DEFAULT_TARGET, 300, "default", 16, **env, **{llamacpp.ENV_MULTICOL: "1"})
    stock = _stock_passes()  # which rounds some widths otherwise (its repacked Q4_K GEMM): it ran other kernels
    assert not all(same for same, _ in stock["widths"].values()), stock["widths"]
    assert stock["multicol"] is None and "do not run" in stock["kernels"]  # the process says they are off
    assert one_token["single"] == stock["single"]


@pytest.mark.integration
def test_split_one_token_attention_breaks_the_identity():
    """The negative control of the two tests above: with llama.cpp's split-KV one-token attention the same
    passes differ, so those tests can fail."""
    result = _passes(DEFAULT_TARGET, 300, "default", **{llamacpp.ENV_SPLIT_KV: "1"})
    assert "not batch-invariant" in result["kernels"]
    assert not any(same for same, _ in result["widths"].values()), result["widths"]


@pytest.mark.integration
def test_generate_with_exact_kernels_is_token_identical_to_plain_decoding():
    """`verispec generate --exact-kernels` on the default target on llama.cpp: the suffix drafter at a fixed
    k = 6 (every round a 7-token pass where a draft is found) against --no-speculation, on a prompt long
    enough for attention to split without exact kernels; --json says which kernels ran."""
    from verispec.catalog import installed

    if installed(DEFAULT_TARGET) is None:
        pytest.fail(f"{DEFAULT_TARGET} is not installed; run `make setup`")
    prompt = "Rewrite this function with a loop instead of recursion, keeping its name:\n\n" + "\n".join(
        f"def f{i}(n):\n    return n if n < 2 else f{i}(n - 1) + f{i}(n - 2)\n" for i in range(12))
    common = [sys.executable, "-m", "verispec.apps.cli", "generate", "--target", DEFAULT_TARGET, "--backend", "llamacpp",
              "--chat", "--prompt", prompt, "--max-new-tokens", "32", "--exact-kernels", "--json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    outs = []
    for extra in (["--drafter", "suffix", "-k", "6"], ["--no-speculation"]):
        run = subprocess.run([*common, *extra], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        outs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    spec, plain = outs
    assert spec["prompt_tokens"] > 256
    assert spec["stats"]["accepted"] > 0
    assert spec["token_ids"] == plain["token_ids"]
    assert "batch-invariant" in spec["kernels"]
