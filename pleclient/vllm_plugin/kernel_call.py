"""One launch of one of vLLM's own Triton kernels, held as data until it runs.

The row decoders (``mxfp8``, ``nvfp4``) decode served rows with the very
kernel stock vLLM decodes its table with, so that the bits are stock's. Held
as data, the same launch can also be compiled for a GPU on a machine that has
none (``compile_for``): Triton's NVIDIA backend and its ``ptxas`` come with
the wheel. That matters because a kernel compiles on a GPU otherwise than
under Triton's interpreter, the only way it runs on CPU: the interpreter
executes Python branches as Python, while the compiler builds every branch
whose condition is not a ``tl.constexpr``. vLLM 0.33's ``_engram_lookup_kernel``
takes ``SORTED`` as a runtime argument on CUDA, so its sorted branch is
compiled too, and a ``None`` for ``sorted_dst`` fails there (and only there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelCall:
    """``kernel[grid](*args, **kwargs)``, not yet run."""

    kernel: Any  # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def launch(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)

    def compile_for(self, arch: int, warp_size: int = 32) -> Any:
        """Compile this launch for an NVIDIA GPU of compute capability ``arch``
        (90: H100, H200, GH200; 121: GB10) without one, and return Triton's
        compiled kernel. The arguments give the signature as Triton's launcher
        would derive it: tensors as pointers, numbers by their width, ``None``
        and ``tl.constexpr`` parameters as constants."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import mangle_type

        params = self.kernel.params
        named = dict(zip((p.name for p in params), self.args, strict=False))
        unknown = set(self.kwargs) - {p.name for p in params}
        if len(self.args) > len(params) or unknown:
            raise TypeError(
                f"{self.kernel.__name__} takes {[p.name for p in params]}; "
                f"got {len(self.args)} positional arguments and {sorted(self.kwargs)}"
            )
        named.update(self.kwargs)
        signature: dict[str, str] = {}
        constants: dict[tuple[int, ...], Any] = {}
        for i, p in enumerate(params):
            if p.name in named:
                value = named[p.name]
            elif p.has_default:
                value = p.default
            else:
                raise TypeError(f"{self.kernel.__name__}: no value for {p.name}")
            if p.is_constexpr or value is None:
                signature[p.name] = "constexpr"
                constants[(i,)] = value
            else:
                signature[p.name] = mangle_type(value)
        source = ASTSource(fn=self.kernel, signature=signature, constexprs=constants)
        return triton.compile(source, target=GPUTarget("cuda", arch, warp_size))
