"""Mutation testing of fp8fn: would the test suite catch the next bug?

Usage (from anywhere; a script, not a test module):

    python tools/mutation.py            # every mutation against the default tests
    python tools/mutation.py --quick    # only tests/test_reference.py, without the slow cases
    python tools/mutation.py --tests tests/test_scaling.py tests/test_linear.py
    python tools/mutation.py --only e4m3-grad-output margin-current --keep
    python tools/mutation.py --list

Each mutation is one small bug of a class fp8fn must never ship (a wrong format, a sum where a
max belongs, a check skipped, an order that depends on the data, ...). For each one the package
`fp8fn/` is copied to a temporary directory, the edit is applied by exact string replacement (a
pattern that does not occur exactly once aborts the run before anything runs: the code moved,
update the mutation here), and pytest runs the chosen tests with `-x -q` against the copy (its
directory first on `sys.path` and in `PYTHONPATH`; a plugin stops the run unless the tests
import the copy). Tests marked `slow` are left out unless `--slow`; hypothesis runs its
derandomized `ci` profile, so that a table is reproducible. The unmutated copy runs first and
must pass. Prints a table: mutation | caught? | by which test | how, and the time taken.
Exit status 0 when every mutation is caught, 1 when some survive, 2 on a setup error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "fp8fn"

# Fast, direct tests first: with -x a mutant stops at its first failing test.
DEFAULT_TESTS = [
    "tests/test_scaling.py",
    "tests/test_state.py",
    "tests/test_routes.py",
    "tests/test_linear.py",
    "tests/test_live_model.py",
    "tests/test_compositions.py",
    "tests/test_checkpoint.py",
    "tests/test_finer.py",
    "tests/test_reference.py",
    "tests/test_transform.py",
    "tests/test_plan.py",
    "tests/test_arguments.py",
    "tests/test_routing.py",
    "tests/test_swap.py",
    "tests/test_discovery.py",
    "tests/test_state_trees.py",
    "tests/test_never_silent.py",
    "tests/test_weight_copies.py",
    "tests/test_compile_steps.py",  # (slow: with --slow)
]
QUICK_TESTS = ["tests/test_reference.py"]
QUICK_DESELECT = ["compiled", "transformer"]  # tests left out by --quick (-k "not ...")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    file: str  # relative to fp8fn/
    edits: tuple  # ((old, new), ...): each `old` must occur exactly once


MUTATIONS = [
    # -- the per-tensor op (_ops/tensorwise.py) and its quantizer (_numerics/fp8.py) -------------
    Mutation(
        "e4m3-grad-output",
        "grad_output cast to e4m3 instead of e5m2",
        "_ops/roles.py",
        (
            (
                "return cast_to_fp8(grad_out, rows, E5M2), g_scale.reciprocal()",
                "return cast_to_fp8(grad_out, rows, E4M3), g_scale.reciprocal()",
            ),
            ("from .._numerics.fp8 import E5M2,", "from .._numerics.fp8 import E4M3, E5M2,"),
        ),
    ),
    Mutation(
        "margin-current",
        "margin dropped from the current-scaling fallback",
        "_ops/roles.py",
        (
            (
                "current = scale_from_amax(amaxes, fp8_max, margin)",
                "current = scale_from_amax(amaxes, fp8_max, 0)",
            ),
        ),
    ),
    Mutation(
        "bias-grad-no-float",
        "bias gradient summed in the output gradient's dtype (no .float())",
        "_ops/tensorwise.py",
        (
            (
                "grads[2] = grad_out.float().sum(0).to(b_dtype)",
                "grads[2] = grad_out.sum(0).to(b_dtype)",
            ),
        ),
    ),
    Mutation(
        "stored-scale-ignored",
        "the stored scale ignored (always current scaling)",
        "_ops/roles.py",
        (
            (
                "return current if newest is None else torch.where(newest > 0, stored, current)",
                "return current if newest is None else torch.where(newest > 0, current, current)",
            ),
        ),
    ),
    Mutation(
        "empty-history-uses-stored",
        "an empty history casts with the stored scale (1) instead of current scaling",
        "_ops/roles.py",
        (
            (
                "return current if newest is None else torch.where(newest > 0, stored, current)",
                "return current if newest is None else torch.where(newest >= 0, stored, current)",
            ),
        ),
    ),
    Mutation(
        "vmap-no-fold",
        "the op's vmap rule does not fold the batch (the generated per-member rule)",
        "_ops/tensorwise.py",
        (("out = _Fp8Linear.apply(rows", "out = _Fp8LinearOp.apply(rows"),),
    ),
    Mutation(
        "grad-output-observes-weight",
        "the grad_output observation is the weight's amax",
        "_ops/roles.py",
        (
            (
                "return torch.stack([x_amax, w_amax, g_amax], -1)",
                "return torch.stack([x_amax, w_amax, w_amax], -1)",
            ),
        ),
    ),
    Mutation(
        "no-saturation",
        "the saturating clamp removed from the cast",
        "_numerics/fp8.py",
        (
            (
                "return hp32.clamp(-fp8_max, fp8_max).to(dtype)",
                "return hp32.to(dtype)",
            ),
        ),
    ),
    Mutation(
        "saturate-inf",
        "casts saturate inf to +-max instead of keeping the overflow visible (NaN)",
        "_numerics/fp8.py",
        (
            (
                "hp32.nan_to_num_(nan=nan, posinf=nan, neginf=nan).clamp_(",
                "hp32.nan_to_num_(nan=nan).clamp_(",
            ),
            (
                "hp32.nan_to_num(nan=nan, posinf=nan, neginf=nan).clamp(",
                "hp32.nan_to_num(nan=nan).clamp(",
            ),
        ),
    ),
    # -- update and merge (_update.py) ----------------------------------------------------------
    Mutation(
        "merge-sums",
        "merge sums observations instead of taking their max",
        "_core/update.py",
        (
            (
                "amax_history=torch.maximum(\n"
                "            observed_only(obs_a.amax_history), observed_only(obs_b.amax_history)\n"
                "        ),",
                "amax_history=observed_only(obs_a.amax_history) + "
                "observed_only(obs_b.amax_history),",
            ),
        ),
    ),
    Mutation(
        "merge-min-scale",
        "merge takes the minimum of the `scale` leaf (all_reduce takes the max)",
        "_core/update.py",
        (
            (
                "scale=torch.maximum(obs_a.scale, obs_b.scale),",
                "scale=torch.minimum(obs_a.scale, obs_b.scale),",
            ),
        ),
    ),
    Mutation(
        "update-pushes-nonfinite",
        "update pushes NaN and inf observations",
        "_core/update.py",
        (("push = (amax > 0) & (amax < math.inf)", "push = amax != 0"),),
    ),
    Mutation(
        "roll-drops-newest",
        "history roll drops the newest entry instead of the oldest",
        "_core/update.py",
        (
            (  # (eager: each pushed row's window starts at its entry 1, as an unpushed one's)
                "push.flatten(), alpha=-1",
                "push.flatten(), alpha=0",
            ),
        ),
    ),
    Mutation(
        "most-recent-uses-max",
        '"most_recent" uses the max of the history',
        "_core/update.py",
        (
            (
                'peak = amax if state.amax_compute == "most_recent" else _max_of_amaxes(history)',
                "peak = _max_of_amaxes(history)",
            ),
        ),
    ),
    Mutation(
        "margin-update",
        "update recomputes the scale without the margin",
        "_core/update.py",
        (
            (
                "new_scale = scale_from_amax(peak, ROLE_FP8_MAX, state.margin)",
                "new_scale = scale_from_amax(peak, ROLE_FP8_MAX, 0)",
            ),
        ),
    ),
    Mutation(
        "update-scale-float32",
        "update computes fp8_max / (amax * 2**margin) in float32 instead of float64",
        "_core/update.py",
        (
            (
                # (`scale_from_amax`'s form, fp8_max * 2**-margin / amax, gives the same float32
                # bits in float32 as in float64: the documented form is the one that differs.)
                "new_scale = scale_from_amax(peak, ROLE_FP8_MAX, state.margin)",
                "new_scale = (torch.tensor(ROLE_FP8_MAX) / (peak * "
                "2.0**state.margin)).clamp(2.0**-149, 3.4028234663852886e38)",
            ),
        ),
    ),
    Mutation(
        "update-scale-float32-divided-twice",
        "update computes fp8_max / amax / 2**margin in float32 instead of float64",
        "_core/update.py",
        (
            (
                "new_scale = scale_from_amax(peak, ROLE_FP8_MAX, state.margin)",
                "new_scale = (torch.tensor(ROLE_FP8_MAX) / peak / "
                "2.0**state.margin).clamp(2.0**-149, 3.4028234663852886e38)",
            ),
        ),
    ),
    Mutation(
        "observation-check-cancels",
        "update sums an observation's older entries with their signs (+x and -x cancel)",
        "_core/update.py",
        (
            (
                "older = obs.amax_history[..., 1:].abs().sum() != 0",
                "older = obs.amax_history[..., 1:].sum() != 0",
            ),
        ),
    ),
    Mutation(
        "history-check-skipped",
        "update takes any history as amaxes >= 0 (its check skipped, not only for its own)",
        "_core/update.py",
        (("        if mark[0] is None:\n", "        if False:\n"),),
    ),
    Mutation(
        "stale-scale",
        "update pushes the amax but keeps the old scale",
        "_core/update.py",
        (
            (
                "scale = torch.where(push, new_scale, scale)",
                "scale = torch.where(push, scale, scale)",
            ),
        ),
    ),
    Mutation(
        "update-accepts-state",
        "update(state, state) accepted (the identity check dropped: a short history passes)",
        "_core/update.py",
        (
            (
                "if obs.amax_history is state.amax_history or known:",
                "if known:",
            ),
        ),
    ),
    # -- the state (_state.py) ------------------------------------------------------------------
    Mutation(
        "no-reuse-check",
        "the reuse check (one state in two recorded forward passes) removed",
        "_core/state.py",
        (("    if part in used:\n", "    if False:\n"),),
    ),
    Mutation(
        "check-scales-skipped",
        "the scale-validity check skipped (0, NaN, inf or negative scales accepted)",
        "_core/state.py",
        (("if not bool(((base > 0) & base.isfinite()).all()):", "if False:"),),
    ),
    Mutation(
        "unflatten-sorts-sites",
        "unflatten_state sorts the sites ('0', '1', '10', '2', ...: no longer fn.init's order)",
        "_core/state.py",
        (("sites = list(leaves)", "sites = sorted(leaves)"),),
    ),
    # -- the transform (_transform/), recompute (checkpoint.py, recompute.py), routing.py --------
    Mutation(
        "sites-call-order",
        "fn.init orders the sites by the example's call order, not by the module tree",
        "_transform/plan.py",
        (
            (
                "for p in plan.stateful for k in range(max(calls.get(p, 0), 1))",
                "for p in sorted(plan.stateful, key=lambda p: list(calls).index(p) if p in "
                "calls else len(calls)) for k in range(max(calls.get(p, 0), 1))",
            ),
        ),
    ),
    Mutation(
        "live-identity-only",
        "live-model routing by weight identity only (no `holder_of` fallback: swapped-in "
        "weights run in high precision)",
        "_transform/routing.py",
        (
            (
                "            layer = self.plan.holder_of(weight, transposed, self.held)",
                "            layer = None",
            ),
        ),
    ),
    Mutation(
        "recompute-live-buffers",
        "the checkpoint recompute runs on the live buffers (batch-norm statistics updated "
        "a second time)",
        "_transform/checkpoint.py",
        (("        if recomputing:", "        if False:"),),
    ),
    Mutation(
        "forward-on-buffer-copies",
        "under checkpoint_fn the forward too runs on copies of the buffers (batch-norm "
        "statistics never updated)",
        "_transform/checkpoint.py",
        (("        if recomputing:", "        if True:"),),
    ),
    Mutation(
        "observe-second-backward",
        "a second backward through one observed forward accepted (autograd sums the two)",
        "_core/observe.py",
        (("        if seen:", "        if False:"),),
    ),
    # -- the finer recipes (_finer.py) ----------------------------------------------------------
    Mutation(
        "finer-bias-grad-input-dtype",
        "finer recipes: the bias gradient rounded through the input's dtype (bf16 autocast)",
        "_ops/rowwise_blockwise_mx.py",
        (
            (
                "grad_b = g.float().sum(0).to(b_dtype)",
                "grad_b = g.float().sum(0).to(x_dtype).to(b_dtype)",
            ),
        ),
    ),
    # -- never silently wrong, part 4 (tests/test_never_silent.py) -------------------------------
    Mutation(
        "checkpoint-fn-prefix",
        "checkpoint_fn: `blocks.10` taken for a submodule of the chosen `blocks.1` (a path "
        "prefix, not a path)",
        "_transform/plan.py",
        (
            (
                'p == "" or name.startswith(p + ".") for p in chosen',
                'p == "" or name.startswith(p) for p in chosen',
            ),
        ),
    ),
    Mutation(
        "linear-bias-keyword",
        "F.linear's bias passed by keyword dropped",
        "_transform/forms.py",
        (
            (
                'bound["input"], bound["weight"], bound.get("bias"), False',
                'bound["input"], bound["weight"], None, False',
            ),
        ),
    ),
    Mutation(
        "autocast-default-device",
        "autocast read for the default device type (CUDA), not for the input's",
        "_ops/linear.py",
        (("    if torch.is_autocast_enabled(device):", "    if torch.is_autocast_enabled():"),),
    ),
    Mutation(
        "first-order-gradients-only",
        "the first-order guard covers the gradients but not the observation",
        "_ops/tensorwise.py",
        (
            (
                "return (*first_order_only(grads, x_amax, api=ctx.api), None, None)",
                "return (*first_order_only(grads[:3], x_amax, api=ctx.api), grads[3], None, None)",
            ),
        ),
    ),
    Mutation(
        "tied-shared-weight",
        "a tied converted layer runs with the shared weight itself (it becomes the other "
        "layer's call: its site, recipe and scales)",
        "_transform/swap.py",
        (("            out[prefix + name] = t.view_as(t)", "            out[prefix + name] = t"),),
    ),
    Mutation(
        "structure-not-reread",
        "the module's structure not re-read by apply (a layer replaced after transform runs "
        "in high precision, a tie made after it loses gradients)",
        "_transform/plan.py",
        (
            (
                "        for m, children, n_params, params in self.structure:",
                "        for m, children, n_params, params in self.structure[:0]:",
            ),
        ),
    ),
    Mutation(
        "computed-weight-accepted",
        "a weight made by a forward pre-hook (prune, weight_norm, spectral_norm) accepted",
        "_transform/layers.py",
        (
            (
                "        if isinstance(getattr(layer, attr, None), torch.Tensor):",
                "        if False:",
            ),
        ),
    ),
    Mutation(
        "addmm-options-ignored",
        "torch.addmm's beta, alpha or out on a layer's weight ignored (silently `bias + x @ W`)",
        "_transform/routing.py",
        (("                    if options:", "                    if False:"),),
    ),
    Mutation(
        "torch-checkpoint-around-apply-refused",
        "torch.utils.checkpoint around fn.apply: its recompute taken for a second observation",
        "_transform/arguments.py",
        (("        if not recomputing_in_torch_checkpoint():", "        if True:"),),
    ),
    Mutation(
        "mode-on-top",
        "fp8fn's routing mode entered above the user's TorchFunctionModes (they never see the "
        "converted layers' calls)",
        "_transform/transformed.py",
        (
            (
                "            innermost_function_mode(call),\n",
                "            call,\n",
            ),
        ),
    ),
]


# The sharded routes: functional FSDP and tensor parallel (`_parallel/dtensor.py`), FSDP2's float8
# all-gather (`_parallel/fsdp_gather.py`). Their tests are multi-rank and marked slow:
#   python tools/mutation.py --only NAME --tests tests/test_sharded.py tests/test_fsdp.py --slow
MUTATIONS += [
    Mutation(
        "fsdp-step1-local-weight-amax",
        "functional FSDP: an empty weight history casts with the shard's amax, not the whole's",
        "_parallel/dtensor.py",
        (("whole = (False, unobserved[1], False)", "whole = (False, False, False)"),),
    ),
    Mutation(
        "fsdp-grad-weight-summed",
        "functional FSDP: the float8 weight's gradient is the sum over ranks, not the mean",
        "_parallel/dtensor.py",
        (("local = local / dist.get_world_size(self.group)", "local = local"),),
    ),
    Mutation(
        "gather-param-grad-summed",
        "functional FSDP: a high-precision gathered parameter's gradient is summed over ranks",
        "_parallel/dtensor.py",
        (
            (
                "local = _ReduceScatter.apply(grad, ctx.group) / dist.get_world_size(ctx.group)",
                "local = _ReduceScatter.apply(grad, ctx.group)",
            ),
        ),
    ),
    Mutation(
        "max-over-ranks-every-role",
        "sharded routes: every role's amax max-reduced over the ranks (a rank's own rows too)",
        "_parallel/dtensor.py",
        (
            (
                "return torch.where(torch.tensor(mask, device=amaxes.device), whole, amaxes)",
                "return whole",
            ),
        ),
    ),
    Mutation(
        "tp-grad-output-local-amax",
        "tensor parallel: an empty grad_output history casts with the local shard's amax",
        "_parallel/dtensor.py",
        (("colwise and unobserved[2]),", "False),"),),
    ),
    Mutation(
        "tp-rowwise-bias-every-rank",
        "tensor parallel: RowwiseParallel's bias added on every rank (the partial sums add it "
        "world-size times)",
        "_parallel/dtensor.py",
        (("add_bias=colwise or mesh.get_local_rank() == 0,", "add_bias=True,"),),
    ),
    Mutation(
        "fsdp2-gathered-amax-first-rank",
        "float8 all-gather: the weight's observation is the first rank's shard's amax",
        "_parallel/fsdp_gather.py",
        (
            (
                "whole_amax = gathered.max() if scale.dim() == 0 else gathered.clone()",
                "whole_amax = gathered[0] if scale.dim() == 0 else gathered.clone()",
            ),
        ),
    ),
    Mutation(
        "fsdp2-backward-stale-scale",
        "float8 all-gather: the backward takes FSDP2's re-gathered bytes, cast with the last "
        "forward's scale, not its own forward's (0.3's bug)",
        "_parallel/fsdp_gather.py",
        (("if self.root._scale is self.scale:", "if True:"),),
    ),
]
# Issue 38: the grouped (experts) op, the filled fast path and its marks, copies of weights.
MUTATIONS += [
    Mutation(
        "amax-large-positive-only",
        "the large-tensor amax takes the max, not the larger magnitude of min and max",
        "_numerics/cpu_fast.py",
        (
            (
                "return torch.maximum(high, low.neg()).abs().float()",
                "return high.abs().float()",
            ),
        ),
    ),
    Mutation(
        "inplace-cast-inf-saturates",
        "the in-place cast (64K elements and more) clamps inf to +-max",
        "_numerics/fp8.py",
        (
            (
                "hp32.nan_to_num_(nan=nan, posinf=nan, neginf=nan).clamp_(",
                "hp32.nan_to_num_(nan=nan).clamp_(",
            ),
        ),
    ),
    Mutation(
        "grouped-grad-output-one-scale",
        "the grouped op casts every expert's output gradient with the first expert's scale",
        "_ops/grouped.py",
        (
            (
                "cast_grad_output(grad_out, g_amax, newest, stored, ctx.margin, ids)",
                "cast_grad_output(grad_out, g_amax, newest, stored, ctx.margin, ids * 0)",
            ),
        ),
    ),
    Mutation(
        "grouped-observation-roles-swapped",
        "the grouped op's observation gives the weight's amax as the input's",
        "_ops/grouped.py",
        (
            (
                "grads[3] = observation(x_amax, w_amax, g_amax)",
                "grads[3] = observation(w_amax, x_amax, g_amax)",
            ),
        ),
    ),
    Mutation(
        "grouped-rows-scale-shifted",
        "the grouped op casts each group's rows with the previous expert's input scale",
        "_ops/grouped.py",
        (
            (
                "x_fp8 = cast_to_fp8(x, per_row(x_scale, ids)[:, None], E4M3)",
                "x_fp8 = cast_to_fp8(x, per_row(x_scale, ids - 1)[:, None], E4M3)",
            ),
        ),
    ),
    Mutation(
        "grouped-grad-margin-dropped",
        "the grouped op's output-gradient scale without the margin",
        "_ops/grouped.py",
        (
            (
                "cast_grad_output(grad_out, g_amax, newest, stored, ctx.margin, ids)",
                "cast_grad_output(grad_out, g_amax, newest, stored, 0, ids)",
            ),
        ),
    ),
    Mutation(
        "grouped-forward-margin-dropped",
        "the grouped op's input and weight scales (empty history) without the margin",
        "_ops/grouped.py",
        (
            (
                "            margin,\n            (448.0, 448.0),",
                "            0,\n            (448.0, 448.0),",
            ),
        ),
    ),
    Mutation(
        "grouped-boundary-row-to-previous-group",
        "the grouped op gives each group's first row to the previous expert (searchsorted left)",
        "_ops/grouped.py",
        (
            (
                "offs.to(torch.int64), torch.arange(rows, device=offs.device), right=True",
                "offs.to(torch.int64), torch.arange(rows, device=offs.device), right=False",
            ),
        ),
    ),
    Mutation(
        "grouped-signed-amax",
        "the grouped op's per-expert amax is the largest value, not the largest magnitude",
        "_ops/grouped.py",
        (
            (
                "row_amax = hp.abs().amax(1).float() if hp.shape[1]",
                "row_amax = hp.amax(1).float() if hp.shape[1]",
            ),
        ),
    ),
    Mutation(
        "grouped-nan-amax-dropped",
        "a NaN in an expert's rows is not observed where the scatter max skips it (CUDA's may)",
        "_ops/grouped.py",
        (
            (
                'return torch.where(nan, float("nan"), out)[:experts]',
                "return out[:experts]",
            ),
        ),
    ),
    Mutation(
        "grouped-weight-grad-with-weight-scale",
        "the grouped op's weight gradient dequantized with the weight's scale, not the input's",
        "_ops/grouped.py",
        (
            (
                "weight_mm(g_fp8, x_fp8, g_inv, x_inv, offs, w_dtype, backend)",
                "weight_mm(g_fp8, x_fp8, g_inv, w_inv, offs, w_dtype, backend)",
            ),
        ),
    ),
    Mutation(
        "grouped-tail-rows-kept",
        "the one-call grouped forward (sm_90) keeps the rows past the last group unwritten",
        "_ops/grouped.py",
        (("    return torch.where((ids < experts)[:, None], out, 0.0)", "    return out"),),
    ),
    Mutation(
        "grouped-device-weight-grad-with-weight-scale",
        "the device grouped backward (sm_90, sm_100) dequantizes the weight gradient with the "
        "weight's scale",
        "_ops/grouped.py",
        (
            (
                "weight_mm_on_device(g_fp8, x_fp8, g_inv, x_inv, offs, w_dtype)",
                "weight_mm_on_device(g_fp8, x_fp8, g_inv, w_inv, offs, w_dtype)",
            ),
        ),
    ),
    Mutation(
        "grouped-device-rows-scale-shifted",
        "the device grouped backward scales each group's input-gradient rows with the previous "
        "expert's scales",
        "_ops/grouped_gemm.py",
        (
            (
                "inv = per_row(a_inv * b_inv, ids)[:, None]",
                "inv = per_row(a_inv * b_inv, ids - 1)[:, None]",
            ),
        ),
    ),
    Mutation(
        "grouped-device-tail-rows-kept",
        "the device grouped backward keeps the unwritten rows past the last group",
        "_ops/grouped_gemm.py",
        (
            (
                "torch.where((ids < b.shape[0])[:, None],",
                "torch.where((ids <= b.shape[0])[:, None],",
            ),
        ),
    ),
    Mutation(
        "grouped-device-empty-expert-kept",
        "the device grouped backward keeps the unwritten weight gradient of an expert with no row",
        "_ops/grouped_gemm.py",
        (
            (
                "has_rows = (offs > starts)[:, None, None]",
                "has_rows = (offs >= starts)[:, None, None]",
            ),
        ),
    ),
    Mutation(
        "keep-anchor-non-differentiable",
        "setup_context marks x_amax non-differentiable: the first-order guard has no anchor",
        "_ops/roles.py",
        (
            (
                "ctx.mark_non_differentiable(*output[1:-1])",
                "ctx.mark_non_differentiable(*output[1:])",
            ),
        ),
    ),
    Mutation(
        "grouped-nvfp4-rank-dropped",
        "grouped NVFP4: every rank rounds its gradients with rank 0's bits",
        "_ops/grouped_block_scaled.py",
        (("expert_keys, recipe, site, keys.process_rank())", "expert_keys, recipe, site, 0)"),),
    ),
    Mutation(
        "nvfp4-bias-grad-quantized",
        "NVFP4: the bias gradient summed from the quantized output gradient (a fused dbias)",
        "_ops/nvfp4.py",
        (
            (
                "grad_b = g.sum(0).to(b_dtype)",
                "grad_b = quantize_dequantize_nvfp4(g).sum(0).to(b_dtype)",
            ),
        ),
    ),
    Mutation(
        "fsdp-batched-scales-margin-dropped",
        "FSDP2 float8 gather: the weights' current scales computed in one batch without their "
        "shared margin",
        "_parallel/fsdp_gather.py",
        (
            (
                "scales = scale_from_amax(flat, FP8_MAX[E4M3], margins[0])",
                "scales = scale_from_amax(flat, FP8_MAX[E4M3], 0)",
            ),
        ),
    ),
    Mutation(
        "attention-aliases-kept-apart",
        "nn.MultiheadAttention: a key and value that FSDP2 hands over as two tensors of the same "
        "memory kept apart (three GEMMs of the packed in_proj, fn.init saw two)",
        "_transform/forms.py",
        (
            (
                "    if _aliases(key, value):\n        value = key",
                "    if False:\n        value = key",
            ),
        ),
    ),
    Mutation(
        "compiled-torch-checkpoint-not-refused",
        "the model's own torch.utils.checkpoint not refused under torch.compile (its body traced "
        "without fp8fn: float32, unobserved, silently)",
        "_transform/transformed.py",
        (("        if self._torch_checkpointed:", "        if False:"),),
    ),
    Mutation(
        "visit-by-path",
        "a layer's Visit looked up by its path, not reached through its weight (a frame the "
        "model calls once per layer guards on the path: a compile per layer)",
        "_transform/routing.py",
        (
            (
                "        visit = self._visit(layer.path) if visit is None else visit",
                "        visit = self._visit(layer.path)",
            ),
        ),
    ),
    Mutation(
        "weight-data-not-routed",
        "`F.linear(x, lin.weight.data)` not routed to the layer's site (summary said float8, "
        "it ran in float32)",
        "_transform/experts.py",
        (("    torch.detach,\n    torch.Tensor.data.__get__,\n)", "    torch.detach,\n)"),),
    ),
    Mutation(
        "update-obs-key-unchecked",
        "update takes a keyed state (a nonzero key) for an observation",
        "_core/update.py",
        (("            older = older | obs.key.any()", "            older = older"),),
    ),
    Mutation(
        "experts-negative-index-unwrapped",
        "an experts weight's negative index (`W[-1]`) not wrapped to its expert",
        "_transform/experts.py",
        (("            idx = idx % d.entry.experts", "            idx = idx"),),
    ),
    Mutation(
        "experts-bmm-one-row-per-id",
        "`bmm` with `W[ids]`: each id's group counted as one row, whatever the rows per id",
        "_transform/experts.py",
        (("offs = (counts * m).cumsum(0).int()", "offs = counts.cumsum(0).int()"),),
    ),
    Mutation(
        "experts-bmm-order-not-restored",
        "`bmm` with `W[ids]`: the rows left in expert order, not put back in the batch's order",
        "_transform/experts.py",
        (("    back = torch.argsort(perm)", "    back = perm"),),
    ),
    Mutation(
        "experts-out-dtype-converted",
        "a grouped GEMM with `out_dtype` converted (its output dtype dropped), not reported",
        "_transform/experts.py",
        (
            (
                'if bound.get("bias") is not None or bound.get("out_dtype") is not None:',
                'if bound.get("bias") is not None:',
            ),
        ),
    ),
    Mutation(
        "float8-gather-uneven-amax-rows",
        "float8 all-gather, experts the ranks do not divide: a rank's amaxes at rank 0's rows",
        "_parallel/fsdp_gather.py",
        (
            (
                "own[first : first + shard.shape[0]] = shard_amax",
                "own[: shard.shape[0]] = shard_amax",
            ),
        ),
    ),
    Mutation(
        "float8-gather-first-row-floor",
        "float8 all-gather: a rank's first expert from the unpadded shard size (floor)",
        "_parallel/fsdp_gather.py",
        (
            (
                "return mesh.get_local_rank() * ceil_div(rows, mesh.size())",
                "return mesh.get_local_rank() * (rows // mesh.size())",
            ),
        ),
    ),
    Mutation(
        "float8-gather-again-not-flipped",
        "float8 all-gather: the backward's re-gather of a transposed expert (`x @ W[e]`) left "
        "untransposed",
        "_parallel/fsdp_gather.py",
        (
            (
                "            return whole.transpose(-2, -1) if flipped else whole",
                "            return whole",
            ),
        ),
    ),
    Mutation(
        "float8-gather-again-not-keyed",
        "float8 all-gather: the backward's re-gather reused whatever scale it was made with",
        "_parallel/fsdp_gather.py",
        (
            (
                "if self._again is None or self._again[0] is not scale:",
                "if self._again is None:",
            ),
        ),
    ),
    Mutation(
        "filled-trusted-from-structure",
        "State.filled trusted from the tree structure (no mark on the values)",
        "_core/state.py",
        (("        return filled_mark(state.amax_history)[0]", "        return filled"),),
    ),
    Mutation(
        "marks-ignore-version",
        "a mark (valid scales, keys, filled) outlives an in-place change of the tensor",
        "_core/registries.py",
        (
            (
                "if fact is not None and version == tensor_version(u):",
                "if fact is not None:",
            ),
        ),
    ),
    Mutation(
        "filled-read-every-step",
        "update reads which histories are filled at every step while one is empty",
        "_core/update.py",
        (
            (
                "if known is not None and (reads >= FILLED_READS or all(known)):",
                "if known is not None and all(known):",
            ),
        ),
    ),
    Mutation(
        "filled-marks-all",
        "update marks every history filled, whatever it observed",
        "_core/update.py",
        (
            (
                "    mark_filled(history, filled, reads)",
                "    mark_filled(history, (True,) * len(filled), reads)",
            ),
        ),
    ),
    Mutation(
        "copy-of-layer-weight-not-followed",
        "a copy of a layer's weight (`.to`, `.clone`) not routed to its site",
        "_transform/tracking.py",
        (
            (
                "        for layer, _, bias, visit in self.given(source):",
                "        for layer, _, bias, visit in []:",
            ),
        ),
    ),
    Mutation(
        "checkpoint-zero-grads",
        "checkpoint_fn under plain autograd gives an unreached parameter zeros, not None",
        "_transform/checkpoint.py",
        (
            (
                "            allow_unused=True,  # None for an input",
                "            materialize_grads=True,\n"
                "            allow_unused=True,  # None for an input",
            ),
        ),
    ),
]
# Issue 30.12's classes on the sharded routes (run them as the block above; `bias-grad-no-float`,
# the op's bias gradient, is the bf16 bias class there too: one op serves every placement).
MUTATIONS += [
    Mutation(
        "sharded-margin-dropped",
        "functional FSDP and tensor parallel: the recipe's margin dropped (cast as margin 0)",
        "_parallel/dtensor.py",
        (('margin = getattr(recipe, "margin", 0)', "margin = 0"),),
    ),
    Mutation(
        "float8-gather-margin-dropped",
        "float8 all-gather: the weights' current-scaling scales without the margin",
        "_parallel/fsdp_gather.py",
        (
            (
                "scales = scale_from_amax(flat, FP8_MAX[E4M3], margins[0])",
                "scales = scale_from_amax(flat, FP8_MAX[E4M3], 0)",
            ),
            (
                "[scale_from_amax(a, FP8_MAX[E4M3], m) for a, m in zip(amaxes, margins)]",
                "[scale_from_amax(a, FP8_MAX[E4M3], 0) for a, m in zip(amaxes, margins)]",
            ),
        ),
    ),
    Mutation(
        "float8-gather-input-scale",
        "float8 all-gather: a weight's stored scale read from its site's input role",
        "_parallel/fsdp_gather.py",
        (("stored = state.scale[span, 1]", "stored = state.scale[span, 0]"),),
    ),
    Mutation(
        "float8-gather-frozen-trains",
        "float8_all_gather: a frozen weight (requires_grad=False) made trainable",
        "_parallel/fsdp_gather.py",
        (("requires_grad=weight.requires_grad", "requires_grad=True"),),
    ),
    Mutation(
        "amax-of-empty-shard",
        "the amax of an empty tensor (a rank holding no rows of a weight) not defined as 0",
        "_numerics/fp8.py",
        (("    if hp.numel() == 0:\n        return", "    if False:\n        return"),),
    ),
    Mutation(
        "amax-of-empty-shard-nonzero",
        "functional FSDP: a rank holding no rows of a weight observes a tiny nonzero amax, not 0 "
        "(a zero weight's history then fills with it where one process's stays empty)",
        "_numerics/fp8.py",
        (
            (
                "return hp.new_zeros((), dtype=torch.float32)",
                "return hp.new_full((), torch.finfo(torch.float32).tiny)",
            ),
        ),
    ),
    Mutation(
        "held-first-parameter",
        "a layer's held weight read as its module's first parameter (nn.MultiheadAttention's "
        "split k/v projections under FSDP2 run in high precision)",
        "_transform/layers.py",
        (
            (
                "return held(self.module, self.attrs[0])",
                "return next(iter(self.module.parameters()))",
            ),
        ),
    ),
]


class SetupError(Exception):
    pass


def mutate(root: Path, mutation: Mutation | None) -> None:
    """Copy the package under `root` and apply `mutation` to the copy."""
    target = root / "fp8fn"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "_fp8fn_mutation_check.py").write_text(_PLUGIN)
    if mutation is None:
        return
    path = target / mutation.file
    text = path.read_text()
    for old, new in mutation.edits:
        count = text.count(old)
        if count != 1:
            raise SetupError(
                f"mutation {mutation.name!r}: expected the pattern exactly once in "
                f"fp8fn/{mutation.file}, found it {count} times:\n    {old}\n"
                "The code moved: update the mutation in tools/mutation.py."
            )
        text = text.replace(old, new)
    path.write_text(text)


_PLUGIN = """\
import os

import pytest


def pytest_collection_finish(session):
    import fp8fn

    root = os.path.realpath(os.environ["FP8FN_MUTATION_ROOT"])
    if not os.path.realpath(fp8fn.__file__).startswith(root + os.sep):
        pytest.exit(
            f"mutation.py: the tests imported fp8fn from {fp8fn.__file__}, not the copy in {root}",
            returncode=3,
        )
"""


def environment(root: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO / "tests")])
    env["FP8FN_MUTATION_ROOT"] = str(root)
    env["COLUMNS"] = "400"  # pytest cuts the short summary's messages to the terminal's width
    env.setdefault("HYPOTHESIS_PROFILE", "ci")  # derandomized (tests/conftest.py): reproducible
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_import(root: Path) -> None:
    """The copy under `root`, not the working tree, is the `fp8fn` the tests import."""
    out = subprocess.run(
        [sys.executable, "-c", "import fp8fn; print(fp8fn.__file__)"],
        cwd=root,
        env=environment(root),
        capture_output=True,
        text=True,
    )
    where = out.stdout.strip()
    if out.returncode or not where.startswith(str(root)):
        raise SetupError(
            f"the tests would import fp8fn from {where or out.stderr!r}, not from the copy in "
            f"{root}: mutations would test the working tree."
        )


_FAILED = re.compile(r"^(FAILED|ERROR) (.+?)(?: - (.*))?$", re.MULTILINE)  # ids may hold spaces


def resolve_tests(tests: list) -> list[Path]:
    """Test files as absolute paths: relative to the repository, else to the current directory."""
    paths = []
    for t in tests:
        candidates = [Path(t)] if Path(t).is_absolute() else [REPO / t, Path.cwd() / t]
        found = next((c.resolve() for c in candidates if c.exists()), None)
        if found is None:
            raise SetupError(f"no test file {t!r} in {REPO} or in {Path.cwd()}.")
        paths.append(found)
    return paths


def run_tests(root: Path, tests: list, select: str | None, slow: bool, timeout: float):
    """Run pytest on the copy under `root`: (status, first failing test, its message, seconds)."""
    cmd = [sys.executable, "-m", "pytest", *map(str, tests)]
    cmd += ["-x", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "_fp8fn_mutation_check"]
    cmd += [f"--rootdir={REPO}", "--import-mode=importlib", "-W", "ignore"]
    if not slow:
        cmd += ["-m", "not slow"]
    if select:
        cmd += ["-k", select]
    start = time.monotonic()
    try:
        out = subprocess.run(
            cmd, cwd=root, env=environment(root), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", "", f"no result within {timeout:.0f} s", time.monotonic() - start
    seconds = time.monotonic() - start
    failed = _FAILED.search(out.stdout)
    if out.returncode == 0:
        return "passed", "", "", seconds
    if out.returncode == 3 and "mutation.py:" in out.stdout + out.stderr:
        raise SetupError((out.stdout + out.stderr).strip().splitlines()[-1])
    if failed:
        test = failed.group(2).split("tests/", 1)[-1]
        return "failed", test, (failed.group(3) or "").strip(), seconds
    tail = (out.stdout + out.stderr).strip().splitlines()[-5:]
    return f"rc {out.returncode}", "", " | ".join(tail), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="test_reference.py, fast cases")
    parser.add_argument("--tests", nargs="+", help="test files (relative to the repository)")
    parser.add_argument("--only", nargs="+", help="mutation names to run")
    parser.add_argument("-k", dest="select", help="pytest -k expression choosing tests")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    parser.add_argument("--slow", action="store_true", help="run tests marked slow too")
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds per mutant's pytest run (default: 3x the baseline's, at least 120)",
    )
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)

    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28} fp8fn/{m.file:24} {m.what}")
        return 0
    tests = args.tests or (QUICK_TESTS if args.quick else DEFAULT_TESTS)
    select = " and ".join(f"not {k}" for k in QUICK_DESELECT) if args.quick else None
    if args.select:
        select = f"({args.select})" + (f" and {select}" if select else "")
    mutations = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTATIONS}
        if unknown:
            print(f"unknown mutations: {sorted(unknown)}", file=sys.stderr)
            return 2
        mutations = [m for m in MUTATIONS if m.name in args.only]

    workdir = Path(tempfile.mkdtemp(prefix="fp8fn-mutation-"))
    rows = []
    started = time.monotonic()
    try:
        tests = resolve_tests(tests)
        # Every pattern first: a stale mutation aborts before anything runs.
        for i, m in enumerate(mutations):
            mutate(workdir / f"check{i}", m)
        baseline = workdir / "baseline"
        mutate(baseline, None)
        check_import(baseline)
        shown = " ".join(str(t.relative_to(REPO) if t.is_relative_to(REPO) else t) for t in tests)
        print(
            f"tests: {shown}"
            + ("" if args.slow else "  -m 'not slow'")
            + (f"  -k {select!r}" if select else "")
        )
        first = 2 * args.timeout if args.timeout else 3600.0
        status, test, message, seconds = run_tests(baseline, tests, select, args.slow, first)
        print(f"baseline (no mutation): {status} in {seconds:.0f} s", flush=True)
        if status != "passed":
            print(f"the unmutated package fails {test}: {message}", file=sys.stderr)
            return 2
        timeout = args.timeout or max(120.0, 3 * seconds)
        for i, m in enumerate(mutations):
            root = workdir / f"mutant{i}"
            mutate(root, m)
            status, test, message, seconds = run_tests(root, tests, select, args.slow, timeout)
            # caught only by a failing test, not by a crash or a timeout (of a rank, say)
            caught = (
                "yes" if status == "failed" else ("NO" if status == "passed" else f"NO ({status})")
            )
            rows.append((m, caught, test, message, seconds))
            print(f"  {m.name}: caught={caught} {test} ({seconds:.0f} s)", flush=True)
    except SetupError as e:
        print(f"setup error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"copies kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print("| mutation | caught? | by which test | how | s |")
    print("|---|---|---|---|---|")
    for m, caught, test, message, seconds in rows:
        how = message.replace("|", "/")[:90]
        by = f"`{test}`" if test else ""
        print(f"| {m.what} (`{m.name}`) | {caught} | {by} | {how} | {seconds:.0f} |")
    survivors = [m.name for m, caught, *_ in rows if caught.startswith("NO")]
    print(f"\n{len(rows) - len(survivors)} of {len(rows)} caught; survivors: {survivors or 'none'}")
    print(f"total {time.monotonic() - started:.0f} s")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
