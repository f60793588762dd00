"""What torch raises for a model that fp8fn cannot run as written, told as fp8fn errors.

Beside `_torch_private.py`, for the same reason: the messages matched here are torch's own
wording, not an API, so a torch upgrade that changes one must fail in one place.
"""

from __future__ import annotations

import contextlib

import torch

from ._torch_private import (
    as_dtensor,
    functorch_level,
    has_backward_hooks,
    raised_by_backward_hook,
)

# What torch raises when the model's own torch.utils.checkpoint runs under torch.func.
_TORCH_CHECKPOINT_UNDER_FUNC = ("saved tensor hooks", "must override the setup_context")
# What torch raises when a module updates a buffer in place under torch.func.grad.
_TORCH_MUTATES_CAPTURED = "would mutate a captured Tensor"
# What torch raises when a model (an HF input hook) calls requires_grad_() under torch.func.
_TORCH_REQUIRES_GRAD_UNDER_FUNC = "call Tensor.requires_grad_() (or perhaps using"
# What torch raises when a DTensor meets a plain tensor in an op.
_MIXED = "got mixed torch.Tensor and DTensor"
# What torch.func raises for an autograd.Function without `setup_context` (DTensor.from_local).
_NO_SETUP_CONTEXT = "must override the setup_context"
# How a sharded model is given to `fn.apply` (said by the errors of a wrongly sharded one).
FSDP_HOWTO = (
    "Functional FSDP takes `params` as `distribute_tensor(p, mesh, [Shard(0)])` on a 1-D mesh, "
    "for a module whose own parameters are plain; tensor parallel takes the module made by "
    "parallelize_module (ColwiseParallel / RowwiseParallel), with "
    "`params = dict(model.named_parameters())`."
)
# Why a tensor-parallel model cannot run under a torch.func transform.
TP_UNDER_FUNC = (
    "fp8fn.apply: expected plain autograd for a tensor-parallel model, got a torch.func "
    "transform: torch's parallel styles convert with DTensor.from_local, an autograd.Function "
    "without setup_context, which torch.func refuses. Differentiate with fp8fn.value_and_grad, "
    "or fp8fn.observe and loss.backward()."
)
USE_CHECKPOINT_FN = (
    "Turn the model's own checkpointing off (HF: `model.gradient_checkpointing_disable()`) and "
    "pass `checkpoint_fn=lambda name, module: ...` to fp8fn.transform."
)


@contextlib.contextmanager
def translated_errors(module, params: dict):
    """Inside, what torch raises for `module` run by `fp8fn.apply` with `params` is re-raised as
    an `fp8fn.apply` error that says what to change (from torch's); other errors pass."""
    try:
        yield
    except TypeError as e:
        bad = {n: type(v).__name__ for n, v in params.items() if not torch.is_tensor(v)}
        if bad:
            raise TypeError(f"fp8fn.apply: expected tensors in `params`, got {bad}.") from e
        raise
    except RuntimeError as e:
        sharded = explain_error(e, module)
        if sharded is not None:
            raise sharded from e
        message = str(e)
        if raised_by_backward_hook(e):
            hooked = [repr(n) for n, m in module.named_modules() if has_backward_hooks(m)]
            raise RuntimeError(
                "fp8fn.apply: expected no full backward hooks under a torch.func transform, "
                f"got one (on the modules {', '.join(hooked) or 'of a global hook'}): "
                "torch runs them as an autograd.Function that torch.func refuses. "
                "Differentiate with plain autograd (fp8fn.value_and_grad, or fp8fn.observe "
                "and loss.backward()), or remove the hook."
            ) from e
        if any(m in message for m in _TORCH_CHECKPOINT_UNDER_FUNC):
            raise RuntimeError(
                "fp8fn.apply: the model calls torch.utils.checkpoint, which does not work "
                f"under torch.func transforms. {USE_CHECKPOINT_FN}"
            ) from e
        if _TORCH_REQUIRES_GRAD_UNDER_FUNC in message:
            raise RuntimeError(
                "fp8fn.apply: the model calls requires_grad_() under a torch.func transform, "
                "which torch refuses. HF models do it in the input hook of their own "
                "gradient checkpointing: remove both with `model.gradient_checkpointing_"
                "disable()` and `model.disable_input_require_grads()`, and pass "
                "`checkpoint_fn=lambda name, module: ...` to fp8fn.transform."
            ) from e
        if _TORCH_MUTATES_CAPTURED in message:
            raise RuntimeError(
                "fp8fn.apply: the model updates a buffer in place (e.g. batch-norm running "
                "statistics), which torch.func transforms refuse for tensors from outside "
                "them. Differentiate with plain autograd (fp8fn.value_and_grad, or "
                "fp8fn.observe and loss.backward()), or put the module in eval mode."
            ) from e
        raise


def explain_error(error: Exception, module) -> Exception | None:
    """A clear fp8fn error for what torch raised on a sharded model in `apply`, else None."""
    message = str(error)
    if _MIXED in message:
        return RuntimeError(
            "fp8fn.apply: expected the model's DTensors to meet only DTensors, got a torch op "
            f"mixing them with plain tensors ({message.splitlines()[0]}). {FSDP_HOWTO} "
            "fp8fn looks at the first entry of `params` to know whether they are DTensors: "
            "give them all as DTensors, or none."
        )
    if (
        _NO_SETUP_CONTEXT in message
        and functorch_level() is not None
        and any(as_dtensor(p) is not None for p in module.parameters())
    ):
        return RuntimeError(TP_UNDER_FUNC)
    return None
