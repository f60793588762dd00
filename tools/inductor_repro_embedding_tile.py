"""Inductor CPU bug, reproduced without fp8fn: a 2-D tiled kernel's indirect atomic add.

Found with torch 2.13.0+cpu (x86-64, AVX-512, gcc). Run: `python
tools/inductor_repro_embedding_tile.py [--threads N] [--config KEY=VALUE ...]`; it prints PASS
or FAIL and exits 0 or 1, so that it can be rerun after each torch upgrade.

What is wrong: with more than one intra-op thread, inductor fuses an embedding's dense backward
(an `index_put` with `accumulate=True`, lowered to `atomic_add_vec` when the loop is parallel)
into the 2-D tiled loop (`transpose_mxn<float, 16, 16>`) that writes a transposed copy (here the
float8 cast of a tensor, widened, for a matmul that takes it column-major). The tile vectorises
along the tokens (x0) and loops over the features (x1_inner); the scatter's index is generated as

    tmpbuf[x0_inner] = x1 + 2L*x1_inner + 32L*idx[x0_inner];

where `x1 + x1_inner + 32L*idx[x0_inner]` is right: the tile's inner offset is applied twice.
The gradient rows get values at the wrong columns, and past the buffer's end for the last rows
(AddressSanitizer: heap-buffer-overflow in the generated kernel; in a larger graph glibc aborts
with "malloc(): unaligned tcache chunk detected"). With one thread the serial (non-atomic) store
path is taken and the result is right.

Known upstream: pytorch/pytorch#191837, "tile2d atomic_add double-applying the inner itervar
offset"; PR pytorch/pytorch#191861 skips the second `transform_indexing`. 2.13.0 has the bug.

The pattern needs, in one fused kernel: the scatter-add, a transposed store of a pointwise chain
of at least two ops ending in a float8 cast (`nan_to_num` then the cast), and a reduction over
the same tensor (the amax). fp8fn's per-tensor recipes produce it in the compiled backward of a
model whose first layer norm follows a token embedding (delayed scaling with filled histories:
the input's cast is recomputed in the backward with its stored scale, next to the amax).
"""

import argparse
import ast
import sys

import torch

V, N, D = 32, 16, 32  # vocabulary, tokens, features


def f(g, w, x, idx, a):
    """(embedding gradient (V, D), a matmul with x's float8 copy (8, D), amax of x * w)."""
    e_grad = torch.ops.aten.embedding_dense_backward(g * w, idx, V, -1, False)
    h = x * w
    x8 = h.nan_to_num().to(torch.float8_e4m3fn)
    return e_grad, a @ x8.t().float().t(), h.abs().amax()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", nargs="*", default=[], help="inductor KEY=VALUE (a literal)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for item in args.config:
        key, value = item.split("=")
        setattr(torch._inductor.config, key, ast.literal_eval(value))
    gen = torch.Generator().manual_seed(0)
    inputs = (
        torch.randn(N, D, generator=gen),
        torch.randn(D, generator=gen),
        torch.randn(N, D, generator=gen),
        torch.randint(0, V, (N,), generator=gen),
        torch.randn(8, N, generator=gen),
    )
    eager = f(*inputs)
    compiled = torch.compile(f)(*inputs)
    diffs = [(e - c).abs().max().item() for e, c in zip(eager, compiled)]
    ok = torch.allclose(eager[0], compiled[0], rtol=1e-5, atol=1e-5)
    print(f"torch {torch.__version__}, {args.threads} threads: max |eager - compiled| = {diffs}")
    print("PASS" if ok else "FAIL: wrong embedding gradient (tile2d atomic_add index)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
