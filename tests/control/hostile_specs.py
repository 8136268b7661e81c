"""Hostile pipeline specs: what a spec author who wants more than a pipeline might write.

``EDITS``: (id, edits to the tiny spec as in spec_corpus.py, key path the error must name, words of
the rule it must say). ``FILES``: (id, the spec file's bytes, key path, words): what cannot be
written as an edit (sizes, aliases, encodings, nesting).
"""

from __future__ import annotations

from typing import Any

from .spec_corpus import apply

VERTEX = {"launcher": "vertex", "image": "us-docker.pkg.dev/acme-ml/loraflow/trainer:0.1.0", "machine_type": "n2-standard-8"}  # fmt: skip
GKE = {"launcher": "gke", "image": "us-docker.pkg.dev/acme-ml/loraflow/trainer:0.1.0", "machine_type": "n2-standard-8"}
INTERPRETER = "changes the Python interpreter"
LOADER = "changes the dynamic loader"
CLOUD = "changes which credentials, project or service endpoint"
NOT_FINITE = "is not a finite number"
TOO_LARGE = "is too large"
TEXT_NO_NUMBER = "): text is no number; write"
BOOLEAN_NO_NUMBER = "): YAML reads true, false, yes, no, on and off as booleans; write"
INVISIBLE = "invisible or direction-changing character"
NOT_ALLOWED = "is not on the allow-list"
INF = float("inf")
NAN = float("nan")


def env(name: str, value: str = "x") -> dict[str, Any]:
    return {"compute.lora_sft": {**VERTEX, "env": {name: value}}}


EDITS: list[tuple[str, dict[str, Any], str, str]] = [
    ("env-ld-preload", env("LD_PRELOAD", "/tmp/evil.so"), "compute.lora_sft.env.LD_PRELOAD", LOADER),
    ("env-ld-library-path", env("LD_LIBRARY_PATH"), "compute.lora_sft.env.LD_LIBRARY_PATH", LOADER),
    ("env-ld-audit", env("LD_AUDIT"), "compute.lora_sft.env.LD_AUDIT", LOADER),
    ("env-dyld", env("DYLD_INSERT_LIBRARIES"), "compute.lora_sft.env.DYLD_INSERT_LIBRARIES", LOADER),
    ("env-gconv", env("GCONV_PATH"), "compute.lora_sft.env.GCONV_PATH", LOADER),
    ("env-pjrt-plugin", env("PJRT_NAMES_AND_LIBRARY_PATHS"), "compute.lora_sft.env.PJRT_NAMES_AND_LIBRARY_PATHS", LOADER),
    ("env-jax-cache", env("JAX_COMPILATION_CACHE_DIR", "gs://x/c"), "compute.lora_sft.env.JAX_COMPILATION_CACHE_DIR", LOADER),
    ("env-pythonpath", env("PYTHONPATH", "gs://evil"), "compute.lora_sft.env.PYTHONPATH", INTERPRETER),
    ("env-pythonstartup", env("PYTHONSTARTUP"), "compute.lora_sft.env.PYTHONSTARTUP", INTERPRETER),
    ("env-pythonhome", env("PYTHONHOME"), "compute.lora_sft.env.PYTHONHOME", INTERPRETER),
    ("env-pythoninspect", env("PYTHONINSPECT"), "compute.lora_sft.env.PYTHONINSPECT", INTERPRETER),
    ("env-pythonuserbase", env("PYTHONUSERBASE"), "compute.lora_sft.env.PYTHONUSERBASE", INTERPRETER),
    ("env-pythonwarnings", env("PYTHONWARNINGS"), "compute.lora_sft.env.PYTHONWARNINGS", INTERPRETER),
    ("env-bash-env", env("BASH_ENV"), "compute.lora_sft.env.BASH_ENV", "changes how a shell"),
    ("env-sh-env", env("ENV"), "compute.lora_sft.env.ENV", "changes how a shell"),
    ("env-ssl-cert", env("SSL_CERT_FILE"), "compute.lora_sft.env.SSL_CERT_FILE", "TLS certificates"),
    ("env-requests-ca", env("REQUESTS_CA_BUNDLE"), "compute.lora_sft.env.REQUESTS_CA_BUNDLE", "TLS certificates"),
    ("env-grpc-roots", env("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"), "compute.lora_sft.env.GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", "TLS"),
    ("env-https-proxy", env("HTTPS_PROXY", "http://evil:3128"), "compute.lora_sft.env.HTTPS_PROXY", "proxy"),
    ("env-http-proxy-lower", env("http_proxy"), "compute.lora_sft.env.http_proxy", "proxy"),
    ("env-no-proxy", env("NO_PROXY"), "compute.lora_sft.env.NO_PROXY", "proxy"),
    ("env-gac", env("GOOGLE_APPLICATION_CREDENTIALS"), "compute.lora_sft.env.GOOGLE_APPLICATION_CREDENTIALS", CLOUD),
    ("env-universe", env("GOOGLE_CLOUD_UNIVERSE_DOMAIN", "evil.com"), "compute.lora_sft.env.GOOGLE_CLOUD_UNIVERSE_DOMAIN", CLOUD),
    ("env-cloudsdk", env("CLOUDSDK_CONFIG"), "compute.lora_sft.env.CLOUDSDK_CONFIG", CLOUD),
    ("env-metadata", env("GCE_METADATA_HOST", "evil.com"), "compute.lora_sft.env.GCE_METADATA_HOST", CLOUD),
    ("env-storage-emulator", env("STORAGE_EMULATOR_HOST", "http://evil"), "compute.lora_sft.env.STORAGE_EMULATOR_HOST", CLOUD),
    ("env-pubsub-emulator", env("PUBSUB_EMULATOR_HOST"), "compute.lora_sft.env.PUBSUB_EMULATOR_HOST", CLOUD),
    ("env-aws", env("AWS_SECRET_ACCESS_KEY"), "compute.lora_sft.env.AWS_SECRET_ACCESS_KEY", CLOUD),
    ("env-hf-endpoint", env("HF_ENDPOINT", "https://evil"), "compute.lora_sft.env.HF_ENDPOINT", CLOUD),
    ("env-loraflow-scratch", env("LORAFLOW_SCRATCH", "/opt/airflow/dags"), "compute.lora_sft.env.LORAFLOW_SCRATCH", "loraflow's"),
    ("env-loraflow-fault", env("LORAFLOW_FAULT"), "compute.lora_sft.env.LORAFLOW_FAULT", "loraflow's"),
    ("env-hf-online", env("HF_HUB_OFFLINE", "0"), "compute.lora_sft.env.HF_HUB_OFFLINE", "loraflow's"),
    ("env-path", env("PATH", "/tmp/evil"), "compute.lora_sft.env.PATH", "process basic"),
    ("env-home", env("HOME"), "compute.lora_sft.env.HOME", "process basic"),
    ("env-tmpdir", env("TMPDIR", "/opt/airflow/dags"), "compute.lora_sft.env.TMPDIR", "process basic"),
    ("env-lowercase", env("my_flag"), "compute.lora_sft.env.my_flag", "not a portable environment variable name"),
    ("env-equals", env("A=B"), "compute.lora_sft.env.A=B", "not a portable environment variable name"),
    ("env-nul-value", env("MY_FLAG", "a\0b"), "compute.lora_sft.env.MY_FLAG", "NUL character"),
    ("env-default-stage", {"compute.default": {"env": {"LD_PRELOAD": "x"}}}, "compute.default.env.LD_PRELOAD", LOADER),
    ("secret-pythonpath", {"secrets": {"PYTHONPATH": {"connection": "hf"}}}, "secrets.PYTHONPATH", INTERPRETER),
    ("secret-proxy", {"secrets": {"HTTPS_PROXY": {"connection": "hf"}}}, "secrets.HTTPS_PROXY", "proxy"),
    ("region-path", {"compute.lora_sft": {**VERTEX, "region": "evil.com/x"}}, "compute.lora_sft.region", "not a Google Cloud region"),
    ("region-host", {"compute.lora_sft": {**VERTEX, "region": "us-central1.evil.com"}}, "compute.lora_sft.region", "not a Google Cloud region"),
    ("region-userinfo", {"compute.lora_sft": {**VERTEX, "region": "evil.com@us-central1"}}, "compute.lora_sft.region", "not a Google Cloud region"),
    ("region-fragment", {"compute.lora_sft": {**VERTEX, "region": "evil.com#"}}, "compute.lora_sft.region", "not a Google Cloud region"),
    ("region-newline", {"compute.lora_sft": {**VERTEX, "region": "us-central1\n"}}, "compute.lora_sft.region", "not a Google Cloud region"),
    ("registry-region", {"publish.vertex_model_registry": {"serving_container_image": "vllm/vllm-openai:v1", "region": "evil.com/"}}, "publish.vertex_model_registry.region", "not a Google Cloud region"),
    ("project-slash", {"publish.vertex_model_registry": {"serving_container_image": "vllm/vllm-openai:v1", "project": "p/../../x"}}, "publish.vertex_model_registry.project", "not a Google Cloud project id"),
    ("project-query", {"publish.vertex_model_registry": {"serving_container_image": "vllm/vllm-openai:v1", "project": "acme-ml?x=1"}}, "publish.vertex_model_registry.project", "not a Google Cloud project id"),
    ("image-url", {"compute.lora_sft": {**VERTEX, "image": "http://evil/x"}}, "compute.lora_sft.image", "not a container image reference"),
    ("image-space", {"compute.lora_sft": {**VERTEX, "image": "trainer:1 --privileged"}}, "compute.lora_sft.image", "not a container image reference"),
    ("machine-type-path", {"compute.lora_sft": {**VERTEX, "machine_type": "n2/../x"}}, "compute.lora_sft.machine_type", "not a machine type"),
    ("topology", {"compute.lora_sft": {**VERTEX, "machine_type": "ct5lp-hightpu-4t", "tpu_topology": "4x4;x"}}, "compute.lora_sft.tpu_topology", "not a TPU topology"),
    ("service-account", {"compute.lora_sft": {**VERTEX, "service_account": "me@evil.com"}}, "compute.lora_sft.service_account", "not a Google service account"),
    ("network", {"compute.lora_sft": {**VERTEX, "network": "projects/1/global/networks/a/../b"}}, "compute.lora_sft.network", "not a VPC network"),
    ("reserved-range", {"compute.lora_sft": {**VERTEX, "network": "projects/1/global/networks/n", "reserved_ip_ranges": ["a/b"]}}, "compute.lora_sft.reserved_ip_ranges.0", "not a Compute Engine resource name"),
    ("reservation", {"compute.lora_sft": {**VERTEX, "reservation": "projects/p/zones/z/reservations/r?x"}}, "compute.lora_sft", "is not projects/PROJECT/zones/ZONE/reservations/NAME"),
    ("namespace-path", {"compute.lora_sft": {**GKE, "namespace": "default/../../api"}}, "compute.lora_sft.namespace", "not a Kubernetes name"),
    ("node-pool", {"compute.lora_sft": {**GKE, "node_pool": "Pool_1"}}, "compute.lora_sft.node_pool", "not a Kubernetes name"),
    ("k8s-sa", {"compute.lora_sft": {**GKE, "kubernetes_service_account": "sa/../x"}}, "compute.lora_sft.kubernetes_service_account", "not a Kubernetes name"),
    ("bucket-host", {"artifact_root": "gs://evil.com:443@x/runs"}, "artifact_root", "not a GCS bucket name"),
    ("bucket-upper", {"data.train": "gs://Bucket/train.jsonl"}, "data.train", "not a GCS bucket name"),
    ("uri-newline", {"data.eval": "gs://loraflow-demo/eval\n.jsonl"}, "data.eval", "control character"),
    ("uri-dot-segment", {"base_model.hf_checkpoint": "gs://loraflow-demo/./m"}, "base_model.hf_checkpoint", "'.' path segment"),
    ("maxtext-jax-cache", {"base_model.model_overrides.jax_cache_dir": "gs://evil/cache"}, "base_model.model_overrides", "jax_cache_dir: " + NOT_ALLOWED),
    ("maxtext-output", {"base_model.model_overrides.base_output_directory": "gs://other-team/x"}, "base_model.model_overrides", "base_output_directory: " + NOT_ALLOWED),
    ("maxtext-token", {"base_model.model_overrides.hf_access_token": "t"}, "base_model.model_overrides", "hf_access_token: " + NOT_ALLOWED),
    ("maxtext-key-syntax", {"base_model.model_overrides": {"vocab_size=1 load_parameters_path": 1}}, "base_model.model_overrides", "not a MaxText setting name"),
    ("maxtext-path-value", {"base_model.model_overrides.attention": "gs://evil/x"}, "base_model.model_overrides", "attention: the value 'gs://evil/x' is not one of"),
    # Names the deny rules let through that write or send outside the run (issue 29, item 4): a step's
    # environment is an allow-list (loraflow/spec/env_rules.py ALLOWED), XLA's flags one too.
    ("env-xla-dump", env("XLA_FLAGS", "--xla_dump_to=/opt/airflow/dags"), "compute.lora_sft.env", "XLA_FLAGS: --xla_dump_to is not on the allow-list"),
    ("env-xla-dump-after-an-allowed-flag", env("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_dump_hlo_as_text"), "compute.lora_sft.env", "XLA_FLAGS: --xla_dump_hlo_as_text is not on the allow-list"),
    ("env-xla-flag-path-value", env("XLA_FLAGS", "--xla_force_host_platform_device_count=/tmp/x"), "compute.lora_sft.env", "XLA_FLAGS: the value of --xla_force_host_platform_device_count"),
    ("env-libtpu-dump", env("LIBTPU_INIT_ARGS", "--xla_dump_to=/tmp/x"), "compute.lora_sft.env", "LIBTPU_INIT_ARGS: --xla_dump_to is not on the allow-list"),
    ("env-jax-dump-ir", env("JAX_DUMP_IR_TO", "/tmp/x"), "compute.lora_sft.env.JAX_DUMP_IR_TO", NOT_ALLOWED),
    ("env-vllm-stats-server", env("VLLM_USAGE_STATS_SERVER", "https://evil.example"), "compute.lora_sft.env.VLLM_USAGE_STATS_SERVER", NOT_ALLOWED),
    ("env-vllm-config-root", env("VLLM_CONFIG_ROOT", "/opt/airflow"), "compute.lora_sft.env.VLLM_CONFIG_ROOT", NOT_ALLOWED),
    ("env-vllm-logging-config", env("VLLM_LOGGING_CONFIG_PATH", "/tmp/log.json"), "compute.lora_sft.env.VLLM_LOGGING_CONFIG_PATH", NOT_ALLOWED),
    ("env-vllm-usage-stats-on", env("VLLM_NO_USAGE_STATS", "0"), "compute.lora_sft.env.VLLM_NO_USAGE_STATS", NOT_ALLOWED),
    ("env-do-track", env("DO_NOT_TRACK", "0"), "compute.lora_sft.env.DO_NOT_TRACK", NOT_ALLOWED),
    ("env-inductor-cache", env("TORCHINDUCTOR_CACHE_DIR", "/opt/airflow/dags"), "compute.lora_sft.env.TORCHINDUCTOR_CACHE_DIR", NOT_ALLOWED),
    ("env-triton-cache", env("TRITON_CACHE_DIR", "/tmp/x"), "compute.lora_sft.env.TRITON_CACHE_DIR", NOT_ALLOWED),
    ("env-hf-home", env("HF_HOME", "/tmp/x"), "compute.lora_sft.env.HF_HOME", NOT_ALLOWED),
    ("env-grpc-trace", env("GRPC_TRACE", "all"), "compute.lora_sft.env.GRPC_TRACE", NOT_ALLOWED),
    ("env-tpu-log-dir", env("TPU_LOG_DIR", "/tmp/x"), "compute.lora_sft.env.TPU_LOG_DIR", NOT_ALLOWED),
    ("env-allowed-name-path-value", env("TF_CPP_MIN_LOG_LEVEL", "/tmp/x"), "compute.lora_sft.env", "TF_CPP_MIN_LOG_LEVEL: the value '/tmp/x' is not"),
    # MaxText settings: model_overrides is an allow-list too (loraflow/spec/override_rules.py).
    ("maxtext-compile-xla-flags", {"base_model.model_overrides.compile_xla_flags": "--xla_dump_to=/tmp/x"}, "base_model.model_overrides", "compile_xla_flags: is not on the allow-list"),
    ("maxtext-prometheus-port", {"base_model.model_overrides.prometheus_port": 9090}, "base_model.model_overrides", "prometheus_port: is not on the allow-list"),
    ("maxtext-vertex-tensorboard", {"base_model.model_overrides.vertex_tensorboard_project": "evil-project"}, "base_model.model_overrides", "vertex_tensorboard_project: is not on the allow-list"),
    ("maxtext-tensorboard", {"base_model.model_overrides.enable_tensorboard": True}, "base_model.model_overrides", "enable_tensorboard: is not on the allow-list"),
    ("maxtext-remat-path", {"base_model.model_overrides.remat_policy": "gs://evil/x"}, "base_model.model_overrides", "remat_policy: the value 'gs://evil/x' is not one of"),
    ("maxtext-dimension-text", {"base_model.model_overrides.base_emb_dim": "128 load_parameters_path=gs://evil/x"}, "base_model.model_overrides", "base_emb_dim: the value '128 load_parameters_path=gs://evil/x' is not"),
    ("maxtext-dimension-bool", {"base_model.model_overrides.head_dim": True}, "base_model.model_overrides", "head_dim: the value true is not"),
    ("asset-bucket", {"schedule": {"asset": "gs://a/x"}}, "schedule", "not a GCS bucket name"),
    # Values Airflow cannot take: each passed `loraflow validate` and then took every DAG of the folder down.
    ("tag-too-long", {"tags": ["x" * 101]}, "tags.0", "longer than 100 characters"),
    ("tag-empty", {"tags": [""]}, "tags.0", "is empty"),
    ("tag-newline", {"tags": ["a\nb"]}, "tags.0", "control character"),
    ("retry-max-delay-inf", {"retry.max_delay_seconds": INF}, "retry.max_delay_seconds", NOT_FINITE),
    ("retry-max-delay-1e300", {"retry.max_delay_seconds": 1e300}, "retry.max_delay_seconds", TOO_LARGE),
    ("retry-max-delay-years", {"retry.max_delay_seconds": 1e12}, "retry.max_delay_seconds", "less than or equal to 86400"),
    ("cron-out-of-range", {"schedule": "99 99 * * *"}, "schedule", "minute 99 is outside 0-59"),
    ("cron-unknown-name", {"schedule": "0 3 * * FOO"}, "schedule", "day of week 'FOO' is not"),
    ("cron-extension", {"schedule": "0 0 LW * *"}, "schedule", "day of month 'LW' is not"),
    ("cron-never-fires", {"schedule": "0 0 31 2 *"}, "schedule", "never fires"),
    ("cron-zero-step", {"schedule": "*/0 * * * *"}, "schedule", "step '0' in minute"),
    ("param-default-below-minimum", {"schedule": "@daily", "params": [{"path": "training.steps", "minimum": 100000}]}, "(top level)", "training.steps: the spec's value 200 is below its minimum 100000"),
    ("param-default-not-in-enum", {"schedule": "@daily", "params": [{"path": "training.steps", "enum": [1, 2]}]}, "(top level)", "training.steps: the spec's value 200 is not one of its enum"),
    ("param-minimum-above-maximum", {"params": [{"path": "training.steps", "minimum": 300, "maximum": 100}]}, "(top level)", "minimum 300 is above its maximum 100"),
    ("asset-too-long", {"schedule": {"asset": "gs://loraflow-demo/" + "x" * 1300}}, "schedule", "at most 1024 bytes"),
    ("description-nul", {"description": "a\x00b"}, "description", "control character"),
    ("param-description-nul", {"params": [{"path": "training.steps", "description": "a\x00b"}]}, "params.0.description", "control character"),
    # Numbers: finite and of a size a pipeline can mean, in every section (one check: loraflow/spec/fields.py).
    ("alpha-inf", {"lora.alpha": INF}, "lora.alpha", NOT_FINITE),
    ("alpha-inf-string", {"lora.alpha": "inf"}, "lora.alpha", TEXT_NO_NUMBER),
    ("alpha-huge-string", {"lora.alpha": "1e29"}, "lora.alpha", TEXT_NO_NUMBER),
    # Numbers are numbers (strict models: loraflow/spec/fields.py SpecModel): never a boolean, never text.
    ("max-drop-true", {"gate.guard": {"set": "general-mc-v1", "max_drop": True}}, "gate.guard.max_drop", BOOLEAN_NO_NUMBER),
    ("max-drop-text", {"gate.guard": {"set": "general-mc-v1", "max_drop": "0.05"}}, "gate.guard.max_drop", TEXT_NO_NUMBER),
    ("steps-text", {"training.steps": "200"}, "training.steps", "valid integer (got '200'): text is no number; write a whole number such as 100"),
    ("hosts-true", {"compute": {"lora_sft": {"launcher": "local", "hosts": True}}}, "compute.lora_sft.hosts", BOOLEAN_NO_NUMBER),
    ("expectation-false", {"data.expectations.duplicates.max_fraction": False}, "data.expectations.duplicates.max_fraction", BOOLEAN_NO_NUMBER),
    ("steps-1e29", {"training.steps": 1e29}, "training.steps", TOO_LARGE),
    ("steps-huge-int", {"training.steps": 10**29}, "training.steps", TOO_LARGE),
    ("seed-huge-int", {"evaluation.seed": 2**64}, "evaluation.seed", TOO_LARGE),
    ("override-nan", {"base_model.model_overrides.head_dim": NAN}, "base_model.model_overrides.head_dim", NOT_FINITE),
    ("param-minimum-inf", {"params": [{"path": "training.steps", "minimum": -INF}]}, "params.0.minimum", NOT_FINITE),
    ("param-enum-nan", {"params": [{"path": "training.steps", "enum": [200, NAN]}]}, "params.0.enum.1", NOT_FINITE),
    ("expectation-huge", {"data.expectations.row_count.min": 10**20}, "data.expectations.row_count.min", TOO_LARGE),
    # Invisible and direction-changing characters in tags and names (what the UI shows is not what it is).
    ("tag-zero-width-space", {"tags": ["prod\u200b"]}, "tags.0", INVISIBLE),
    ("tag-right-to-left-override", {"tags": ["\u202etxt.exe"]}, "tags.0", INVISIBLE),
    ("tag-isolate", {"tags": ["a\u2066b"]}, "tags.0", INVISIBLE),
    ("tag-byte-order-mark", {"tags": ["\ufeffdemo"]}, "tags.0", INVISIBLE),
    ("display-name-bidi", {"publish.vertex_model_registry": {"serving_container_image": "vllm/vllm-openai:v1", "display_name": "llama\u202e"}}, "publish.vertex_model_registry.display_name", INVISIBLE),
]  # fmt: skip

# Unusual values the schema accepts: each must build a DAG that Airflow takes (they are no refusals).
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("tag-of-100-characters", {"tags": ["x" * 100, "é" * 100]}),
    ("tags-repeated", {"tags": ["loraflow", "a", "a"]}),
    ("param-on-a-null-setting-with-a-schedule", {"schedule": "@daily", "params": [{"path": "evaluation.max_examples", "minimum": 1}]}),
    ("param-choice-with-a-schedule", {"schedule": "0 3 * * 1", "params": [{"path": "evaluation.answer_format", "enum": ["pattern", "tagged"]}]}),
    ("param-float-bounds", {"schedule": "@hourly", "params": [{"path": "lora.alpha", "minimum": 0.5, "maximum": 64}]}),
    ("cron-with-names-and-steps", {"schedule": "*/15 0-23/2 1,15 JAN-jun mon-FRI"}),
    ("cron-on-the-29th-of-february", {"schedule": "0 0 29 2 *"}),
    ("cron-31st-or-mondays", {"schedule": "0 0 31 4 1"}),
    ("once", {"schedule": "@once"}),
    ("annually", {"schedule": "@annually"}),
    ("asset-of-1024-bytes", {"schedule": {"asset": "gs://loraflow-demo/" + "é" * 512}}),
    ("retry-at-its-bounds", {"retry": {"retries": 10, "delay_seconds": 3600, "backoff": 10, "max_delay_seconds": 86400}}),
    ("description-with-lines-and-tabs", {"description": "\n\tfirst\r\nsecond"}),
    ("largest-number", {"training.seed": 2**53, "evaluation.seed": 0}),
]  # fmt: skip


def tiny_with(tiny: dict[str, Any], ident: str, edits: dict[str, Any]) -> dict[str, Any]:
    """The tiny spec with ``edits`` applied, renamed ``ident`` (so it can live in a DAG folder)."""
    import copy

    data = apply(copy.deepcopy(tiny), edits)
    data["name"] = ident
    return data


def alias_bomb(levels: int = 12, width: int = 10) -> bytes:
    """A "billion laughs" of ``width ** levels`` scalars once expanded, a few hundred bytes as written:
    a param's ``enum`` (a list of anything, valid as written) whose levels each repeat the one before."""
    items = ["&l0 [" + ", ".join(["lol"] * width) + "]"]
    items += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return ("params:\n  - path: training.steps\n    enum: [" + ", ".join(items) + "]\n").encode()


def _deep(depth: int) -> bytes:
    return ("params:\n  - path: training.steps\n    enum: " + "[" * depth + "1" + "]" * depth + "\n").encode()


def files(tiny_text: bytes) -> list[tuple[str, bytes, str, str]]:
    """Hostile spec files (bytes), each named by its id; the tiny spec's text is the base."""
    return [
        ("alias-bomb", tiny_text + alias_bomb(), "(yaml)", "once its aliases (*name) are expanded"),
        ("recursive-alias", tiny_text + b"tags: &t [a, *t]\n", "(yaml)", "refers to its own anchor"),
        ("two-mebibytes", tiny_text + b"#" + b"x" * (2 * 1024 * 1024) + b"\n", "(file)", "over the cap of 1048576 bytes"),
        ("not-utf8", tiny_text + b"description: caf\xe9 \xff\xfe\n", "byte", "not valid YAML: not UTF-8 text"),
        ("nul-bytes", "name: x\n".encode("utf-16-le") + b"\x00\x00\xff", "byte", "not valid YAML: not UTF-8 text"),
        ("deep-nesting", tiny_text + _deep(500), "(yaml)", "nests deeper than 64 levels"),
        ("deeper-than-libyaml", tiny_text + _deep(5000), "line", "not valid YAML"),
        ("python-tag", tiny_text + b"tags: !!python/object/apply:os.system ['touch /tmp/pwned']\n", "line", "not valid YAML"),
        ("not-a-mapping", b"- just\n- a list\n", "(top level)", "a spec is a YAML mapping"),
        ("duplicate-section", tiny_text + b"training:\n  steps: 1\n", "line", "duplicate key 'training'"),
        ("duplicate-nested-key", tiny_text + b"retry:\n  retries: 1\n  retries: 5\n", "line", "duplicate key 'retries'"),
        ("binary-tag", tiny_text + b"retry: !!binary aGVsbG8=\n", "line", "the tag !!binary is not allowed"),
        ("set-tag", tiny_text + b"notify: !!set {a, b}\n", "line", "the tag !!set is not allowed"),
        ("omap-tag", tiny_text + b"publish: !!omap [{registry: gs://a-b/r}]\n", "line", "the tag !!omap is not allowed"),
        ("custom-tag", tiny_text + b"notify: [!evil {kind: file}]\n", "line", "the tag !evil is not allowed"),
        ("date-value", tiny_text + b"publish: {registry: 2026-01-01}\n", "line", "is read as a date"),
        ("yaml-infinity", tiny_text.replace(b"alpha: 32", b"alpha: .inf"), "lora.alpha", NOT_FINITE),
        ("yaml-not-a-number", tiny_text.replace(b"alpha: 32", b"alpha: .NaN"), "lora.alpha", NOT_FINITE),
        ("yaml-huge-float", tiny_text.replace(b"steps: 200", b"steps: 1.0e+29"), "training.steps", TOO_LARGE),
    ]  # fmt: skip
