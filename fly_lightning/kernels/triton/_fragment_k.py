"""K in the order of wgmma's bf16 register fragment, for loops whose converted weights are the MMA's register operand.

A sum over K may run in any order. Summing each 128-wide K step in the order the register fragment holds it
(``fragment_k``) makes each lane's fragment values of a row one natural run of 32 elements: one vector load of MX
bytes and one scale per lane, decoded in place and renamed into the fragment (``to_fragment_order``) with no trip
through shared memory. The other operand is read in the same order (``fragment_k`` offsets). Both helpers are plain
index arithmetic and reshapes, so the interpreter runs them as the GPU does.
"""

from __future__ import annotations

import triton
import triton.language as tl

STEP = 128  # K elements per step: 8 slices of the bf16 MMA's K = 16


@triton.jit
def fragment_k(BLOCK_K: tl.constexpr):
    """Natural K offset (within a 128-wide step) at each MMA K index ``f = 16 j + 8 h + 2 c + p``: element
    ``32 c + 4 j + 2 h + p``. In the fragment, lane ``c = lane % 4`` of a row holds pairs ``p`` at ``2 c`` and
    ``2 c + 8`` of every 16-wide slice ``j``: under this order, the row's natural elements ``[32 c, 32 c + 32)``."""
    tl.static_assert(BLOCK_K == 128)
    f = tl.arange(0, BLOCK_K)
    return 32 * ((f // 2) % 4) + 4 * (f // 16) + 2 * ((f // 8) % 2) + f % 2


@triton.jit
def to_fragment_order(v):
    """Rows ``[R, 128]`` in natural K order to ``fragment_k``'s order: (c, j, h, p) -> (j, h, c, p), a renaming of
    each lane's registers once the compiler loads lane ``c``'s natural run into them."""
    R: tl.constexpr = v.shape[0]
    tl.static_assert(v.shape[1] == 128)
    return tl.reshape(tl.permute(tl.reshape(v, (R, 4, 8, 2, 2)), (0, 2, 3, 1, 4)), (R, 128))
