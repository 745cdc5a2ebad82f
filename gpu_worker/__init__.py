"""The worker: weights, paged KV cache, scheduling and sampling. Its Engine is usable in-process.

Importing it first holds torch and oneDNN to the CPU tier that
$PAGEDSERVE_CPU_ISA names, if any (shared/cpu_tier.py): they read their own
limits once, when torch is imported, which every module here goes on to do.
"""

import os

from shared.cpu_tier import limit_libraries

limit_libraries(os.environ)
