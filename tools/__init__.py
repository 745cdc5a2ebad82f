"""pagedserve's tools: benchmarks, the device check, the default model's trainer, the failover client.

Every script is a module, run from the repository root with -m (which puts
the root first on sys.path, so `tools`, `server`, `gpu_worker` and `shared`
import as they do in the tests):

    python -m tools.bench.serving.bench_serving --help

    bench/serving/   through HTTP: a server started here or running elsewhere
    bench/engine/    the Engine in this process, no HTTP; bench_checkpoint writes random-weight checkpoints
    bench/kernels/   one kernel or layer at a time
    device/          the GPU machine's check (device_check.sh) and what it runs
    training/        the embedded default model's trainer (train_default_model) and its parts
    benchlib/        what the scripts share; no scripts
    client/          the failover client, for programs that talk to several replicas
    deploy/          nginx, systemd and Kubernetes files for running replicas

A module in a script folder is either a script or one script's part, named
in its docstring (bench_compare of bench_serving, bench_structured_output of
bench_offline, device_sizes of device_check); what two scripts use is in
benchlib/. test.sh and setup_env.sh are the test suite's entry points.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
