"""Compile fp8fn's Triton kernels to cubins for the given CUDA archs, without a GPU (Triton's
bundled ptxas): `python tests/_triton_cubins.py 90 100` prints `{arch: [compiled, failed]}` as
JSON, then one line per failure. Run with `TRITON_INTERPRET=0` (the kernels must be JIT
functions, not the interpreter's). tests/test_triton_cubins.py runs it in the slow tier.

One variant per kernel, dtype pair and launch geometry (2 kernels x 3 input dtypes x 2 float8
formats x 2 geometries = 24 per arch: the transposing kernels' 64 x 64 tiles with 4 warps, the
flat kernels' 4096-element blocks with 8 warps, as `triton_jit._allocate` launches them), each
with every other feature on (the cast, the observation, delayed scaling), sizes as int32; and
the flat bf16 ones with int64 sizes (a tensor past 2**31 elements): 28 per arch. All 120
constexpr variants take ~2 s each on 2 cores, over 2 minutes per arch.
"""

import itertools
import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp8fn._kernels import triton_jit as kernels
from fp8fn._numerics.fp8 import E4M3, E5M2, FP8_MAX

_POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
_FP8 = {E4M3: "*fp8e4nv", E5M2: "*fp8e5"}
_FEATURES = {"CAST": True, "FINAL": False, "OBSERVE": True, "DELAYED": True}
_GEOMETRIES = (  # (TRANSPOSE, BLOCK, num_warps)
    (True, kernels._TILE, kernels._TILE_WARPS),
    (False, kernels._BLOCK, kernels._WARPS),
)


def variants():
    """`(name, kernel, signature, constexprs, num_warps)` of the variants compiled."""
    kinds = itertools.product(
        (kernels.cast_amax_kernel, kernels.cast_from_amax_kernel), _GEOMETRIES, _POINTER, _FP8
    )
    for kernel, (transpose, block, warps), hp, fp8 in kinds:
        constants = {**kernels._format(fp8), "FP8_MAX": FP8_MAX[fp8], "BLOCK": block}
        constants["TRANSPOSE"] = transpose
        # sizes past 2**31 elements come as int64 (Triton specializes): the flat bf16 kernels
        for size in ("i32", "i64") if not transpose and hp is torch.bfloat16 else ("i32",):
            signature, constexprs = {}, {}
            for i, arg in enumerate(kernel.arg_names):
                if arg.isupper():
                    signature[arg] = "constexpr"
                    constexprs[(i,)] = _FEATURES.get(arg, constants.get(arg))
                elif arg == "hp_ptr":
                    signature[arg] = _POINTER[hp]
                elif arg in ("out_ptr", "out_t_ptr"):
                    signature[arg] = _FP8[fp8]
                elif arg.endswith("_ptr"):
                    signature[arg] = "*fp32"
                else:  # the sizes, and the margin (a float)
                    signature[arg] = "fp32" if arg == "margin" else size
            name = f"{kernel.__name__}[{hp}->{fp8}, TRANSPOSE={transpose}, sizes {size}]"
            yield name, kernel, signature, constexprs, warps


def main(archs: list[int]) -> None:
    counts, failures = {}, []
    for arch in archs:
        done = failed = 0
        for name, kernel, signature, constexprs, warps in variants():
            try:
                compiled = triton.compile(
                    ASTSource(kernel, signature, constexprs),
                    target=GPUTarget("cuda", arch, 32),
                    options={"num_warps": warps},
                )
                assert compiled.asm["cubin"], name
                done += 1
            except Exception as e:  # noqa: BLE001 (reported, one line per failure)
                failed += 1
                failures.append(f"sm_{arch} {name}: {type(e).__name__}: {str(e)[:200]!r}")
        counts[arch] = [done, failed]
    print(json.dumps(counts))
    print("\n".join(failures))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
