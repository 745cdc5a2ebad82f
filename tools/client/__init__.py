"""A client for pagedserve's users, not part of the contract between its processes.

failover_client.py retries and resumes a request across replicas;
failover_stream.py resumes a stream mid-way; sse_parser.py reads SSE.
"""
