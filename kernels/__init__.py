"""Kernels: Triton (GPU, one per file with a torch reference beside it) and native CPU ones.

Under ``TRITON_INTERPRET=1`` (CPU tests) one interpreter bug is patched before any kernel is
defined: Triton 3.6's interpreter turns a run-time loop bound (a 1-element array) into an int with
``int(array)``, which NumPy >= 2.4 rejects (triton-lang/triton#9171). Compiled kernels never take
that path.
"""

import os


def _fix_interpreter_loop_bounds() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "tandem_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    patched.tandem_fixed = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_loop_bounds()
