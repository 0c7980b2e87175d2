"""FP8 through NVIDIA Transformer Engine (PRECISION=fp8 FP8_BACKEND=te): the chapter's
"forward in FP8 on the H100 Transformer Engine", next to our own FP8Linear (fp8.py).

Chapter section 1, FP8. Read fp8.py first: this file only builds TE's modules and its
FP8 autocast from the same fp8.Settings, so the two backends can be compared.

TE is imported only here, and only when asked for: it is an optional extra
(pip install --no-build-isolation 'transformer_engine[pytorch]' on a CUDA machine).
Its recipe: DelayedScaling, HYBRID (E4M3 forward, E5M2 gradients), amax history
FP8_AMAX_HISTORY, margin FP8_MARGIN, amax_compute_algo "max"; or Float8CurrentScaling
for FP8_RECIPE=current. TE does its backward in FP8 (HYBRID), so FP8_GRAD does not apply.
Its FP8 state lives inside TE's modules (`_extra_state`, saved in a snapshot).
"""
import functools

import torch


def _te():
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except ImportError:
        raise ValueError("fp8_backend=te needs Transformer Engine (pip install --no-build-isolation "
                         "'transformer_engine[pytorch]', on a CUDA machine); use --fp8_backend=native") from None
    return te, te_recipe


def check_available(device):
    """Raise ValueError (one line) unless TE and an FP8-capable GPU are here."""
    _te()
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("fp8_backend=te needs an sm89+ GPU (Ada, Hopper or newer); use --fp8_backend=native")


@functools.lru_cache(maxsize=None)
def _te_recipe(settings):
    """One TE recipe object per fp8.Settings: TE keys its global amax buffers by recipe."""
    _, te_recipe = _te()
    if settings.recipe == "current":
        if not hasattr(te_recipe, "Float8CurrentScaling"):
            raise ValueError("fp8_recipe=current needs Transformer Engine >= 2.2; use fp8_recipe=delayed")
        return te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    return te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=settings.history,
                                    margin=settings.margin, amax_compute_algo="max")


def autocast(settings):
    """TE's FP8 autocast for these settings: entered around every forward."""
    te, _ = _te()
    if hasattr(te, "autocast"):  # TE >= 2.9
        return te.autocast(enabled=True, recipe=_te_recipe(settings))
    return te.fp8_autocast(enabled=True, fp8_recipe=_te_recipe(settings))


def linear_factory(settings):
    """The callable model.py builds every Linear with: te.pytorch.Linear in BF16."""
    te, _ = _te()
    _te_recipe(settings)  # an unsupported recipe fails here, at build, not at the first forward

    def make(in_features, out_features, bias):
        if in_features % 16 or out_features % 16:
            raise ValueError(f"fp8 needs Linear dimensions divisible by 16, got {in_features} -> {out_features}")
        return te.Linear(in_features, out_features, bias=bias, params_dtype=torch.bfloat16)
    return make
