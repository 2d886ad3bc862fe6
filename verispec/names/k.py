"""k, the number of draft tokens per round: its defaults, in one place, and its check.

k is an integer >= 0 (0: plain decoding) or 'auto' (a cost-aware policy picks it each round, 0..K_MAX). Without a k
the backend's default drafter and its own pair get DEFAULTS' k; any other drafter gets default_k: 'auto' where
llama.cpp runs (its passes' cost grows with their width, so a fixed k can lose to plain decoding), else DEFAULT_K.
DEFAULTS also says which drafter the default target gets where its backend pairs it with a draft model of its
own."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.names.drafters import DRAFTER_NAMES, FREE_DRAFTERS

DEFAULT_K = 4  # a fixed k where none is asked for (transformers)
K_MAX = 8  # the largest k the cost-aware policy drafts


def check_k(k: int | str) -> int | str:
    """k as given, or a ValueError: an integer >= 0 or 'auto'."""
    if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"k must be an integer >= 0 or 'auto', got {k!r}")
    return k


def parse_k(text: str) -> int | str:
    """k from its text form (ValueError saying what was expected), checked as check_k checks it."""
    text = text.strip()
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"expected an integer or 'auto', got {text!r}") from None
    if k < 0:
        raise ValueError(f"must be >= 0 or 'auto', got {k}")
    return k


@dataclass(frozen=True)
class Defaults:
    """The drafter and k a target backend gets when the user names neither. `pair_drafter` and `draft`, where
    set: one user's generation with the default target and no draft named drafts with `pair_drafter` and the
    catalog model `draft` instead (a server, whose rows share each pass, keeps `drafter`)."""

    drafter: str
    k: int | str
    pair_drafter: str | None = None
    draft: str | None = None

    def __post_init__(self) -> None:
        if (self.pair_drafter is None) != (self.draft is None):
            raise ValueError("a pair drafter and its draft model are set together")
        if self.drafter not in DRAFTER_NAMES or self.pair_drafter in (*FREE_DRAFTERS, "tree"):
            raise ValueError(f"not a default: drafter {self.drafter!r}, pair drafter {self.pair_drafter!r}")


# per target backend; a drafter that takes no draft model (ngram, suffix) loads none, which shortens the load.
# llama.cpp: the suffix lookups are free and share a server's passes well; for one user a 135M model, whose step
# costs a small fraction of the target's, drafts where they find no confident match (docs/performance.md)
DEFAULTS: dict[str, Defaults] = {
    "hf": Defaults("model", DEFAULT_K),
    "llamacpp": Defaults("suffix", "auto", pair_drafter="hybrid-suffix", draft="smollm2-135m-instruct"),
}


def default_k(target_backend: str, draft_backend: str | None) -> int | str:
    """k when none is asked for and the drafter is not the backend's default: 'auto' where llama.cpp runs, else
    DEFAULT_K."""
    return "auto" if "llamacpp" in (target_backend, draft_backend) else DEFAULT_K


def own_default(target_backend: str, drafter: str | None, draft_model: object, draft_backend: str | None,
                named: bool) -> bool:
    """Whether a drafter is the target backend's own default (DEFAULTS): its drafter where the user named none
    (`named` False), or its pair drafter with the pair's draft model (a catalog name); the draft, if any, on the
    target's backend."""
    defaults = DEFAULTS.get(target_backend)
    return drafter is not None and defaults is not None and draft_backend in (None, target_backend) and (
        not named and drafter == defaults.drafter
        or defaults.pair_drafter is not None and drafter == defaults.pair_drafter and draft_model == defaults.draft)


def unasked_k(target_backend: str, drafter: str | None, draft_model: object, draft_backend: str | None,
              named: bool) -> int | str:
    """k when none is asked for: 0 without a drafter (plain decoding), 'auto' for a token tree, DEFAULTS' k for
    the backend's own default (own_default), else default_k."""
    if drafter is None:
        return 0
    if drafter == "tree":
        return "auto"
    if own_default(target_backend, drafter, draft_model, draft_backend, named):
        return DEFAULTS[target_backend].k
    return default_k(target_backend, draft_backend)


def backend_defaults(backend: str) -> Defaults:
    """DEFAULTS' entry for a target backend; a backend without one drafts with a draft model at DEFAULT_K."""
    return DEFAULTS.get(backend, Defaults("model", DEFAULT_K))


def default_drafter(backend: str, has_model: bool) -> str:
    """The drafter for DraftSpec's 'auto' on a target backend: DEFAULTS' choice, unless a draft model is given
    and that drafter takes none (then 'model': a draft model the user names is used). A backend without an
    entry drafts with a draft model."""
    drafter = backend_defaults(backend).drafter
    if has_model and drafter in FREE_DRAFTERS:
        return "model"
    return drafter
