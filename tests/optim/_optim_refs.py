"""Independent float64 NumPy implementations of the published update equations.

Each reference is a class with ``init(params)`` and ``step(grads, params) -> updates`` working on
dicts of float64 arrays. They are written from the papers / documented equations, not from
the library code.
"""

from __future__ import annotations

import numpy as np


class _Ref:
    def __init__(self, **hp):
        self.hp = hp
        self.t = 0

    def init(self, params):
        self.s = {k: self.init_leaf(v) for k, v in params.items()}
        return self

    def step(self, grads, params):
        self.t += 1
        out = {}
        for k in grads:
            out[k], self.s[k] = self.leaf(grads[k], params[k], self.s[k])
        return self.post(out, params)

    def post(self, updates, params):
        return updates


class Adam(_Ref):
    """Kingma & Ba 2015 (+ decoupled decay, Loshchilov & Hutter 2019; Nesterov: Dozat 2016)."""

    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p))

    def leaf(self, g, p, s):
        lr, b1, b2, eps = self.hp["lr"], self.hp.get("b1", 0.9), self.hp.get("b2", 0.999), \
            self.hp.get("eps", 1e-8)
        wd, nest = self.hp.get("wd", 0.0), self.hp.get("nesterov", False)
        m, v = s
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        t = self.t
        if nest:
            mh = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1 ** t)
        else:
            mh = m / (1 - b1 ** t)
        vh = v / (1 - b2 ** t)
        return -lr * (mh / (np.sqrt(vh) + eps) + wd * p), (m, v)


class AMSGrad(_Ref):
    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p), np.zeros_like(p))

    def leaf(self, g, p, s):
        lr, b1, b2, eps = self.hp["lr"], 0.9, 0.999, 1e-8
        m, v, vmax = s
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = np.maximum(vmax, v / (1 - b2 ** self.t))
        return -lr * (m / (1 - b1 ** self.t)) / (np.sqrt(vmax) + eps), (m, v, vmax)


class AdaMax(_Ref):
    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p))

    def leaf(self, g, p, s):
        lr, b1, b2, eps = self.hp["lr"], 0.9, 0.999, 1e-8
        m, u = s
        m = b1 * m + (1 - b1) * g
        u = np.maximum(b2 * u, np.abs(g) + eps)
        return -lr * m / (1 - b1 ** self.t) / u, (m, u)


class AdaBelief(_Ref):
    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p))

    def leaf(self, g, p, s):
        lr, b1, b2, eps, eps_root = self.hp["lr"], 0.9, 0.999, 1e-16, 1e-16
        m, sv = s
        m = b1 * m + (1 - b1) * g
        sv = b2 * sv + (1 - b2) * (g - m) ** 2 + eps_root
        mh = m / (1 - b1 ** self.t)
        sh = sv / (1 - b2 ** self.t)
        return -lr * mh / (np.sqrt(sh) + eps), (m, sv)


class RAdam(_Ref):
    """Liu et al. 2020."""

    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p))

    def leaf(self, g, p, s):
        lr, b1, b2, eps = self.hp["lr"], 0.9, 0.999, 1e-8
        m, v = s
        t = self.t
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh = m / (1 - b1 ** t)
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t * b2 ** t / (1 - b2 ** t)
        if rho >= 5.0:
            r = np.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            u = r * mh / (np.sqrt(v / (1 - b2 ** t)) + eps)
        else:
            u = mh
        return -lr * u, (m, v)


class Yogi(_Ref):
    """Zaheer et al. 2018."""

    def init_leaf(self, p):
        return (np.full_like(p, 1e-6), np.full_like(p, 1e-6))

    def leaf(self, g, p, s):
        lr, b1, b2, eps = self.hp["lr"], 0.9, 0.999, 1e-3
        m, v = s
        m = b1 * m + (1 - b1) * g
        v = v - (1 - b2) * np.sign(v - g * g) * g * g
        return -lr * (m / (1 - b1 ** self.t)) / (np.sqrt(v / (1 - b2 ** self.t)) + eps), (m, v)


class Lion(_Ref):
    """Chen et al. 2023."""

    def init_leaf(self, p):
        return np.zeros_like(p)

    def leaf(self, g, p, m):
        lr, b1, b2, wd = self.hp["lr"], 0.9, 0.99, self.hp.get("wd", 1e-3)
        c = np.sign(b1 * m + (1 - b1) * g)
        return -lr * (c + wd * p), b2 * m + (1 - b2) * g


class RMSProp(_Ref):
    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p))

    def leaf(self, g, p, s):
        lr, d, eps, centered = self.hp["lr"], 0.9, 1e-8, self.hp.get("centered", False)
        m, v = s
        v = d * v + (1 - d) * g * g
        m = d * m + (1 - d) * g
        denom = v - m * m if centered else v
        return -lr * g / np.sqrt(denom + eps), (m, v)


class Adagrad(_Ref):
    def init_leaf(self, p):
        return np.full_like(p, 0.1)

    def leaf(self, g, p, s):
        s = s + g * g
        return -self.hp["lr"] * g / np.sqrt(s + 1e-7), s


class AdaDelta(_Ref):
    """Zeiler 2012."""

    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p))

    def leaf(self, g, p, s):
        rho, eps = 0.9, 1e-6
        eg, ex = s
        eg = rho * eg + (1 - rho) * g * g
        dx = np.sqrt(ex + eps) / np.sqrt(eg + eps) * g
        ex = rho * ex + (1 - rho) * dx * dx
        return -self.hp["lr"] * dx, (eg, ex)


class SGD(_Ref):
    def init_leaf(self, p):
        return np.zeros_like(p)

    def leaf(self, g, p, buf):
        mom, nest = self.hp.get("momentum", 0.0), self.hp.get("nesterov", False)
        buf = g + mom * buf
        d = g + mom * buf if nest else buf
        return -self.hp["lr"] * d, buf


class Signum(_Ref):
    def init_leaf(self, p):
        return np.zeros_like(p)

    def leaf(self, g, p, m):
        m = 0.9 * m + 0.1 * g
        return -self.hp["lr"] * np.sign(m), m


class Rprop(_Ref):
    """Riedmiller & Braun 1993 (iRprop- variant: no step right after a sign change)."""

    def init_leaf(self, p):
        return (np.full_like(p, self.hp["lr"]), np.zeros_like(p))

    def leaf(self, g, p, s):
        step, prev = s
        prod = g * prev
        step = np.where(prod > 0, np.minimum(step * 1.2, 50.0),
                        np.where(prod < 0, np.maximum(step * 0.5, 1e-6), step))
        out = np.where(prod < 0, 0.0, prev)
        new_prev = np.where(prod < 0, 0.0, step * np.sign(g))
        return -out, (step, new_prev)


class Lamb(_Ref):
    """You et al. 2020."""

    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p))

    def leaf(self, g, p, s):
        lr, b1, b2, eps, wd = self.hp["lr"], 0.9, 0.999, 1e-6, self.hp.get("wd", 0.0)
        m, v = s
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1 ** self.t)) / (np.sqrt(v / (1 - b2 ** self.t)) + eps) + wd * p
        pn, rn = np.linalg.norm(p), np.linalg.norm(r)
        ratio = 1.0 if pn == 0 or rn == 0 else pn / rn
        return -lr * ratio * r, (m, v)


class Lars(_Ref):
    """You et al. 2017."""

    def init_leaf(self, p):
        return np.zeros_like(p)

    def leaf(self, g, p, buf):
        lr, wd, tc, mom = self.hp["lr"], self.hp.get("wd", 0.0), 0.001, 0.9
        d = g + wd * p
        pn, dn = np.linalg.norm(p), np.linalg.norm(d)
        ratio = 1.0 if pn == 0 or dn == 0 else tc * pn / dn
        buf = -lr * ratio * d + mom * buf
        return buf, buf


class NovoGrad(_Ref):
    """Ginsburg et al. 2019."""

    def init_leaf(self, p):
        return (np.zeros_like(p), 0.0)

    def leaf(self, g, p, s):
        lr, b1, b2, eps, wd = self.hp["lr"], 0.9, 0.25, 1e-6, 0.0
        m, v = s
        n2 = float(np.sum(g * g))
        v = n2 if self.t == 1 else b2 * v + (1 - b2) * n2
        a = g / (np.sqrt(v) + eps) + wd * p
        m = a if self.t == 1 else b1 * m + a
        return -lr * m, (m, v)


class SM3(_Ref):
    """Anil et al. 2019 (SM3-II) with momentum on the preconditioned gradient."""

    def init_leaf(self, p):
        return ([np.zeros(p.shape[i]) for i in range(p.ndim)], np.zeros_like(p))

    def leaf(self, g, p, s):
        accs, m = s
        if g.ndim == 1:
            nu = accs[0] + g * g
        else:
            mins = None
            for i, a in enumerate(accs):
                shape = [1] * g.ndim
                shape[i] = g.shape[i]
                e = a.reshape(shape)
                mins = e if mins is None else np.minimum(mins, e)
            nu = mins + g * g
        pre = np.where(nu > 0, g / np.sqrt(nu + 1e-8), 0.0)
        m = 0.9 * m + 0.1 * pre
        if g.ndim == 1:
            new = [nu]
        else:
            new = [nu.max(axis=tuple(j for j in range(g.ndim) if j != i)) for i in range(g.ndim)]
        return -self.hp["lr"] * m, (new, m)


class Adafactor(_Ref):
    """Shazeer & Stern 2018 with Optax's defaults (no momentum, clip 1, param scale)."""

    def init_leaf(self, p):
        if p.ndim >= 2 and sorted(p.shape)[-2] >= 128:
            d = np.argsort(p.shape)
            d1, d0 = int(d[-2]), int(d[-1])
            return ("f", np.zeros(np.delete(p.shape, d0)), np.zeros(np.delete(p.shape, d1)),
                    (d1, d0))
        return ("v", np.zeros_like(p))

    def leaf(self, g, p, s):
        beta = 1 - (self.t) ** -0.8
        g2 = g * g + 1e-30
        if s[0] == "f":
            _, r, c, (d1, d0) = s
            r = beta * r + (1 - beta) * g2.mean(axis=d0)
            c = beta * c + (1 - beta) * g2.mean(axis=d1)
            rd1 = d1 - 1 if d1 > d0 else d1
            vhat = np.expand_dims(r / r.mean(axis=rd1, keepdims=True), d0) * \
                np.expand_dims(c, d1)
            u = g / np.sqrt(vhat)
            s = ("f", r, c, (d1, d0))
        else:
            v = beta * s[1] + (1 - beta) * g2
            u = g / np.sqrt(v)
            s = ("v", v)
        rms = np.sqrt(np.mean(u * u))
        u = u / max(1.0, rms / 1.0)
        u = u * self.hp["lr"]
        u = u * max(np.sqrt(np.mean(p * p)), 1e-3)
        return -u, s


class Muon(_Ref):
    """Jordan et al. 2024: Nesterov momentum, Newton–Schulz (quintic) orthogonalisation;
    AdamW (Nesterov) for non-matrices."""

    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p))

    @staticmethod
    def ns(x, steps=5):
        a, b, c = 3.4445, -4.7750, 2.0315
        tr = x.shape[0] > x.shape[1]
        if tr:
            x = x.T
        x = x / (np.linalg.norm(x) + 1e-8)
        for _ in range(steps):
            A = x @ x.T
            x = a * x + (b * A + c * A @ A) @ x
        return x.T if tr else x

    def leaf(self, g, p, s):
        lr, t = self.hp["lr"], self.t
        m, v = s
        if g.ndim == 2:
            beta = 0.95
            m = beta * m + (1 - beta) * g
            mh = beta * m / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta ** t)
            o = self.ns(mh) * np.sqrt(max(1.0, g.shape[1] / g.shape[0]))
            return -lr * o, (m, v)
        b1, b2 = 0.9, 0.999
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1 ** t)
        return -lr * mh / (np.sqrt(v / (1 - b2 ** t)) + 1e-8), (m, v)


class Shampoo(_Ref):
    """Blocked Shampoo with RMSProp grafting and EMA momentum, as documented in cairn.optim."""

    def init_leaf(self, p):
        return {"L": None, "R": None, "PL": None, "PR": None, "v": np.zeros_like(p),
                "m": np.zeros_like(p)}

    @staticmethod
    def inv_root(a, eps):
        a = 0.5 * (a + a.T)
        w, q = np.linalg.eigh(a)
        ridge = eps * max(w.max(), 1e-30)
        w = np.maximum(w, 0) + ridge
        return (q * w ** -0.25) @ q.T

    def leaf(self, g, p, s):
        lr, b1, b2, eps, every = self.hp["lr"], 0.9, 0.999, 1e-6, self.hp.get("every", 2)
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        graft = g / (np.sqrt(s["v"]) + 1e-8)
        if g.ndim < 2:
            d = graft
        else:
            G = g.reshape(-1, g.shape[-1])
            if s["L"] is None:
                s["L"], s["R"] = np.zeros((G.shape[0],) * 2), np.zeros((G.shape[1],) * 2)
                s["PL"], s["PR"] = np.eye(G.shape[0]), np.eye(G.shape[1])
            s["L"] = b2 * s["L"] + (1 - b2) * G @ G.T
            s["R"] = b2 * s["R"] + (1 - b2) * G.T @ G
            if (self.t - 1) % every == 0:
                s["PL"], s["PR"] = self.inv_root(s["L"], eps), self.inv_root(s["R"], eps)
            D = (s["PL"] @ G @ s["PR"]).reshape(g.shape)
            dn = np.linalg.norm(D)
            d = D * (np.linalg.norm(graft) / dn if dn > 0 else 0.0)
        s["m"] = b1 * s["m"] + (1 - b1) * d
        return -lr * s["m"], s


class ScheduleFreeAdamW(_Ref):
    """Defazio et al. 2024 (constant lr, no warmup); params given are the y iterates."""

    def init(self, params):
        super().init(params)
        self.z = {k: v.copy() for k, v in params.items()}
        self.wsum = 0.0
        return self

    def init_leaf(self, p):
        return np.zeros_like(p)

    def step(self, grads, params):
        lr, b1, b2, eps = self.hp["lr"], 0.9, 0.999, 1e-8
        self.t += 1
        w = lr ** 2
        self.wsum += w
        ck = w / self.wsum
        out = {}
        for k in grads:
            v = b2 * self.s[k] + (1 - b2) * grads[k] ** 2
            self.s[k] = v
            z_old = self.z[k]
            z = z_old - lr * grads[k] / (np.sqrt(v / (1 - b2 ** self.t)) + eps)
            x_old = (params[k] - (1 - b1) * z_old) / b1
            x = (1 - ck) * x_old + ck * z
            y = b1 * x + (1 - b1) * z
            self.z[k] = z
            out[k] = y - params[k]
        return out


class ClipAdam(Adam):
    """clip_by_global_norm(c) before Adam."""

    def step(self, grads, params):
        c = self.hp["clip"]
        n = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        if n >= c:
            grads = {k: g / n * c for k, g in grads.items()}
        return super().step(grads, params)


class Fromage(_Ref):
    """Bernstein et al. 2020."""

    def init_leaf(self, p):
        return None

    def leaf(self, g, p, s):
        lr = self.hp["lr"]
        pn, gn = np.linalg.norm(p), np.linalg.norm(g)
        ratio = 1.0 if pn == 0 or gn == 0 else pn / gn
        return (p - lr * ratio * g) / np.sqrt(1 + lr ** 2) - p, s


class ScheduleFreeSGD:
    """Defazio et al. 2024 ("The Road Less Scheduled"), SGD form, with Optax's schedule
    conventions, written on explicit ``x`` and ``z`` sequences (not recovered from ``y``):

        gamma_t  = lr * min(t / warmup, 1)          (lr when no warmup), t = 1, 2, ...
        z_{t+1}  = z_t - gamma_{t-1} (g_t + wd y_t)  (the inner sgd's own count starts at 0)
        w_t      = (max_{i<=t} gamma_i)^p,  c_{t+1} = w_t / sum_{i<=t} w_i
        x_{t+1}  = (1 - c_{t+1}) x_t + c_{t+1} z_{t+1}
        y_{t+1}  = b1 x_{t+1} + (1 - b1) z_{t+1}     (the params the model sees)

    with x_1 = z_1 = y_1. ``step(g, y)`` returns the update ``y_{t+1} - y``.

    ``anchor_y``: before each step take ``x_t = (y - (1 - b1) z_t) / b1`` from the ``y`` the
    model holds (the identity above, as the reference PyTorch implementation does when
    only y and z are stored); used at low precision, where the stored y is the rounded one.
    """

    def __init__(self, lr, b1=0.9, warmup=None, wd=0.0, power=2.0, anchor_y=False):
        self.lr, self.b1, self.warmup, self.wd, self.power = lr, b1, warmup, wd, power
        self.anchor_y = anchor_y
        self.t = 0

    def gamma(self, t):
        return self.lr if self.warmup is None else self.lr * min(t / self.warmup, 1.0)

    def init(self, params):
        self.x = {k: v.copy() for k, v in params.items()}
        self.z = {k: v.copy() for k, v in params.items()}
        self.wsum, self.max_lr = 0.0, 0.0
        return self

    def y(self):
        return {k: self.b1 * self.x[k] + (1 - self.b1) * self.z[k] for k in self.x}

    def step(self, grads, params):
        self.t += 1
        self.max_lr = max(self.max_lr, self.gamma(self.t))
        w = self.max_lr ** self.power
        self.wsum += w
        c = w / self.wsum if self.wsum > 0 else 0.0
        lr_z = self.gamma(self.t - 1)
        if self.anchor_y:
            self.x = {k: (params[k] - (1 - self.b1) * self.z[k]) / self.b1 for k in params}
        for k in grads:
            self.z[k] = self.z[k] - lr_z * (grads[k] + self.wd * params[k])
            self.x[k] = (1 - c) * self.x[k] + c * self.z[k]
        y = self.y()
        return {k: y[k] - params[k] for k in y}


class Lookahead:
    """Zhang et al. 2019: the fast weights take ``inner`` steps; every ``k``-th step the slow
    weights move ``phi <- phi + alpha (theta - phi)`` and the fast ones restart from them
    (with ``reset``, the inner optimizer restarts from its initial state too).

    ``step(g, fast, slow)`` returns ``(fast_update, slow_update)``.
    """

    def __init__(self, make_inner, k, alpha, reset=False):
        self.make_inner, self.k, self.alpha, self.reset, self.t = make_inner, k, alpha, reset, 0

    def init(self, fast):
        self.inner = self.make_inner().init(fast)
        return self

    def step(self, grads, fast, slow):
        self.t += 1
        u = self.inner.step(grads, fast)
        theta = {k: fast[k] + u[k] for k in fast}
        if self.t % self.k:
            return u, {k: np.zeros_like(v) for k, v in slow.items()}
        new_slow = {k: slow[k] + self.alpha * (theta[k] - slow[k]) for k in slow}
        if self.reset:
            self.inner = self.make_inner().init(fast)
        return ({k: new_slow[k] - fast[k] for k in fast},
                {k: new_slow[k] - slow[k] for k in slow})


def run_against(name, ours, ref, dtype, shapes, steps=20):
    """Feed ``ours`` (a GradientTransformation) and ``ref`` (a float64 reference object with
    ``init``/``step``) the same random gradients and params for ``steps`` steps.

    Both see exactly the values cast to ``dtype``; params then follow the reference's
    float64 trajectory. Returns ``(steps, elements)`` errors relative to the step's largest
    reference update, after checking every update keeps the params' dtype and shape."""
    import zlib

    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(zlib.crc32(name.encode()))
    params = {k: rng.normal(size=s) for k, s in shapes.items()}

    def cast(t):
        return {k: jnp.asarray(v, dtype) for k, v in t.items()}

    def f64(t):
        return {k: np.asarray(v, np.float64) for k, v in t.items()}

    state = ours.init(cast(params))
    ref = ref.init(f64(cast(params)))
    update = jax.jit(ours.update)
    errs = []
    for _ in range(steps):
        g = cast({k: rng.normal(size=s) for k, s in shapes.items()})
        p = cast(params)
        g64, p64 = f64(g), f64(p)
        u, state = update(g, state, p)
        ru = ref.step(g64, p64)
        scale = max(float(np.max(np.abs(v))) for v in ru.values()) + 1e-12
        errs.append(np.concatenate([np.abs(np.asarray(u[k], np.float64) - ru[k]).ravel() / scale for k in ru]))
        for k in u:
            assert u[k].dtype == dtype, f"{name}: update dtype at {k} is {u[k].dtype}"
            assert u[k].shape == tuple(shapes[k]), f"{name}: update shape at {k} is {u[k].shape}"
        params = {k: p64[k] + ru[k] for k in params}
    return np.stack(errs)
