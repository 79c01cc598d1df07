"""NumPy per-leaf versions of what the benchmarks time: the same math, in place, no numbaccum.

They are the baseline a careful NumPy user would write: in-place ufuncs into preallocated
buffers, one leaf at a time.
"""

from __future__ import annotations

import numpy as np

K = 4
LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-8
DECAY = 0.9


class NumpyMultiStepsAdam:
    """Per-leaf MultiSteps(adam), or MultiSteps(chain(clip_by_global_norm(max_norm), adam)), with
    in-place ufuncs and preallocated buffers.

    ``update(grads, block=None)``: each ufunc runs over a whole leaf, with a leaf-sized scratch
    buffer. ``block=n``: each leaf is processed in runs of ``n`` elements, all ufuncs of a step
    on one run before the next, so the scratch and the run's acc/mu/nu slices stay in cache.
    Both modes give the same bits, so they can share one state (and its memory) in a benchmark.
    With ``max_norm``, an emitting step accumulates every leaf first (the clip needs the norm of
    the whole mean), then clips and runs Adam leaf by leaf.
    """

    def __init__(self, like_leaves, k=K, lr=LR, b1=B1, b2=B2, eps=EPS, max_norm=None):
        self.k, self.lr, self.b1, self.b2, self.eps = k, lr, b1, b2, eps
        self.max_norm = max_norm
        self.dtype = like_leaves[0].dtype
        self.acc = [np.zeros_like(x) for x in like_leaves]
        self.mu = [np.zeros_like(x) for x in like_leaves]
        self.nu = [np.zeros_like(x) for x in like_leaves]
        self.upd = [np.zeros_like(x) for x in like_leaves]
        # np.zeros (calloc) rather than zeros_like: the returned zero tree is never written,
        # so its pages need not count against the benchmark's memory.
        self.zeros = [np.zeros(x.shape, x.dtype) for x in like_leaves]
        n_scratch = max([1] + [x.size for x in like_leaves])
        self._t1 = np.empty(n_scratch, self.dtype)
        self._t2 = np.empty(n_scratch, self.dtype)
        self.mini_step = 0
        self.count = 0  # Adam's step count (number of emissions)

    def update(self, grads, block=None):
        """``grads``: list of leaves. Returns the list of update leaves (owned by self)."""
        dt = self.dtype.type
        n = self.mini_step
        inv = dt(n + 1)  # acc += (g - acc) / (n + 1), a true division as optax does
        emit = n == self.k - 1
        cf = None
        if emit:
            self.count += 1
            c = self.count
            cf = dict(
                b1=dt(self.b1),
                omb1=dt(1 - self.b1),
                b2=dt(self.b2),
                omb2=dt(1 - self.b2),
                bc1=dt(1 - self.b1**c),
                bc2=dt(1 - self.b2**c),
                eps=dt(self.eps),
                mlr=dt(-self.lr),
            )
        clipping = emit and self.max_norm is not None
        for i, g in enumerate(grads):
            for sl in self._runs(g.size, block):
                self._accumulate(g, i, sl, inv)
                if emit and not clipping:
                    self._adam(i, sl, cf)
        if clipping:
            sq = 0.0
            for a in self.acc:
                flat = a.reshape(-1)
                sq += float(np.dot(flat, flat))  # float32 dot products, summed in float64
            norm = np.sqrt(sq)
            clip = None if norm < self.max_norm else (dt(norm), dt(self.max_norm))
            for i, g in enumerate(grads):
                for sl in self._runs(g.size, block):
                    self._adam(i, sl, cf, clip)
        if emit:
            self.mini_step = 0
            return self.upd
        self.mini_step = n + 1
        return self.zeros

    @staticmethod
    def _runs(size, block):
        if block is None or block >= size:
            return [slice(None)]
        return [slice(s, min(s + block, size)) for s in range(0, size, block)]

    def _accumulate(self, g, i, sl, inv):
        g = g.reshape(-1)[sl]
        acc = self.acc[i].reshape(-1)[sl]
        t1 = self._t1[: g.size]
        np.subtract(g, acc, out=t1)
        np.divide(t1, inv, out=t1)
        np.add(acc, t1, out=acc)

    def _adam(self, i, sl, cf, clip=None):
        acc = self.acc[i].reshape(-1)[sl]
        if clip is not None:  # (acc / norm) * max_norm in place: acc is reset below anyway
            np.divide(acc, clip[0], out=acc)
            np.multiply(acc, clip[1], out=acc)
        mu = self.mu[i].reshape(-1)[sl]
        nu = self.nu[i].reshape(-1)[sl]
        u = self.upd[i].reshape(-1)[sl]
        m = acc.size
        t1 = self._t1[:m]
        t2 = self._t2[:m]
        # mu = b1 * mu + (1 - b1) * acc
        np.multiply(acc, cf["omb1"], out=t1)
        np.multiply(mu, cf["b1"], out=mu)
        np.add(mu, t1, out=mu)
        # nu = b2 * nu + (1 - b2) * acc^2
        np.multiply(acc, acc, out=t1)
        np.multiply(t1, cf["omb2"], out=t1)
        np.multiply(nu, cf["b2"], out=nu)
        np.add(nu, t1, out=nu)
        # u = -lr * (mu / bc1) / (sqrt(nu / bc2) + eps)
        np.divide(nu, cf["bc2"], out=t2)
        np.sqrt(t2, out=t2)
        np.add(t2, cf["eps"], out=t2)
        np.divide(mu, cf["bc1"], out=u)
        np.divide(u, t2, out=u)
        np.multiply(u, cf["mlr"], out=u)
        acc.fill(0)


class NumpyEma:
    """Per-leaf ema with debias, in place."""

    def __init__(self, leaves: list[np.ndarray]) -> None:
        self.ema = [np.zeros_like(x) for x in leaves]
        self.out = [np.zeros_like(x) for x in leaves]
        self.tmp = np.empty(max(x.size for x in leaves), leaves[0].dtype)
        self.count = 0

    def update(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        t = grads[0].dtype.type
        self.count += 1
        bc = t(1) - t(DECAY) ** self.count
        for g, e, out in zip(grads, self.ema, self.out):
            tmp = self.tmp[: g.size].reshape(g.shape)
            e *= t(DECAY)
            np.multiply(g, t(1 - DECAY), out=tmp)
            e += tmp
            np.divide(e, bc, out=out)
        return self.out


class NumpyClipByGlobalNorm:
    """Per-leaf clip_by_global_norm into preallocated outputs: the norm from per-leaf dot
    products in float64, then ``(g / norm) * max_norm`` leaf by leaf (optax's order)."""

    def __init__(self, leaves: list[np.ndarray], max_norm: float) -> None:
        self.out = [np.zeros_like(x) for x in leaves]
        self.max_norm = max_norm

    def update(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        sq = 0.0
        for g in grads:
            flat = g.reshape(-1)
            sq += float(np.dot(flat, flat))  # float32 dot products, summed in float64
        norm = np.sqrt(sq)
        t = grads[0].dtype.type
        for g, o in zip(grads, self.out):
            if norm < self.max_norm:
                np.copyto(o, g)
            else:
                np.divide(g, t(norm), out=o)
                o *= t(self.max_norm)
        return self.out
