"""The failover client: for programs that talk to several pagedserve replicas directly, with no balancer in front.

    from tools.client.failover_client import FailoverClient

failover_client.py retries and resumes a request across replicas;
failover_stream.py resumes a stream mid-way; sse_parser.py reads SSE.
Standard library only: importing it loads neither torch nor the server, and
the folder can be copied into a program as it is.

Why here: it is a library for pagedserve's users, and neither the frontend
nor the worker imports it, so it is no part of shared/ (what those two
processes agree on). tools/ holds what users run beside the server; the
client sits next to deploy/, the nginx, systemd and Kubernetes files for
running replicas, since it is the other way to spread requests over them
(README: "Client failover"). It is not in deploy/ itself, which holds
configuration files, not code, nor in benchlib/, which only the benchmarks
use.
"""
