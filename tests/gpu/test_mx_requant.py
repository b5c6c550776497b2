"""The MX -> e4m3 1x128 re-expression on the GPU (fp16 products and the hardware's e4m3 conversions, which the
interpreter does not run): bit-exact against the module's plain-torch ``reference`` with blocks far apart (rounding
on e4m3's steps), NaN blocks, zero rows and extreme scales."""

from __future__ import annotations

import pytest
import torch

from fly_lightning.kernels.triton._mx_requant import reference, requantize
from fly_lightning.quant import formats

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spread", [3, 12])
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_matches_the_reference_bit_for_bit(fmt, spread):
    r, k = 300, 1024
    x = torch.randn(r, k // 32, 32, device="cuda")
    x = (x * torch.exp2(torch.randint(-spread, spread + 1, (r, k // 32, 1), device="cuda").float())).view(r, k)
    a, a_s = formats.to_mx(x, fmt)
    a_s = a_s.view(torch.uint8).clone()
    a_s[0, 1], a_s[1, 4:8], a_s[3, :4] = 255, 254, 0  # NaN block, 2^127 group, 2^-127 group
    a_s = a_s.view(torch.float8_e8m0fnu)
    a = a.clone()
    a[2] = 0  # a zero row
    qa, sa, qb, sb = requantize(a, a_s, fmt, a, a_s, fmt)
    want_q, want_s = reference(a, a_s, fmt)
    for q, sc in ((qa, sa), (qb, sb.t())):
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(sc, want_s)
