"""Two pagedserve replicas behind the shipped tools/deploy/nginx.conf, as users run them: real servers, a real nginx,
the openai SDK (no retries of its own) as the clients.

Under a steady load of completions from several clients, not one request fails while one replica's worker is
SIGKILLed (the replica answers 503 until a new worker is ready; nginx sends those requests to the other), while a
whole replica is SIGKILLed (nginx retries on the survivor, which takes all the traffic), and while the dead replica
comes back on its port (after fail_timeout nginx sends it traffic again). Streams arrive token by token; the
client's X-Request-Id reaches the replica; nginx's own errors use the OpenAI error schema.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import openai
import pytest

from shared.default_model import DEFAULT_MODEL_NAME

from helpers.metrics_scrape import total
from helpers.nginx_proxy import NginxProxy, start_nginx, stop_nginx
from helpers.running_server import WAIT_S, WORKER_PID, RunningServer, free_port, http_exchange, start_server, stop_server
from helpers.waiting import wait_until

# No standby: these replicas show nginx routing around one whose worker is down, a window a standby closes.
REPLICA_FLAGS = ("--device", "cpu", "--num-kv-blocks", "256", "--max-num-seqs", "8", "--standby-workers", "0")
NUM_CLIENTS = 4
MAX_TOKENS = 4
BURST = 8  # concurrent requests that make nginx try a replica it would otherwise spare (least_conn)
STREAM_TOKENS = 400  # long enough that the replica is still generating when the first token arrives
RECOVERY_S = 45.0  # a replica's restart plus nginx's fail_timeout, on a busy machine
SUCCESS = "vllm:request_success_total"
RUNNING = "vllm:num_requests_running"
LOG_FIELD = re.compile(r"(\w+)=(.*?)(?= \w+=|$)")


def proxy_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def request(proxy: NginxProxy, method: str, path: str, body: bytes | dict | None = None,
            headers: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    return http_exchange(proxy.port, method, path, body, headers)


def access_log(proxy: NginxProxy) -> list[dict[str, str]]:
    """nginx's access log, one dict per request: status, upstream (the replicas tried), upstream_status, ..."""
    return [dict(LOG_FIELD.findall(line)) for line in proxy.access_log_lines()]


class Replica:
    """One replica on a port: its current server process, and every process it has had (to clean up after)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.servers: list[RunningServer] = []

    def start(self, port: int = 0) -> Replica:
        run_directory = self.directory / f"run{len(self.servers)}"
        run_directory.mkdir(parents=True)
        self.servers.append(start_server(run_directory, None, *REPLICA_FLAGS, port=port))
        return self

    @property
    def server(self) -> RunningServer:
        return self.servers[-1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def num_successes(self) -> float:
        """The replica's own count of completed requests (every finish reason), from its /metrics."""
        return total(self.server.scrape(), SUCCESS)

    def kill_worker(self) -> int:
        worker_pid = self.server.worker_pid
        os.killpg(worker_pid, signal.SIGKILL)  # the worker leads its own process group
        return worker_pid

    def kill(self) -> None:
        """SIGKILL the server and its worker at once, as a machine's death would."""
        self.server.process.kill()
        self._kill_workers(self.server)
        self.server.process.wait()

    def close(self) -> None:
        for server in self.servers:
            stop_server(server)
            self._kill_workers(server)

    @staticmethod
    def _kill_workers(server: RunningServer) -> None:
        for pid in map(int, WORKER_PID.findall(server.log.read_bytes())):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Load:
    """NUM_CLIENTS threads sending non-streaming completions through the proxy, back to back, until stopped."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.num_ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()  # num_ok += 1 from several threads
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(NUM_CLIENTS)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(WAIT_S)

    def _run(self, client_index: int) -> None:
        client = proxy_client(self.base_url)
        while not self._stop.is_set():
            self.send(client, f"ROMEO {client_index}:")

    def send(self, client: openai.OpenAI, prompt: str) -> None:
        try:
            completion = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"ignore_eos": True})
        except openai.APIError as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")
            return
        if completion.usage.completion_tokens == MAX_TOKENS and completion.choices[0].finish_reason == "length":
            with self._lock:
                self.num_ok += 1
        else:
            self.failures.append(f"an incomplete completion: {completion}")

    def burst(self) -> None:
        """BURST requests at once, each from its own client, on top of the steady load."""
        threads = [threading.Thread(target=self.send, args=(proxy_client(self.base_url), f"JULIET {i}:"))
                   for i in range(BURST)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)

    def wait_for_more(self, num_requests: int) -> None:
        goal = self.num_ok + num_requests
        wait_until(lambda: self.num_ok >= goal or self.failures, WAIT_S,
                   message=f"{num_requests} more requests to succeed")
        assert not self.failures, self.failures


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two replicas of the default model and nginx in front of them; every process is gone afterwards."""
    directory = tmp_path_factory.mktemp("replicas")
    replicas = [Replica(directory / "a"), Replica(directory / "b")]
    proxy = None
    try:
        for replica in replicas:
            replica.start()
        proxy = start_nginx(directory / "nginx", [replica.address for replica in replicas])
        yield proxy, replicas
    finally:
        if proxy is not None:
            stop_nginx(proxy)
        for replica in replicas:
            replica.close()


def test_a_stream_arrives_token_by_token(cluster):
    """The first token reaches the client through nginx while its replica is still generating the rest: decided by
    the replicas' own count of running requests, not by timing, which a loaded machine makes noisy."""
    proxy, replicas = cluster
    stream = proxy_client(proxy.base_url).completions.create(
        model=DEFAULT_MODEL_NAME, prompt="KING HENRY:", max_tokens=STREAM_TOKENS, temperature=0, stream=True,
        logprobs=0, extra_body={"ignore_eos": True})
    # A chunk carries the tokens of the steps that ended since the last one: one, or more on a busy machine.
    chunks = (chunk for chunk in stream if chunk.choices and chunk.choices[0].text)
    num_tokens = len(next(chunks).choices[0].logprobs.tokens)
    running = sum(total(replica.server.scrape(), RUNNING) for replica in replicas)
    assert running == 1, f"the first token arrived after its replica had finished: {running} requests running"
    assert num_tokens + sum(len(chunk.choices[0].logprobs.tokens) for chunk in chunks) == STREAM_TOKENS


def test_the_request_id_reaches_the_replica_and_comes_back(cluster):
    proxy, _ = cluster
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
    status, headers, _ = request(proxy, "POST", "/v1/completions", body, {"X-Request-Id": "trace-4711"})
    assert status == 200 and headers["x-request-id"] == "trace-4711"
    status, headers, _ = request(proxy, "POST", "/v1/completions", body)
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"]), headers
    ids = {"trace-4711", headers["x-request-id"]}
    # nginx writes a request's log line as it finishes the request, which may be after the client has its answer.
    wait_until(lambda: ids <= {entry["request_id"] for entry in access_log(proxy)}, 5,
               message=f"nginx to log the ids it sent to the replica, {ids}")


def test_requests_survive_a_worker_death_a_replica_death_and_its_return(cluster):
    proxy, (a, b) = cluster
    load = Load(proxy.base_url).start()
    try:
        wait_until(lambda: a.num_successes() > 0 and b.num_successes() > 0, WAIT_S, message="both replicas to serve")

        # (a) a's worker dies: a answers 503 until its new worker is ready; nginx sends those requests to b.
        old_worker = a.kill_worker()
        a.server.wait_for(lambda: not a.server.is_healthy(), "replica a to report its worker's death")
        load.burst()
        a.server.wait_for(lambda: a.server.worker_pid != old_worker and a.server.is_healthy(), "a's new worker")
        assert not load.failures, load.failures
        wait_until(lambda: any(entry["status"] == "200" and "503" in entry["upstream_status"]
                               for entry in access_log(proxy)), 5, message="nginx to log a's 503 retried on b")
        served = a.num_successes()
        wait_until(lambda: a.num_successes() > served + NUM_CLIENTS or load.failures, RECOVERY_S,
                   message="a to take traffic again")  # more than the requests in flight on a when its worker died
        load.wait_for_more(NUM_CLIENTS)

        # (b) b dies whole: the requests in flight on it and the next ones go to a.
        b_port, served = b.server.port, a.num_successes()
        b.kill()
        wait_until(lambda: a.num_successes() >= served + 3 * NUM_CLIENTS or load.failures, WAIT_S,
                   message="a to take b's traffic")
        load.wait_for_more(NUM_CLIENTS)
        wait_until(lambda: any(entry["status"] == "200" and "502" in entry["upstream_status"]
                               and b.address in entry["upstream"] for entry in access_log(proxy)),
                   5, message="nginx to log a request that failed to reach b and was retried on a")

        # (c) b comes back on its port: after fail_timeout nginx tries it again and it takes traffic.
        b.start(port=b_port)
        wait_until(lambda: b.num_successes() > 0 or load.failures, RECOVERY_S, message="the new b to take traffic")
        load.wait_for_more(NUM_CLIENTS)
    finally:
        load.stop()
    assert not load.failures, load.failures
    assert load.num_ok >= 10 * NUM_CLIENTS


# ---------------------------------------------------------------------------------------------- nginx's own answers


@pytest.fixture
def proxy_to_nothing(tmp_path):
    """nginx in front of two ports where nothing listens."""
    proxy = start_nginx(tmp_path, [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
    yield proxy
    stop_nginx(proxy)


def test_with_no_replica_up_the_proxy_answers_503_in_the_openai_schema(proxy_to_nothing):
    status, headers, body = request(proxy_to_nothing, "POST", "/v1/completions",
                                    {"model": DEFAULT_MODEL_NAME, "prompt": "Hi", "max_tokens": 4})
    assert status == 503 and headers["content-type"] == "application/json" and headers["retry-after"] == "1"
    error = json.loads(body)["error"]
    assert error["type"] == "service_unavailable" and "no pagedserve replica" in error["message"], error
    with pytest.raises(openai.InternalServerError) as raised:
        proxy_client(proxy_to_nothing.base_url).completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=4)
    assert raised.value.status_code == 503 and "no pagedserve replica" in raised.value.message


def test_a_body_over_the_limit_gets_413_in_the_openai_schema(proxy_to_nothing):
    prompt = "x" * (8 * 1024 * 1024)  # with the JSON around it, just over client_max_body_size 8m
    status, headers, body = request(proxy_to_nothing, "POST", "/v1/completions",
                                    {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 4})
    assert status == 413 and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "client_max_body_size" in error["message"], error
