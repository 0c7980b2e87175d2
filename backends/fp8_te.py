"""FP8 through NVIDIA Transformer Engine (PRECISION=fp8 FP8_BACKEND=te): the chapter's
"forward in FP8 on the H100 Transformer Engine", next to our own FP8Linear (fp8.py).

Chapter section 1, FP8. Read fp8.py first: this file only builds TE's modules, its
FP8 autocast and its recompute flags from the same fp8.Settings, so the two backends
can be compared.

TE is imported only here, and only when asked for: it is an optional extra
(pip install --no-build-isolation 'transformer_engine[pytorch]' on a CUDA machine).
Its recipe: DelayedScaling, HYBRID (E4M3 forward, E5M2 gradients), amax history
FP8_AMAX_HISTORY, margin FP8_MARGIN, amax_compute_algo "max"; or Float8CurrentScaling
for FP8_RECIPE=current (which has no margin: config.py refuses FP8_MARGIN with it).
TE does its backward in FP8 (HYBRID), so FP8_GRAD does not apply. Its FP8 state lives
inside TE's modules (`_extra_state`, saved in a snapshot).

Where TE's delayed scaling differs from fp8.py's (the rest of the list: docs/fp8.md):
  - TE moves its amax history at the exit of every forward autocast (each micro-step) and
    after every backward (transformer_engine/pytorch/quantization.py,
    reduce_and_update_fp8_tensors), fp8.py once per optimizer step: with ACCUM=K the same
    FP8_AMAX_HISTORY spans K times fewer optimizer steps under TE.
  - evaluation forwards: TE's quantization writes their amax into the history's current row,
    but the autocast's exit updates nothing while grad is disabled (autocast_exit: only
    `if torch.is_grad_enabled()`), so train.py's evaluation, which runs under this autocast,
    leaves its amax to be folded into the next training forward's update. fp8.py's layers
    record nothing in evaluation (model.eval()).
"""
import functools

import torch


# fp8_refined.WEIGHT_MODES as te.Linear's is_first_microbatch (module/linear.py, Linear.forward)
IS_FIRST_MICROBATCH = {"fresh": None, "refresh": True, "reuse": False}


INSTALL = "pip install --no-build-isolation 'transformer_engine[pytorch]'"


def _te():
    """TE's torch module and its recipes, or ValueError in one line: not installed, or installed but
    broken. A TE built against another torch fails at import in its own ways: loading its shared
    libraries (transformer_engine/common/__init__.py: load_framework_extension, _load_cuda_library)
    raises OSError from ctypes (an undefined symbol, a missing libcudnn), ImportError from the
    extension module, RuntimeError ("shared object not found"), FileNotFoundError, or an
    AssertionError on mismatched package versions; transformer_engine/pytorch/__init__.py asserts
    its minimum torch."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "transformer_engine":
            raise ValueError(_broken(e)) from None
        raise ValueError(f"fp8_backend=te needs Transformer Engine ({INSTALL}, on a CUDA machine); use "
                         f"--fp8_backend=native") from None
    except (ImportError, OSError, RuntimeError, AssertionError) as e:
        raise ValueError(_broken(e)) from None
    return te, te_recipe


def _broken(e):
    cause = " ".join(str(e).split())
    cause = cause if len(cause) <= 160 else cause[:157] + "..."
    return (f"fp8_backend=te: Transformer Engine is installed but does not import ({type(e).__name__}: "
            f"{cause or 'no message'}); a TE built against another torch than this one ({torch.__version__}) "
            f"fails so: reinstall it here ({INSTALL}) or use --fp8_backend=native")


def fp8_support(te):
    """(available, reason), from Transformer Engine itself: te.is_fp8_available(return_reason=True)
    in TE >= 2.9 (transformer_engine/pytorch/quantization.py), check_fp8_support() before
    (transformer_engine/pytorch/fp8.py). Beyond sm89+, Ada needs cuBLASLt >= 12.1.3 and CUDA >= 12.1:
    asking TE is the only way to learn what its first autocast would otherwise assert."""
    if hasattr(te, "is_fp8_available"):
        return te.is_fp8_available(return_reason=True)
    return te.fp8.check_fp8_support()


def check_available(device):
    """Raise ValueError (one line) unless TE is installed and says FP8 runs on this GPU."""
    te, _ = _te()
    if device.type != "cuda":
        raise ValueError("fp8_backend=te needs a CUDA GPU (sm89+: Ada, Hopper or newer); use --fp8_backend=native")
    available, reason = fp8_support(te)
    if not available:
        reason = " ".join(str(reason).split()) or "no reason given"
        raise ValueError(f"fp8_backend=te: Transformer Engine says FP8 cannot run here: {reason}; "
                         f"use --fp8_backend=native")


@functools.lru_cache(maxsize=None)
def _te_recipe(settings):
    """One TE recipe object per fp8.Settings: TE keys its global amax buffers by recipe."""
    _, te_recipe = _te()
    if settings.scaling == "current":
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


def recompute_contexts(settings):
    """(around a recompute unit's forward, [contexts around its re-run]) as TE's own
    te.distributed.checkpoint sets them (transformer_engine/pytorch/distributed.py,
    _CheckpointFunction). The forward runs inside activation_recompute_forward(
    activation_recompute=True, recompute_phase=False): each delayed-scaling module stashes the
    amax history and scales it quantizes with (quantization.py,
    copy_forward_fp8_meta_tensors_for_recompute; module/base.py, prepare_forward). The re-run
    runs inside (..., recompute_phase=True) and then TE's FP8 autocast with the same recipe:
    each module swaps the stashed scales in (get_old_fp8_meta_tensors_for_recompute, put back
    by restore_fp8_meta_tensors after its forward), so the re-run computes the same bytes, and
    it does not record its amax for the update, so the history moves only once: the update at
    this autocast's exit finds the current amax row zero and skips the roll (delayed_scaling.cu)."""
    te, _ = _te()
    phase = te.distributed.activation_recompute_forward
    return (phase(activation_recompute=True, recompute_phase=False),
            [phase(activation_recompute=True, recompute_phase=True), autocast(settings)])


@functools.lru_cache(maxsize=None)
def _linear_class():
    te, _ = _te()

    class Linear(te.Linear):
        """te.Linear told which micro-step it runs in (its weight_mode, fp8_refined.WEIGHT_MODES, set
        as on our FP8Linear by precision.Precision.forward_context under FP8_KEEP_WEIGHT, else "fresh",
        so None: TE's own default). With is_first_microbatch set,
        TE quantizes the weight on micro-step 1 into a cached workspace (the E4M3 weight and, on
        Hopper, its transpose for the backward GEMM) and reuses it for the other micro-steps; with
        None it quantizes afresh in every forward (module/linear.py, Linear.forward: no cache
        name when is_first_microbatch is None; module/base.py, quantize_weight)."""

        weight_mode = "fresh"
        recording = True  # TE's re-run records nothing by its own recompute flags: kept for fp8_refined.Rerun

        def forward(self, inp):
            return super().forward(inp, is_first_microbatch=IS_FIRST_MICROBATCH[self.weight_mode])
    return Linear


def linear_factory(settings):
    """The callable model.py builds every Linear with: te.pytorch.Linear in BF16."""
    _te_recipe(settings)  # an unsupported recipe fails here, at build, not at the first forward
    linear = _linear_class()

    def make(in_features, out_features, bias):
        if in_features % 16 or out_features % 16:
            raise ValueError(f"fp8 needs Linear dimensions divisible by 16, got {in_features} -> {out_features}")
        return linear(in_features, out_features, bias=bias, params_dtype=torch.bfloat16)
    return make
