"""The host side of a lowered prim_func, replayed in Python: which kernels it launches, with which grid
and arguments, under which host branches, and the workspaces it allocates.

TVM splits a CUDA prim_func into device kernels and a host function that binds the arguments,
evaluates the launch dimensions and calls each kernel (`T.call_ffi_kernel`). The host function's
TVMScript is Python syntax: HostProgram parses it with `ast` and interprets the statements of its
compute scope (`with T.attr({"compute_scope": ...})`):
  name: T.let[...] = expr                   a scalar (CSE temporaries, derived shapes)
  name = T.decl_buffer(..., data=b.data)    another view of buffer b (same memory); also name = b.view(...)
  name = T.alloc_buffer((extent,), dtype)   a device workspace (fresh memory filled with 0xff bytes)
  if cond: ... else: ...                    host branches (e.g. the GEMV's n <= 8 launch)
  T.call_ffi_kernel("kernel", args..., launch dims..., launch_params=[...])
"""
from __future__ import annotations

import ast
import numpy as np


class TEval:
    """The `T.` functions of host expressions, on Python ints (C semantics where they differ)."""

    @staticmethod
    def min(a, b):
        return min(a, b)

    @staticmethod
    def max(a, b):
        return max(a, b)

    @staticmethod
    def Div(a, b):
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q

    truncdiv = Div

    @staticmethod
    def FloorDiv(a, b):
        return a // b

    floordiv = FloorDiv

    @staticmethod
    def FloorMod(a, b):
        return a % b

    floormod = FloorMod

    @staticmethod
    def truncmod(a, b):
        return a - TEval.Div(a, b) * b

    @staticmethod
    def Cast(_dt, x):
        return int(x)

    @staticmethod
    def Select(c, a, b):
        return a if c else b

    if_then_else = Select

    @staticmethod
    def int64(x):
        return int(x)

    int32 = uint32 = uint64 = int64

    @staticmethod
    def bool(x):
        return bool(x)


def _call_name(node) -> str | None:
    """'alloc_buffer' for T.alloc_buffer(...), etc."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _const(node):
    return node.value if isinstance(node, ast.Constant) else None


class HostProgram:
    """The compute scope of every host function of a lowered module, ready to replay."""

    def __init__(self, script: str):
        self.bodies: dict[str, list] = {}
        tree = ast.parse(script)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                scope = self._compute_scope(node.body)
                if scope is not None:
                    self.bodies[node.name] = scope

    @classmethod
    def _compute_scope(cls, stmts):
        for s in stmts:
            if isinstance(s, ast.With):
                ctx = s.items[0].context_expr
                if (isinstance(ctx, ast.Call) and _call_name(ctx) == "attr" and ctx.args and isinstance(ctx.args[0], ast.Dict)
                        and any(_const(k) == "compute_scope" for k in ctx.args[0].keys)):
                    return s.body
                inner = cls._compute_scope(s.body)
                if inner is not None:
                    return inner
            elif isinstance(s, ast.If):
                inner = cls._compute_scope(s.body) or cls._compute_scope(s.orelse)
                if inner is not None:
                    return inner
        return None

    def kernel_names(self, func: str) -> list[str]:
        """Every kernel the host function may launch (all branches), in source order."""
        return [_const(n.args[0]) for s in self.bodies[func] for n in ast.walk(s)
                if isinstance(n, ast.Call) and _call_name(n) == "call_ffi_kernel"]

    def launches(self, func: str, env: dict, buffers: dict) -> list[tuple[str, list, dict]]:
        """[(kernel, argument values, {launch param: extent})] of prim_func `func` in launch order.

        env: scalar values by name (grows with the lets); buffers: arrays by buffer name (grows with the
        views and workspaces). A pointer argument's value is the array."""
        if func not in self.bodies:
            raise KeyError(f"no host function {func!r} (have {sorted(self.bodies)})")
        out: list = []
        self._run(self.bodies[func], env, buffers, {}, out)
        return out

    def _eval(self, node, env):
        return eval(compile(ast.Expression(node), "<host>", "eval"), {"T": TEval}, env)  # noqa: S307

    def _run(self, stmts, env, buffers, views, out):
        """views: {view name: the buffer it views}, to name the caller's buffer in errors."""
        for s in stmts:
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None:
                env[s.target.id] = self._eval(s.value, env)
            elif isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                self._buffer(s.targets[0].id, s.value, env, buffers, views)
            elif isinstance(s, ast.If):
                self._run(s.body if self._eval(s.test, env) else s.orelse, env, buffers, views, out)
            elif isinstance(s, ast.With):
                self._run(s.body, env, buffers, views, out)
            elif isinstance(s, ast.Expr) and _call_name(s.value) == "call_ffi_kernel":
                out.append(self._launch(s.value, env, buffers, views))

    def _buffer(self, name, call, env, buffers, views):
        kind = _call_name(call)
        kw = {k.arg: k.value for k in call.keywords}
        src = None
        if kind == "decl_buffer":
            data = kw.get("data")
            if isinstance(data, ast.Attribute) and data.attr == "data" and isinstance(data.value, ast.Name):
                src = data.value.id
        elif kind == "view" and isinstance(call.func.value, ast.Name):
            src = call.func.value.id
        if src is not None:
            views[name] = views.get(src, src)
            if src in buffers:
                buffers[name] = buffers[src]
        elif kind == "alloc_buffer":
            shape = self._eval(call.args[0], env)
            dtype = _const(call.args[1]) if len(call.args) > 1 else _const(kw.get("dtype")) or "float32"
            nbytes = int(np.prod(shape)) * _itemsize(dtype or "float32")
            buffers[name] = np.full(max(nbytes, 1), 0xFF, np.uint8)

    def _launch(self, call, env, buffers, views):
        kernel = _const(call.args[0])
        kw = {k.arg: k.value for k in call.keywords}
        params = [_const(x) for x in kw["launch_params"].elts]
        vals = []
        for a in call.args[1:]:
            if isinstance(a, ast.Attribute) and a.attr == "data" and isinstance(a.value, ast.Name):
                if a.value.id not in buffers:
                    raise KeyError(f"kernel {kernel} reads buffer {views.get(a.value.id, a.value.id)!r}: pass it "
                                   "(arrays by buffer name)")
                vals.append(buffers[a.value.id])
            else:
                vals.append(int(self._eval(a, env)))
        dims = dict(zip(params, vals[len(vals) - len(params):], strict=True))
        return kernel, vals[:len(vals) - len(params)], dims


def _itemsize(dtype: str) -> int:
    bits = "".join(ch for ch in dtype if ch.isdigit())
    return max(1, int(bits) // 8) if bits else 4
