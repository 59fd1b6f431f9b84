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
        compiled kernel. The arguments are bound and specialized by Triton's
        own launcher code (its binder and ``_pack_args``: pointer types and
        alignment, integer widths and divisibility, a 1 made a constant,
        ``do_not_specialize``), so the variant compiled is the one this launch
        would compile on such a GPU."""
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile, make_backend
        from triton.runtime.jit import create_function_from_signature

        target = GPUTarget("cuda", arch, warp_size)
        backend = make_backend(target)
        kwargs = dict(self.kwargs)
        kwargs.setdefault("debug", bool(knobs.runtime.debug))
        kwargs.setdefault("instrumentation_mode", knobs.compilation.instrumentation_mode)
        binder = create_function_from_signature(self.kernel.signature, self.kernel.params, backend)
        bound, specialization, options = binder(*self.args, **kwargs)
        options, signature, constants, attrs = self.kernel._pack_args(
            backend, kwargs, bound, specialization, options
        )
        source = ASTSource(self.kernel, signature, constants, attrs)
        return compile(source, target=target, options=options.__dict__)
