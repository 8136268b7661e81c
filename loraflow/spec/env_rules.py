"""Which environment variables a pipeline spec may set for a step: the rule tables.

A spec's ``compute.<stage>.env`` puts variables into the step program's environment, locally and in
Vertex AI or GKE containers. It is an **allow-list** (``ALLOWED``): a spec author may tune the step
(XLA's and libtpu's flags, JAX's backend and debugging switches, log levels, thread counts, the
step tunables), each name with the reason it is there and the values it takes, and nothing else:
many variables the deny rules below let through still write or send outside the run (a dump
folder, a compiler cache, a library's config root, a usage-statistics server), and new ones come
with every library release. ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS`` take flags of ``XLA_FLAGS_ALLOWED``
only (no ``--xla_dump_*``). ``step_refusal(name)`` and ``value_problem(name, value)`` say why a
name or value is refused; the spec schema calls them for every entry.

``RULES`` are what can take a step over: nothing that changes the interpreter or the loader before
loraflow's code runs, which certificates are trusted, where traffic goes, which credentials or
project the cloud clients use, the process basics the deployer sets, or loraflow's own wiring.
They name the reason for the names they match (for ``compute.env`` before the allow-list is asked)
and are what a ``secrets`` name must pass (``refusal(name)``). A ``secrets`` name must also be named
for a secret (``secret_refusal``: ``SECRET_SUFFIXES``).

Names are matched case-insensitively against the rules (``http_proxy`` is a proxy too), and must
then be portable upper-case names (``[A-Z_][A-Z0-9_]*``, at most 128 characters).

Asking for a name, a flag or a value that is not on a list: docs/security.md, "Asking for a
variable, flag or override".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraflow.errors import excerpt

MAX_NAME_LENGTH = 128
_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_FIX = "remove it from the spec; the deployer sets such variables in the image or the worker's environment"
_ASK = "to ask for one, see docs/security.md, 'Asking for a variable, flag or override'"


@dataclass(frozen=True)
class Rule:
    """Names this rule refuses (exact names, prefixes, suffixes) and why."""

    reason: str
    names: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    suffixes: tuple[str, ...] = ()

    def matches(self, upper: str) -> bool:
        return upper in self.names or upper.startswith(self.prefixes) or upper.endswith(self.suffixes)


RULES: tuple[Rule, ...] = (
    Rule(
        "changes the Python interpreter (it can run code before loraflow's)",
        prefixes=("PYTHON",),
    ),
    Rule(
        "changes how a shell or another interpreter the step may start runs (it can run code)",
        frozenset(
            {
                "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "IFS", "CDPATH",
                "PERL5OPT", "PERL5LIB", "PERLLIB", "RUBYOPT", "RUBYLIB", "NODE_OPTIONS", "NODE_PATH",
                "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS",
            }
        ),
        prefixes=("BASH_FUNC_", "GIT_"),
    ),
    Rule(
        "changes the dynamic loader or which native code is loaded (shared libraries, compiled programs)",
        frozenset(
            {
                "GCONV_PATH", "GLIBC_TUNABLES", "LOCPATH", "PJRT_NAMES_AND_LIBRARY_PATHS",
                "TPU_LIBRARY_PATH", "JAX_COMPILATION_CACHE_DIR", "OPENSSL_CONF", "OPENSSL_ENGINES",
                "OPENSSL_MODULES",
            }
        ),
        prefixes=("LD_", "DYLD_"),
    ),
    Rule(
        "changes which TLS certificates are trusted or where TLS keys are written",
        frozenset(
            {"SSL_CERT_FILE", "SSL_CERT_DIR", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", "SSLKEYLOGFILE",
             "NODE_EXTRA_CA_CERTS", "TENSORSTORE_CA_PATH"}
        ),
        suffixes=("_CA_BUNDLE", "_CA_CERTS"),
    ),
    Rule("routes the step's network traffic through a proxy", suffixes=("_PROXY",)),
    Rule(
        "changes which credentials, project or service endpoint the step's cloud clients use",
        frozenset(
            {
                "STORAGE_EMULATOR_HOST", "HF_ENDPOINT", "BOTO_CONFIG", "BOTO_PATH", "KUBECONFIG", "NETRC",
                "SSH_AUTH_SOCK", "SSH_ASKPASS", "DOCKER_CONFIG", "DOCKER_HOST",
            }
        ),
        prefixes=("GOOGLE_", "CLOUDSDK_", "GCE_METADATA_", "AWS_", "AZURE_", "KUBERNETES_", "TENSORSTORE_GCS_"),
        suffixes=("_EMULATOR_HOST",),
    ),
    Rule(
        "is a process basic the worker sets for every step (search path, home, locale, scratch space)",
        frozenset({"PATH", "HOME", "TMPDIR", "TMP", "TEMP", "SHELL", "USER", "LOGNAME", "LANG", "LANGUAGE"}),
        prefixes=("LC_", "XDG_"),
    ),
    Rule(
        "is loraflow's, Airflow's or the platform's own wiring of the step (offline mode, hosts, configuration)",
        frozenset(
            {
                "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "JOB_COMPLETION_INDEX",
                "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "CLUSTER_SPEC", "TF_CONFIG",
            }
        ),
        prefixes=("LORAFLOW_", "AIRFLOW", "AIP_", "CLOUD_ML_", "MEGASCALE_"),
    ),
)  # fmt: skip


# loraflow's own variables a spec may set: step tunables that change no trust boundary (the rest of
# LORAFLOW_* wires hosts, scratch space, environments and fault injection: the deployer's).
STEP_TUNABLES = frozenset(
    {
        "LORAFLOW_LOG_LEVEL",
        "LORAFLOW_JOIN_TIMEOUT",
        "LORAFLOW_HEARTBEAT_TIMEOUT",
        "LORAFLOW_SHUTDOWN_TIMEOUT",
        "LORAFLOW_HARDWARE",
    }
)


# ------------------------------------------------------------------------------ the allow-list


@dataclass(frozen=True)
class Allowed:
    """A variable a spec may set for a step: why a spec author needs it, and the values it takes
    (``pattern`` matches a whole value; ``values`` says it in words for the error). A whole number's
    bounds are ``bounds``: the value is compared with them as a number (``whole_number`` makes one)."""

    reason: str
    values: str
    pattern: str
    bounds: tuple[int, int] | None = None

    def takes(self, value: str) -> bool:
        if re.fullmatch(self.pattern, value) is None:
            return False
        return self.bounds is None or self.bounds[0] <= int(value) <= self.bounds[1]


def whole_number(reason: str, lowest: int, highest: int, unit: str = "a number") -> Allowed:
    """A variable that takes a whole number from ``lowest`` to ``highest`` (written plainly: digits,
    no sign, no leading zero); the words of its error and its check come from the same bounds."""
    return Allowed(reason, f"{unit} from {lowest} to {highest}", r"0|[1-9][0-9]{0,17}", (lowest, highest))


# XLA's flags a spec may pass in XLA_FLAGS or LIBTPU_INIT_ARGS (``--flag`` or ``--flag=value``, the
# value a plain word or number): the performance flags MaxText's own recipes set, and the CPU
# device count. Dumping (``--xla_dump_*``), profiling and anything naming a file or folder are not here.
XLA_FLAGS_ALLOWED: dict[str, str] = {
    "xla_force_host_platform_device_count": "CPU: how many devices JAX makes of the host (sharding tried on CPU)",
    "xla_tpu_enable_latency_hiding_scheduler": "TPU: schedule to hide collectives' latency behind compute",
    "xla_tpu_enable_async_collective_fusion": "TPU: run fused collectives asynchronously",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "TPU: fuse all-gathers into asynchronous collectives",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "TPU: let an asynchronous collective span steps",
    "xla_tpu_overlap_compute_collective_tc": "TPU: overlap compute and collectives on the TensorCore",
    "xla_enable_async_all_gather": "asynchronous all-gather (FSDP's weight gathering)",
    "xla_enable_async_collective_permute": "asynchronous collective permute",
    "xla_tpu_enable_data_parallel_all_reduce_opt": "TPU: optimise data-parallel all-reduce",
    "xla_tpu_data_parallel_opt_different_sized_ops": "TPU: the same for operands of different sizes",
    "xla_tpu_megacore_fusion_allow_ags": "TPU: allow all-gathers in megacore fusions",
    "xla_tpu_enable_ag_backward_pipelining": "TPU: pipeline all-gathers in the backward pass",
    "xla_tpu_scoped_vmem_limit_kib": "TPU: scoped vector memory per kernel (larger fused kernels)",
    "xla_tpu_spmd_rng_bit_generator_unsafe": "TPU: faster partitioned random numbers",
    "xla_gpu_enable_latency_hiding_scheduler": "GPU: schedule to hide collectives' latency behind compute",
}
_FLAG = re.compile(r"--([a-z0-9_]+)(?:=(.*))?")
_FLAG_VALUE = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_FLAGS = "flags of XLA_FLAGS_ALLOWED (loraflow/spec/env_rules.py), --flag or --flag=VALUE, separated by spaces"
_BOOL = r"0|1|true|false|True|False"
_LEVELS = r"(?i:debug|info|warning|error|critical)"

ALLOWED: dict[str, Allowed] = {
    "XLA_FLAGS": Allowed("XLA compiler flags: collective scheduling and overlap, the CPU device count", _FLAGS, ""),
    "LIBTPU_INIT_ARGS": Allowed("the TPU runtime's compiler flags (the same XLA flags, read by libtpu)", _FLAGS, ""),
    "JAX_PLATFORMS": Allowed(
        "which JAX backend the step uses (the launcher's default is the worker's)",
        "cpu, tpu, cuda or rocm, or a comma-separated list of them", r"(?:cpu|tpu|cuda|rocm)(?:,(?:cpu|tpu|cuda|rocm))*",
    ),
    "JAX_TRACEBACK_FILTERING": Allowed(
        "how many of JAX's own frames a traceback shows (debugging)",
        "off, auto, tracebackhide, remove_frames or quiet_remove_frames",
        r"off|auto|tracebackhide|remove_frames|quiet_remove_frames",
    ),
    "JAX_DEBUG_NANS": Allowed("stop at the first NaN a computation makes (a diverging run)", "0, 1, true or false", _BOOL),
    "JAX_LOG_COMPILES": Allowed("log each compilation (finding recompilations)", "0, 1, true or false", _BOOL),
    "JAX_DEFAULT_MATMUL_PRECISION": Allowed(
        "JAX's default matmul precision", "default, high, highest, bfloat16, tensorfloat32 or float32",
        r"default|high|highest|bfloat16|tensorfloat32|float32",
    ),
    "TF_CPP_MIN_LOG_LEVEL": Allowed("verbosity of XLA's C++ logging in the step's output", "0, 1, 2 or 3", r"[0-3]"),
    "TPU_STDERR_LOG_LEVEL": Allowed("verbosity of libtpu's logging on stderr", "0, 1, 2 or 3", r"[0-3]"),
    "TPU_MIN_LOG_LEVEL": Allowed("libtpu's minimum log level", "0, 1, 2 or 3", r"[0-3]"),
    "VLLM_LOGGING_LEVEL": Allowed(
        "vLLM's log level (the launcher's default follows LORAFLOW_LOG_LEVEL)", "DEBUG, INFO, WARNING, ERROR or CRITICAL",
        _LEVELS,
    ),
    "VLLM_ATTENTION_BACKEND": Allowed(
        "vLLM's attention kernel on the serving host", "a backend name such as FLASH_ATTN or TORCH_SDPA",
        r"[A-Z][A-Z0-9_]{0,63}",
    ),
    "OMP_NUM_THREADS": whole_number("CPU threads of OpenMP in native libraries", 1, 1024),
    "TOKENIZERS_PARALLELISM": Allowed("whether Hugging Face tokenizers use threads", "true or false", r"true|false"),
    "LORAFLOW_LOG_LEVEL": Allowed(
        "how much loraflow and the libraries log in the step's output", "DEBUG, INFO, WARNING, ERROR or CRITICAL", _LEVELS
    ),
    "LORAFLOW_JOIN_TIMEOUT": whole_number(
        "seconds a multi-host step waits for every host to join (slow-starting pods)", 1, 86400, "whole seconds"
    ),
    "LORAFLOW_HEARTBEAT_TIMEOUT": whole_number(
        "seconds without a host's heartbeat before the other hosts stop", 1, 86400, "whole seconds"
    ),
    "LORAFLOW_SHUTDOWN_TIMEOUT": whole_number(
        "seconds the hosts of a multi-host step that ended well wait for host 0's outputs", 1, 86400, "whole seconds"
    ),
    "LORAFLOW_HARDWARE": Allowed(
        "MaxText's hardware when JAX's devices do not tell", "cpu, tpu, gpu or gpu_multiprocess",
        r"cpu|tpu|gpu|gpu_multiprocess",
    ),
}  # fmt: skip


def refusal(name: str) -> str | None:
    """Why the rules refuse ``name`` (the rule and the fix), or None: what every name must pass."""
    if name in STEP_TUNABLES:
        return None
    upper = name.upper()
    for rule in RULES:
        if rule.matches(upper):
            return f"{name} {rule.reason}; {_FIX}"
    if not _NAME.fullmatch(name) or len(name) > MAX_NAME_LENGTH:
        return (
            f"{name!r} is not a portable environment variable name; use upper-case letters, digits and '_' "
            f"(not starting with a digit, at most {MAX_NAME_LENGTH} characters), e.g. HF_TOKEN"
        )
    return None


# A secret goes only into a variable named for one. A library reads its settings (JAX_PLATFORMS,
# XLA_FLAGS, ...), splits them and may print a piece in an error (JAX printed one comma-separated
# piece of a token mapped to JAX_PLATFORMS), which the log masker, knowing only the whole value and
# its lines, cannot recognise; a variable named as a credential is read whole, as one.
SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_SECRET", "_PASSWORD")


def secret_refusal(name: str) -> str | None:
    """Why ``secrets`` may not map a secret to ``name`` (the rule and the fix), or None."""
    reason = refusal(name)
    if reason is not None or name.endswith(SECRET_SUFFIXES):
        return reason
    return (
        f"{name} is not named for a secret: a library may read it as a setting, split the value and print "
        "a piece of it, which the log masker cannot recognise; map the secret to the variable the step "
        "reads it from, named ending in _TOKEN, _KEY, _SECRET or _PASSWORD (e.g. HF_TOKEN)"
    )


def check_secret_name(name: str) -> str:
    """``name`` if ``secrets`` may map a secret to it; else ``ValueError`` naming the rule and the fix."""
    reason = secret_refusal(name)
    if reason is not None:
        raise ValueError(reason)
    return name


def step_refusal(name: str) -> str | None:
    """Why a spec may not set ``name`` in a step's environment (``compute.<stage>.env``), or None:
    the rule it breaks, else that it is not on the allow-list."""
    reason = refusal(name)
    if reason is not None or name in ALLOWED:
        return reason
    return (
        f"{name} is not on the allow-list of variables a spec may set for a step (loraflow/spec/env_rules.py "
        f"ALLOWED: {', '.join(sorted(ALLOWED))}); remove it; {_ASK}"
    )


def value_problem(name: str, value: str) -> str | None:
    """Why ``value`` is refused for the allowed variable ``name``, or None."""
    allowed = ALLOWED[name]
    if allowed.values == _FLAGS:
        return _flags_problem(value)
    if allowed.takes(value):
        return None
    return f"the value {excerpt(value)} is not {allowed.values}; write one of those"


def _flags_problem(value: str) -> str | None:
    for word in value.split():
        match = _FLAG.fullmatch(word)
        if match is None:
            return f"{excerpt(word)} is not a flag; write --flag or --flag=VALUE"
        flag, flag_value = match.groups()
        if flag not in XLA_FLAGS_ALLOWED:
            return (
                f"--{flag} is not on the allow-list of XLA flags a spec may set (loraflow/spec/env_rules.py "
                f"XLA_FLAGS_ALLOWED); remove it; {_ASK}"
            )
        if flag_value is not None and not _FLAG_VALUE.fullmatch(flag_value):
            return f"the value of --{flag}, {excerpt(flag_value)}, is not a plain word or number; write one"
    return None


def check_step_name(name: str) -> str:
    """``name`` if a spec may set it for a step (``compute.<stage>.env``); else ``ValueError`` saying why."""
    reason = step_refusal(name)
    if reason is not None:
        raise ValueError(reason)
    return name


def check_step_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` (allowed names) if every value is one its variable takes; else ``ValueError`` naming each."""
    problems = [f"{name}: {why}" for name, value in env.items() if (why := value_problem(name, value))]
    if problems:
        raise ValueError("; ".join(problems))
    return env


def check_value(value: str) -> str:
    """A value the operating system can pass: no NUL character."""
    if "\0" in value:
        raise ValueError("the value contains a NUL character, which no environment can hold; remove it")
    return value
