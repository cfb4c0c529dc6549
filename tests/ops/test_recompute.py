"""`recompute_except_kernels`: a region recomputed in the backward except its kept kernels, against the plain call."""

from __future__ import annotations

import weakref

import pytest
import torch

from hybridlm.ops.recompute import kept_kernel, on_contiguous, recompute_except_kernels

LAUNCHES = {"scan": 0, "other": 0}


def _scan_launch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A stand-in for a scan kernel: a weighted cumulative sum over steps, counted (its last output by weak
    reference)."""
    LAUNCHES["scan"] += 1
    out = torch.cumsum(x * w, dim=1)
    LAUNCHES["last"] = weakref.ref(out)
    return out


def _other_launch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    LAUNCHES["other"] += 1
    return torch.cumsum(x * w, dim=1)


@torch.library.custom_op("hybridlm_test::recompute_scan", mutates_args=())
def _scan(x: torch.Tensor, w: torch.Tensor, other: bool) -> torch.Tensor:
    return kept_kernel(_other_launch if other else _scan_launch, x, w)


def _scan_setup(ctx, inputs, output):
    x, w, _ = inputs
    ctx.save_for_backward(x, w)


def _scan_backward(ctx, dout):
    x, w = ctx.saved_tensors
    g = dout.flip(1).cumsum(1).flip(1)  # d/d(x w) of a cumulative sum
    return g * w, (g * x).sum((0, 1)), None


_scan.register_autograd(_scan_backward, setup_context=_scan_setup)


class Region:
    """prepare -> scan -> output, with the preparation's calls counted (it runs again in the backward). `after`: what
    follows the scan ("scale": times 2, which keeps nothing; "none": the scan's output itself; "product": times a
    weight, which keeps the scaled output, computed from the scan's; "both": the scan's output and that product)."""

    def __init__(self, w_prep: torch.Tensor, w_scan: torch.Tensor, after: str = "scale"):
        self.w_prep, self.w_scan, self.after = w_prep, w_scan, after
        self.prepared = 0
        self.other_on_call = None  # the call number whose scan launches `_other_launch` (a nondeterministic region)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.prepared += 1
        u = torch.sin(h) * self.w_prep  # [B, T, C]: kept by the scan in the plain call
        s = _scan(u, self.w_scan, self.prepared == self.other_on_call)
        if self.after == "none":
            return s
        if self.after == "both":  # the scan's output, alive after the forward, and a product computed from it
            return s, (s * 2.0) * self.w_prep
        return s * 2.0 if self.after == "scale" else (s * 2.0) * self.w_prep


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 7, 5, generator=g, dtype=dtype, requires_grad=True)
    w_prep = torch.randn(5, generator=g, dtype=dtype, requires_grad=True)
    w_scan = torch.randn(5, generator=g, dtype=dtype, requires_grad=True)
    return h, w_prep, w_scan


def _run(recompute: bool, *, retain: bool = False):
    h, w_prep, w_scan = _inputs()
    region = Region(w_prep, w_scan)
    LAUNCHES.update(scan=0, other=0)
    out = recompute_except_kernels(region, h) if recompute else region(h)
    dout = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    out.backward(dout, retain_graph=retain)
    grads = [t.grad.clone() for t in (h, w_prep, w_scan)]
    if retain:  # a second backward through the same graph recomputes (and replays) again
        for t in (h, w_prep, w_scan):
            t.grad = None
        out.backward(dout)
        grads += [t.grad for t in (h, w_prep, w_scan)]
    return out.detach(), grads, region.prepared, LAUNCHES["scan"]


def test_values_and_gradients_equal_the_plain_call():
    out, grads, prepared, launches = _run(recompute=True)
    out_plain, grads_plain, prepared_plain, launches_plain = _run(recompute=False)
    assert torch.equal(out, out_plain)
    for g, g_plain in zip(grads, grads_plain):
        assert torch.equal(g, g_plain)
    assert (prepared_plain, launches_plain) == (1, 1)
    # The preparation runs again in the backward; the kept kernel does not.
    assert (prepared, launches) == (2, 1)


def test_a_second_backward_replays_again():
    out, grads, prepared, launches = _run(recompute=True, retain=True)
    _, grads_plain, _, _ = _run(recompute=False)
    for g, g_plain in zip(grads, grads_plain + grads_plain):
        assert torch.equal(g, g_plain)
    assert (prepared, launches) == (3, 1)


def test_the_region_keeps_its_inputs_not_what_feeds_the_kernel():
    """The storages autograd keeps after the forward, outside the region's own checkpoint hooks: in the plain call the
    scan keeps sin(h) * w_prep and the product keeps sin(h); the region keeps h (its input, for the recomputation)
    and none of its intermediates. Empty tensors are not counted: torch 2.11's checkpoint saves an empty marker
    tensor of its own under the caller's hooks."""
    kept = {}
    for recompute in (False, True):
        h, w_prep, w_scan = _inputs()
        region = Region(w_prep, w_scan)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (t.numel() and saved.append(t.data_ptr()), t)[1],
                                                   lambda t: t):
            out = recompute_except_kernels(region, h) if recompute else region(h)
        params = {t.data_ptr() for t in (w_prep, w_scan)}
        kept[recompute] = {ptr for ptr in saved if ptr not in params} - {h.data_ptr()}
        out.sum().backward()
    assert len(kept[False]) == 2  # sin(h) (for the product's gradient) and sin(h) * w_prep (for the scan's)
    assert kept[True] == set()


def test_a_region_that_calls_another_kernel_on_recomputation_raises():
    h, w_prep, w_scan = _inputs()
    region = Region(w_prep, w_scan)
    region.other_on_call = 2  # the recomputation launches a different kernel
    out = recompute_except_kernels(region, h)
    with pytest.raises(RuntimeError, match="same order each time"):
        out.sum().backward()


def test_outside_a_region_the_kernel_just_runs():
    h, w_prep, w_scan = _inputs()
    LAUNCHES.update(scan=0)
    _scan(h, w_scan, False)
    _scan(h, w_scan, False)
    assert LAUNCHES["scan"] == 2


def test_a_kernel_output_nothing_keeps_is_freed_after_the_forward():
    """The region holds its kernels' outputs by weak reference: the scan's output, which only the scaling reads, is
    freed after the forward as in the plain call, and the gradients stay exact (its stand-in feeds nothing kept)."""
    for recompute in (False, True):
        h, w_prep, w_scan = _inputs()
        region = Region(w_prep, w_scan)
        out = recompute_except_kernels(region, h) if recompute else region(h)
        assert LAUNCHES["last"]() is None
        out.sum().backward()
    _, grads, _, _ = _run(recompute=True)
    _, grads_plain, _, _ = _run(recompute=False)
    for g, g_plain in zip(grads, grads_plain):
        assert torch.equal(g, g_plain)


def test_a_kernel_output_changed_in_place_after_the_forward_raises():
    h, w_prep, w_scan = _inputs()
    out = recompute_except_kernels(Region(w_prep, w_scan, after="none"), h)
    out.mul_(3.0)  # the plain call's gradients would still be right: the scan keeps nothing of its output
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        out.sum().backward()


def test_a_saved_tensor_computed_from_a_freed_output_shows_as_nan():
    """Outside the contract: (s * 2) * w keeps s * 2, computed from the scan's output s, which nothing keeps. Its
    stand-in is NaN, so the gradient that reads it is NaN, not silently wrong; the one that does not is exact."""
    h, w_prep, w_scan = _inputs()
    recompute_except_kernels(Region(w_prep, w_scan, after="product"), h).sum().backward()
    assert torch.isnan(w_prep.grad).all()
    assert torch.isfinite(w_scan.grad).all()


def test_a_kernel_output_still_alive_is_handed_back():
    """The caller holds the scan's output s, so the recomputation gets s itself: the product's saved s * 2 is
    recomputed from the real values and every gradient equals the plain call's."""
    grads = {}
    for recompute in (False, True):
        h, w_prep, w_scan = _inputs()
        region = Region(w_prep, w_scan, after="both")
        s, product = recompute_except_kernels(region, h) if recompute else region(h)
        (s.sum() + product.sum()).backward()
        grads[recompute] = [t.grad for t in (h, w_prep, w_scan)]
    for g, g_plain in zip(grads[True], grads[False]):
        assert torch.equal(g, g_plain)


def _strided_launch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A stand-in for a launcher that needs contiguous inputs (as the Triton scans do)."""
    assert x.is_contiguous()
    LAUNCHES["strided"] = LAUNCHES.get("strided", 0) + 1
    return torch.cumsum(x * w, dim=1)


@torch.library.custom_op("hybridlm_test::recompute_strided_scan", mutates_args=())
def _strided_scan(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return kept_kernel(on_contiguous(_strided_launch), x, w)


_strided_scan.register_autograd(_scan_backward, setup_context=lambda ctx, inputs, output: _scan_setup(
    ctx, (*inputs, False), output))


def _copies(events) -> int:
    """The copies (`aten::clone`, `aten::copy_`) among a profile's operators, nested calls included (a custom op's
    own ops too, which a dispatch mode would not see)."""
    return sum(e.count for e in events.key_averages() if e.key in ("aten::clone", "aten::copy_"))


def test_a_strided_input_is_copied_inside_the_kept_call_only():
    """`on_contiguous`: the launcher gets a contiguous copy of a strided input, made inside the kept call, so the
    recomputation's replay copies nothing (a copy made before `kept_kernel` would be made again and thrown away);
    one wrapper per launcher; the gradients are the plain call's."""
    assert on_contiguous(_strided_launch) is on_contiguous(_strided_launch)
    grads, copies_in_backward = {}, {}
    for recompute in (False, True):
        h, w_prep, w_scan = _inputs()

        def region(h):
            u = (torch.sin(h) * w_prep).transpose(0, 1)  # [T, B, C]: strided
            return _strided_scan(u, w_scan) * 2.0

        LAUNCHES["strided"] = 0
        out = recompute_except_kernels(region, h) if recompute else region(h)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            out.sum().backward()
        assert LAUNCHES["strided"] == 1
        copies_in_backward[recompute] = _copies(profile)
        grads[recompute] = [t.grad for t in (h, w_prep, w_scan)]
    assert copies_in_backward[True] == copies_in_backward[False]  # the recomputation adds none
    for plain, recomputed in zip(grads[False], grads[True]):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)
