"""The frontend's side of the engine worker: its process, its channel, its supervision.

engine_client.py owns the channel and the record of every request in flight
(request_state.py); supervisor.py restarts a worker that hangs or dies and
resumes what was in flight; process.py, standby.py, runtime_dir.py,
kv_segment.py and sharing.py start workers and give them what they share.
Knows the wire protocol (shared/protocol.py) and nothing of HTTP or the APIs.
"""
