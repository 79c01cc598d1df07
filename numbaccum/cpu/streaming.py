"""Streaming (non-temporal) stores for the CPU driver's large outputs.

A plain store first reads the cache line it writes (write-allocate): an output that is only
written costs a read and a write per element. A streaming store writes whole lines without
reading them and without evicting what the caches hold, which is what an output larger than the
last-level cache wants (`numbaccum._config.STREAM_BYTES`).

LLVM vectorises no loop holding a streaming store its vector width does not align, and numba's
array accesses promise only the element's alignment: a formula's loop with one runs scalar
(measured: 2.5x slower for a scale with its division). So the driver's streaming variant
(`numbaccum.cpu.driver`) computes a block of the output into a small scratch buffer with the
usual vectorised loop, and `stream_copy` writes the block out: elements one by one up to a
32-byte boundary, then 32-byte vectors with ``!nontemporal`` (``vmovntps``), then the tail.

Streaming stores are weakly ordered: the thread that made them runs `sfence` before the
parallel region ends, so the next kernel, on any thread, reads what they wrote. x86-64 only
(`available`): ``sfence`` is an x86 instruction; elsewhere the driver stores as usual.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["BLOCK", "available", "sfence", "stream_copy"]

BLOCK = 1024  # elements a streaming kernel computes into scratch at a time: 4-8 KiB, in L1
_VECTOR = 32  # bytes per streaming store (an AVX register; a cache line is two of them)


def available() -> bool:
    """Whether this machine's kernels may use streaming stores (x86-64)."""
    return _X86_64


_X86_64 = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def stream_copy(typingctx, dst, start, src, count):
    """``dst[start:start + count] = src[:count]`` with streaming stores (both 1-D, contiguous,
    of one float dtype, or uint16: a bfloat16 buffer's bits; no bounds check: the driver's
    loops stay inside both)."""
    ok = (
        isinstance(dst, types.Array)
        and isinstance(src, types.Array)
        and dst.ndim == src.ndim == 1
        and dst.dtype == src.dtype
        and (isinstance(dst.dtype, types.Float) or dst.dtype == types.uint16)
        and isinstance(start, types.Integer)
        and isinstance(count, types.Integer)
    )
    if not ok:
        return None

    def codegen(context, builder, sig, args):
        dty, startty, sty, countty = sig.args
        d = context.make_array(dty)(context, builder, args[0])
        s = context.make_array(sty)(context, builder, args[2])
        elt = context.get_data_type(dty.dtype)
        size = context.get_abi_sizeof(elt)
        i64 = ir.IntType(64)
        const = lambda v: ir.Constant(i64, v)  # noqa: E731
        count = context.cast(builder, args[3], countty, types.int64)
        dst0 = builder.gep(d.data, [context.cast(builder, args[1], startty, types.int64)])
        src0 = s.data
        # Elements before the first 32-byte boundary of the destination, one by one.
        misaligned = builder.and_(builder.ptrtoint(dst0, i64), const(_VECTOR - 1))
        head = builder.udiv(
            builder.and_(builder.sub(const(_VECTOR), misaligned), const(_VECTOR - 1)), const(size)
        )
        head = builder.select(builder.icmp_signed("<", count, head), count, head)
        with cgutils.for_range(builder, head) as loop:
            i = loop.index
            builder.store(builder.load(builder.gep(src0, [i])), builder.gep(dst0, [i]))
        width = _VECTOR // size
        vty = ir.VectorType(elt, width)
        nvec = builder.sdiv(builder.sub(count, head), const(width))
        hint = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, nvec) as loop:
            k = builder.add(head, builder.mul(loop.index, const(width)))
            v = builder.load(builder.bitcast(builder.gep(src0, [k]), vty.as_pointer()), align=size)
            store = builder.store(v, builder.bitcast(builder.gep(dst0, [k]), vty.as_pointer()), align=_VECTOR)
            store.set_metadata("nontemporal", hint)
        tail = builder.add(head, builder.mul(nvec, const(width)))
        with cgutils.for_range(builder, builder.sub(count, tail)) as loop:
            i = builder.add(tail, loop.index)
            builder.store(builder.load(builder.gep(src0, [i])), builder.gep(dst0, [i]))
        return context.get_dummy_value()

    return types.void(dst, start, src, count), codegen


@intrinsic
def sfence(typingctx):
    """Orders this thread's streaming stores before every later store (x86's ``sfence``)."""

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.sfence"), [])
        return context.get_dummy_value()

    return types.void(), codegen
