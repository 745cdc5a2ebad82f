"""Test-wide setup that must happen before any test module imports torch or triton.

Without a CUDA device, Triton kernels run in Triton's interpreter on CPU
tensors; the interpreter is chosen when triton is first imported, which
transformers and torch do early, so it is set here.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
