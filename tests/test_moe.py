"""The per-expert float8 grouped GEMM (`fp8fn._ops.grouped`) against a float64 per-expert
reference loop written from DESIGN.md's formulas (scale = fmax / amax, saturating cast, GEMM of
the casts divided by both scales)."""

import pytest
import torch

from fp8fn._ops.grouped import grouped_mm

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _q(hp, scale, dtype, fmax):
    """float64 value of `hp * scale` saturated to +-fmax and rounded to `dtype`."""
    return (hp.double() * scale).clamp(-fmax, fmax).to(dtype).double()


def _scale(amax, fmax, margin=0):
    return torch.tensor(fmax / (amax * 2.0**margin), dtype=torch.float64).float().double()


def _reference(x, w, ends, g, stored=None):
    """Per-expert float64 loop: `(out, grad_x, grad_w, observations (E, 3))`."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    gx, gw = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(w.shape, dtype=torch.float64)
    obs = torch.zeros(w.shape[0], 3, dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        xe, ge = x[start:end], g[start:end]
        wa = w[e].abs().max().item()
        obs[e, 1] = wa
        if end > start:
            xa, ga = xe.abs().max().item(), ge.abs().max().item()
            obs[e, 0], obs[e, 2] = xa, ga
            if stored is None:
                xs, ws, gs = _scale(xa, 448.0), _scale(wa, 448.0), _scale(ga, 57344.0)
            else:
                xs, ws, gs = (stored[e, i].double() for i in range(3))
            xq, wq, gq = _q(xe, xs, E4, 448.0), _q(w[e], ws, E4, 448.0), _q(ge, gs, E5, 57344.0)
            out[start:end] = xq @ wq.T / (xs * ws)
            gx[start:end] = gq @ wq / (gs * ws)
            gw[e] = gq.T @ xq / (gs * xs)
        start = end
    return out, gx, gw, obs


def _case(ends, experts=4, k=32, n=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = ends[-1]
    x = torch.randn(rows, k, generator=gen) * torch.linspace(0.5, 4.0, rows)[:, None]
    w = torch.randn(experts, n, k, generator=gen) * torch.arange(1.0, experts + 1)[:, None, None]
    g = torch.randn(rows, n, generator=gen)
    return x, w, torch.tensor(ends, dtype=torch.int32), g


def _run(x, w, offs, g, newest=None, stored=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    if newest is not None:
        newest = newest.clone().requires_grad_()
    out = grouped_mm(x, w, offs, newest, stored)
    grads = torch.autograd.grad(out, [x, w] + ([newest] if newest is not None else []), g)
    return (out, *grads)


def _close(got, want):
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ends", [[5, 12, 20, 27], [0, 9, 9, 16]])
def test_current_scaling_matches_float64_reference(ends):
    x, w, offs, g = _case(ends)
    out, gx, gw = _run(x, w, offs, g)
    r_out, r_gx, r_gw, _ = _reference(x, w, ends, g)
    _close(out, r_out)
    _close(gx, r_gx)
    _close(gw, r_gw)


def test_delayed_scaling_uses_stored_scales_and_observes_per_expert():
    ends = [6, 6, 15, 22]  # expert 1 receives no token
    x, w, offs, g = _case(ends, seed=1)
    newest = torch.ones(4, 3)
    stored = torch.tensor([[50.0, 30.0, 9000.0], [40.0, 20.0, 8000.0],
                           [60.0, 25.0, 7000.0], [35.0, 10.0, 6000.0]])
    out, gx, gw, obs = _run(x, w, offs, g, newest, stored)
    r_out, r_gx, r_gw, r_obs = _reference(x, w, ends, g, stored)
    _close(out, r_out)
    _close(gx, r_gx)
    _close(gw, r_gw)
    assert torch.equal(obs.double(), r_obs.float().double())


def test_idle_expert_observes_zero_input_and_grad_output():
    """0 = not observed: `update` keeps the idle expert's input and grad_output histories."""
    ends = [7, 7, 7, 12]
    x, w, offs, g = _case(ends, seed=2)
    _, _, gw, obs = _run(x, w, offs, g, torch.zeros(4, 3), torch.zeros(4, 3))
    for e in (1, 2):
        assert obs[e, 0].item() == 0.0 and obs[e, 2].item() == 0.0
        assert obs[e, 1].item() == w[e].abs().max().item()
        assert torch.equal(gw[e], torch.zeros_like(gw[e]))
    assert obs[0, 0].item() == x[:7].abs().max().item()
    assert obs[3, 2].item() == g[7:12].abs().max().item()


def test_saturation_and_bfloat16_output_dtype():
    ends = [3, 8]
    x, w, offs, g = _case(ends, experts=2, seed=3)
    x = x.bfloat16()
    stored = torch.full((2, 3), 1e4)  # far too large: values saturate to +-448
    out = grouped_mm(x, w.bfloat16(), offs, torch.ones(2, 3), stored)
    assert out.dtype == torch.bfloat16
    ref = _reference(x.float(), w.bfloat16().float(), ends, g, stored)[0]
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_rows_past_the_last_group_are_zero_without_gradient():
    x, w, offs, g = _case([4, 9, 9, 14], seed=4)
    x = torch.cat([x, torch.randn(3, x.shape[1])])
    g = torch.cat([g, torch.randn(3, g.shape[1])])
    out, gx, _ = _run(x, w, offs, g)
    assert torch.equal(out[14:], torch.zeros_like(out[14:]))
    assert torch.equal(gx[14:], torch.zeros_like(gx[14:]))
    _close(out[:14], _reference(x[:14], w, [4, 9, 9, 14], g[:14])[0])


def test_torch_func_grad_gives_the_same_gradients_and_observations():
    ends = [3, 10, 10, 18]
    x, w, offs, g = _case(ends, seed=5)
    newest, stored = torch.ones(4, 3), torch.full((4, 3), 20.0)

    def loss(w, newest):
        return (grouped_mm(x, w, offs, newest, stored) * g).sum()

    gw, obs = torch.func.grad(loss, argnums=(0, 1))(w, newest)
    _, _, r_gw, r_obs = _run(x, w, offs, g, newest, stored)
    assert torch.equal(gw, r_gw) and torch.equal(obs, r_obs)


def test_second_order_raises():
    x, w, offs, g = _case([5, 11], experts=2, seed=6)
    w = w.requires_grad_()
    (gw,) = torch.autograd.grad((grouped_mm(x, w, offs) * g).sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="higher-order derivatives"):
        torch.autograd.grad(gw.square().sum(), w)


def test_autocast_casts_x_first_and_outputs_its_dtype():
    x, w, offs, g = _case([6, 13], experts=2, seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_mm(x, w, offs)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, grouped_mm(x.bfloat16(), w, offs))


def test_nan_in_one_group_is_observed_by_that_expert_only():
    ends = [4, 9, 15]
    x, w, offs, g = _case(ends, experts=3, seed=8)
    x[6, 3] = float("nan")
    _, _, _, obs = _run(x, w, offs, g, torch.ones(3, 3), torch.full((3, 3), 10.0))
    assert obs[1, 0].isnan()
    assert obs[0, 0].item() == x[:4].abs().max().item()
    assert obs[2, 0].item() == x[9:15].abs().max().item()
