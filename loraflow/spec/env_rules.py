"""Which environment variables a pipeline spec may set for a step: the one rule table.

A spec's ``compute.<stage>.env`` and ``secrets`` put variables into the step program's environment,
locally and in Vertex AI or GKE containers. A spec author may tune the step (``XLA_FLAGS``,
``LIBTPU_INIT_ARGS``, ``JAX_*``, ``TF_CPP_MIN_LOG_LEVEL``, an ``HF_TOKEN`` secret) but may not take
the step over: nothing that changes the interpreter or the loader before loraflow's code runs,
which certificates are trusted, where traffic goes, which credentials or project the cloud
clients use, the process basics the deployer sets, or loraflow's own wiring (of loraflow's own
variables only ``STEP_TUNABLES`` are the spec's). ``refusal(name)``
says which rule a name breaks (or ``None``); the spec schema calls it for every name it accepts.
A ``secrets`` name must also be named for a secret (``secret_refusal``: ``SECRET_SUFFIXES``).

Names are matched case-insensitively against the rules (``http_proxy`` is a proxy too), and must
then be portable upper-case names (``[A-Z_][A-Z0-9_]*``, at most 128 characters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_NAME_LENGTH = 128
_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_FIX = "remove it from the spec; the deployer sets such variables in the image or the worker's environment"


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
    {"LORAFLOW_LOG_LEVEL", "LORAFLOW_JOIN_TIMEOUT", "LORAFLOW_HEARTBEAT_TIMEOUT", "LORAFLOW_HARDWARE"}
)


def refusal(name: str) -> str | None:
    """Why a spec may not set the environment variable ``name`` (the rule and the fix), or None."""
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


def check_name(name: str) -> str:
    """``name`` if a spec may set it; else ``ValueError`` naming the rule it breaks and the fix."""
    reason = refusal(name)
    if reason is not None:
        raise ValueError(reason)
    return name


def check_value(value: str) -> str:
    """A value the operating system can pass: no NUL character."""
    if "\0" in value:
        raise ValueError("the value contains a NUL character, which no environment can hold; remove it")
    return value
