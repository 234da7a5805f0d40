"""The megatron-core releases megatron_chunkflow runs on, and every API difference between them.

    from megatron_chunkflow import compat
    compat.check_release()                       # at start: a release outside the range refused
    compat.backward_step(inp, out, grad, config)  # the same call on every supported release

Supported: megatron-core 0.16.1 through 0.19.2 (the newest on PyPI), with Megatron-LM's training
package at tags core_v0.16.1 and core_v0.19.0. Each difference below names the release that
introduced it; the rest of the package calls these functions and never asks which release is
installed (Megatron-LM's training API differences live in megatron_lm/compat.py, beside the
plugin that meets them).
"""

from __future__ import annotations

import functools
import inspect
import os

OLDEST = (0, 16, 1)
NEWEST = (0, 19, 2)
RANGE = "megatron-core 0.16.1 to 0.19.2"
# a newer release is refused at start unless this is set (then it runs, with a warning)
ALLOW_UNTESTED = "CHUNKFLOW_ALLOW_UNTESTED_MEGATRON"


class UnsupportedRelease(RuntimeError):
    """The installed megatron-core is outside RANGE (or missing)."""


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.19.2+855d539' / '0.17.0rc0' -> (0, 19, 2) / (0, 17, 0): the release, without the local
    part 0.18+ appends from `git rev-parse` or a pre-release tag."""
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def installed() -> tuple[int, int, int]:
    """The installed megatron-core's release, e.g. (0, 19, 2): megatron/core/package_info.py
    where `import megatron.core` would find it, read without importing megatron.core (seconds of
    imports for a version: `make` asks for it)."""
    import ast
    import importlib.util
    import sys
    from pathlib import Path

    module = sys.modules.get("megatron.core.package_info")
    if module is not None:
        return parse_version(module.__version__)
    spec = importlib.util.find_spec("megatron")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "core" / "package_info.py"
        if (path.parent / "__init__.py").is_file() and path.is_file():
            numbers = {}  # MAJOR = 0, MINOR = 19, PATCH = 2: literals in every release
            for node in ast.parse(path.read_text()).body:
                if (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Name)
                        and isinstance(node.value, ast.Constant)):
                    numbers[node.targets[0].id] = node.value.value
            if all(isinstance(numbers.get(k), int) for k in ("MAJOR", "MINOR", "PATCH")):
                return numbers["MAJOR"], numbers["MINOR"], numbers["PATCH"]
            from megatron.core import package_info  # another layout: ask the module itself

            return parse_version(package_info.__version__)
    raise UnsupportedRelease(f"megatron-core is not installed (no megatron/core on the path); "
                             f"megatron_chunkflow runs on {RANGE}: pip install megatron-core")


def version_text(release: tuple[int, int, int] | None = None) -> str:
    """(0, 19, 2) -> '0.19.2'."""
    return ".".join(map(str, release or installed()))


def check_release() -> tuple[int, int, int]:
    """The installed release, or UnsupportedRelease (one line naming RANGE) outside it; a newer
    release runs with a warning where CHUNKFLOW_ALLOW_UNTESTED_MEGATRON=1."""
    release = installed()
    if OLDEST <= release <= NEWEST:
        return release
    where = f"megatron-core {version_text(release)} is installed; megatron_chunkflow runs on {RANGE}"
    if release > NEWEST and os.environ.get(ALLOW_UNTESTED) == "1":
        import warnings

        warnings.warn(f"{where} ({ALLOW_UNTESTED}=1: continuing untested)", stacklevel=2)
        return release
    hint = (f"pip install 'megatron-core>={version_text(OLDEST)},<={version_text(NEWEST)}'"
            + (f", or set {ALLOW_UNTESTED}=1 to try it" if release > NEWEST else ""))
    raise UnsupportedRelease(f"{where} ({hint})")


# -- pipeline_parallel.schedules ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _backward_step_takes_model_type() -> bool:
    from megatron.core.pipeline_parallel import schedules

    return "model_type" in inspect.signature(schedules.backward_step).parameters


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """Megatron's backward_step for one micro-batch. 0.17 removed its `model_type` argument
    (0.16.1 takes it and ignores it for decoder-only models)."""
    from megatron.core.pipeline_parallel import schedules

    if _backward_step_takes_model_type():
        from megatron.core.enums import ModelType

        return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad,
                                       ModelType.encoder_or_decoder, config)
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


# -- models ---------------------------------------------------------------------------------------

MODEL_CLASSES = ("auto", "gpt", "hybrid")


def has_hybrid_model() -> bool:
    """megatron.core.models.hybrid.HybridModel exists: 0.18 added it (MambaModel's successor)."""
    import importlib.util

    return importlib.util.find_spec("megatron.core.models.hybrid") is not None


def recommended_model_class() -> str:
    """The model class the installed release recommends: "hybrid" from 0.19, which deprecates
    GPTModel ("GPTModel IS DEPRECATED ... use HybridModel"); "gpt" before."""
    return "hybrid" if installed() >= (0, 19, 0) and has_hybrid_model() else "gpt"


def resolve_model_class(name: str, flag: str = "--model-class", moe: bool = False) -> str:
    """"auto" -> recommended_model_class() (GPTModel for a mixture-of-experts model, `moe`:
    ChunkFlow builds MoE layers there only); "hybrid" where the release has no HybridModel, or
    for an MoE model, is a ValueError naming `flag`."""
    if name not in MODEL_CLASSES:
        raise ValueError(f"{flag} {name}: choose one of {', '.join(MODEL_CLASSES)}")
    if name == "auto":
        return "gpt" if moe else recommended_model_class()
    if name == "hybrid" and moe:
        raise ValueError(f"{flag} hybrid: ChunkFlow builds mixture-of-experts layers in GPTModel "
                         "only (not yet HybridModel's 'E' layers); use --model-class gpt or auto")
    if name == "hybrid" and not has_hybrid_model():
        raise ValueError(f"{flag} hybrid: megatron-core {version_text()} has no HybridModel "
                         "(megatron-core 0.18 added it); use --model-class gpt")
    return name


# -- Python ----------------------------------------------------------------------------------------

def backport_typing_override() -> None:
    """Megatron-LM's training package from 0.19 imports `typing.override` (new in Python 3.12, which
    0.17+ declare). Its megatron-core still imports on 3.11, so on a 3.11 machine (this project's
    CPU tests) typing gets typing_extensions' `override`, the same marker decorator. A no-op on
    3.12 and later."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


# -- Megatron-LM's training package (megatron/training, beside pretrain_gpt.py) --------------------

MEGATRON_LM_TAGS = "Megatron-LM core_v0.16.1 and core_v0.19.0"
# the Megatron-LM tag of each megatron-core release line (`make megatron-lm` checks it out)
TAG_OF_LINE = {(0, 16): "core_v0.16.1", (0, 17): "core_v0.17.1", (0, 18): "core_v0.18.2",
               (0, 19): "core_v0.19.0"}


def megatron_lm_tag() -> str:
    """The Megatron-LM tag whose training package goes with the installed megatron-core."""
    return TAG_OF_LINE.get(installed()[:2], f"core_v{version_text()}")


def model_builders() -> list[type]:
    """Megatron-LM's model builder classes, whose build_distributed_models builds and wraps the
    model from a config container: 0.18 added megatron/training/models (HybridModelBuilder), 0.19
    the GPTModelBuilder pretrain_gpt.py builds through. None at core_v0.16.1 (training.get_model
    builds from a model provider, as later tags still do when given one)."""
    try:
        from megatron.training import models
    except ImportError:
        return []
    return [getattr(models, name) for name in ("GPTModelBuilder", "HybridModelBuilder")
            if hasattr(models, name)]


def megatron_lm_problem(checkout: tuple[int, int, int]) -> str | None:
    """Why a Megatron-LM checkout of release `checkout` (its megatron/core/package_info.py) cannot
    run with the installed megatron-core, or None: both in RANGE and of one release line (0.19.0's
    training package with megatron-core 0.19.2 is fine; with 0.16.1 it imports APIs that do not
    exist)."""
    core = installed()
    if not OLDEST <= core <= NEWEST:
        return f"megatron_chunkflow runs on {RANGE}"
    if not OLDEST <= checkout <= NEWEST:
        return f"megatron_chunkflow runs on {MEGATRON_LM_TAGS} (and the tags between)"
    if checkout[:2] != core[:2]:
        return (f"the checkout's training package needs megatron-core {checkout[0]}.{checkout[1]}.x "
                f"(check out core_v{core[0]}.{core[1]}.x, or install megatron-core "
                f"{checkout[0]}.{checkout[1]}.x)")
    return None


def renders_conversations(tokenizer) -> bool:
    """Whether Megatron-LM's tokenizer renders conversations itself (tokenize_conversation: its
    SFTTokenizer, the multimodal one). From 0.17 every text tokenizer of megatron-core's has the
    method and raises NotImplementedError unless its library is "sft"."""
    if not callable(getattr(tokenizer, "tokenize_conversation", None)):
        return False
    try:
        from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText
    except ImportError:  # core_v0.16.1 trains with Megatron-LM's own tokenizers
        return True
    return not isinstance(tokenizer, MegatronTokenizerText) or tokenizer.library == "sft"


def sft_appends_eod() -> bool:
    """Whether Megatron-LM's SFT dataset (--sft) ends each conversation with EOD (as its own
    target) when the template did not: core_v0.16.1 does; 0.17 and later keep the template's
    tokens as they are."""
    return installed() < (0, 17, 0)


def null_tokenizer_vocab_flag(vocab_size: int) -> int:
    """The --vocab-size that gives Megatron-LM's NullTokenizer (mock and pre-tokenized data) a
    vocabulary of `vocab_size` ids: from 0.17 megatron/training builds megatron-core's tokenizers,
    whose NullTokenizer counts its end-of-document id inside --vocab-size; core_v0.16.1's own
    adds one past it."""
    return vocab_size if installed() >= (0, 17, 0) else vocab_size - 1


def balancing_loss_scale(grad, local_rows: int, group_size: int):
    """`grad` times the factor megatron-core's router multiplies its balancing loss by under
    per-token loss, in its order of operations (router.py attach_and_log_load_balancing_loss):
    the rows this rank routed, and from 0.19 also the router's TP x CP group size (so that the
    loss's weight is the micro-batch's tokens whatever the layout; before, it shrank by TP x CP)."""
    if installed() >= (0, 19, 0):
        return (grad * group_size) * local_rows
    return grad * local_rows


def reset_moe_metrics() -> None:
    """Empty megatron-core's process-wide MoE logging tracker, whose entries are sized by the
    layer count of the first model that records one: 0.18 moved it into moe_logging's
    MoEMetricsTracker (destroy_moe_metrics_tracker); before, a dict in moe_utils."""
    if installed() >= (0, 18, 0):
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
    else:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
