"""The multi-host wiring as Vertex AI, GKE and the local launcher give it to each process."""

from __future__ import annotations

import json

import pytest

from loraflow.launchers.multihost import DistributedConfig, MultiHostError, distributed_config


def cluster_spec(pools: dict[str, list[str]], task: str, index: int) -> str:
    return json.dumps({"cluster": pools, "environment": "cloud", "task": {"type": task, "index": index}})


def test_nothing_set_is_a_single_process() -> None:
    assert distributed_config({}) is None


def test_local_form() -> None:
    env = {"LORAFLOW_COORDINATOR": "127.0.0.1:1234", "LORAFLOW_NUM_PROCESSES": "2", "LORAFLOW_PROCESS_ID": "1"}
    cfg = distributed_config(env)
    assert cfg == DistributedConfig("127.0.0.1:1234", 2, 1, "local")
    assert not cfg.is_coordinator
    assert cfg.jax_kwargs() == {"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 1}
    assert cfg.env() == env  # the local form round-trips


def test_local_form_half_set_names_what_is_missing() -> None:
    with pytest.raises(MultiHostError, match="without LORAFLOW_NUM_PROCESSES, LORAFLOW_PROCESS_ID"):
        distributed_config({"LORAFLOW_COORDINATOR": "127.0.0.1:1234"})


def test_vertex_cluster_spec_single_pool() -> None:
    pools = {"workerpool0": ["cmle-training-workerpool0-ab-0:2222", "cmle-training-workerpool0-ab-1:2222"]}
    first = distributed_config({"CLUSTER_SPEC": cluster_spec(pools, "workerpool0", 0)})
    second = distributed_config({"CLUSTER_SPEC": cluster_spec(pools, "workerpool0", 1)})
    assert first == DistributedConfig("cmle-training-workerpool0-ab-0:2222", 2, 0, "vertex")
    assert first.is_coordinator
    assert second is not None and second.process_id == 1 and second.coordinator == first.coordinator


def test_vertex_processes_are_numbered_across_pools_in_pool_order() -> None:
    pools = {
        "workerpool1": ["w1-0:2222", "w1-1:2222"],
        "workerpool0": ["w0-0:2222"],
        "workerpool10": ["w10-0:2222"],
        "workerpool2": ["w2-0:2222"],
    }
    ids = {
        (task, i): distributed_config({"CLUSTER_SPEC": cluster_spec(pools, task, i)})
        for task in pools
        for i in range(len(pools[task]))
    }
    assert {k: c.process_id for k, c in ids.items() if c} == {
        ("workerpool0", 0): 0,
        ("workerpool1", 0): 1,
        ("workerpool1", 1): 2,
        ("workerpool2", 0): 3,
        ("workerpool10", 0): 4,
    }
    assert {c.coordinator for c in ids.values() if c} == {"w0-0:2222"}


def test_vertex_single_replica_is_a_single_process() -> None:
    assert distributed_config({"CLUSTER_SPEC": cluster_spec({"workerpool0": ["h:2222"]}, "workerpool0", 0)}) is None


def test_vertex_malformed_cluster_spec() -> None:
    with pytest.raises(MultiHostError, match="not the JSON Vertex AI sets"):
        distributed_config({"CLUSTER_SPEC": "{not json"})
    with pytest.raises(MultiHostError, match=r"outside 0\.\.1"):
        distributed_config({"CLUSTER_SPEC": cluster_spec({"workerpool0": ["a:1", "b:1"]}, "workerpool0", 2)})


def test_local_form_wins_over_cluster_spec() -> None:
    env = {
        "CLUSTER_SPEC": cluster_spec({"workerpool0": ["a:1", "b:1"]}, "workerpool0", 1),
        "LORAFLOW_COORDINATOR": "10.0.0.1:9",
        "LORAFLOW_NUM_PROCESSES": "4",
        "LORAFLOW_PROCESS_ID": "3",
    }
    assert distributed_config(env) == DistributedConfig("10.0.0.1:9", 4, 3, "local")


def test_gke_tpu_webhook_env() -> None:
    env = {"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "js-w-0-0.js,js-w-0-1.js,js-w-0-2.js,js-w-0-3.js"}
    assert distributed_config(env) == DistributedConfig("js-w-0-0.js:8476", 4, 2, "gke")
    env |= {"LORAFLOW_COORDINATOR_PORT": "1234"}
    cfg = distributed_config(env)
    assert cfg is not None and cfg.coordinator == "js-w-0-0.js:1234"


def test_gke_jobset_index_with_coordinator_host() -> None:
    env = {"JOB_COMPLETION_INDEX": "1", "LORAFLOW_COORDINATOR_HOST": "js-w-0-0.js", "LORAFLOW_EXPECTED_HOSTS": "2"}
    assert distributed_config(env) == DistributedConfig("js-w-0-0.js:8476", 2, 1, "gke")


def test_gke_index_without_hosts_says_what_to_set() -> None:
    with pytest.raises(MultiHostError, match="TPU_WORKER_HOSTNAMES"):
        distributed_config({"JOB_COMPLETION_INDEX": "0"})


def test_expected_hosts_mismatch_fails_early() -> None:
    env = {"CLUSTER_SPEC": cluster_spec({"workerpool0": ["a:1"]}, "workerpool0", 0), "LORAFLOW_EXPECTED_HOSTS": "4"}
    with pytest.raises(MultiHostError, match="asked for 4 hosts but the vertex environment describes 1"):
        distributed_config(env)
    with pytest.raises(MultiHostError, match="no multi-host wiring found"):
        distributed_config({"LORAFLOW_EXPECTED_HOSTS": "2"})
    assert distributed_config({"LORAFLOW_EXPECTED_HOSTS": "1"}) is None


@pytest.mark.parametrize("coordinator", ["nohostport", ":123", "host:"])
def test_coordinator_must_be_host_port(coordinator: str) -> None:
    env = {"LORAFLOW_COORDINATOR": coordinator, "LORAFLOW_NUM_PROCESSES": "2", "LORAFLOW_PROCESS_ID": "0"}
    with pytest.raises(MultiHostError, match="is not host:port"):
        distributed_config(env)
