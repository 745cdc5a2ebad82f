"""What the tools' scripts share; nothing here is run on its own.

    target.py          Target (where a server is, its API key and model), served_model, auth_header
    stats.py           percentile
    workload.py        BenchRequest, the synthetic and JSONL workloads
    http_load.py       the asyncio load generator: streamed completions, TTFT/ITL/E2E, the summary table
    stream_load.py     Load: threads streaming completions one after another, every token's arrival time
    local_server.py    `python -m server` started on a free port; --policy NAME=FLAGS; a workload through it
    metrics.py         /metrics scraped and summed, /health, polling
    server_process.py  a server's processes as /proc shows them: RSS, the workers and the busiest of them
    hostile_client.py  bad requests, the attacker that sends them, the /health and RSS sampler
    checkpoints.py     random-weight Llama checkpoints of known shapes, and tokenizers for them
    machine_limits.py  this machine's matmul rate and memory bandwidth (imports torch)
    roofline.py        a run's FLOPs and bytes, and the lower bound on its time

Only machine_limits.py imports torch at import time (roofline.py's
format_roofline and checkpoints.py do when called): the load generators
stay light.
"""
